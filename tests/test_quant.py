"""Weight-only int4 / int8 linears: each kernel against its own dequantized float weight, GGUF
blocks repacked against gguf's dequantization, and greedy decoding of a quantized model
against its dequantized float twin.

Tolerance of a product: the kernels take bf16 activations, may round the dequantized weight to
bf16 on the way (AVX512-BF16 dot products) and return bf16. So y is compared with x (rounded
to bf16, as the kernel sees it) times the float32 dequantized weight, per output within
2^-7 * sum_k |x_k W_nk| (a few bf16 roundings of every term, whatever the cancellation) plus
2^-8 |y| (the output's rounding). specee's own int4 kernel (model/kernels/int4_matmul.cpp, at
each level this CPU runs: AVX-512 BF16, AVX2, portable), run here with bf16 activations (its int8
ones, the default: tests/test_quant_int8.py), multiplies the same bf16 x by the exact
weights in float32 and returns float32: it is held to float32 error, 2^-10 * sum_k |x_k| s_nk
(its per-group sums carry at most 136 s per weight, exact products, float32 additions).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import GGML_QUANT_SIZES, dequantize

from specee.model import kernels
from specee.model.kernels import int4_kernel
from specee.model.llama import Transformer
from specee.model.gguf_blocks import GGUFWeight, gguf_int4_codes
from specee.model.quant import FloatLinear, Int4Linear, Int8Linear, linear_from_parts
from specee.sampling import top_k

from conftest import greedy_with_margins, real_model_dir

pytestmark = pytest.mark.usefixtures("single_thread")
CPU = torch.device("cpu")


@pytest.fixture
def bf16_activations():
    """The int4 kernel's bf16-activation arithmetic, which these bounds describe (int8 activations,
    the default: tests/test_quant_int8.py)."""
    if int4_kernel() is None:
        yield
        return
    before = kernels.use_activations("bf16")
    yield
    kernels.use_activations(before)


def assert_kernel_matches(lin, x: torch.Tensor) -> None:
    xb, W = x.to(torch.bfloat16).float(), lin.dequantize()
    ref = xb @ W.t()
    if lin.bias is not None:
        ref = ref + lin.bias
    y = lin(x)
    assert y.dtype == x.dtype and y.shape == ref.shape
    if getattr(lin, "kernel", None) is not None:
        steps = lin.scales.float().repeat_interleave(lin.group, dim=1)
        bound = 2 ** -10 * (xb.abs() @ steps.t()) + 1e-6
    else:
        bound = 2 ** -7 * (xb.abs() @ W.abs().t()) + 2 ** -8 * ref.abs()
    assert ((y - ref).abs() <= bound).all(), f"max excess {float(((y - ref).abs() - bound).max()):.3g}"


@pytest.mark.parametrize("mode,out", [("int4", 96), ("int4", 128), ("int8", 96)])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.usefixtures("bf16_activations")
def test_quantized_linear_matches_its_dequantized_weight(mode, out, bias):
    """int4 with 96 outputs runs PyTorch's kernel; with 128 (a multiple of 64) specee's where its
    kernels build."""
    torch.manual_seed(0)
    w = torch.randn(out, 128) * 0.1
    b = torch.randn(out) if bias else None
    lin = linear_from_parts([w[:32], w[32:]], b, mode, CPU, torch.float32, keep_rows=True)  # fused from two parts
    assert isinstance(lin, Int4Linear if mode == "int4" else Int8Linear)
    if mode == "int4":
        assert (lin.kernel is not None) == (out % 64 == 0 and int4_kernel() is not None)
    W = lin.dequantize()
    # the quantization itself: within half a step of the float weight, and not the float weight
    if mode == "int4":
        step = lin.scales.float().repeat_interleave(32, dim=1)
    else:
        step = lin.scales.float()[:, None].expand_as(W)
    assert ((W - w).abs() <= 0.5 * step + 1e-6).all() and not torch.equal(W, w)
    for rows in (1, 3, 8):
        assert_kernel_matches(lin, torch.randn(rows, 128))
    assert_kernel_matches(lin, torch.randn(2, 5, 128))  # [B, S, K] as the runtime calls it
    ids = torch.tensor([[5, 0], [95, 40]])
    torch.testing.assert_close(lin.rows(ids), W[ids], rtol=0, atol=0)
    part = lin.take_rows(slice(64, None))  # project_kv's k/v rows
    torch.testing.assert_close(part.dequantize(), W[64:], rtol=0, atol=0)
    assert_kernel_matches(part, torch.randn(3, 128))


@pytest.mark.parametrize("out", [48, 64])
def test_int4_rows_without_kept_nibbles_come_back_through_the_kernel(out):
    """From PyTorch's packing (48 outputs) and from specee's layout (64, where its kernel runs)."""
    torch.manual_seed(1)
    w = torch.randn(out, 64)
    kept = Int4Linear.from_float(w, keep_rows=True)
    packed_only = Int4Linear.from_float(w)
    assert packed_only.nibbles is None
    torch.testing.assert_close(packed_only.dequantize(), kept.dequantize(), rtol=0, atol=0)


def reachable_levels() -> list[str]:
    kernel = int4_kernel()
    return [] if kernel is None else list(kernels.LEVELS[: kernel.int4_best_level() + 1])


@pytest.fixture(params=kernels.LEVELS)
def level(request):
    """Run the int4 kernel at each level this CPU runs (AVX-512 BF16 machines reach all three)."""
    if request.param not in reachable_levels():
        pytest.skip(f"the int4 kernel's {request.param} path does not run on this CPU (or it is not built)")
    before = kernels.use_level(request.param)
    yield request.param
    kernels.use_level(before)


@torch.inference_mode()
def test_the_int4_kernel_on_a_large_product_and_1_to_8_rows(level, bf16_activations, monkeypatch):
    """Several groups and 64-output blocks, every row count 1-8 (blocks of four and what is left),
    an outlier input, zeros; each row's output is the same bit for bit whatever rows share its call
    (what keeps speculative verification equal to one-token decoding); and SPECEE_CPU_KERNELS=0 puts
    the same weights back on PyTorch's kernel."""
    torch.manual_seed(2)
    w = torch.randn(320, 1024) * 0.05
    lin = Int4Linear.from_float(w)
    assert lin.kernel is not None and kernels.LEVELS[lin.kernel.int4_level()] == level
    x = torch.randn(8, 1024)
    x[0, 7] = 40.0
    for rows in range(1, 9):
        assert_kernel_matches(lin, x[:rows])
    together = lin(x)
    assert all(torch.equal(lin(x[i : i + 1])[0], together[i]) for i in range(8))
    assert torch.equal(lin(x[2:5]), together[2:5]) and torch.equal(lin(x[3:8]), together[3:8])
    assert torch.equal(lin(x.to(torch.bfloat16)), together.to(torch.bfloat16))  # bf16 in: the same products
    assert torch.equal(lin(torch.zeros(1, 1024)), torch.zeros(1, 320))
    monkeypatch.setenv("SPECEE_CPU_KERNELS", "0")
    plain = Int4Linear.from_float(w)
    assert plain.kernel is None
    torch.testing.assert_close(plain.dequantize(), lin.dequantize(), rtol=0, atol=0)
    # the two kernels agree within the bf16 output rounding PyTorch's applies
    torch.testing.assert_close(plain(x), together, rtol=2 ** -7, atol=1e-3)


