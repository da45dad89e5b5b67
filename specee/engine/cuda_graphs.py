"""CUDA graphs of decode steps: one replay instead of every layer's kernel launches.

On a GPU, a full-depth decode step of a 7B model is ~600 small kernels; launching them from Python
took 9.3 ms a step on an H200's host against ~4 ms of GPU work (benchmarks/gpu_cost.py), so decoding
ran at the host's speed. A graph records a step's kernels once and replays them with one launch.

A graph fixes every shape and address, so a step is graphed only where its shape repeats: every
segment one decode row (full depth, or a speculative step that did not draft). Its rows attend as
one segment over the span of the KV pool that holds their requests' runs (a bucket of `BUCKET`
slots past the last slot any row reads), each through a mask to its own run's slots up to its own:
one attention and one cache write per layer for the batch, where a segment each took 8 attention
kernels a layer at 8 requests (3.5 of a step's 11 ms). The key is the span and the number of rows,
so requests may join or leave, at the same place in the pool, without a new graph; one is captured
the second step in a row its key is seen, the last `KEEP` are kept, and all share one memory pool,
as only one replays at a time. A span much longer than what its rows read (a pool fragmented by
requests between them) runs eagerly instead.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

from ..model.kv_cache import KVCache
from ..model.llama import StepInputs, Transformer
from .kv_manager import KVCacheManager
from .runner import Segment, ragged_inputs

BUCKET = 256  # slots: a span ends at most this far past the last slot its rows read
KEEP = 32  # graphs kept (least recently used dropped)
SLACK = 4  # a span graphs if at most this many times the slots its rows read, plus a bucket


@dataclass
class Graph:
    """A captured step and the static tensors it reads and writes."""

    graph: torch.cuda.CUDAGraph
    tokens: torch.Tensor  # [N] the rows' token ids
    cos: torch.Tensor  # [1, N, 1, D]
    sin: torch.Tensor
    slots: torch.Tensor  # [N] each row's slot in its own run
    starts: torch.Tensor  # [N] where its run starts in the span
    out: torch.Tensor | None = None  # [N, H] final hidden states


def graphable(segments: list[Segment]) -> bool:
    """Whether a step's segments are all plain decode rows (one row, reading every slot before it)."""
    return all(s.exits is None and s.step.reads == "all" and s.tokens.shape[0] == 1 for s in segments)


class DecodeGraphs:
    def __init__(self, model: Transformer, kv: KVCacheManager):
        self.model, self.kv = model, kv
        self.graphs: OrderedDict[tuple[int, int, int], Graph] = OrderedDict()
        self.pool = torch.cuda.graph_pool_handle()
        self.slot_bytes = kv.k.stride(3) * kv.k.element_size()
        self.last_key: tuple[int, int, int] | None = None
        self.replays = 0  # steps served by a graph (tests and benchmarks read it)

    def forward(self, segments: list[Segment]) -> torch.Tensor | None:
        """Final hidden states [N, H] of the decode rows, from a graph; None where the step is not
        graphed (the caller runs it eagerly)."""
        if not graphable(segments):
            self.last_key = None
            return None
        runs = [(s.cache.k.data_ptr() - self.kv.k.data_ptr()) // self.slot_bytes for s in segments]
        first = min(runs)
        span = min(-(-(max(r + s.step.kv_len for r, s in zip(runs, segments)) - first) // BUCKET) * BUCKET,
                   self.kv.capacity - first)
        if span > SLACK * sum(s.step.kv_len for s in segments) + BUCKET:
            self.last_key = None
            return None
        key = (first, span, len(segments))
        g = self.graphs.get(key)
        if g is None:
            seen, self.last_key = self.last_key == key, key
            if not seen:
                return None
            g = self.graphs[key] = self._capture(segments, [r - first for r in runs], first, span)
            if len(self.graphs) > KEEP:
                self.graphs.popitem(last=False)
        else:
            self._load(g, segments, [r - first for r in runs])
        self.graphs.move_to_end(key)
        self.last_key = key
        g.graph.replay()
        self.replays += 1
        return g.out

    @staticmethod
    def _load(g: Graph, segments: list[Segment], starts: list[int]) -> None:
        """Copy this step's rows into the graph's input tensors."""
        g.starts.copy_(torch.tensor(starts), non_blocking=True)
        if len(segments) == 1:
            s = segments[0]
            g.tokens.copy_(s.tokens), g.cos.copy_(s.step.cos), g.sin.copy_(s.step.sin), g.slots.copy_(s.step.slots)
            return
        torch.cat([s.tokens for s in segments], out=g.tokens)
        torch.cat([s.step.cos for s in segments], dim=1, out=g.cos)
        torch.cat([s.step.sin for s in segments], dim=1, out=g.sin)
        torch.cat([s.step.slots for s in segments], out=g.slots)

    def _capture(self, segments: list[Segment], starts: list[int], first: int, span: int) -> Graph:
        model, kv, N = self.model, self.kv, len(segments)
        cos = segments[0].step.cos
        g = Graph(torch.cuda.CUDAGraph(), torch.empty(N, dtype=torch.long, device=model.device),
                  cos.new_empty(1, N, *cos.shape[2:]), cos.new_empty(1, N, *cos.shape[2:]),
                  torch.empty(N, dtype=torch.long, device=model.device),
                  torch.empty(N, dtype=torch.long, device=model.device))
        self._load(g, segments, starts)
        window = slice(first, first + span)
        cache = KVCache.over(kv.k[:, :, :, window], kv.v[:, :, :, window], kv.filled[:, :, window], kv.slot_ids)

        def step() -> torch.Tensor:
            slots = g.starts + g.slots  # in the span
            keys = torch.arange(span, device=model.device)[None, :]
            reads = (keys >= g.starts[:, None]) & (keys <= slots[:, None])  # [N, span]: its run up to its slot
            inputs = StepInputs(slots=slots, cos=g.cos, sin=g.sin, kv_len=span, reads="mask",
                                mask=reads.view(1, 1, N, span))
            batch = ragged_inputs([Segment(g.tokens, cache, inputs)], [inputs], [N])
            return model.ragged_layers(0, model.cfg.num_layers, model.embed(g.tokens[None, :]), batch)[0]

        side = torch.cuda.Stream(model.device)  # a first run off the capture: lazy initialisations (cuBLAS) happen here
        side.wait_stream(torch.cuda.current_stream(model.device))
        with torch.cuda.stream(side):
            step()
        torch.cuda.current_stream(model.device).wait_stream(side)
        with torch.cuda.graph(g.graph, pool=self.pool, capture_error_mode="thread_local"):  # other threads may use the GPU
            g.out = step()
        return g
