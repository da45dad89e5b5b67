"""The C++ batch-1 decoder layer (model/kernels/decode_layer.cpp) against the Python layer it
replaces, on quantized models: layer by layer on the same inputs (one token, a verification
pass's rows under their mask, a causal prefill, rows under skip's per-layer mask), and greedy
decoding.

Tolerance: both call the same int4/int8 kernels and attention; the C++ layer computes the RMS
norms, RoPE and the SiLU gate in its own loops, whose float32 results differ from PyTorch's by
an ulp or so. An activation rounded to bfloat16 for a kernel can then land on the other side of
a rounding boundary: one bf16 step (2^-8 relative) of one input, so a product moves by at most
2^-8 sum_k |x_k W_nk|. Through a layer's four products that is bounded here by 2^-6 of the
layer's output scale."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from checkpoints import VARIANTS, make_checkpoint
from conftest import greedy_with_margins, real_model_dir

from specee.engine.full_depth import prefill
from specee.model.llama import Transformer

pytestmark = pytest.mark.usefixtures("single_thread")


def variant(name: str):
    """A fixture variant whose vocabulary is a multiple of 16, as an int4 LM head needs."""
    v = VARIANTS[name]
    return replace(v, vocab_padding=8) if v.tokenizer == "metaspace" else v  # 312 tokens + 8


def load(path, mode) -> Transformer:
    model = Transformer.load(path, "cpu", torch.float32, quantization=mode)
    if model.fast_layers is None:
        pytest.skip("the C++ decode layer could not be built here (no compiler)")
    return model


def rows_case(model, cache, case: str, ids: list[int]):
    """(step inputs, rows) for a case: the last token, the last 4 tokens (a verification pass), the
    whole sequence from slot 0 (a prefill), or the last token reading only some slots (skip)."""
    n = len(ids) - 1
    if case == "token":
        return model.range_inputs(n, 1), ids[-1:]
    if case == "pass":
        return model.range_inputs(n - 3, 4), ids[-4:]
    if case == "prefill":
        return model.range_inputs(0, len(ids)), ids
    holes = (torch.arange(n + 1) % 3 != 1).view(1, 1, 1, n + 1)  # as skip leaves them (exit/kv_policy.py)
    return replace(model.range_inputs(n, 1), reads="mask", mask=holes), ids[-1:]


@pytest.mark.parametrize("mode", ["int4", "int8"])
@pytest.mark.parametrize("name", ["llama3", "qwen2", "llama_attention_bias", "tied"])
@pytest.mark.parametrize("case", ["token", "pass", "prefill", "holes"])
@torch.inference_mode()
def test_the_cpp_layer_matches_the_python_layer(tmp_path, name, mode, case):
    """GQA, q/k/v biases, an o bias, a tied head: each layer's output and the K/V it writes."""
    model = load(make_checkpoint(tmp_path / name, variant(name), seed=4), mode)
    fast = model.fast_layers
    torch.manual_seed(0)
    ids = torch.randint(0, model.cfg.vocab_size, (9,)).tolist()
    cache = model.new_cache(1, len(ids))
    prefill(model, cache, [ids[:-1]])
    step, rows = rows_case(model, cache, case, ids)
    h = model.embed(torch.tensor([rows]))
    for i in range(model.cfg.num_layers):
        twin = model.new_cache(1, len(ids))
        twin.k.copy_(cache.k)
        twin.v.copy_(cache.v)
        model.fast_layers = None
        want = model.layer(i, h, step, cache)
        model.fast_layers = fast
        got = model.layer(i, h, step, twin)
        assert got.shape == want.shape == (1, len(rows), model.cfg.hidden_size)
        scale = float(want.abs().max())
        torch.testing.assert_close(got, want, rtol=0, atol=2 ** -6 * scale)
        for name in ("k", "v"):
            torch.testing.assert_close(getattr(twin, name)[i], getattr(cache, name)[i], rtol=0,
                                       atol=2 ** -6 * float(getattr(cache, name)[i].abs().max()))
        h = want


