"""A training-free drafter: prompt lookup over the request's own history (n-gram matching).

For the next position it finds earlier occurrences of the history's longest suffix
(max_ngram tokens, then shorter ones) and proposes the tokens that followed them, most
frequent first (ties: most recent first). It fills up to k with the history's most
frequent tokens, then with the lowest unused token ids, so a proposal is always k distinct
ids. Useful when no draft model shares the target's tokenizer, and strong on tasks that
copy from the prompt (summarisation, RAG, code editing). For speculative decoding, `draft`
is vLLM's prompt lookup: the tokens that followed the latest earlier occurrence of the
history's longest matching suffix, as a chain.

The follow tables are updated incrementally on `advance` (O(max_ngram) per token);
`truncate` rebuilds them from the kept history (rollbacks are rare); `row_candidates` pushes
a draft's tokens with a journal and undoes them exactly.
"""
from __future__ import annotations

import heapq
from typing import Any

import torch

from ..sampling import SamplingParams
from .base import Draft, Drafter


_MISSING = object()  # a journal's "this key did not exist"


class NGramDrafter(Drafter):
    def __init__(self, k: int, vocab_size: int, device: str | torch.device = "cpu", max_ngram: int = 3):
        if k < 1 or k > vocab_size:
            raise ValueError(f"k must be in [1, vocab_size={vocab_size}], got {k}")
        if max_ngram < 1:
            raise ValueError(f"max_ngram must be >= 1, got {max_ngram}")
        self.k, self.vocab_size, self.max_ngram = k, vocab_size, max_ngram
        self.device = torch.device(device)
        self.name = f"ngram-n{max_ngram}"
        self.fingerprint = f"ngram-n{max_ngram}"
        self._clear()

    def _clear(self) -> None:
        self._history: list[int] = []
        # _follow[n-1][ngram] = {follower: [count, last position]}
        self._follow: list[dict[tuple[int, ...], dict[int, list[int]]]] = [{} for _ in range(self.max_ngram)]
        self._freq: dict[int, list[int]] = {}  # token -> [count, last position]

    def _push(self, token: int, journal: list[tuple[dict, Any, Any]] | None = None) -> None:
        """Append `token`; with a journal, note each (dict, key, old value or _MISSING) changed."""
        hist = self._history
        t = len(hist)
        hist.append(token)
        for n in range(1, min(self.max_ngram, t) + 1):
            table, key = self._follow[n - 1], tuple(hist[t - n : t])
            if journal is not None and key not in table:
                journal.append((table, key, _MISSING))
            followers = table.setdefault(key, {})
            if journal is not None:
                journal.append((followers, token, list(followers[token]) if token in followers else _MISSING))
            entry = followers.setdefault(token, [0, 0])
            entry[0] += 1
            entry[1] = t
        if journal is not None:
            journal.append((self._freq, token, list(self._freq[token]) if token in self._freq else _MISSING))
        f = self._freq.setdefault(token, [0, 0])
        f[0] += 1
        f[1] = t

    # ---- the Drafter interface ----------------------------------------------------------------
    def reset(self, prompt_ids: list[int], max_new_tokens: int | None = None) -> None:
        self._clear()
        for t in prompt_ids:
            self._push(int(t))

    def advance(self, token: int) -> None:
        self._push(int(token))

    def candidates(self) -> list[int]:
        """The proposal as a Python list (what `propose` puts on the device)."""
        k, hist = self.k, self._history
        out: list[int] = []
        seen: set[int] = set()
        for n in range(min(self.max_ngram, len(hist)), 0, -1):
            table = self._follow[n - 1].get(tuple(hist[len(hist) - n :]))
            if table:
                for tok, _ in sorted(table.items(), key=lambda kv: (-kv[1][0], -kv[1][1])):
                    if tok not in seen:
                        seen.add(tok)
                        out.append(tok)
                        if len(out) == k:
                            return out
        if self._freq:
            for tok, _ in heapq.nlargest(k + len(seen), self._freq.items(), key=lambda kv: (kv[1][0], kv[1][1])):
                if tok not in seen and tok < self.vocab_size:
                    seen.add(tok)
                    out.append(tok)
                    if len(out) == k:
                        return out
        tok = 0
        while len(out) < k:
            if tok not in seen:
                out.append(tok)
            tok += 1
        return out

    def propose(self) -> torch.Tensor:
        return torch.tensor(self.candidates(), dtype=torch.long, device=self.device)

    # ---- speculative decoding: prompt lookup -------------------------------------------------
    def chain(self, n: int) -> list[int]:
        """Up to n tokens copied from after the most recent earlier occurrence of the history's
        longest matching suffix (max_ngram tokens, then shorter); [] when nothing matches."""
        hist = self._history
        for size in range(min(self.max_ngram, len(hist)), 0, -1):
            table = self._follow[size - 1].get(tuple(hist[len(hist) - size :]))
            if table:
                start = max(last for _, last in table.values())  # the follower of the latest occurrence
                return hist[start : start + n]
        return []

    def draft(self, n: int, params: SamplingParams, generator: torch.Generator | None, width: int) -> Draft:
        tokens = self.chain(n)
        return Draft(torch.tensor(tokens, dtype=torch.long, device=self.device), ids=tokens)

    def row_candidates(self, draft: Draft) -> torch.Tensor:
        tokens = draft.host_ids()
        journal: list[tuple[dict, Any, Any]] = []
        rows = [self.candidates()]
        for token in tokens:
            self._push(int(token), journal)
            rows.append(self.candidates())
        for container, key, old in reversed(journal):  # undo, newest change first
            if old is _MISSING:
                del container[key]
            else:
                container[key] = old
        del self._history[len(self._history) - len(tokens):]
        return torch.tensor(rows, dtype=torch.long, device=self.device)

    def truncate(self, length: int) -> None:
        if not 0 <= length <= len(self._history):
            raise ValueError(f"cannot truncate a history of {len(self._history)} tokens to {length}")
        if length < len(self._history):
            self.reset(self._history[:length])

    def teacher_forced_top_k(self, ids: list[int], start: int) -> torch.Tensor:
        if not 0 <= start <= len(ids):
            raise ValueError(f"start must be in [0, {len(ids)}], got {start}")
        sim = NGramDrafter(self.k, self.vocab_size, "cpu", self.max_ngram)
        sim.reset(ids[:start])
        rows = []
        for p in range(start, len(ids)):
            rows.append(sim.candidates())
            sim.advance(ids[p])
        out = torch.tensor(rows, dtype=torch.long).view(len(rows), self.k)
        return out.to(self.device)
