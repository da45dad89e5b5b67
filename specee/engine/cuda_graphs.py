"""CUDA graphs of decode steps: one replay instead of every layer's kernel launches.

On a GPU, a full-depth decode step of a 7B model is ~600 small kernels; launching them from Python
took 9.3 ms a step on an H200's host against ~4 ms of GPU work (benchmarks/gpu_cost.py), so decoding
ran at the host's speed. A graph records a step's kernels once and replays them with one launch.

A graph fixes every shape and address, so a step is graphed only where its shape repeats: every
segment one decode row (full depth, or a speculative step that did not draft), reading its own
cache through a mask over a bucket of `BUCKET` slots (attention reads the cache up to the bucket;
the slots past the row's own are masked out, so the bucket, not the length, is in the key). The
key is the batch's caches (their storage in the pool) and buckets: a stable batch meets a new key
every `BUCKET` tokens, a join or a finish at once. A key is captured the second step in a row it is
seen (a batch whose membership changes every step stays eager), and the last `KEEP` graphs are
kept; all share one memory pool, as only one replays at a time.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

from ..model.llama import StepInputs, Transformer
from .runner import Segment, ragged_inputs

BUCKET = 256  # slots: attention reads at most this many masked slots more than it needs
KEEP = 32  # graphs kept (least recently used dropped)


@dataclass
class Graph:
    """A captured step and the static tensors it reads and writes."""

    graph: torch.cuda.CUDAGraph
    tokens: torch.Tensor  # [N] the rows' token ids
    cos: torch.Tensor  # [1, N, 1, D]
    sin: torch.Tensor
    slots: torch.Tensor  # [N] each row's slot in its own cache
    out: torch.Tensor | None = None  # [N, H] final hidden states


def graphable(segments: list[Segment]) -> bool:
    """Whether a step's segments are all plain decode rows (one row, reading every slot before it)."""
    return all(s.exits is None and s.step.reads == "all" and s.tokens.shape[0] == 1 for s in segments)


class DecodeGraphs:
    def __init__(self, model: Transformer):
        self.model = model
        self.graphs: OrderedDict[tuple, Graph] = OrderedDict()
        self.pool = torch.cuda.graph_pool_handle()
        self.last_key: tuple | None = None
        self.replays = 0  # steps served by a graph (tests and benchmarks read it)

    def forward(self, segments: list[Segment]) -> torch.Tensor | None:
        """Final hidden states [N, H] of the decode rows, from a graph; None where the step is not
        graphed (the caller runs it eagerly)."""
        if not graphable(segments):
            self.last_key = None
            return None
        buckets = [min(-(-s.step.kv_len // BUCKET) * BUCKET, s.cache.max_len) for s in segments]
        key = tuple((s.cache.k.data_ptr(), b) for s, b in zip(segments, buckets))
        g = self.graphs.get(key)
        if g is None:
            seen, self.last_key = self.last_key == key, key
            if not seen:
                return None
            g = self.graphs[key] = self._capture(segments, buckets)
            if len(self.graphs) > KEEP:
                self.graphs.popitem(last=False)
        self.graphs.move_to_end(key)
        self.last_key = key
        self._load(g, segments)
        g.graph.replay()
        self.replays += 1
        return g.out

    @staticmethod
    def _load(g: Graph, segments: list[Segment]) -> None:
        """Copy this step's rows into the graph's input tensors."""
        if len(segments) == 1:
            s = segments[0]
            g.tokens.copy_(s.tokens), g.cos.copy_(s.step.cos), g.sin.copy_(s.step.sin), g.slots.copy_(s.step.slots)
            return
        torch.cat([s.tokens for s in segments], out=g.tokens)
        torch.cat([s.step.cos for s in segments], dim=1, out=g.cos)
        torch.cat([s.step.sin for s in segments], dim=1, out=g.sin)
        torch.cat([s.step.slots for s in segments], out=g.slots)

    def _capture(self, segments: list[Segment], buckets: list[int]) -> Graph:
        model = self.model
        first = segments[0].step
        g = Graph(torch.cuda.CUDAGraph(), torch.empty(len(segments), dtype=torch.long, device=model.device),
                  first.cos.new_empty(1, len(segments), *first.cos.shape[2:]),
                  first.sin.new_empty(1, len(segments), *first.sin.shape[2:]),
                  torch.empty(len(segments), dtype=torch.long, device=model.device))
        self._load(g, segments)
        widest = max(buckets)

        def step() -> torch.Tensor:
            reads = torch.arange(widest, device=model.device)[None, :] <= g.slots[:, None]  # [N, widest]: each row its slots up to its own
            steps = [StepInputs(slots=g.slots[j : j + 1], cos=g.cos[:, j : j + 1], sin=g.sin[:, j : j + 1], kv_len=b,
                                reads="mask", mask=reads[j, :b].view(1, 1, 1, b)) for j, b in enumerate(buckets)]
            batch = ragged_inputs(segments, steps, [1] * len(segments))
            h = model.embed(g.tokens[None, :])
            return model.ragged_layers(0, model.cfg.num_layers, h, batch)[0]

        side = torch.cuda.Stream(model.device)  # a first run off the capture: lazy initialisations (cuBLAS) happen here
        side.wait_stream(torch.cuda.current_stream(model.device))
        with torch.cuda.stream(side):
            step()
        torch.cuda.current_stream(model.device).wait_stream(side)
        with torch.cuda.graph(g.graph, pool=self.pool, capture_error_mode="thread_local"):  # other threads may use the GPU
            g.out = step()
        return g