@torch.inference_mode()
def test_a_long_prompts_mlp_runs_in_chunks_of_rows_as_in_one(tmp_path):
    """A prompt whose gate/up output passes the C++ layer's 16 MB (an intermediate size of 8192: 256 rows
    a chunk, here 300 rows) against the Python layer, which runs each product over all rows at once
    (both on the int8 kernel: a prompt's AMX tiles, which the Python layer has not, are tests/test_amx.py's)."""
    from checkpoints import LONG_CONTEXT

    from specee.model.kernels import use_prompt_tiles

    cfg = dict(LONG_CONTEXT.config, intermediate_size=8192, num_hidden_layers=1)
    model = load(make_checkpoint(tmp_path / "m", replace(LONG_CONTEXT, config=cfg, vocab_padding=8), seed=2), "int4")
    ids = torch.randint(3, model.cfg.vocab_size, (300,), generator=torch.Generator().manual_seed(1)).tolist()
    h = model.embed(torch.tensor([ids]))
    outs = []
    tiles = use_prompt_tiles(False)
    try:
        for layers in (None, model.fast_layers):
            model.fast_layers = layers
            outs.append(model.layer(0, h, model.range_inputs(0, len(ids)), model.new_cache(1, len(ids))))
    finally:
        use_prompt_tiles(tiles)
    want, got = outs
    torch.testing.assert_close(got, want, rtol=0, atol=2 ** -6 * float(want.abs().max()))


@pytest.mark.parametrize("mode", ["int4", "int8"])
def test_greedy_decoding_through_the_cpp_layer(mode):
    """The reference model, 24 tokens: the same tokens as the Python layer, or a first difference
    only where the two logit vectors nearly tie (within twice their difference). Logits agree to
    0.05 + 2% but for a few in ten thousand: a changed summation order (ATen's attention against
    row_attention.cpp) can move one activation block's int8 rounding by a step, which moves single
    logits by up to ~0.2; the worst logit is bounded at 0.25."""
    model = load(real_model_dir("ref-target-24L"), mode)
    prompt = [t % model.cfg.vocab_size for t in (1, 415, 2936, 9060, 285, 1142, 28723, 13, 1014, 349)]
    got, got_logits = greedy_with_margins(model, prompt, 24)
    fast, model.fast_layers = model.fast_layers, None
    want, want_logits = greedy_with_margins(model, prompt, 24)
    model.fast_layers = fast
    for i, (a, b) in enumerate(zip(got, want)):
        if a != b:
            diff = float((got_logits[i] - want_logits[i]).abs().max())
            margin = float(want_logits[i][b] - want_logits[i][a])
            assert margin <= 2 * diff, f"step {i}: token {a} vs {b}, margin {margin:.4f} > 2 x {diff:.4f}"
            break
        diff, want_row = (got_logits[i] - want_logits[i]).abs(), want_logits[i].abs()
        assert float((diff > 0.05 + 0.02 * want_row).float().mean()) <= 1e-3, f"step {i}: logits apart"
        assert float(diff.max()) <= 0.25, f"step {i}: a logit {float(diff.max()):.3f} apart"


def test_the_cpp_layer_serves_every_request_of_a_quantized_cpu_model(tmp_path, monkeypatch):
    """Float models keep the Python layer (the reference), as does SPECEE_CPU_KERNELS=0; a quantized
    model runs every step through it, one ragged call per layer whatever the batch holds, and a
    batch gives each request its tokens decoded alone."""
    from specee import LLM, SamplingParams

    path = make_checkpoint(tmp_path / "m", variant("llama3"), seed=1)
    assert Transformer.load(path, "cpu", torch.float32).fast_layers is None
    monkeypatch.setenv("SPECEE_CPU_KERNELS", "0")
    assert Transformer.load(path, "cpu", torch.float32, quantization="int4").fast_layers is None
    monkeypatch.delenv("SPECEE_CPU_KERNELS")
    llm = LLM(path, quantization="int4")
    if llm.model.fast_layers is None:
        pytest.skip("the C++ decode layer could not be built here (no compiler)")
    calls = []

    class Counted:
        def __init__(self, layer):
            self.layer = layer

        def ragged(self, *a):
            calls.append(len(a[6]))  # the segments (requests) of the call
            return self.layer.ragged(*a)

    real = llm.model.fast_layers
    L, params = llm.model.cfg.num_layers, SamplingParams(max_tokens=6, ignore_eos=True)
    alone = [llm.generate(p, params)[0].token_ids for p in ([5, 6, 7], [8, 9])]
    llm.model.fast_layers = [Counted(f) for f in real]
    assert llm.generate([5, 6, 7], params)[0].token_ids == alone[0]
    assert calls == [1] * 6 * L  # the prefill and the decode steps after its token
    calls.clear()
    assert [o.token_ids for o in llm.generate([[5, 6, 7], [8, 9]], params)] == alone  # a batch: the C++ layer too
    assert calls == [2] * 6 * L
    llm.model.fast_layers = real


