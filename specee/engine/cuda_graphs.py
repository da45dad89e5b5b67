"""CUDA graphs of decode and verification steps: one replay instead of every layer's kernel launches.

On a GPU, a full-depth decode step of a 7B model is ~600 small kernels; launching them from Python
took 9.3 ms a step on an H200's host against ~4 ms of GPU work (benchmarks/gpu_cost.py), so decoding
ran at the host's speed. A graph records a step's kernels once and replays them with one launch.

A graph fixes every shape and address, so a step is graphed only where its shape repeats: every
segment a decode row or a verification chain (full depth, speculative chains; not a prefill, a
tree or early exit's hooks). Its rows attend as one segment (`SpanBatch`) over the span of the KV
pool that holds their requests' runs, ending at most a bucket of `BUCKET` slots past the last slot
any row reads, each row through a mask to its own run's slots up to its own: one attention and one
cache write per layer for the batch, where a segment each took 8 attention kernels a layer at 8
requests (3.5 of a step's 11 ms). The key is the span and the number of rows, so requests may join
or leave at the same place in the pool without a new graph. A key is captured the second time it is
seen, the last `KEEP` graphs are kept, and all share one memory pool (only one replays at a time).
A span much longer than what its rows read (a pool fragmented by requests between them) runs eagerly.
"""
from __future__ import annotations

from collections import OrderedDict

import torch

from ..model.llama import Transformer
from ..model.step_inputs import StepInputs
from .kv_manager import KVCacheManager
from .runner import Segment, ragged_inputs

BUCKET = 256  # slots: a span ends at most this far past the last slot its rows read
KEEP = 32  # graphs kept (least recently used dropped)
SLACK = 4  # a span graphs if at most this many times the slots its rows read, plus a bucket
MAX_ROWS = 16  # a segment's rows at most (a decode row, or a chain of drafts and the token before them)


def graphable(segments: list[Segment]) -> bool:
    """Whether every segment is a decode row or a verification chain (each row reads its own
    request's slots up to its own) over a run of the engine's pool, without early exit's hooks."""
    return all(s.exits is None and s.step.reads in ("all", "chain") and s.tokens.shape[0] <= MAX_ROWS
               and s.cache.pool_slot is not None for s in segments)


class SpanBatch:
    """A step's rows as one segment over the pool's slots [first, first + span): the static tensors a
    graph reads (rows' tokens, RoPE rows, slots in their runs, where their runs start) and the forward
    it records, which runs the model's own layers under a mask."""

    def __init__(self, model: Transformer, kv: KVCacheManager, first: int, span: int, rows: int):
        self.model, self.span, device = model, span, model.device
        self.tokens = torch.empty(rows, dtype=torch.long, device=device)
        D = model.cfg.head_dim
        self.cos = model.cos_table.new_empty(1, rows, 1, D)
        self.sin = model.cos_table.new_empty(1, rows, 1, D)
        self.slots = torch.empty(rows, dtype=torch.long, device=device)
        self.starts = torch.empty(rows, dtype=torch.long, device=device)
        self.cache = kv.view(first, first + span)

    def load(self, segments: list[Segment], starts: list[int]) -> None:
        """Copy the step's rows in; starts: each segment's run start in the span."""
        per_row = [a for a, s in zip(starts, segments) for _ in range(s.tokens.shape[0])]
        self.starts.copy_(torch.tensor(per_row))
        torch.cat([s.tokens for s in segments], out=self.tokens)
        torch.cat([s.step.cos for s in segments], dim=1, out=self.cos)
        torch.cat([s.step.sin for s in segments], dim=1, out=self.sin)
        torch.cat([s.step.slots for s in segments], out=self.slots)

    def forward(self) -> torch.Tensor:
        """Every layer over the rows: their final hidden states [rows, H]."""
        model, N = self.model, self.tokens.shape[0]
        slots = self.starts + self.slots
        keys = torch.arange(self.span, device=model.device)[None, :]
        reads = (keys >= self.starts[:, None]) & (keys <= slots[:, None])  # [N, span]: its run up to its slot
        step = StepInputs(slots=slots, cos=self.cos, sin=self.sin, kv_len=self.span, reads="mask",
                          mask=reads.view(1, 1, N, self.span))
        batch = ragged_inputs([Segment(self.tokens, self.cache, step)], [step], [N])
        return model.ragged_layers(0, model.cfg.num_layers, model.embed(self.tokens[None, :]), batch)[0]


class DecodeGraphs:
    """The graphs of one engine's steps, keyed by (first slot, span, rows), over its KV pool."""

    def __init__(self, model: Transformer, kv: KVCacheManager):
        self.model, self.kv = model, kv
        self.graphs: OrderedDict[tuple[int, int, int], tuple[torch.cuda.CUDAGraph, SpanBatch, torch.Tensor]]
        self.graphs = OrderedDict()
        self.seen: OrderedDict[tuple[int, int, int], None] = OrderedDict()  # keys met once, the latest last
        self.pool = torch.cuda.graph_pool_handle()
        self.replays = 0  # steps served by a graph (tests and benchmarks read it)

    def span(self, segments: list[Segment]) -> tuple[int, int, list[int]] | None:
        """The pool span the segments' rows read (first slot, length) and each run's start in it; None
        where they are not graphable or the span is much longer than what they read."""
        if not graphable(segments):
            return None
        runs = [s.cache.pool_slot for s in segments]
        first = min(runs)
        end = max(r + s.step.kv_len for r, s in zip(runs, segments))
        span = min(-(-(end - first) // BUCKET) * BUCKET, self.kv.capacity - first)
        if span > SLACK * sum(s.step.kv_len for s in segments) + BUCKET:
            return None
        return first, span, [r - first for r in runs]

    def forward(self, segments: list[Segment]) -> torch.Tensor | None:
        """Final hidden states [N, H] of the segments' rows from a graph; None where the step is not
        graphed (the caller runs it eagerly)."""
        where = self.span(segments)
        if where is None:
            return None
        first, span, starts = where
        key = (first, span, sum(s.tokens.shape[0] for s in segments))
        entry = self.graphs.get(key)
        if entry is None:
            if key not in self.seen:
                self.seen[key] = None
                if len(self.seen) > 4 * KEEP:
                    self.seen.popitem(last=False)
                return None
            del self.seen[key]
            batch = SpanBatch(self.model, self.kv, *key)
            batch.load(segments, starts)
            entry = self.graphs[key] = self._capture(batch)
            if len(self.graphs) > KEEP:
                self.graphs.popitem(last=False)
        else:
            entry[1].load(segments, starts)
            self.graphs.move_to_end(key)
        graph, _, out = entry
        graph.replay()
        self.replays += 1
        return out

    def _capture(self, batch: SpanBatch) -> tuple[torch.cuda.CUDAGraph, SpanBatch, torch.Tensor]:
        """Record the batch's forward (its inputs loaded) as a graph."""
        device = self.model.device
        side = torch.cuda.Stream(device)  # a first run off the capture: lazy initialisations (cuBLAS) happen here
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            batch.forward()
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):  # other threads may run
            out = batch.forward()
        return graph, batch, out