@torch.inference_mode()
def test_prefetching_or_not_gives_the_same_products_at_every_level(level):
    """Whether the int4 products prefetch (chosen per CPU at load, engine/threads.py) changes no bit,
    for both activations, one row and several."""
    kernel = int4_kernel()
    torch.manual_seed(4)
    lin = Int4Linear.from_float(torch.randn(320, 1024) * 0.05)
    x = torch.randn(5, 1024)
    prefetch, activations = kernel.int4_prefetch(), kernels.ACTIVATIONS[kernel.int4_activations()]
    try:
        for name in kernels.ACTIVATIONS:
            kernels.use_activations(name)
            kernel.int4_set_prefetch(True)
            assert kernel.int4_prefetch()
            on = (lin(x), lin(x[:1]))
            kernel.int4_set_prefetch(False)
            assert not kernel.int4_prefetch()
            off = (lin(x), lin(x[:1]))
            assert torch.equal(on[0], off[0]) and torch.equal(on[1], off[1]), name
    finally:
        kernel.int4_set_prefetch(prefetch)
        kernels.use_activations(activations)


@torch.inference_mode()
def test_the_int4_levels_differ_only_in_float32_summation_order():
    levels = reachable_levels()
    if len(levels) < 2:
        pytest.skip("one int4 kernel level on this CPU")
    torch.manual_seed(3)
    lin = Int4Linear.from_float(torch.randn(192, 2048) * 0.05)
    x = torch.randn(5, 2048)
    before = kernels.use_level(levels[0])
    try:
        outs = {}
        for name in levels:
            kernels.use_level(name)
            outs[name] = lin(x)
    finally:
        kernels.use_level(before)
    steps = lin.scales.float().repeat_interleave(32, dim=1)
    bound = 2 ** -16 * (x.to(torch.bfloat16).float().abs() @ steps.t()) * 136  # a few ulp of the sums' terms
    for name in levels[1:]:
        assert ((outs[name] - outs[levels[0]]).abs() <= bound).all(), name


