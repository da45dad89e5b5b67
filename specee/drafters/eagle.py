"""The EAGLE drafter: drives an EagleHead (eagle_head.py) during speculative decoding.

State: the head's own one-layer KV cache, filled for the committed history, and the head's
output at the last committed position (which predicts the first draft token). Alignment (the
contract): the row pairing the target's feature at position t with the token at t + 1 sits at
slot and RoPE position t + 1 and predicts the token at t + 2; slot 0 is never written.

* begin: pairs (f(x_0), x_1) .. (f(x_{m-2}), x_{m-1}) of the prompt in one head pass;
* draft: a chain, feeding the head's own output back with each draft token;
* tree_root / tree_rows: the same, for the beam rows of an EAGLE-2 tree (speculative/tree.py);
* commit: the target's real features replace the fed-back ones: the accepted rows are rerun.
"""
from __future__ import annotations

import torch

from ..sampling import SamplingParams
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
        self._rows: torch.Tensor | None = None  # outputs of the last tree call's rows, [1, k, H]

    def _ensure_capacity(self, needed: int) -> None:
        cache = self._cache
        if needed <= cache.max_len:
            return
        grown = self.head.new_cache(1, min(max(needed, 2 * cache.max_len), self.context + 1))
        grown.k[:, :, :, : self._n] = cache.k[:, :, :, : self._n]
        grown.v[:, :, :, : self._n] = cache.v[:, :, :, : self._n]
        self._cache = grown

    @torch.inference_mode()
    def _pairs(self, features: torch.Tensor, tokens: list[int]) -> None:
        """Head rows for (features[j], tokens[j]) at slots _n.._n + S - 1; the last output is kept."""
        S = len(tokens)
        self._ensure_capacity(self._n + S)
        ids = torch.tensor([tokens], device=self.device)
        out = self.head.forward(features, ids, self.target.range_inputs(self._n, S), self._cache)
        self._n += S
        self._cache.length = self._n
        self._last = out[:, -1:]

    # ---- speculative decoding -----------------------------------------------------------------
    def begin(self, history: list[int], features: torch.Tensor | None = None) -> None:
        if features is None or features.shape[1] != len(history) - 1:
            raise ValueError("the EAGLE drafter starts from the target's features at every prompt position")
        self._history, self._n, self._last = list(history), 1, None
        self._pairs(features, history[1:])

    def commit(self, tokens: list[int], matched: int, features: torch.Tensor | None = None) -> None:
        if features is None or features.shape[1] != len(tokens):
            raise ValueError("the EAGLE drafter commits with the target's features at the rows before each token")
        self._history.extend(tokens)
        self._pairs(features, tokens)

    @torch.inference_mode()
    def draft(self, n: int, params: SamplingParams, generator: torch.Generator | None, width: int) -> Draft:
        head, h = self.head, self._last
        n = max(0, min(n, self.context - self._n))
        self._ensure_capacity(self._n + n)
        chain = DraftChain(params, generator, head.shortlist, width, self.device)
        for j in range(n):
            token = chain.pick(head.logits(h[0]))  # scores over the shortlist
            if j < n - 1:
                h = head.forward(h, token.view(1, 1), self.target.range_inputs(self._n + j, 1), self._cache)
        return chain.draft()

    def tree_root(self, candidates: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        if self._n + candidates > self.context:
            return None
        self._ensure_capacity(self._n + candidates)
        self._rows = self._last
        return self.head.logits(self._last[0]), self.head.shortlist

    @torch.inference_mode()
    def tree_rows(self, parents: torch.Tensor, tokens: torch.Tensor, depth: int, slots: torch.Tensor,
                  visible: torch.Tensor) -> torch.Tensor:
        """Beam rows (token at depth `depth`, fed the parent row's output) at slots n + slots, each
        reading the committed slots and the candidates in `visible`; their logits [k, shortlist]."""
        n, (k, C), target = self._n, visible.shape, self.target
        mask = torch.cat([visible.new_ones(k, n), visible], dim=1).view(1, 1, k, n + C)
        positions = target.slot_ids[n - 1 + depth].expand(1, k)
        step = target.step_inputs(positions, n + slots, mask, n + C)
        self._rows = self.head.forward(self._rows[:, parents], tokens.view(1, k), step, self._cache)
        return self.head.logits(self._rows[0])

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
        return self.head.shortlist[self.head.logits(self._last[0, 0]).topk(self.k).indices]
