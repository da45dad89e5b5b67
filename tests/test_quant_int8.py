"""The int4 kernel's int8-activation path (model/kernels/int4_q8.cpp) against an integer reference
written here: activations quantized per block of 32 (d = max|x| / 127 in float32, x_q = round(x *
float32(1 / d)) to nearest even), exact integer dot products of the nibbles with x_q per group, and
y = sum over groups of (s d) acc + (z - 8 s) d sum(x_q).

What is compared, at every dispatch level this CPU reaches (avx512 / avx2 / portable), for 1 to 11
rows (blocks of 8 and what is left):
- bit for bit, on inputs where every float32 operation after the integer sums is exact (powers of
  two for s, d and z - 8 s, integer activations): the int32 sums and the combination formula;
- on random inputs (outliers, zero blocks, an all-zero row), y against the reference's float64
  combination of the same integer sums, within float32 rounding of that sum:
  (2 G + 4) 2^-24 sum_g (|s d acc| + |(z - 8 s) d sum x_q|) (each group adds two rounded terms);
- each row's output bit for bit whatever rows share the call, bf16 input equal to its float32 value;
- greedy decoding of int4 models under int8 activations against their dequantized float weights
  with activations rounded by this reference (the same arithmetic, float32 summation order aside).
"""
from __future__ import annotations

import copy
import os
import subprocess
import sys
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from specee.model import kernels
from specee.model.llama import Transformer
from specee.model.quant import FloatLinear, Int4Linear, _bf16_unpack

from checkpoints import VARIANTS, make_checkpoint
from conftest import SMOLLM2_GGUF, greedy_with_margins

pytestmark = pytest.mark.usefixtures("single_thread")
GROUP = 32


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x_q int64 [M, K], d float32 [M, G]) as the kernel rounds float32 activations."""
    xb = x.float().reshape(x.shape[0], -1, GROUP)
    d = xb.abs().amax(-1) / 127
    inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    return torch.round(xb * inv[..., None]).reshape(x.shape).long(), d


def fake_quantized(x: torch.Tensor) -> torch.Tensor:
    """x as the kernel sees it: d x_q, in float32."""
    flat = x.reshape(-1, x.shape[-1])
    q, d = quantize_activations(flat)
    return (q.float().view(flat.shape[0], -1, GROUP) * d[..., None]).reshape(x.shape)


def reference(lin: Int4Linear, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, sum of the terms' magnitudes) in float64: the integer sums combined exactly."""
    q, d = quantize_activations(x)
    M, N, G = x.shape[0], lin.out_features, lin.in_features // GROUP
    acc = torch.einsum("mgk,ngk->mng", q.view(M, G, GROUP), _bf16_unpack(lin.packed).long().view(N, G, GROUP))
    s = lin.scales.float()
    z8 = (lin.zeros.float() - 8 * s).double()  # one float32 rounding, as the kernel's
    sd_acc = acc.double() * (s.double() * d.double()[:, None, :])
    z_term = z8[None] * (d.double() * q.view(M, G, GROUP).sum(-1).double())[:, None, :]
    return (sd_acc + z_term).sum(-1), (sd_acc.abs() + z_term.abs()).sum(-1)


@pytest.fixture
def int8():
    before = kernels.use_activations("int8")
    yield
    kernels.use_activations(before)


def reachable_levels() -> list[str]:
    kernel = kernels.int4_kernel()
    return [] if kernel is None else list(kernels.LEVELS[: kernel.int4_best_level() + 1])


@pytest.fixture(params=kernels.LEVELS)
def level(request, int8):
    if request.param not in reachable_levels():
        pytest.skip(f"the int4 kernel's {request.param} path does not run on this CPU (or it is not built)")
    before = kernels.use_level(request.param)
    yield request.param
    kernels.use_level(before)