def cpu_flags() -> set[str]:
    try:
        info = open("/proc/cpuinfo").read()
    except OSError:
        pytest.skip("no /proc/cpuinfo to read the CPU's flags from")
    return set(next((line.split(":", 1)[1].split() for line in info.splitlines() if line.startswith("flags")), []))


def test_the_best_level_follows_the_cpu_flags_and_bf16_only_gates_the_bf16_kernel():
    """AVX-512 F, BW and VNNI give the avx512 level (the int8 products, attention, SiLU); BF16 is asked
    only by the bf16-activation kernel, which otherwise runs its avx2 path. (An Intel Xeon whose
    hypervisor hides AVX-512 BF16 ran everything at avx2 before: 0.64x of its avx512 decode speed.)"""
    kernel = int4_kernel()
    if kernel is None:
        pytest.skip("the CPU kernels are not built here")
    flags = cpu_flags()
    avx512 = {"avx512f", "avx512bw", "avx512_vnni"} <= flags
    expected = "avx512" if avx512 else "avx2" if {"avx2", "fma"} <= flags else "portable"
    assert kernels.LEVELS[kernel.int4_best_level()] == expected
    before = kernels.use_level(expected)
    try:
        bf16_level = kernels.LEVELS[kernel.int4_bf16_level()]
        assert bf16_level == ("avx2" if avx512 and "avx512_bf16" not in flags else expected)
        before_activations = kernels.use_activations("bf16")
        try:
            assert kernels.describe().startswith(f"{bf16_level} kernels, bf16 activations")
        finally:
            kernels.use_activations(before_activations)
    finally:
        kernels.use_level(before)


def level_in_subprocess(value: str):
    import os
    import subprocess
    import sys

    code = ("from specee.model import kernels; k = kernels.int4_kernel(); "
            "print(kernels.LEVELS[k.int4_level()] if k else 'none')")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "SPECEE_CPU_LEVEL": value}, cwd=str(kernels.HERE.parents[2]))


def test_specee_cpu_level_forces_a_lower_path_and_the_portable_one_says_so():
    if "avx2" not in reachable_levels():
        pytest.skip("no AVX2 path on this CPU")
    avx2 = level_in_subprocess("avx2")
    assert avx2.stdout.strip() == "avx2" and "portable" not in avx2.stderr
    portable = level_in_subprocess("portable")
    assert portable.stdout.strip() == "portable"
    assert "specee: note: int4 products run the portable C++ path (SPECEE_CPU_LEVEL=portable)" in portable.stderr
    bad = level_in_subprocess("sse9")
    assert bad.returncode != 0 and "SPECEE_CPU_LEVEL='sse9': choose one of portable, avx2, avx512" in bad.stderr


def test_bad_shapes_and_modes_are_refused():
    with pytest.raises(ValueError, match="multiple of 16"):
        Int4Linear.from_float(torch.randn(40, 64))
    with pytest.raises(ValueError, match="unknown quantization 'int3'"):
        linear_from_parts([torch.randn(16, 32)], None, "int3", CPU, torch.float32)


