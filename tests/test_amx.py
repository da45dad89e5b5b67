"""A prompt's products (model/kernels/amx_prompt.cpp; int4 and GGUF blocks) and attention
(prompt_attention.cpp) on AMX-BF16 tiles: the arithmetic they claim (bf16 activations times the
dequantized weights rounded to bf16: int4's (q - 8) s + z, gguf's own dequantization of Q4_K / Q6_K /
Q5_0 / Q8_0; attention over bf16 queries, keys, values and probabilities; float32 sums), rows
independent of their company, the rule that sends only a prompt of 32 rows or more there, and a
request's tokens the same alone or batched. Skipped on CPUs without AMX-BF16 (never called there)."""
from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
import torch

from specee.model import kernels
from specee.model.quant import FloatLinear, Int4Linear

PROMPT_ROWS = 32  # decode_layer.cpp's kTilePromptRows


def amx_kernels():
    k = kernels.int4_kernel()
    if k is None:
        pytest.skip("the CPU kernels are not built here")
    if not k.amx_available():
        pytest.skip("this CPU (or its kernel) gives no AMX-BF16 tiles")
    return k


def bf16_weights(lin: Int4Linear) -> torch.Tensor:
    """W = q s + (z - 8 s), rounded once to bf16: what the kernel's tiles hold."""
    s = lin.scales.float().repeat_interleave(32, dim=-1)
    z8 = lin.zeros.float().repeat_interleave(32, dim=-1) - 8 * s
    return (lin._ints(slice(None)).float() * s + z8).to(torch.bfloat16)


@torch.inference_mode()
@pytest.mark.parametrize("K,N", [(64, 64), (576, 192), (1536, 576), (2048, 320)])
def test_products_are_bf16_sums_of_the_dequantized_weights(K, N):
    k = amx_kernels()
    torch.manual_seed(K + N)
    lin = Int4Linear.from_float(torch.randn(N, K) * 0.05)
    wb = bf16_weights(lin).double()
    for M in (1, 15, 16, 17, 32, 33, 100, 300):
        x = torch.randn(M, K)
        xb = x.to(torch.bfloat16).double()
        y = k.int4_mm_amx(x, lin.packed, lin.scales_and_zeros)
        exact = xb @ wb.t()
        bound = 2 ** -20 * (xb.abs() @ wb.abs().t()) * K ** 0.5 + 1e-30  # float32 sums over K
        assert ((y.double() - exact).abs() <= bound).all(), (M, float((y.double() - exact).abs().max()))


def assert_bf16_sums(y: torch.Tensor, x: torch.Tensor, wb: torch.Tensor) -> None:
    """y equals x rounded to bf16 times the bf16 weights wb, summed in float32 (a few ulp over K)."""
    xb, w = x.to(torch.bfloat16).double(), wb.double()
    exact = xb @ w.t()
    bound = 2 ** -20 * (xb.abs() @ w.abs().t()) * x.shape[1] ** 0.5 + 1e-30
    assert ((y.double() - exact).abs() <= bound).all(), float((y.double() - exact).abs().max())