def exact_case(K: int, rows: int, seed: int, unit_scales: bool) -> tuple[Int4Linear, torch.Tensor]:
    """Weights and activations whose float32 combination is exact: activations k 2^e and (k + 1/2) 2^e
    (ties, which round to even) with each block's largest |x| = 127 2^e (so d = 2^e), s = 2^a,
    z - 8 s = m 2^b (m small), or s = 1, z = 8 and d = 1 (y is then the plain sum of the int32 dot
    products). The largest sums (q = 15 against +-127 throughout), some blocks and one row zero."""
    g = torch.Generator().manual_seed(seed)
    N, G = 128, K // GROUP
    q = torch.randint(0, 16, (N, K), generator=g, dtype=torch.uint8)
    if unit_scales:
        s, z8 = torch.ones(N, G), torch.zeros(N, G)
        e = torch.zeros(rows, G)
    else:
        s = 2.0 ** -torch.randint(0, 3, (N, G), generator=g).float()
        z8 = torch.randint(-7, 8, (N, G), generator=g).float() * 2.0 ** -torch.randint(0, 3, (N, G), generator=g).float()
        e = torch.randint(-1, 2, (rows, G), generator=g).float()
    q[0], q[1] = 15, 0
    xq = torch.randint(-126, 127, (rows, G, GROUP), generator=g).float()
    xq += 0.5 * (torch.rand(rows, G, GROUP, generator=g) < 0.25)  # ties: 2 k + 1 halves
    xq[:, :, 0] = 127 * torch.where(torch.rand(rows, G, generator=g) < 0.5, -1.0, 1.0)  # the block's max
    xq[0], xq[1] = 127, -127
    x = (xq * 2.0 ** e[..., None]).view(rows, K)
    x[:, GROUP:2 * GROUP] = 0  # a zero block: d = 0
    x[-1] = 0
    return Int4Linear(q, s, s * 8 + z8, GROUP), x


@pytest.mark.parametrize("unit_scales,K", [(True, 2048), (False, 256)])
@torch.inference_mode()
def test_integer_sums_and_their_combination_bit_for_bit(level, unit_scales, K):
    lin, x = exact_case(K, 11, seed=K, unit_scales=unit_scales)
    assert lin.kernel is not None
    want, magnitude = reference(lin, x)
    unit = 1.0 if unit_scales else 2.0 ** -3  # every term a multiple of it: partial sums exact below 2^24 units
    assert magnitude.max() < 2 ** 24 * unit
    for rows in range(1, 12):
        assert torch.equal(lin(x[:rows]), want[:rows].float()), f"{rows} rows"


# row counts about the kernel's row chunks (8), up to a prompt's
MANY_ROWS = (1, 7, 8, 9, 15, 16, 17, 33, 63, 64, 65, 100, 257)


@pytest.mark.parametrize("threads", [1, 2, 4])
@torch.inference_mode()
def test_many_rows_bit_for_bit_against_the_integer_reference_and_each_row_alone(level, threads):
    """A prompt's rows, which threads split by rows as well as by output blocks: every row's output
    equals the exact reference (inputs whose float32 combination is exact) and the row computed alone,
    whatever rows and threads share the call; 3 output blocks, 65 groups (a step's 5-8 rows on 2 threads:
    half-block units; on 4, a thread with no units; each thread quantizes a share of x)."""
    rows, K = 257, 2080
    lin, x = exact_case(K, rows, seed=K, unit_scales=True)
    lin = Int4Linear(_bf16_unpack(lin.packed).repeat(3, 1)[:192], lin.scales.repeat(3, 1)[:192],
                     lin.zeros.repeat(3, 1)[:192], GROUP)  # 192 outputs: 3 blocks of 64
    want, magnitude = reference(lin, x)
    assert magnitude.max() < 2 ** 24  # integers: every partial sum exact
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        together = lin(x)
        assert torch.equal(together, want.float())
        alone = torch.cat([lin(x[i:i + 1]) for i in range(rows)])
        assert torch.equal(alone, together)
        for n in MANY_ROWS:
            assert torch.equal(lin(x[rows - n:]), together[rows - n:]), f"last {n} rows"
    finally:
        torch.set_num_threads(before)


@torch.inference_mode()
def test_every_level_quantizes_nan_and_inf_activations_alike(int8):
    """The vector quantization keeps the scalar one's results for non-finite inputs too (a NaN drops
    out of its block's maximum, as from std::max), so a row's numbers never depend on the level."""
    levels = reachable_levels()
    if len(levels) < 2:
        pytest.skip("one int4 kernel level on this CPU")
    lin, x = exact_case(256, 36, seed=9, unit_scales=True)
    for r in range(GROUP):  # a NaN at every place in a block (a vector maximum's lanes), the block zero in row 35
        x[r, 2 * GROUP + r] = x[35, GROUP + r] = float("nan")
    x[32, 70], x[33, 100], x[34, 101] = float("inf"), float("-inf"), float("nan")
    before = kernels.use_level(levels[0])
    try:
        outs = []
        for name in levels:
            kernels.use_level(name)
            outs.append(lin(x))
    finally:
        kernels.use_level(before)
    for name, out in zip(levels[1:], outs[1:]):
        torch.testing.assert_close(out, outs[0], rtol=0, atol=0, equal_nan=True, msg=name)