# ---- GGUF blocks ---------------------------------------------------------------------------------
def random_blocks(qtype: T, rows: int, cols: int, seed: int = 0) -> GGUFWeight:
    """Random raw blocks (every bit pattern of codes, scales and mins), with sane fp16 scale fields."""
    rng = np.random.default_rng(seed)
    block, size = GGML_QUANT_SIZES[qtype]
    data = rng.integers(0, 256, (rows * cols // block, size), dtype=np.uint8)
    fp16_fields = {T.Q4_0: [0], T.Q4_1: [0, 2], T.Q4_K: [0, 2], T.Q8_0: [0], T.Q5_0: [0], T.Q5_1: [0, 2],
                   T.Q5_K: [0, 2], T.Q6_K: [size - 2]}[qtype]
    for at in fp16_fields:  # scales around 1e-3 as in real checkpoints, either sign for Q4_1's min
        value = rng.uniform(2e-4, 4e-3, len(data)).astype(np.float16) * (-1 if at == 2 and qtype == T.Q4_1 else 1)
        data[:, at:at + 2] = value.view(np.uint8).reshape(-1, 2)
    return GGUFWeight(qtype, data.reshape(rows, -1))


@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q4_1, T.Q4_K])
def test_gguf_q4_blocks_repack_to_int4_codes_exactly(qtype):
    g = random_blocks(qtype, 48, 512)
    assert g.shape == (48, 512)
    ref = torch.from_numpy(dequantize(g.data, qtype))
    q, scales, zeros = gguf_int4_codes(g)
    W = (q.float() - 8) * scales.repeat_interleave(32, 1) + zeros.repeat_interleave(32, 1)
    if qtype == T.Q4_0:  # d (q - 8): the same float32 product
        torch.testing.assert_close(W, ref, rtol=0, atol=0)
    else:  # d q + m regrouped as (q - 8) d + (m + 8 d): float32 reassociation, a few ulp
        torch.testing.assert_close(W, ref, rtol=0, atol=4 * torch.finfo(torch.float32).eps * float(ref.abs().max()))
    # the kernel's copy reads scale and zero in bf16 (unit roundoff 2^-8): the only rounding, bounded per
    # weight by 2^-8 (8 |scale| + |zero|)
    lin = linear_from_parts([g], None, "int4", CPU, torch.float32)  # auto runs Q4_K as stored (test_kquant.py)
    assert isinstance(lin, Int4Linear)
    s, z = scales.repeat_interleave(32, 1), zeros.repeat_interleave(32, 1)
    bound = 2 ** -8 * (8 * s.abs() + z.abs()) * (1 + 1e-6)
    err = (lin.dequantize() - ref).abs()
    assert (err <= bound).all()
    assert_kernel_matches(lin, torch.randn(4, 512))


@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q5_0, T.Q5_1, T.Q5_K, T.Q6_K])
def test_gguf_8_5_6_bit_blocks_map_to_int8_within_half_a_channel_step(qtype):
    g = random_blocks(qtype, 32, 512, seed=3)
    ref = g.dequantize()
    lin = linear_from_parts([g], None, "int8", CPU, torch.float32)  # auto's choice, but for Q6_K's kernel
    assert isinstance(lin, Int8Linear)  # per-block scales do not map to per-channel ones: requantized
    step = lin.scales.float()[:, None]
    assert ((lin.dequantize() - ref).abs() <= 0.5 * step * (1 + 1e-3)).all()
    assert_kernel_matches(lin, torch.randn(2, 512))


def test_auto_keeps_float_parts_float_and_fuses_mixed_parts_in_the_finer_format():
    w = torch.randn(32, 64)
    assert isinstance(linear_from_parts([w], None, "auto", CPU, torch.float32), FloatLinear)
    mixed = [random_blocks(T.Q4_K, 256, 256), random_blocks(T.Q6_K, 32, 256)]  # Q4_K_M's q/k + v
    before = kernels.use_activations("bf16") if int4_kernel() else None  # else auto runs both as stored (test_kquant)
    try:
        fused = linear_from_parts(mixed, None, "auto", CPU, torch.float32)
    finally:
        if before:
            kernels.use_activations(before)
    assert isinstance(fused, Int8Linear) and fused.out_features == 288
    assert isinstance(linear_from_parts(mixed, None, "int4", CPU, torch.float32), Int4Linear)


# ---- a whole model ---------------------------------------------------------------------------------
def dequantized_twin(model: Transformer) -> Transformer:
    """The same model object with every linear replaced by a float one holding its dequantized weight."""
    import copy

    twin = copy.copy(model)
    twin.layers = [copy.copy(w) for w in model.layers]
    for w, t in zip(model.layers, twin.layers):
        for name in ("qkv", "kv", "o", "gate_up", "down"):
            lin = getattr(w, name)
            setattr(t, name, FloatLinear(lin.dequantize().to(model.dtype), lin.bias))
    twin.head = FloatLinear(model.head.dequantize().to(model.dtype))
    twin.fast_layers = None  # the float reference runs the Python layer
    return twin


@pytest.mark.parametrize("mode", ["int4", "int8"])
def test_greedy_quantized_model_equals_its_dequantized_float_model(mode):
    assert_greedy_equals_dequantized_twin(mode)