def gguf_blocks(qtype, N: int, K: int, seed: int):
    """Random GGUF blocks of qtype with float16 scales of ordinary size (not powers of two: the
    weights' bf16 rounding is exercised) and every code pattern the random bytes give."""
    import numpy as np

    from specee.model.gguf_blocks import GGUFWeight

    gguf = pytest.importorskip("gguf")
    T = gguf.GGMLQuantizationType
    size, per, scales = {T.Q4_K: (144, 256, (0, 2)), T.Q6_K: (210, 256, (208,)), T.Q5_0: (22, 32, (0,)),
                         T.Q8_0: (34, 32, (0,))}[qtype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (N, K // per, size), dtype=np.uint8)
    for at in scales:
        d = rng.uniform(1e-3, 2e-2, (N, K // per)).astype(np.float16)
        raw[..., at:at + 2] = d.view(np.uint8).reshape(N, K // per, 2)
    return GGUFWeight(qtype, raw.reshape(N, -1))


@torch.inference_mode()
@pytest.mark.parametrize("types", [("Q4_K",), ("Q6_K",), ("Q5_0",), ("Q8_0",), ("Q4_K", "Q6_K", "Q8_0")])
def test_gguf_products_are_bf16_sums_of_ggufs_dequantized_weights(types):
    """Each type alone, and parts of several types fused (as q/k/v of mixed types are)."""
    k = amx_kernels()
    gguf = pytest.importorskip("gguf")
    from specee.model.quant_gguf import KQuantLinear

    K = 512
    parts = [gguf_blocks(getattr(gguf.GGMLQuantizationType, t), 64 if i else 96, K, seed=i) for i, t in enumerate(types)]
    lin = KQuantLinear(parts, None, k)
    wb = torch.cat([p.dequantize().float() for p in parts]).to(torch.bfloat16)
    for M in (1, 16, 33, 70):
        x = torch.randn(M, K, generator=torch.Generator().manual_seed(M))
        y = k.kquant_mm_amx(x, lin.packed, lin.tiles)
        assert_bf16_sums(y, x, wb)
        assert torch.equal(k.kquant_mm_amx(x[1:M], lin.packed, lin.tiles), y[1:M])


@torch.inference_mode()
def test_a_rows_outputs_do_not_depend_on_the_rows_beside_it():
    k = amx_kernels()
    torch.manual_seed(1)
    lin = Int4Linear.from_float(torch.randn(576, 1536) * 0.05)
    x = torch.randn(300, 1536)
    y = k.int4_mm_amx(x, lin.packed, lin.scales_and_zeros)
    for first, count in ((0, 1), (3, 7), (5, 16), (1, 17), (2, 33), (100, 64), (40, 255)):
        part = k.int4_mm_amx(x[first:first + count], lin.packed, lin.scales_and_zeros)
        assert torch.equal(part, y[first:first + count]), (first, count)


def first_layer(model, n: int, tiles: bool | None, dequantize: bool = False) -> torch.Tensor:
    """Layer 0 on an n-token prompt: the C++ layer with prompt tiles on or off; or, with tiles None,
    the reference: the Python layer (with its linears dequantized to float32 if `dequantize`)."""
    ids = torch.randint(3, model.cfg.vocab_size, (n,), generator=torch.Generator().manual_seed(n))
    h = model.embed(ids[None])
    w = model.layers[0]
    linears = {name: getattr(w, name) for name in ("qkv", "o", "gate_up", "down")}
    fast, before = model.fast_layers, kernels.use_prompt_tiles(bool(tiles))
    if tiles is None:
        model.fast_layers = None
        if dequantize:
            for name, lin in linears.items():
                setattr(w, name, FloatLinear(lin.dequantize(), lin.bias))
    try:
        return model.layer(0, h, model.range_inputs(0, n), model.new_cache(1, n))
    finally:
        model.fast_layers = fast
        for name, lin in linears.items():
            setattr(w, name, lin)
        kernels.use_prompt_tiles(before)


@torch.inference_mode()
def test_only_a_prompt_of_32_rows_or_more_runs_on_tiles_and_closer_to_the_float_layer(tmp_path):
    """The C++ layer on a prompt: below 32 rows the same bits with tiles on or off; from 32 rows the
    tiles' outputs differ from the int8 path's and sit closer to the layer with the dequantized
    weights in float32 (the plain reference)."""
    amx_kernels()
    from checkpoints import make_checkpoint
    from test_decode_layer import load, variant

    model = load(make_checkpoint(tmp_path / "m", variant("llama3"), seed=3), "int4")
    w = model.layers[0]
    assert all(isinstance(lin, Int4Linear) and lin.kernel is not None for lin in (w.qkv, w.o, w.gate_up, w.down))

    short = [first_layer(model, PROMPT_ROWS - 1, t) for t in (True, False)]
    assert torch.equal(short[0], short[1])
    on, off, ref = (first_layer(model, 64, t, dequantize=True) for t in (True, False, None))
    assert not torch.equal(on, off)
    rms = lambda a: float((a - ref).pow(2).mean().sqrt())  # noqa: E731
    assert rms(on) < rms(off), (rms(on), rms(off))


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bf16: bool = True) -> torch.Tensor:
    """Causal attention of q [heads, S, D] over k, v [kv_heads, S, D] in float64, [S, heads D]; with
    bf16, as the tiles claim to compute it: q / sqrt(D), keys and values rounded to bf16, and each
    row's probabilities e^(s - max) rounded to bf16 and divided by their unrounded sum."""
    H, S, D = q.shape
    group = H // k.shape[0]
    rounded = (lambda x: x.float().bfloat16().double()) if bf16 else (lambda x: x.double())  # noqa: E731
    qb, kb, vb = rounded(q * (1 / math.sqrt(D))), rounded(k), rounded(v)
    later = torch.triu(torch.ones(S, S, dtype=torch.bool), 1)
    out = []
    for h in range(H):
        s = (qb[h] @ kb[h // group].T).masked_fill(later, float("-inf"))
        e = (s - s.max(-1, keepdim=True).values).exp()
        out.append(rounded(e) @ vb[h // group] / e.sum(-1, keepdim=True))
    return torch.cat(out, dim=1)


@torch.inference_mode()
@pytest.mark.parametrize("heads,kv_heads,S,D", [(9, 3, 32, 64), (9, 3, 33, 64), (12, 2, 100, 128), (4, 4, 257, 32),
                                                (6, 2, 70, 96), (9, 3, 769, 64)])
def test_prompt_attention_is_causal_attention_over_bf16_operands(heads, kv_heads, S, D):
    k = amx_kernels()
    assert k.prompt_attention_available(D) and not k.prompt_attention_available(24)  # 16 goes to prompt_attention_avx2
    gen = torch.Generator().manual_seed(S)
    q = torch.randn(heads, S, D, generator=gen) * 2
    keys = (torch.randn(kv_heads, S, D, generator=gen) * 2).half()
    values = torch.randn(kv_heads, S, D, generator=gen).half()
    y = k.prompt_attention(q, keys, values).double()
    err = (y - causal_attention(q, keys, values)).abs()
    # float32 sums and a polynomial exp against float64: typically ~1e-7; now and then a probability
    # sits at a bf16 rounding boundary and moves one step (2^-8 of it), never more
    assert err.pow(2).mean().sqrt() < 1e-4 and (err > 1e-4).double().mean() < 0.01
    assert err.max() < 2 ** -8 * values.abs().max()
    exact = (y - causal_attention(q, keys, values, bf16=False)).pow(2).mean().sqrt()  # unrounded operands:
    assert 1e-4 < exact < 1e-2, float(exact)  # bf16's error shows, and stays bf16's


@torch.inference_mode()
def test_a_prompt_rows_attention_depends_neither_on_the_rows_after_it_nor_on_where_its_part_starts():
    """Row i of a prompt gets the same bits whether the prompt ends at row i or runs on, and whether its
    rows start at slot 0 or at a later part's first slot (chunked prefill: the earlier parts' keys
    come from the cache): no row's numbers depend on its block's other rows or on the padding."""
    k = amx_kernels()
    gen = torch.Generator().manual_seed(0)
    q, keys, values = torch.randn(6, 300, 64, generator=gen), torch.randn(2, 300, 64, generator=gen).half(), \
        torch.randn(2, 300, 64, generator=gen).half()
    y = k.prompt_attention(q, keys, values)
    for S in (1, 15, 16, 17, 32, 33, 100, 299):
        assert torch.equal(k.prompt_attention(q[:, :S], keys[:, :S], values[:, :S]), y[:S]), S
    for start, end in ((32, 64), (47, 300), (100, 133), (256, 300)):
        part = k.prompt_attention(q[:, start:end], keys[:, :end], values[:, :end])
        assert torch.equal(part, y[start:end]), (start, end)


@torch.inference_mode()
def test_a_prompt_of_32_rows_or_more_attends_on_tiles_in_the_layer(tmp_path):
    """The C++ layer with int8 weights (whose products never run on tiles), head size 32: below 32
    rows the same bits with tiles on or off; from 32 rows the attention differs and both stay close
    to the Python layer."""
    amx_kernels()
    from checkpoints import make_checkpoint
    from test_decode_layer import load, variant

    model = load(make_checkpoint(tmp_path / "m", variant("gqa_head_dim"), seed=3), "int8")
    assert model.cfg.head_dim == 32 and model.kv_dtype == torch.float16

    short = [first_layer(model, PROMPT_ROWS - 1, t) for t in (True, False)]
    assert torch.equal(short[0], short[1])
    on, off, ref = (first_layer(model, 64, t) for t in (True, False, None))
    assert not torch.equal(on, off) and torch.allclose(off, ref, atol=1e-3)
    rms = lambda a: float(a.pow(2).mean().sqrt())  # noqa: E731
    assert rms(on - ref) < 0.02 * rms(ref), (rms(on - ref), rms(ref))  # bf16 operands: ~0.7% on this fixture


@torch.inference_mode()
@pytest.mark.parametrize("name,quantization", [("gqa_head_dim", "int4"), ("gqa_head_dim", "int8"), ("llama3", "int4")])
def test_a_prompt_prefilled_in_parts_gets_the_bits_of_one_pass(tmp_path, name, quantization):
    """Chunked prefill's parts (32, 32 and 36 rows of a 100-token prompt, each reading the earlier parts'
    keys from the cache) give every row the hidden state of the prompt in one pass, bit for bit: with
    the tiles on (products with int4 weights; attention at head size 32) and off."""
    amx_kernels()
    from checkpoints import make_checkpoint
    from test_decode_layer import load, variant

    model = load(make_checkpoint(tmp_path / "m", variant(name), seed=4), quantization)
    ids = torch.randint(3, model.cfg.vocab_size, (1, 100), generator=torch.Generator().manual_seed(1))
    for tiles in (True, False):
        before = kernels.use_prompt_tiles(tiles)
        try:
            whole = model.forward(ids, model.range_inputs(0, 100), model.new_cache(1, 100))
            cache = model.new_cache(1, 100)
            parts = [model.forward(ids[:, a:b], model.range_inputs(a, b - a, prompt=True), cache)
                     for a, b in ((0, 32), (32, 64), (64, 100))]
        finally:
            kernels.use_prompt_tiles(before)
        assert torch.equal(torch.cat(parts, dim=1), whole), tiles


@torch.inference_mode()
@pytest.mark.parametrize("name", ["llama3", "gqa_head_dim"])
def test_a_long_prompts_tokens_are_the_same_alone_and_beside_other_requests(tmp_path, name):
    """Greedy tokens of a 40-token and a 70-token prompt (on tiles: products, and with a head size
    of 32 attention too) and two short ones (not), batched with requests joining while others decode,
    equal each request's tokens alone."""
    amx_kernels()
    from checkpoints import make_checkpoint
    from test_decode_layer import variant

    from specee import LLM, SamplingParams

    llm = LLM(str(make_checkpoint(tmp_path / "m", variant(name), seed=5)), quantization="int4")
    vocab = llm.model.cfg.vocab_size
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in (40, 5, 70, 9)]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    alone = [llm.generate([p], params)[0].token_ids for p in prompts]
    engine = llm.engine
    seqs = llm._sequences(prompts[:2], params, True)
    for s in seqs:
        engine.add_request(s)
    engine.step()
    engine.step()
    late = llm._sequences(prompts[2:], params, True)  # join while the first two decode
    for s in late:
        engine.add_request(s)
    while engine.has_unfinished():
        engine.step()
    assert [s.output_ids for s in seqs + late] == alone


def test_specee_amx_is_checked_and_switches_prompt_tiles_off_as_does_a_lower_cpu_level():
    amx_kernels()
    code = "from specee.model import kernels; k = kernels.int4_kernel(); print(k.amx_enabled())"
    root = str(kernels.HERE.parents[2])

    def run(**env: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                              env={**os.environ, **env}, cwd=root)

    assert run(SPECEE_AMX="1", SPECEE_CPU_LEVEL="avx512").stdout.strip() == "True"
    assert run(SPECEE_AMX="0").stdout.strip() == "False"
    assert run(SPECEE_CPU_LEVEL="avx2").stdout.strip() == "False"  # the AVX2 path tested as it runs elsewhere
    bad = run(SPECEE_AMX="yes")
    assert bad.returncode != 0 and "SPECEE_AMX='yes'" in bad.stderr
