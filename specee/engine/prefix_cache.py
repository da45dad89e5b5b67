"""Prefix caching (vLLM's automatic prefix caching, llama.cpp's prompt cache): which runs of the KV pool
hold finished requests' prompt rows, how a new prompt finds the longest of them that it starts with,
and which of them to give up when blocks are wanted. The KV-cache manager owns the blocks and copies
the rows (kv_manager.py); this module only keeps the books.

Only whole blocks of prompt rows are kept: a prefill's arithmetic, which a later prefill's rows
continue exactly as a chunked prefill's next part would (generated rows came from decode steps).
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

BLOCK_SIZE = 16  # slots a block holds (the KV pool's unit)


def block_hashes(tokens: list[int]) -> list[int]:
    """A key for each whole block of `tokens` with all the blocks before it (vLLM's prefix-cache keys): a
    prompt's cached rows are found by its keys, whatever the number of prompts cached."""
    keys, key = [], 0
    for i in range(0, len(tokens) - BLOCK_SIZE + 1, BLOCK_SIZE):
        key = hash((key, *tokens[i : i + BLOCK_SIZE]))
        keys.append(key)
    return keys


@dataclass(eq=False)
class CachedPrompt:
    """A finished request's whole blocks of prompt rows, kept in the pool for a later prompt that starts alike."""

    tokens: list[int]  # the prompt tokens whose K/V its blocks hold (len: whole blocks)
    keys: list[int]  # block_hashes(tokens)
    first: int  # its run's first block in the pool

    @property
    def blocks(self) -> int:
        return len(self.keys)


class PrefixCache:
    def __init__(self):
        self.prompts: OrderedDict[CachedPrompt, None] = OrderedDict()  # least recently used first
        self.by_key: dict[int, OrderedDict[CachedPrompt, None]] = {}  # a block key -> the prompts holding it

    def __len__(self) -> int:
        return len(self.prompts)

    @property
    def blocks(self) -> int:
        return sum(p.blocks for p in self.prompts)

    def holds(self, key: int) -> bool:
        return key in self.by_key

    def add(self, tokens: list[int], keys: list[int], first: int) -> None:
        p = CachedPrompt(tokens, keys, first)
        self.prompts[p] = None
        for key in keys:
            self.by_key.setdefault(key, OrderedDict())[p] = None

    def covered(self, tokens: list[int], keys: list[int]) -> list[CachedPrompt]:
        """The cached prompts whose every block `tokens` (`keys`: their block_hashes) starts with: a prompt
        kept with these blocks serves whoever they served (a chat's next turn holds the last turn's prompt)."""
        return [p for i, key in enumerate(keys) for p in self.by_key.get(key, ())
                if p.blocks == i + 1 and p.tokens == tokens[: p.blocks * BLOCK_SIZE]]

    def remove(self, p: CachedPrompt) -> None:
        del self.prompts[p]
        for key in p.keys:
            holders = self.by_key[key]
            del holders[p]
            if not holders:
                del self.by_key[key]

    def match(self, tokens: list[int], keys: list[int], limit: int) -> tuple[CachedPrompt, int] | None:
        """The cached prompt sharing the most whole blocks with `tokens` (`keys`: their block_hashes), no more
        than `limit` tokens, and how many blocks it shares (it becomes the most recently used); None if none
        shares a block."""
        found, n = None, 0
        for key in keys[: max(limit, 0) // BLOCK_SIZE]:
            if (holders := self.by_key.get(key)) is None:
                break
            found, n = next(reversed(holders)), n + 1
        if found is None or found.tokens[: n * BLOCK_SIZE] != tokens[: n * BLOCK_SIZE]:  # (a hash collision)
            return None
        self.prompts.move_to_end(found)
        return found, n

    def in_the_way(self, free_runs: list[tuple[int, int]], need: int,
                   keep: CachedPrompt | None = None) -> list[CachedPrompt] | None:
        """The cached prompts to give up for a run of `need` blocks of free and cached blocks: of the
        stretches that would do, the one whose most recently used prompt is least recent (a hot system
        prompt stays); None if none would do. Never `keep`."""
        rank = {p: i for i, p in enumerate(self.prompts)}
        segments = sorted([(at, n, None) for at, n in free_runs] +
                          [(p.first, p.blocks, p) for p in self.prompts if p is not keep], key=lambda s: s[0])
        best, lo, total = None, 0, 0
        for hi, (at, n, _) in enumerate(segments):
            if hi and at != segments[hi - 1][0] + segments[hi - 1][1]:  # a request's run lies between
                lo, total = hi, 0
            total += n
            while total - segments[lo][1] >= need:  # the shortest stretch ending here
                total, lo = total - segments[lo][1], lo + 1
            if total >= need:
                inside = [p for _, _, p in segments[lo : hi + 1] if p is not None]
                cost = max((rank[p] for p in inside), default=-1)
                if best is None or cost < best[0]:
                    best = cost, inside
        return None if best is None else best[1]