@pytest.mark.parametrize("rows", [2, 4])
@torch.inference_mode()
def test_a_chains_verification_rows_equal_decoding_them_one_by_one_bit_for_bit(rows):
    """A speculative chain's rows, verified in one pass, give exactly the hidden states (and K/V) that
    decoding them one token at a time gives: what makes speculative greedy output equal full-depth
    greedy output on a quantized model, not only up to near-ties. On SmolLM2 (4-bit, 30 layers) one
    masked attention call over all rows rounds differently (hidden states 0.4% apart)."""
    from conftest import MODELS

    path = MODELS / "smollm2-135m-instruct" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path.exists():
        pytest.skip(f"SmolLM2 GGUF not available: {path} is absent")
    model = load(path, "auto")
    torch.manual_seed(3)
    ids = torch.randint(0, 1000, (40,)).tolist()
    n = len(ids) - rows
    caches = []
    for together in (True, False):
        cache = model.new_cache(1, len(ids))
        prefill(model, cache, [ids[:n]])
        outs = []
        for start, count in [(n, rows)] if together else [(n + j, 1) for j in range(rows)]:
            step = model.range_inputs(start, count)
            h = model.embed(torch.tensor([ids[start:start + count]]))
            for i in range(model.cfg.num_layers):
                h = model.layer(i, h, step, cache)
            outs.append(h[0])
        caches.append((torch.cat(outs), cache))
    (pass_h, pass_cache), (one_h, one_cache) = caches
    assert torch.equal(pass_h, one_h)
    assert torch.equal(pass_cache.k, one_cache.k) and torch.equal(pass_cache.v, one_cache.v)


# (query heads, kv heads, head size) of the real models' attention (one chunk of 16 floats per head for
# the fixture; 4 for SmolLM2 and Qwen2.5-0.5B, 8 for Qwen2.5-1.5B), grouped 3, 7 and 6 to a kv head, and
# 14 heads on one: row_attention.cpp takes a kv head's heads in tiles of up to 6 (head size 64) or 3
# (128) at the AVX-512 level, so 7 run as 4 + 3 and 14 as 5 + 5 + 4, and in tiles of up to 3 at the AVX2
# level (7 as 3 + 2 + 2, 14 as 3 + 3 + 3 + 3 + 2); and one head to a kv head (tiles of one)
ATTENTION_SHAPES = {"llama3 fixture": None, "smollm2-like": (6, 2, 64), "qwen-0.5b-like": (14, 2, 64),
                    "qwen-1.5b-like": (12, 2, 128), "14-to-1": (14, 1, 64), "one-to-one": (4, 4, 32)}


@pytest.mark.parametrize("level", ["avx512", "avx2", "portable"])
@pytest.mark.parametrize("kv", ["float32", "float16"])
@pytest.mark.parametrize("shape", list(ATTENTION_SHAPES))
@torch.inference_mode()
def test_single_row_attention_matches_atens_within_float_rounding(tmp_path, shape, kv, level):
    """The C++ layer's one-row attention (row_attention.cpp's AVX-512 or AVX2 tiles; ATen's at the
    portable level) against the Python layer's (ATen's scaled dot-product attention), on float weights
    so the products match: decode rows and a chain's rows over a 30-token prefix, grouped-query heads
    of the models' shapes; with a float32 cache, and a float16 one that both layers write rounded to
    nearest and read as float32."""
    from specee.model import kernels as kernel_levels
    from specee.model.quant import kernel_spec

    kernels = kernel_levels.cpu_kernels()
    if kernels is None:
        pytest.skip("the C++ decode layer could not be built here (no compiler)")
    if kernel_levels.LEVELS.index(level) > kernels.int4_best_level():
        pytest.skip(f"this CPU has no {level}")
    before = kernel_levels.use_level(level)
    try:
        assert kernels.row_attention_available(64) == (level != "portable")
        _single_row_attention_against_atens(tmp_path, shape, kv, kernels, kernel_spec)
    finally:
        kernel_levels.use_level(before)


