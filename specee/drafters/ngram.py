"""A training-free drafter: prompt lookup over the request's own history (n-gram matching).

For the next position it finds earlier occurrences of the history's longest suffix
(max_ngram tokens, then shorter ones) and proposes the tokens that followed them, most
frequent first (ties: most recent first). It fills up to k with the history's most
frequent tokens, then with the lowest unused token ids, so a proposal is always k distinct
ids. Useful when no draft model shares the target's tokenizer, and strong on tasks that
copy from the prompt (summarisation, RAG, code editing). For speculative decoding, `draft`
is vLLM's prompt lookup: the tokens that followed the latest earlier occurrence of the
history's longest matching suffix, as a chain.

Speculative decoding's chain looks the suffix up in a table of each n-gram's latest occurrence,
indexed lazily when a chain is asked for (~2 us a lookup; a vectorised scan of a 900-token history
took 26 us, 90 us inside a busy step), so a step that does not draft only appends its tokens. The
chain table keeps where each n-gram's occurrence before the latest ended, so a rollback (lossless
early exit rolls back often) restores the entries of the tokens it drops. The follow tables, which
SpecEE's top-k candidates need (counts and recency), are indexed lazily up to the history's end
when `candidates` asks; `truncate` drops them when a rollback reaches below what they cover;
`row_candidates` pushes a draft's tokens with a journal and undoes them exactly.
"""
from __future__ import annotations

import heapq
from array import array
from typing import Any

import torch

from ..sampling import SamplingParams
from .base import Draft, Drafter


_MISSING = object()  # a journal's "this key did not exist"


class NGramDrafter(Drafter):
    free_chains = True

    def __init__(self, k: int, vocab_size: int, device: str | torch.device = "cpu", max_ngram: int = 3,
                 min_ngram: int = 1):
        """min_ngram: the shortest suffix match a chain copies from (vLLM's prompt_lookup_min); the
        top-k candidates use every length."""
        if k < 1 or k > vocab_size:
            raise ValueError(f"k must be in [1, vocab_size={vocab_size}], got {k}")
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram} and {max_ngram}")
        self.k, self.vocab_size, self.max_ngram, self.min_ngram = k, vocab_size, max_ngram, min_ngram
        self.device = torch.device(device)
        self.match = 0  # the last chain's matched suffix (tokens; 0: no chain)
        self.name = f"ngram-n{max_ngram}"
        self.fingerprint = f"ngram-n{max_ngram}"
        self._clear()

    def _clear(self) -> None:
        self._history: list[int] = []
        # over the n-grams that end before position `_ends` (and before the history's last token):
        # _latest[n-1][ngram] = where its latest occurrence ends; _earlier[n-1][end] = where the one before
        # the n-gram ending at `end` ends (-1: none), so that a rollback restores what it drops
        self._latest: list[dict[tuple[int, ...], int]] = [{} for _ in range(self.max_ngram)]
        self._earlier = [array("q") for _ in range(self.max_ngram)]
        self._ends = 0
        # _follow[n-1][ngram] = {follower: [count, last position]}, over the history's first `_indexed` tokens
        self._follow: list[dict[tuple[int, ...], dict[int, list[int]]]] = [{} for _ in range(self.max_ngram)]
        self._freq: dict[int, list[int]] = {}  # token -> [count, last position]
        self._indexed = 0

    def _index(self, journal: list[tuple[dict, Any, Any]] | None = None) -> None:
        """Bring the follow tables up to the history's end; with a journal, note each (dict, key, old
        value or _MISSING) changed."""
        hist = self._history
        for t in range(self._indexed, len(hist)):
            token = hist[t]
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
        self._indexed = len(hist)

    # ---- the Drafter interface ----------------------------------------------------------------
    def reset(self, prompt_ids: list[int], max_new_tokens: int | None = None) -> None:
        self._clear()
        self._history = [int(t) for t in prompt_ids]

    def advance(self, token: int) -> None:
        self._history.append(int(token))

    def extend(self, tokens: list[int]) -> None:
        self._history += tokens  # ints (a verdict's host read)

    def candidates(self) -> list[int]:
        """The proposal as a Python list (what `propose` puts on the device)."""
        self._index()
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
        longest matching suffix (max_ngram tokens, then shorter); [] when no suffix of min_ngram
        tokens or more matches."""
        hist, m = self._history, len(self._history)
        self.match = 0
        for end in range(self._ends, m - 1):  # index the n-grams that end before the last token
            for size in range(1, self.max_ngram + 1):  # one `_earlier` entry per end and size
                if size > end + 1:
                    self._earlier[size - 1].append(-1)
                    continue
                table, key = self._latest[size - 1], tuple(hist[end - size + 1 : end + 1])
                self._earlier[size - 1].append(table.get(key, -1))
                table[key] = end
        self._ends = max(self._ends, m - 1)
        for size in range(min(self.max_ngram, m - 1), self.min_ngram - 1, -1):
            end = self._latest[size - 1].get(tuple(hist[m - size :]))
            if end is not None:
                self.match = size
                return hist[end + 1 : end + 1 + n]
        return []

    def draft(self, n: int, params: SamplingParams, generator: torch.Generator | None, width: int) -> Draft:
        tokens = self.chain(n)
        return Draft(torch.tensor(tokens, dtype=torch.long, device=self.device), ids=tokens)

    def row_candidates(self, draft: Draft) -> torch.Tensor:
        tokens = draft.host_ids()
        journal: list[tuple[dict, Any, Any]] = []
        rows = [self.candidates()]
        for token in tokens:
            self._history.append(int(token))
            self._index(journal)
            rows.append(self.candidates())
        for container, key, old in reversed(journal):  # undo, newest change first
            if old is _MISSING:
                del container[key]
            else:
                container[key] = old
        del self._history[len(self._history) - len(tokens):]
        self._indexed = len(self._history)  # `candidates` indexed it all before the pushes
        return torch.tensor(rows, dtype=torch.long, device=self.device)

    def truncate(self, length: int) -> None:
        if not 0 <= length <= len(self._history):
            raise ValueError(f"cannot truncate a history of {len(self._history)} tokens to {length}")
        hist, keep = self._history, max(length - 1, 0)
        for end in range(self._ends - 1, keep - 1, -1):  # the chain table's dropped n-grams, newest first
            for size in range(1, min(self.max_ngram, end + 1) + 1):
                key, before = tuple(hist[end - size + 1 : end + 1]), self._earlier[size - 1][end]
                if before < 0:
                    del self._latest[size - 1][key]
                else:
                    self._latest[size - 1][key] = before
        for earlier in self._earlier:
            del earlier[keep:]
        self._ends = min(self._ends, keep)
        del hist[length:]
        if self._indexed > length:  # the tables counted dropped tokens: index again when asked
            self._follow = [{} for _ in range(self.max_ngram)]
            self._freq, self._indexed = {}, 0

    def teacher_forced_top_k(self, ids: list[int], start: int) -> torch.Tensor:
        if not 0 <= start <= len(ids):
            raise ValueError(f"start must be in [0, {len(ids)}], got {start}")
        sim = NGramDrafter(self.k, self.vocab_size, "cpu", self.max_ngram, self.min_ngram)
        sim.reset(ids[:start])
        rows = []
        for p in range(start, len(ids)):
            rows.append(sim.candidates())
            sim.advance(ids[p])
        out = torch.tensor(rows, dtype=torch.long).view(len(rows), self.k)
        return out.to(self.device)
