"""The EAGLE drafter: drives an EagleHead (eagle_head.py) during speculative decoding.

State: the head's own one-layer KV cache, filled for the committed history, and the head's
output at the last committed position (which predicts the first draft token). Alignment (the
contract): the row pairing the target's feature at position t with the token at t + 1 sits at
slot and RoPE position t + 1 and predicts the token at t + 2; slot 0 is never written.

* begin: pairs (f(x_0), x_1) .. (f(x_{m-2}), x_{m-1}) of the prompt, run in one head pass;
* commit: the target's real features replace the fed-back ones: the accepted rows are rerun;
* draft / draft_all: a chain, feeding the head's own output back with each draft token;
* tree_roots / tree_rows: the same, for the beam rows of EAGLE-2 trees (speculative/tree.py).
The pairs of begin and commit wait for the next draft (at most one commit waits), so that the
forks of an engine step (one per request) run them together, then advance their chains
together (or grow their trees together): one ragged head forward per draft depth (engine/runner.py's
inputs, the target's `ragged_layer`), each fork in its own cache.
"""
from __future__ import annotations

from itertools import accumulate

import torch

from ..engine.runner import Segment, ragged_inputs
from ..sampling import SamplingParams
from ..speculative.tree import beam_inputs
from .base import Draft, DraftChain, Drafter
from .eagle_head import EagleHead