def _single_row_attention_against_atens(tmp_path, shape, kv, kernels, kernel_spec):
    v = variant("llama3")
    if ATTENTION_SHAPES[shape] is not None:
        heads, kv_heads, head_dim = ATTENTION_SHAPES[shape]
        v = replace(v, config={**v.config, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
                               "head_dim": head_dim, "hidden_size": 16 * heads})  # transformers: a multiple of heads
    model = Transformer.load(make_checkpoint(tmp_path / "m", v, seed=1), "cpu", torch.float32, kv_cache_dtype=kv)
    cfg = model.cfg
    assert model.kv_dtype == getattr(torch, kv)
    assert ATTENTION_SHAPES[shape] in (None, (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim))
    fast = [kernels.DecodeLayer(w.attn_norm, w.mlp_norm, cfg.rms_norm_eps, cfg.num_heads, cfg.num_kv_heads,
                                cfg.head_dim, *map(list, zip(*(kernel_spec(x) for x in (w.qkv, w.o, w.gate_up, w.down)))))
            for w in model.layers]
    ids = torch.randint(3, cfg.vocab_size, (36,), generator=torch.Generator().manual_seed(0)).tolist()
    outs, caches = {}, {}
    for name, layers in (("aten", None), ("cpp", fast)):
        model.fast_layers = layers
        cache = caches[name] = model.new_cache(1, len(ids))
        assert cache.k.dtype == getattr(torch, kv)
        prefill(model, cache, [ids[:30]])
        rows = [model.forward(torch.tensor([[ids[n]]]), model.range_inputs(n, 1), cache)[0] for n in range(30, 33)]
        rows.append(model.forward(torch.tensor([ids[33:36]]), model.range_inputs(33, 3), cache)[0])  # a chain
        outs[name] = torch.cat(rows)
    model.fast_layers = None
    # the cache itself: layer 0's K/V (from the same embeddings) within one rounding of the cache's
    # dtype (float16: both round to nearest even; a float32 ulp apart before can round a step apart)
    ulp = 2**-10 if kv == "float16" else 1e-5
    for a, b in ((caches["cpp"].k[0], caches["aten"].k[0]), (caches["cpp"].v[0], caches["aten"].v[0])):
        torch.testing.assert_close(a.float(), b.float(), rtol=ulp, atol=1e-6 if kv == "float16" else 1e-5)
    # float32 rounding of two layers (the C++ layer's norms and sums run in another order too), relative
    # to the hidden states' size (up to ~100 in the wider shapes, where the differences reach 3.5e-4); a
    # float16 cache turns such ulps into float16 steps (2^-11) of K/V, and layer 1 reads the differences
    # of layer 0's attention (2.5e-4 of the scale at most, measured here; a misread head is of its order)
    scale = outs["aten"].abs().max().item()
    atol = max(1e-4, 5e-6 * scale) if kv == "float32" else 2e-3 * scale
    torch.testing.assert_close(outs["cpp"], outs["aten"], rtol=1e-4 if kv == "float32" else 1e-3, atol=atol)


def test_the_cpp_layers_silu_matches_torchs_at_every_level_with_tails_extremes_and_nan():
    """activation.cpp's SiLU(gate) * up against torch's, elementwise to float32's precision, for
    lengths with and without a tail past the 16-wide vectors, large and tiny gates and NaN."""
    from specee.model import kernels

    if kernels.cpu_kernels() is None:
        pytest.skip("no C++ kernels here")
    g = torch.Generator().manual_seed(0)
    for n in (1, 15, 16, 17, 40, 1536):
        gate, up = torch.randn(n, generator=g) * 6, torch.randn(n, generator=g)
        gate[0] = -100.0 if n > 1 else 100.0  # e^-100 clamps to e^-87: |silu| <= 1e-35 where torch says 0
        if n > 16:
            gate[1:4] = torch.tensor([0.0, 88.0, -1e-30])
            gate[n - 1] = float("nan")  # in the tail
            gate[5] = float("nan")  # in a vector
        want = torch.nn.functional.silu(gate) * up
        for level in kernels.LEVELS[: kernels.cpu_kernels().int4_best_level() + 1]:
            before = kernels.use_level(level)
            try:
                got = kernels.cpu_kernels().silu_mul(gate, up)
            finally:
                kernels.use_level(before)
            torch.testing.assert_close(got, want, rtol=2e-6, atol=1e-30, equal_nan=True, msg=f"n={n}, {level}")