def test_greedy_int4_model_equals_its_dequantized_float_model_at_every_kernel_level(level):
    assert_greedy_equals_dequantized_twin("int4")


def assert_greedy_equals_dequantized_twin(mode: str) -> None:
    path = real_model_dir("ref-target-24L")
    model = Transformer.load(path, "cpu", torch.float32, quantization=mode)
    model.head.ranker = None  # the int8 head's own kernel; its int4 ranking is tested below
    twin = dequantized_twin(model)
    prompt = [1, 415, 2936, 9060, 285, 1142, 28723, 13, 1014, 349]
    prompt = [t % model.cfg.vocab_size for t in prompt]
    got, got_logits = greedy_with_margins(model, prompt, 24)
    want, want_logits = greedy_with_margins(twin, prompt, 24)
    for i, (a, b) in enumerate(zip(got, want)):
        if a != b:  # allowed only where the float logits nearly tie, within the two models' difference
            diff = float((got_logits[i] - want_logits[i]).abs().max())
            margin = float(want_logits[i][b] - want_logits[i][a])
            assert margin <= 2 * diff, f"step {i}: token {a} vs {b}, float margin {margin:.4f} > 2 x {diff:.4f}"
            break
        torch.testing.assert_close(got_logits[i], want_logits[i], rtol=0.05, atol=0.1)


def test_resident_weight_bytes_shrink():
    path = real_model_dir("ref-target-24L")
    sizes = {mode: Transformer.load(path, "cpu", torch.float32, quantization=mode).weight_bytes()
             for mode in (None, "int8", "int4")}
    assert sizes["int4"] < sizes["int8"] < sizes[None]


def test_int8_refuses_an_input_dim_its_kernel_gets_wrong():
    with pytest.raises(ValueError, match="multiple of 16"):
        Int8Linear.from_float(torch.randn(32, 172))


def test_bank_cache_key_names_quantization_only_when_weights_are_quantized(tmp_path, monkeypatch):
    """`auto` on float weights runs float: it shares the float bank; int4 weights move the features."""
    from specee import LLM
    from specee.drafters.ngram import NGramDrafter

    monkeypatch.setenv("SPECEE_CACHE", str(tmp_path))
    path = real_model_dir("ref-target-24L")
    keys = {}
    for q in (None, "auto", "int4"):
        llm = LLM(path, quantization=q, progress=False)
        keys[q] = llm.bank_cache_path(NGramDrafter(4, llm.model.cfg.vocab_size, llm.model.device).fingerprint, 4).name
    assert keys["auto"] == keys[None] and keys["int4"] != keys[None] and "-int4-" in keys["int4"]


@pytest.mark.parametrize("mode", ["int4", "int8"])
@torch.inference_mode()
def test_a_quantized_heads_best_logits_are_its_own_float32_products(mode):
    """The kernels return bfloat16 logits (0.125 apart near 25), which can tie or swap the best
    tokens; the top few per row (ranked by an int4 copy of an int8 head) are recomputed in float32
    from the dequantized head, so greedy picks exactly the argmax of x @ W^T with the quantized
    weights W; the other logits stay within int4's error of those products."""

    model = Transformer.load(real_model_dir("ref-target-24L"), "cpu", torch.float32, quantization=mode)
    prompt = [t % model.cfg.vocab_size for t in (1, 415, 2936, 9060, 285, 1142, 28723, 13, 1014, 349)]
    tokens, _ = greedy_with_margins(model, prompt, 48)
    x = model.norm(model.hidden_states(prompt + tokens)[-1])  # the model's own states: 58 positions
    logits = model.lm_head(x)
    ref = x @ model.head.dequantize().t()
    raw = (model.head.ranker or model.head.head)(x)  # the kernel's own, bfloat16-rounded (an int8 head: ranked in int4)
    assert torch.equal(logits.argmax(-1), ref.argmax(-1))
    assert not torch.equal(raw, logits)
    ids = top_k(raw, model.head.refined)  # the entries recomputed (ties at the last place: the head's own choice)
    torch.testing.assert_close(logits.gather(-1, ids), ref.gather(-1, ids), rtol=1e-5, atol=1e-5)
    if mode == "int8":  # ranked by the int4 copy: its own error, half a group step per weight at most
        assert model.head.ranker is not None
        W4 = model.head.ranker.dequantize()
        bound = (x.abs() @ (W4 - model.head.dequantize()).abs().t()) + 2 ** -7 * (x.abs() @ W4.abs().t())
        assert ((logits - ref).abs() <= bound).all()
