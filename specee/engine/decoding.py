"""How a running request decodes: the rows it adds to a step and how its tokens are chosen.

A decoding is a plan (the rows of a request's segment) plus an acceptance rule (the tokens those
rows' logits give) plus a commit (what the cache and the request keep). The engine does the rest
the same way for every decoding: prefill, one forward over every request's rows, one host read
of all verdicts, stop checks. `FullDepth` is the plain one (one row, its sampled token);
speculative decoding (speculative/speculative.py) plans a draft chain or tree.
"""
from __future__ import annotations

import torch

from ..model.llama import Transformer
from ..sampling import sample
from .runner import Segment
from .scheduler import Running


class FullDepth:
    """Full-depth decoding: each step writes the last token's K/V and samples the next token."""

    feature_layers: tuple[int, ...] = ()  # target layers a drafter reads (EAGLE)
    extra_rows = 0  # cache slots a step may write beyond prompt + max_tokens

    def __init__(self, model: Transformer):
        self.model = model

    def begin_step(self, batch: list[Running], waiting: bool = False) -> None:
        """A step of these requests begins (those past their prefill decode in it); waiting: whether
        other requests wait for a slot or for blocks."""

    def end_step(self, tokens: int, seconds: float) -> None:
        """A step of only decoding requests emitted `tokens` in `seconds`."""

    def prefill_length(self, seq) -> int:
        """Prompt tokens the prefill runs (all: the first token comes from its last row)."""
        return len(seq.prompt_ids)

    def start(self, r: Running, features: torch.Tensor | None) -> None:
        """The request's prefill gave its first token (`r.last`); features: the prompt rows' features."""

    def plan(self, r: Running) -> Segment:
        n = r.cache.length
        return Segment(torch.tensor([r.last], device=self.model.device), r.cache, self.model.range_inputs(n, 1))

    def picks(self, r: Running, rows: int) -> range:
        """Which of the request's `rows` final rows need logits (here: all)."""
        return range(rows)

    def takes_argmax(self, r: Running) -> bool:
        """Whether the request's verdict is its one row's argmax (a greedy plain step), which the engine
        then reads from one argmax over the step's rows instead of calling `choose`."""
        return r.seq.params.greedy

    def choose(self, r: Running, logits: torch.Tensor) -> torch.Tensor:
        """The request's verdict on the device from its rows' logits: here [t], the next token."""
        return sample(logits, r.seq.params, r.generator)

    def commit(self, r: Running, verdict: list[int], features: torch.Tensor | None) -> list[int]:
        """Keep what the verdict says in the cache; returns the tokens the request emits."""
        r.cache.length += 1
        return verdict

    def stats(self, r: Running, decode_seconds: float) -> dict | None:
        return None