def test_the_heads_top_k_names_torchs_k_largest_at_every_level_with_ties_nan_and_short_rows():
    """greedy.cpp's top_k_rows (the candidates a quantized LM head recomputes) against torch.topk's
    values: rows with and without a tail past the 16-wide vectors, many ties, a NaN (never chosen
    while k values beat it), and a row with fewer than k values above -inf (k distinct indices still)."""
    from specee.model import kernels
    from specee.sampling import top_k

    if kernels.cpu_kernels() is None:
        pytest.skip("no C++ kernels here")
    g = torch.Generator().manual_seed(0)
    for n, k in ((5, 5), (40, 16), (49152, 16), (151936, 16)):
        x = torch.randn(4, n, generator=g)
        x[1] = (x[1] * 3).round()  # ties
        x[2, n // 2] = float("nan")
        x[3] = float("-inf")
        x[3, n - 1] = 1.0
        want = x.nan_to_num(nan=float("-inf")).topk(k, dim=-1).values
        for level in kernels.LEVELS[: kernels.cpu_kernels().int4_best_level() + 1]:
            before = kernels.use_level(level)
            try:
                got = top_k(x, k)
            finally:
                kernels.use_level(before)
            assert all(len(set(row.tolist())) == k for row in got), (n, level)
            assert torch.equal(x.gather(1, got).nan_to_num(nan=float("-inf")).sort(descending=True).values, want), \
                (n, level)


@torch.inference_mode()
def test_the_layer_stack_runs_a_step_in_one_call_with_each_layers_numbers(tmp_path):
    """The C++ stack (a range of layers in one call from Python) gives the hidden states of calling
    the layers one at a time, bit for bit, on a batch of a decode row and a verification chain; an
    engine step makes one stack call; wrapping the layers (or no C++ layers) leaves no stack."""
    from specee import LLM, SamplingParams
    from specee.engine.runner import Segment, ragged_inputs

    llm = LLM(make_checkpoint(tmp_path / "m", variant("qwen2"), seed=3), quantization="int4")
    model = llm.model
    if model.fast_stack is None:
        pytest.skip("the C++ decode layer could not be built here (no compiler)")
    caches = [model.new_cache(1, 32), model.new_cache(1, 32)]
    prefix = torch.randn(1, 12, model.cfg.hidden_size)
    for cache in caches:
        model.ragged_layers(0, model.cfg.num_layers, prefix, ragged_inputs(
            [Segment(torch.zeros(12, dtype=torch.long), cache, model.range_inputs(0, 12))],
            [model.range_inputs(0, 12)], [12]))
    steps = [model.range_inputs(12, 1), model.range_inputs(12, 4)]  # a decode row, a chain
    batch = ragged_inputs([Segment(torch.zeros(n, dtype=torch.long), c, s) for n, c, s in zip((1, 4), caches, steps)],
                          steps, [1, 4])
    h = torch.randn(1, 5, model.cfg.hidden_size)
    stack, L = model.fast_stack, model.cfg.num_layers
    got = model.ragged_layers(1, L, model.ragged_layers(0, 1, h, batch), batch)  # two ranges, as feature layers split them
    model.fast_stack = None
    want = model.ragged_layers(0, L, h, batch)
    model.fast_stack = stack
    assert torch.equal(got, want)

    calls = []

    class Counted:
        def ragged(self, *a):
            calls.append((a[0], a[1]))
            return stack.ragged(*a)

    params = SamplingParams(max_tokens=6, ignore_eos=True)
    alone = llm.generate([5, 6, 7], params)[0].token_ids
    model.fast_stack = Counted()
    assert llm.generate([5, 6, 7], params)[0].token_ids == alone
    assert calls == [(0, L)] * 6  # the prefill and each decode step after its token: one call each
    model.fast_stack = stack
    model.fast_layers = [layer for layer in model.fast_layers]  # C++ layers still: a stack of them
    assert model.fast_stack is not None
    model.fast_layers = [lambda *a: None] + model.fast_layers[1:]
    assert model.fast_stack is None


@pytest.mark.parametrize("mode", ["int4", "int8"])
@torch.inference_mode()
def test_steady_steps_through_the_stack_allocate_only_their_output(tmp_path, mode):
    """The C++ layers keep their intermediate rows between calls (kernels/scratch.h): with int4
    kernels a decode step through the whole stack allocates one tensor, its output, as a one-layer
    range does (the profiler sees every CPU tensor allocation: ~8 a layer before), and a step of
    another shape in between (a chain's 4 rows, a prefill's 12) leaves the next step's numbers
    unchanged, also outside inference mode (int8's ATen products write into the rows in place, which
    ATen refuses on tensors made in inference mode)."""
    from torch.profiler import ProfilerActivity, profile

    from specee.engine.runner import Segment, ragged_inputs

    model = load(make_checkpoint(tmp_path / "m", variant("qwen2"), seed=3), mode)
    L = model.cfg.num_layers
    assert L >= 2

    def batch_of(n: int, at: int):
        cache, steps = model.new_cache(1, 32), [model.range_inputs(at, n)]
        return ragged_inputs([Segment(torch.zeros(n, dtype=torch.long), cache, steps[0])], steps, [n])

    decode, chain, prompt = batch_of(1, 12), batch_of(4, 12), batch_of(12, 0)
    h1, h4, h12 = (torch.randn(1, n, model.cfg.hidden_size) for n in (1, 4, 12))

    def allocations(first: int, last: int) -> int:
        model.ragged_layers(first, last, h1, decode)  # the shape's first call sizes the workspace
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            model.ragged_layers(first, last, h1, decode)
        return sum(e.name == "[memory]" for e in prof.events())

    if mode == "int4":  # int8's products are ATen's (model/quant.py), which allocate their own
        assert 1 <= allocations(0, L) == allocations(0, 1) <= 2  # the output (and its release, if seen)
    alone = model.ragged_layers(0, L, h1, decode)
    model.ragged_layers(0, L, h4, chain)
    model.ragged_layers(0, L, h12, prompt)
    assert torch.equal(model.ragged_layers(0, L, h1, decode), alone)
    with torch.inference_mode(False):  # the buffers were made under inference mode: still writable here
        assert torch.equal(model.ragged_layers(0, L, h1.clone(), decode), alone)


def test_the_heads_rescoring_the_final_norm_and_q8_0_rows_match_their_references():
    """The quantized head's helpers in C++: Q8_0 rows as gguf dequantizes them (bit for bit), the
    exact rescoring of candidates (float64 dot products to float32 rounding, nothing else written)
    and the final RMS norm (torch's to float32 rounding)."""
    import gguf
    import numpy as np
    from gguf.quants import quantize

    from specee.model import kernels
    from specee.model.gguf_blocks import GGUFWeight

    module = kernels.cpu_kernels()
    if module is None:
        pytest.skip("no C++ kernels here")
    g = torch.Generator().manual_seed(0)
    weight = (torch.randn(300, 96, generator=g) * torch.logspace(-3, 1, 300).unsqueeze(1)).numpy()
    table = GGUFWeight(gguf.GGMLQuantizationType.Q8_0, quantize(weight, gguf.GGMLQuantizationType.Q8_0))
    ids = torch.tensor([299, 0, 17, 17, 150])
    want = torch.from_numpy(np.ascontiguousarray(table.dequantize().numpy()[ids.numpy()]))
    assert torch.equal(table.rows(ids), want) and torch.equal(module.q8_0_rows(table._table(), ids), want)
    with pytest.raises(RuntimeError, match="outside the table"):
        module.q8_0_rows(table._table(), torch.tensor([300]))

    x = torch.randn(3, 96, generator=g)
    logits = torch.randn(3, 300, generator=g)
    picked = torch.stack([torch.randperm(300, generator=g)[:16] for _ in range(3)])
    rows = table.rows(picked.reshape(-1)).view(3, 16, 96)
    got = module.rescore_rows(logits.clone(), picked, rows, x)
    exact = (rows.double() * x.double().unsqueeze(1)).sum(-1).float()
    untouched = torch.ones_like(logits, dtype=torch.bool).scatter_(1, picked, False)
    assert torch.equal(got[untouched], logits[untouched])
    torch.testing.assert_close(got.gather(1, picked), exact, rtol=1e-5, atol=1e-5)

    h, w = torch.randn(2, 5, 96, generator=g) * 7, torch.rand(96, generator=g) + 0.5
    torch.testing.assert_close(module.rms_norm(h, w, 1e-5), torch.nn.functional.rms_norm(h, (96,), w, 1e-5),
                               rtol=2e-6, atol=1e-6)