@torch.inference_mode()
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_a_non_finite_activation_makes_its_row_non_finite_and_no_other(int8, bad):
    """Rounded to int8, a NaN became code 0 (and INT_MIN in its block's sum): finite garbage that the
    engine's non-finite check could not see. Now its block's step is NaN, at every level."""
    lin, x = exact_case(256, 6, seed=4, unit_scales=True)
    clean = lin(x)
    x[2, 40] = bad
    before = kernels.use_level(reachable_levels()[0])
    try:
        for name in reachable_levels():
            kernels.use_level(name)
            out = lin(x)
            assert not out[2].isfinite().any(), name
            assert torch.equal(out[[0, 1, 3, 4, 5]], clean[[0, 1, 3, 4, 5]]), name
    finally:
        kernels.use_level(before)


@pytest.mark.parametrize("N,K", [(192, 1024), (64, 96)])
@torch.inference_mode()
def test_random_products_within_float32_rounding_and_rows_identical(level, N, K):
    torch.manual_seed(N)
    lin = Int4Linear.from_float(torch.randn(N, K) * 0.05)
    assert lin.kernel is not None and kernels.LEVELS[lin.kernel.int4_level()] == level
    x = torch.randn(11, K)
    x[0, 7] = 40.0  # an outlier: its block's step is 40 / 127
    x[1, 3] = 1e4
    x[2, :GROUP] = 0
    x[3] = 0
    want, magnitude = reference(lin, x)
    bound = (2 * K // GROUP + 4) * 2.0 ** -24 * magnitude
    together = lin(x)
    excess = ((together.double() - want).abs() - bound).max()
    assert excess <= 0, f"beyond float32 rounding by {float(excess):.3g}"
    assert torch.equal(together[3], torch.zeros(N))
    for rows in range(1, 12):
        assert torch.equal(lin(x[:rows]), together[:rows]), f"{rows} rows"
    assert all(torch.equal(lin(x[i:i + 1])[0], together[i]) for i in range(11))
    assert torch.equal(lin(x[2:7]), together[2:7]) and torch.equal(lin(x[3:11]), together[3:11])
    xb = x.to(torch.bfloat16)
    assert torch.equal(lin(xb).float(), lin(xb.float()).to(torch.bfloat16).float())  # bf16 in: its float32 value


@torch.inference_mode()
def test_the_activation_setting_switches_every_int4_product_and_back(int8):
    torch.manual_seed(5)
    lin = Int4Linear.from_float(torch.randn(128, 256) * 0.05)
    x = torch.randn(3, 256)
    want, _ = reference(lin, x)
    as_int8 = lin(x)
    kernels.use_activations("bf16")
    as_bf16 = lin(x)
    assert kernels.use_activations("int8") == "bf16"
    assert not torch.equal(as_int8, as_bf16) and torch.equal(lin(x), as_int8)
    torch.testing.assert_close(as_int8.double(), want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="int4 activations 'int3': choose one of bf16, int8"):
        kernels.use_activations("int3")


def setting_in_subprocess(value: str) -> subprocess.CompletedProcess:
    code = ("from specee.model import kernels; k = kernels.int4_kernel(); "
            "print(kernels.ACTIVATIONS[k.int4_activations()] if k else 'none')")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**os.environ, kernels.ACTIVATIONS_ENV: value}, cwd=str(kernels.HERE.parents[2]))


def test_specee_activations_sets_the_mode_and_refuses_others():
    if kernels.int4_kernel() is None:
        pytest.skip("the CPU kernels are not built here")
    assert setting_in_subprocess("int8").stdout.strip() == "int8"
    assert setting_in_subprocess("bf16").stdout.strip() == "bf16"
    assert setting_in_subprocess("").stdout.strip() == kernels.DEFAULT_ACTIVATIONS
    bad = setting_in_subprocess("fp8")
    assert bad.returncode != 0 and "SPECEE_ACTIVATIONS='fp8': choose one of bf16, int8" in bad.stderr


