"""The rows a CUDA graph records (engine/cuda_graphs.py's SpanBatch: every row of a step as one
segment over the pool span holding its requests' runs, each row masked to its own run) compute
what the engine's eager forward computes, on the CPU: the graph's inputs and masks are right before
any GPU captures them. The graphs themselves run in tests/test_cuda.py."""
from __future__ import annotations

import pytest
import torch
from checkpoints import Variant, make_checkpoint

from specee import LLM
from specee.engine.cuda_graphs import SpanBatch, graphable
from specee.engine.runner import ModelRunner, Segment

SMALL = Variant("graphs3", "llama", dict(num_hidden_layers=3, num_key_value_heads=2), vocab_padding=8)


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    return LLM(make_checkpoint(tmp_path_factory.mktemp("graphs") / "m", SMALL, seed=3), dtype="float32",
               quantization=None)


def test_span_batch_rows_equal_the_eager_forward(llm):
    model, kv = llm.model, llm.engine.kv
    g = torch.Generator().manual_seed(0)
    caches, lengths = [], (5, 11, 3)
    for name, n in zip("abc", lengths):  # three runs side by side in the pool, each prefilled
        cache = kv.allocate(name, 40)
        ids = torch.randint(3, model.cfg.vocab_size, (n,), generator=g)
        ModelRunner(model).forward([Segment(ids, cache, model.range_inputs(0, n))])
        caches.append(cache)
    tokens = [torch.randint(3, model.cfg.vocab_size, (k,), generator=g) for k in (1, 4, 1)]
    # a decode row, a verification chain of the token and 3 drafts, a decode row
    segments = [Segment(t, c, model.range_inputs(n, t.shape[0])) for t, c, n in zip(tokens, caches, lengths)]
    assert graphable(segments)
    eager = ModelRunner(model).forward(segments)[0]
    written = [(c.k[:, :, :, n : n + t.shape[0]].clone(), c.v[:, :, :, n : n + t.shape[0]].clone())
               for c, n, t in zip(caches, lengths, tokens)]
    for c, n, t in zip(caches, lengths, tokens):  # the span pass must write them again
        c.k[:, :, :, n : n + t.shape[0]] = 0
        c.v[:, :, :, n : n + t.shape[0]] = 0
    runs = [c.pool_slot for c in caches]
    slot_bytes = kv.k.stride(3) * kv.k.element_size()  # each run where its storage lies in the pool
    assert runs == [(c.k.data_ptr() - kv.k.data_ptr()) // slot_bytes for c in caches]
    first, span = min(runs), 160
    batch = SpanBatch(model, kv, first, span, sum(t.shape[0] for t in tokens))
    batch.load(segments, [r - first for r in runs])
    torch.testing.assert_close(batch.forward(), eager, rtol=1e-5, atol=1e-5)
    for (k, v), c, n, t in zip(written, caches, lengths, tokens):
        torch.testing.assert_close(c.k[:, :, :, n : n + t.shape[0]], k, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(c.v[:, :, :, n : n + t.shape[0]], v, rtol=1e-5, atol=1e-5)


def test_prefills_trees_and_exits_are_not_graphed(llm):
    model, cache = llm.model, llm.engine.kv.allocate("p", 40)
    ids = torch.arange(3, 9)
    assert not graphable([Segment(ids, cache, model.range_inputs(0, 6))])  # a prefill: causal, any length
    tree = model.step_inputs(torch.arange(6, 9)[None], torch.arange(6, 9), torch.ones(1, 1, 3, 9, dtype=torch.bool), 9)
    assert not graphable([Segment(ids[:3], cache, tree)])
    assert not graphable([Segment(ids[:1], cache, model.range_inputs(6, 1), exits=object())])
