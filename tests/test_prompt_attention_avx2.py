"""A prompt's attention in AVX2 float32 (model/kernels/prompt_attention_avx2.cpp), where the kernels
run at their AVX2 level or at AVX-512 without AMX tiles: causal attention in float32 (against float64),
rows independent of the rows beside them and of where a chunked prefill's part starts, the rule that
sends only a prompt of 32 rows or more there, and the C++ layer still beside the Python one. Run at
each of the two levels the CPU has (an AVX-512 one lowered to AVX2 too); skipped elsewhere."""
from __future__ import annotations

import pytest
import torch
from test_amx import PROMPT_ROWS, causal_attention, first_layer

from specee.model import kernels


@pytest.fixture(params=["avx2", "avx512"])
def kernel(request):
    """The kernels at the level the test is for (AVX2, or AVX-512 where AMX does not take the prompt's
    attention), then back."""
    k = kernels.int4_kernel()
    if k is None:
        pytest.skip("the CPU kernels are not built here")
    if kernels.LEVELS.index(request.param) > k.int4_best_level():
        pytest.skip(f"this CPU has no {request.param.upper()}")
    if request.param == "avx512" and k.amx_available():
        pytest.skip("at the AVX-512 level this CPU's AMX tiles take a prompt's attention (test_amx.py)")
    before = kernels.use_level(request.param)
    try:
        if not k.prompt_attention_available(64):
            pytest.skip("this CPU has no F16C, or prompt tiles are switched off (SPECEE_AMX=0)")
        yield k
    finally:
        kernels.use_level(before)


@torch.inference_mode()
@pytest.mark.parametrize("heads,kv_heads,S,D", [(9, 3, 32, 64), (9, 3, 33, 64), (12, 2, 100, 128), (4, 4, 257, 32),
                                                (14, 2, 70, 64), (6, 2, 50, 256), (9, 3, 769, 64)])
def test_prompt_attention_is_causal_attention_in_float32(kernel, heads, kv_heads, S, D):
    assert not kernel.prompt_attention_available(24) and not kernel.prompt_attention_available(272)
    gen = torch.Generator().manual_seed(S)
    q = torch.randn(heads, S, D, generator=gen) * 2
    keys = (torch.randn(kv_heads, S, D, generator=gen) * 2).half()
    values = torch.randn(kv_heads, S, D, generator=gen).half()
    y = kernel.prompt_attention(q, keys, values).double()
    err = (y - causal_attention(q, keys, values, bf16=False)).abs()
    # float32 sums and a polynomial exp (relative error ~1e-7) against float64; bf16 operands would be ~1e-3
    assert err.max() < 1e-5 * values.abs().max(), float(err.max())
    assert err.pow(2).mean().sqrt() < 1e-6, float(err.pow(2).mean().sqrt())


@torch.inference_mode()
def test_a_prompt_rows_attention_depends_neither_on_the_rows_after_it_nor_on_where_its_part_starts(kernel):
    """Row i gets the same bits whether the prompt ends at row i or runs on, and whether its rows start
    at slot 0 or at a later part's first slot (the earlier parts' keys from the cache): its tile's other
    rows and the padded keys add nothing to its sums."""
    gen = torch.Generator().manual_seed(0)
    q, keys, values = torch.randn(6, 300, 64, generator=gen), torch.randn(2, 300, 64, generator=gen).half(), \
        torch.randn(2, 300, 64, generator=gen).half()
    y = kernel.prompt_attention(q, keys, values)
    for S in (1, 2, 15, 16, 17, 32, 33, 100, 299):
        assert torch.equal(kernel.prompt_attention(q[:, :S], keys[:, :S], values[:, :S]), y[:S]), S
    for start, end in ((32, 64), (47, 300), (100, 133), (255, 300), (299, 300)):
        part = kernel.prompt_attention(q[:, start:end], keys[:, :end], values[:, :end])
        assert torch.equal(part, y[start:end]), (start, end)


@torch.inference_mode()
def test_only_a_prompt_of_32_rows_or_more_attends_together_and_stays_beside_the_python_layer(kernel, tmp_path):
    """The C++ layer at the level: below 32 rows the same bits with prompt tiles on or off (every row
    through row_attention.cpp); from 32 rows the attention's order of sums differs, and both stay as close
    to the Python layer."""
    from checkpoints import make_checkpoint
    from test_decode_layer import load, variant

    model = load(make_checkpoint(tmp_path / "m", variant("llama3"), seed=3), "int4")
    short = [first_layer(model, PROMPT_ROWS - 1, t) for t in (True, False)]
    assert torch.equal(short[0], short[1])
    on, off, ref = (first_layer(model, 80, t) for t in (True, False, None))
    assert not torch.equal(on, off)
    rms = lambda a: float((a - ref).pow(2).mean().sqrt())  # noqa: E731
    assert rms(on) < 2 * rms(off) + 1e-6 and torch.allclose(on, ref, atol=1e-3), (rms(on), rms(off))


@torch.inference_mode()
def test_a_prompt_prefilled_in_parts_gets_the_bits_of_one_pass(kernel, tmp_path):
    """Chunked prefill's parts (32, 32 and 36 rows of a 100-token prompt) give every row the hidden state
    of the prompt in one pass, bit for bit, with the rows attending together."""
    from checkpoints import make_checkpoint
    from test_decode_layer import load, variant

    model = load(make_checkpoint(tmp_path / "m", variant("llama3"), seed=4), "int4")
    ids = torch.randint(3, model.cfg.vocab_size, (1, 100), generator=torch.Generator().manual_seed(1))
    whole = model.forward(ids, model.range_inputs(0, 100), model.new_cache(1, 100))
    cache = model.new_cache(1, 100)
    parts = [model.forward(ids[:, a:b], model.range_inputs(a, b - a, prompt=True), cache)
             for a, b in ((0, 32), (32, 64), (64, 100))]
    assert torch.equal(torch.cat(parts, dim=1), whole)