# ---- whole models ------------------------------------------------------------------------------------
class FakeQuantLinear(FloatLinear):
    """A float linear whose input is first rounded as the int8 kernel rounds it."""

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(fake_quantized(x), self.weight, self.bias)


def fake_quantized_twin(model: Transformer) -> Transformer:
    """The model with every layer linear float (its dequantized weight) behind the reference rounding;
    the head plain float32, as the quantized head's best logits are recomputed (quant.RefinedHead)."""
    twin = copy.copy(model)
    twin.layers = [copy.copy(w) for w in model.layers]
    for w, t in zip(model.layers, twin.layers):
        for name in ("qkv", "kv", "o", "gate_up", "down"):
            lin = getattr(w, name)
            assert lin.kernel is not None, f"{name} does not run specee's int4 kernel"
            setattr(t, name, FakeQuantLinear(lin.dequantize(), lin.bias))
    twin.head = FloatLinear(model.head.dequantize())
    twin.fast_layers = None
    return twin


def assert_same_greedy(model: Transformer, prompt: list[int], steps: int, rtol: float) -> None:
    """The same tokens, and the best logits (those the quantized head recomputes in float32) within
    rtol of the largest; a first difference is allowed only where the twin's top two tokens tie within
    twice the two models' difference. Why not float32 closeness: the two sum in different orders, and
    an ulp can move an activation across an int8 rounding boundary, one step d of one input (the tiny
    model: logits equal to 2e-6 for 6 tokens, then apart by up to 0.6% of the largest)."""
    got, got_logits = greedy_with_margins(model, prompt, steps)
    want, want_logits = greedy_with_margins(fake_quantized_twin(model), prompt, steps)
    for i, (a, b) in enumerate(zip(got, want)):
        best = want_logits[i].topk(8).indices
        diff = float((got_logits[i][best] - want_logits[i][best]).abs().max())
        # also where the tokens part: a gross error there made any margin look like a tie
        assert diff <= rtol * float(want_logits[i].abs().max()), f"step {i}: best logits apart by {diff:.3g}"
        if a != b:
            margin = float(want_logits[i][b] - want_logits[i][a])
            assert margin <= 2 * diff, f"step {i}: token {a} vs {b}, margin {margin:.4f} > 2 x {diff:.4f}"
            break


@torch.inference_mode()
def test_greedy_int4_model_under_int8_activations_equals_its_fake_quantized_twin(tmp_path, int8):
    cfg = dict(VARIANTS["llama3"].config, hidden_size=128, intermediate_size=256, num_hidden_layers=4)
    path = make_checkpoint(tmp_path / "m", replace(VARIANTS["llama3"], config=cfg, vocab_padding=8), seed=3)
    # a float32 cache: a float16 one rounds K/V the twin's RoPE computes an ulp apart up to 1,000x further
    # apart (2^-11), beyond this measure of the activations' arithmetic (test_decode_layer covers float16)
    model = Transformer.load(path, "cpu", torch.float32, quantization="int4", kv_cache_dtype="float32")
    assert_same_greedy(model, [1, 45, 200, 7, 88, 13, 250, 9], 24, rtol=0.02)


@torch.inference_mode()
def test_greedy_smollm2_under_int8_activations_equals_its_fake_quantized_twin(int8):
    """SmolLM2's residual stream reaches ~2e4 in a few channels, so rounding differences of either
    activation mode move its logits by tenths (measured on this prompt's first token: int8 kernel
    against this twin 0.40, the bf16 kernel against plain float weights 0.74; largest logit 24)."""
    from specee.tokenizer import Tokenizer

    if not SMOLLM2_GGUF.exists():
        pytest.skip(f"{SMOLLM2_GGUF} is absent")
    model = Transformer.load(SMOLLM2_GGUF, "cpu", torch.float32, quantization="auto", kv_cache_dtype="float32")
    prompt = Tokenizer(SMOLLM2_GGUF).tok.encode("The capital of France is a city that").ids
    assert_same_greedy(model, prompt, 16, rtol=0.05)
