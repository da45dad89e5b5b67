"""A small causal LM as the drafter: its greedy top-k for the next position.

The draft model runs through specee's own runtime (`Transformer.load`) with its own
batch-1 KV cache. `advance` only records the token; the forward runs lazily in
`propose()`, so several tokens consumed at once (a rollback in lossless mode, a prompt)
go through the draft model in one forward, and a `truncate` right after an `advance`
costs nothing. The per-token path is lean: cache slots, RoPE rows and the LM head slice
are views of tensors prepared once; the only per-step allocations are the layer
activations and the one-token input. Nothing is copied to the host. `restrict_vocab` makes
the LM head score only a shortlist of frequent tokens (FR-Spec; calibration picks it and the
predictor bank carries it): the full head reads as many bytes per token as the reference
draft's four layers.

For speculative decoding, `draft(n)` runs the draft autoregressively n steps past the history
in its own cache; `commit` keeps the cache rows of the draft tokens the target accepted, so a
step re-runs only the target's own token.
"""
from __future__ import annotations

import copy

from pathlib import Path

import torch

from ..model.llama import Transformer
from ..model.resolve import resolve_model
from ..model.weights import fingerprint_weights
from ..sampling import SamplingParams
from ..speculative.tree import beam_inputs
from ..tokenizer import Tokenizer
from .base import Draft, DraftChain, Drafter, check_same_tokenizer