class EagleDrafter(Drafter):
    scores_vocabulary = True

    def __init__(self, head: EagleHead, k: int = 4, max_len: int = 256):
        self.head, self.target, self.k = head, head.target, k
        self.name = "eagle"
        self.fingerprint = f"eagle-{head.target_fingerprint}"
        self.feature_layers = tuple(head.config.feature_layers)
        self.device = head.target.device
        self.context = head.target.cfg.context_limit
        self._cache = head.new_cache(1, max(2, min(max_len, self.context)))
        self._history: list[int] = []
        self._n = 0  # next slot to write: slots 1.._n - 1 hold the committed pairs
        self._last: torch.Tensor | None = None  # head output at the last committed position, [1, 1, H]
        self._pending: torch.Tensor | None = None  # target features [1, S, W] of the last S tokens, not run yet

    def _ensure_capacity(self, needed: int) -> None:
        cache = self._cache
        if needed <= cache.max_len:
            return
        grown = self.head.new_cache(1, min(max(needed, 2 * cache.max_len), self.context + 1))
        grown.k[:, :, :, : self._n] = cache.k[:, :, :, : self._n]
        grown.v[:, :, :, : self._n] = cache.v[:, :, :, : self._n]
        self._cache = grown

    @torch.inference_mode()
    def _catch_up(self, drafters: list["EagleDrafter"]) -> None:
        """The pending pairs of every fork that has some (the target's features and the last tokens of the
        history) as one ragged head forward, each fork's rows at its next slots in its own cache; each
        keeps its last output."""
        waiting = [d for d in drafters if d._pending is not None]
        if not waiting:
            return
        rows = [d._pending.shape[1] for d in waiting]
        ids = torch.tensor([t for d, S in zip(waiting, rows) for t in d._history[-S:]], device=self.device)
        segments = []
        for d, S, tokens in zip(waiting, rows, ids.split(rows)):
            d._ensure_capacity(d._n + S)
            segments.append(Segment(tokens, d._cache, self.target.range_inputs(d._n, S)))
        feats = torch.cat([d._pending for d in waiting], dim=1) if len(waiting) > 1 else waiting[0]._pending
        out = self.head.ragged(feats, ids[None], ragged_inputs(segments, [s.step for s in segments], rows))
        for d, S, end in zip(waiting, rows, accumulate(rows)):
            d._last, d._pending = out[:, end - 1 : end], None
            d._n += S
            d._cache.length = d._n

    # ---- speculative decoding -----------------------------------------------------------------
    def begin(self, history: list[int], features: torch.Tensor | None = None) -> None:
        if features is None or features.shape[1] != len(history) - 1:
            raise ValueError("the EAGLE drafter starts from the target's features at every prompt position")
        self._history, self._n, self._last, self._pending = list(history), 1, None, features

    def commit(self, tokens: list[int], matched: int, features: torch.Tensor | None = None) -> None:
        if features is None or features.shape[1] != len(tokens):
            raise ValueError("the EAGLE drafter commits with the target's features at the rows before each token")
        if self._pending is not None:  # a step that did not draft: at most one commit waits
            self._catch_up([self])
        self._history.extend(tokens)
        self._pending = features

    def draft(self, n: int, params: SamplingParams, generator: torch.Generator | None, width: int) -> Draft:
        return self.draft_all([self], [n], [params], [generator], width)[0]

    @torch.inference_mode()
    def draft_all(self, drafters: list["EagleDrafter"], ns: list[int], params: list[SamplingParams],
                  generators: list[torch.Generator | None], width: int) -> list[Draft]:
        """`draft` for several forks at once: each draft depth is one ragged head forward over the rows
        of the forks still drafting (each at its own slot and position, in its own cache), and the
        logits one call over their outputs. The forks run longest chain first, so the rows of a depth
        are a prefix of the previous depth's: the outputs stay one tensor, sliced as forks drop out."""
        target = self.target
        self._catch_up(drafters)
        ns = [max(0, min(n, d.context - d._n)) for n, d in zip(ns, drafters)]
        chains = [DraftChain(p, g, self.head.shortlist, width, self.device) for p, g in zip(params, generators)]
        order = sorted(range(len(drafters)), key=lambda i: -ns[i])
        forks = [drafters[i] for i in order]
        for d, n in zip(drafters, ns):
            d._ensure_capacity(d._n + n)
        h = torch.cat([d._last for d in forks], dim=1) if len(forks) > 1 else forks[0]._last  # [1, F, H]
        for j in range(ns[order[0]] if order else 0):
            live = sum(ns[i] > j for i in order)  # rows drafting at depth j, a prefix of `order`
            logits = self.head.logits(h[0, :live])
            tokens = torch.cat([chains[i].pick(logits[r : r + 1]) for r, i in enumerate(order[:live])])
            fed = sum(ns[i] > j + 1 for i in order)  # the last draft token's row is not needed to draft
            if fed:
                segments = [Segment(tokens[r : r + 1], d._cache, target.range_inputs(d._n + j, 1))
                            for r, d in enumerate(forks[:fed])]
                batch = ragged_inputs(segments, [s.step for s in segments], [1] * fed)
                h = self.head.ragged(h[:, :fed], tokens[None, :fed], batch)
        return [c.draft() for c in chains]

    # the draft-tree interface (specee.speculative.tree.TreeGrower): the trees of all forks grow together
    def tree_roots(self, drafters: list["EagleDrafter"], candidates: int
                   ) -> tuple[torch.Tensor | None, torch.Tensor, list[bool], torch.Tensor | None]:
        """The root logits of the forks with room for `candidates` rows past their history; state: their
        head outputs at the root, [1, R, H]."""
        self._catch_up(drafters)
        fits = [d._n + candidates <= d.context for d in drafters]
        grown = [d for d, f in zip(drafters, fits) if f]
        for d in grown:
            d._ensure_capacity(d._n + candidates)
        if not grown:
            return None, self.head.shortlist, fits, None
        rows = torch.cat([d._last for d in grown], dim=1)
        return self.head.logits(rows[0]), self.head.shortlist, fits, rows

    @torch.inference_mode()
    def tree_rows(self, drafters: list["EagleDrafter"], state: torch.Tensor, parents: torch.Tensor,
                  tokens: torch.Tensor, depth: int, slots: torch.Tensor, visible: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        """The beam rows of every fork (token at depth `depth`, fed its parent row's output) in one ragged
        head forward, each fork's rows in its own cache; their logits [R, k, shortlist] and outputs."""
        (R, k, _), target = visible.shape, self.target
        segments = [Segment(t, d._cache, beam_inputs(target, d._n, depth, s, v))
                    for d, t, s, v in zip(drafters, tokens, slots, visible)]
        P = state.shape[1] // R  # each fork's rows in the previous call
        feed = state[:, (parents + torch.arange(0, R * P, P, device=self.device)[:, None]).flatten()]
        batch = ragged_inputs(segments, [s.step for s in segments], [k] * R)
        out = self.head.ragged(feed, tokens.view(1, R * k), batch)
        return self.head.logits(out[0]).view(R, k, -1), out

    # ---- the early-exit interface: the head needs the target's features, which it does not pass
    def _no_features(self) -> None:
        raise TypeError("the EAGLE drafter reads the target's hidden states; it serves speculative decoding "
                        "(begin/draft/commit), not the early-exit drafter interface")

    def reset(self, prompt_ids: list[int], max_new_tokens: int | None = None) -> None:
        self._no_features()

    def advance(self, token: int) -> None:
        self._no_features()

    def fork(self) -> "EagleDrafter":
        """The same head with a cache of its own: each request of a batch drafts with one."""
        return EagleDrafter(self.head, self.k, self._cache.max_len)

    def truncate(self, length: int) -> None:
        self._no_features()

    def teacher_forced_top_k(self, ids: list[int], start: int) -> torch.Tensor:
        self._no_features()

    def propose(self) -> torch.Tensor:
        """The head's top-k for the position after the committed history."""
        self._catch_up([self])
        return self.head.shortlist[self.head.logits(self._last[0, 0]).topk(self.k).indices]