class DraftModelDrafter(Drafter):
    scores_vocabulary = True

    def __init__(self, model_dir: str | Path, target_tokenizer: Tokenizer, k: int = 4,
                 device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32, max_len: int = 512,
                 *, target_dir: str | Path | None = None, vocab_size: int | None = None,
                 quantization: str | None = None):
        """model_dir: the draft checkpoint; target_tokenizer: the target's tokenizer (the draft's
        must be identical, else DrafterMismatchError); max_len: initial KV capacity (grows on
        demand; `reset(prompt, max_new_tokens)` sizes it for a request). vocab_size: the
        target's vocabulary rows (proposals are restricted to ids below it; default: the
        tokenizer's vocabulary size)."""
        self.model_dir = resolve_model(model_dir, what="draft model")  # a checkpoint directory or a .gguf file
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        draft_tokenizer = Tokenizer(self.model_dir)
        check_same_tokenizer(target_tokenizer, draft_tokenizer, target_dir, self.model_dir)
        self.model = Transformer.load(self.model_dir, device, dtype, quantization)  # quant.py's modes
        cfg = self.model.cfg
        limit = min(cfg.vocab_size, vocab_size or target_tokenizer.vocab_size)
        if k > limit:
            raise ValueError(f"k={k} exceeds the vocabulary ({limit} tokens)")
        self.k = k
        self.name = f"draft:{self.model_dir.name}"
        self.fingerprint = fingerprint_weights(self.model_dir)
        self.device = self.model.device
        self.vocab_limit = limit
        self._full_head = self.model.head.take_rows(slice(0, limit))  # rows the target can emit (float: a view)
        self._head, self._head_ids = self._full_head, None  # the rows scored; their token ids (None = all)
        self.context = cfg.context_limit
        self._cache = self.model.new_cache(1, max(1, min(max_len, self.context)))
        self._history: list[int] = []
        self._offset = 0  # history index of cache slot 0 (> 0 only past the draft's context)
        self._n = 0  # history tokens in the cache: history[offset : offset + n]
        self._last: torch.Tensor | None = None  # final-normed hidden state of the last cached token, [1, H]
        self._drafted = 0  # draft tokens whose K/V sit in the cache past the history (slots n, n+1, ...)
        self._draft_states: list[torch.Tensor] = []  # final-normed states the last draft scored, [1, H] each

    # ---- cache management ------------------------------------------------------------------
    @torch.inference_mode()
    def _ensure_capacity(self, needed: int) -> None:
        cache = self._cache
        if needed <= cache.max_len:
            return
        new_len = min(max(needed, 2 * cache.max_len), self.context)
        grown = self.model.new_cache(1, new_len)
        grown.k[:, :, :, : self._n] = cache.k[:, :, :, : self._n]
        grown.v[:, :, :, : self._n] = cache.v[:, :, :, : self._n]
        grown.length = self._n
        self._cache = grown

    # ---- the forward -----------------------------------------------------------------------
    @torch.inference_mode()
    def _run(self, tokens: list[int]) -> None:
        """Push tokens (the pending tail of the history) through the draft; keep the top-k."""
        S = len(tokens)
        if self._n + S > self.context:  # past the draft's context: keep the last half-context
            self._offset = len(self._history) - self.context // 2
            self._n = 0
            tokens = self._history[self._offset:]
            S = len(tokens)
        n = self._n
        self._ensure_capacity(n + S)
        model = self.model
        h = model.forward(torch.tensor([tokens], device=self.device), model.range_inputs(n, S), self._cache)
        self._last = model.norm(h[0, -1:])
        self._n = n + S
        self._cache.length = self._n

    def _top_k(self, normed: torch.Tensor) -> torch.Tensor:
        """Token ids of the k best-scored head rows for final-normed hidden states [N, H]: [N, k]."""
        best = self._head(normed).topk(self.k, dim=-1).indices
        return best if self._head_ids is None else self._head_ids[best]

    # ---- the Drafter interface ----------------------------------------------------------------
    def reset(self, prompt_ids: list[int], max_new_tokens: int | None = None) -> None:
        if not prompt_ids:
            raise ValueError("empty prompt: the drafter needs at least one token")
        self._history = list(prompt_ids)
        self._offset, self._n, self._last, self._drafted = 0, 0, None, 0
        self._cache.length = 0
        if max_new_tokens is not None:
            self._ensure_capacity(min(len(prompt_ids) + max_new_tokens, self.context))

    def fork(self) -> "DraftModelDrafter":
        """Same model and head; a KV cache of its own (sized by `reset`)."""
        twin = copy.copy(self)
        twin._cache = self.model.new_cache(1, 1)
        return twin

    @property
    def shortlist(self) -> torch.Tensor | None:
        """The token ids the LM head scores (None: the whole vocabulary)."""
        return self._head_ids

    def restrict_vocab(self, token_ids: torch.Tensor | None) -> None:
        """Score only the LM-head rows of `token_ids` (distinct ids below the target's vocabulary,
        at least k of them); None restores the whole vocabulary."""
        if token_ids is None:
            self._head, self._head_ids = self._full_head, None
        else:
            ids = torch.as_tensor(token_ids, dtype=torch.long).flatten()
            if ids.numel() < self.k or ids.unique().numel() != ids.numel():
                raise ValueError(f"a vocabulary shortlist needs >= k={self.k} distinct token ids, got "
                                 f"{ids.numel()} ({ids.unique().numel()} distinct)")
            if int(ids.min()) < 0 or int(ids.max()) >= self.vocab_limit:
                raise ValueError(f"shortlist token ids must be in [0, {self.vocab_limit})")
            ids = ids.to(self.device)
            self._head, self._head_ids = self._full_head.take_rows(ids), ids

    def advance(self, token: int) -> None:
        self._history.append(int(token))

    def extend(self, tokens: list[int]) -> None:
        self._history.extend(int(t) for t in tokens)

    def pending(self) -> int:
        return len(self._history) - (self._offset + self._n)

    def _catch_up(self) -> torch.Tensor:
        """Run the history tokens not yet in the cache; the last one's final-normed hidden state."""
        pending = self.pending()
        if pending > 0:
            self._run(self._history[len(self._history) - pending:])
        elif self._last is None:
            raise RuntimeError("propose() before reset(): the drafter has no history")
        return self._last

    def propose(self) -> torch.Tensor:
        return self._top_k(self._catch_up())[0]

    # ---- speculative decoding -----------------------------------------------------------------
    def draft(self, n: int, params: SamplingParams, generator: torch.Generator | None, width: int) -> Draft:
        return self.draft_all([self], [n], [params], [generator], width)[0]

    @torch.inference_mode()
    def _catch_up_all(self, drafters: list["DraftModelDrafter"]) -> list[torch.Tensor]:
        """`_catch_up` of several forks: their pending tokens in one ragged forward of the draft model,
        each in its own cache; each fork's last final-normed state."""
        from ..engine.runner import ModelRunner, Segment

        model = self.model
        normed: list[torch.Tensor | None] = [None] * len(drafters)
        segments, who = [], []
        for i, d in enumerate(drafters):
            pending = d.pending()
            if 0 < pending and d._n + pending <= d.context:
                d._ensure_capacity(d._n + pending)
                ids = torch.tensor(d._history[-pending:], device=self.device)
                segments.append(Segment(ids, d._cache, model.range_inputs(d._n, pending)))
                who.append((i, pending))
            else:  # nothing pending, or past the draft's context (its window moves): alone
                normed[i] = d._catch_up()
        if segments:
            h, _, rows = ModelRunner(model).forward(segments)
            last = model.norm(h[torch.tensor(rows).cumsum(0) - 1])
            for (i, pending), state in zip(who, last):
                d = drafters[i]
                d._last, d._n = state[None], d._n + pending
                d._cache.length = d._n
                normed[i] = d._last
        return normed

    @torch.inference_mode()
    def draft_all(self, drafters: list["DraftModelDrafter"], ns: list[int], params: list[SamplingParams],
                  generators: list[torch.Generator | None], width: int) -> list[Draft]:
        """`draft` for several forks at once: each forward of the draft model (the catch-up of every
        fork's pending tokens, then each draft position) is one ragged forward over the forks' rows,
        each in its own cache, and the LM head one call over their states."""
        from ..engine.runner import ModelRunner, Segment

        model, runner = self.model, ModelRunner(self.model)
        normed = self._catch_up_all(drafters)
        starts = [d._n for d in drafters]
        ns = [max(0, min(n, d.context - start)) for n, d, start in zip(ns, drafters, starts)]
        chains = [DraftChain(p, g, self._head_ids, width, self.device) for p, g in zip(params, generators)]
        for d, n, start, state in zip(drafters, ns, starts, normed):
            d._ensure_capacity(start + n)
            d._draft_states = [state]
        for j in range(max(ns, default=0)):
            active = [i for i, n in enumerate(ns) if j < n]
            scores = self._head(torch.cat([normed[i] for i in active]))
            segments, who = [], []
            for row, i in enumerate(active):
                token = chains[i].pick(scores[row : row + 1])
                if j < ns[i] - 1:  # the last draft token's K/V is not needed to draft
                    segments.append(Segment(token, drafters[i]._cache, model.range_inputs(starts[i] + j, 1)))
                    who.append(i)
            if segments:
                states = model.norm(runner.forward(segments)[0])
                for row, i in enumerate(who):
                    normed[i] = states[row : row + 1]
                    drafters[i]._draft_states.append(normed[i])
        for d, n in zip(drafters, ns):
            d._drafted = max(n - 1, 0)
        return [c.draft() for c in chains]

    @torch.inference_mode()
    def row_candidates(self, draft: Draft) -> torch.Tensor:
        """The states `draft` scored give rows 0..n-1; one more draft step (the last draft token,
        whose K/V commit can then keep) gives row n."""
        n, states = draft.tokens.shape[0], self._draft_states
        if n:
            model, slot = self.model, self._n + n - 1
            h = model.forward(draft.tokens[-1:].view(1, 1), model.range_inputs(slot, 1), self._cache)
            states = states + [model.norm(h[0])]
            self._drafted = n
        return self._top_k(torch.cat(states))

    # the draft-tree interface (specee.speculative.tree.TreeGrower): candidates sit at slots n + c
    def tree_roots(self, drafters: list["DraftModelDrafter"], candidates: int
                   ) -> tuple[torch.Tensor | None, torch.Tensor | None, list[bool], None]:
        """Logits for the position after each fork's history that has room for `candidates` rows past
        it, and the token id of each column."""
        normed = self._catch_up_all(drafters)
        fits = [d._n + candidates <= d.context for d in drafters]
        grown = [(d, state) for d, state, f in zip(drafters, normed, fits) if f]
        for d, _ in grown:
            d._ensure_capacity(d._n + candidates)
            d._drafted = 0
        logits = self._head(torch.cat([state for _, state in grown])) if grown else None
        return logits, self._head_ids, fits, None

    @torch.inference_mode()
    def tree_rows(self, drafters: list["DraftModelDrafter"], state: None, parents: torch.Tensor, tokens: torch.Tensor,
                  depth: int, slots: torch.Tensor, visible: torch.Tensor) -> tuple[torch.Tensor, None]:
        """The beam rows of every fork in one ragged forward, each fork's rows in its own cache; their
        logits [R, k, V']."""
        from ..engine.runner import ModelRunner, Segment

        model, (R, k, _) = self.model, visible.shape
        segments = [Segment(t, d._cache, beam_inputs(model, d._n, depth, s, v))
                    for d, t, s, v in zip(drafters, tokens, slots, visible)]
        return self._head(model.norm(ModelRunner(model).forward(segments)[0])).view(R, k, -1), None

    def commit(self, tokens: list[int], matched: int, features: torch.Tensor | None = None) -> None:
        keep = min(matched, self._drafted)  # accepted draft tokens whose K/V the draft already wrote
        self._history.extend(int(t) for t in tokens)
        if keep:
            self._n += keep
            self._cache.length = self._n
            self._last = None  # the target's own token (at least) is pending: _catch_up re-runs it
        self._drafted = 0

    def truncate(self, length: int) -> None:
        if not 0 <= length <= len(self._history):
            raise ValueError(f"cannot truncate a history of {len(self._history)} tokens to {length}")
        if length == len(self._history):
            return
        del self._history[length:]
        self._drafted = 0
        if self._offset + self._n > length or (self._last is None and self._offset + self._n == length):
            # the logits of the new last token are gone: re-run that one token on propose()
            keep = length - 1 - self._offset
            if keep < 0:  # rolled back before the window: rebuild it from the history
                self._offset = max(0, length - self.context // 2)
                keep = 0
            self._n = keep
            self._cache.length = keep
            self._last = None

    @torch.inference_mode()
    def teacher_forced_top_k(self, ids: list[int], start: int) -> torch.Tensor:
        """One forward over ids[:-1] with a fresh cache; row j: top-k after ids[:start + j]."""
        if not 1 <= start <= len(ids):
            raise ValueError(f"start must be in [1, {len(ids)}], got {start}")
        if start == len(ids):
            return torch.empty(0, self.k, dtype=torch.long, device=self.device)
        if len(ids) - 1 > self.context:
            raise ValueError(f"{len(ids) - 1} tokens exceed the draft model's context of {self.context}")
        model = self.model
        S = len(ids) - 1
        h = model.forward(torch.tensor([ids[:-1]], device=self.device), model.range_inputs(0, S),
                          model.new_cache(1, S))[0, start - 1:]
        return self._top_k(model.norm(h))
