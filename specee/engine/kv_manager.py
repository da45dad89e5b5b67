"""The KV-cache manager: it owns all cache memory, one preallocated pool of fixed-size blocks.

A request holds a run of consecutive blocks: at admission enough for its prompt, the draft rows of
one verification pass and its first new tokens (the scheduler's choice), then more as it decodes
(`grow`: the blocks after its run where they are free, else a longer run elsewhere, its own rows
copied). Requests join and leave without copying anyone else's rows, rollback after a rejected
draft is a length change (`KVCache.length`), and the per-layer fill state of layers that early exit
skipped lives in the pool beside the K/V. When a run cannot grow, the scheduler parks a request
(`park`: its run's contents move out of the pool, exactly, vLLM's swap) and brings it back later
(`restore`), so its tokens do not change.

Prefix caching (prefix_cache.py keeps the books): a finished request's whole blocks of prompt rows
stay in the pool as a cached prompt (`keep`), and a later request whose prompt starts with the same
tokens has them copied into its run (`allocate(prefix=...)`) and prefills only the rest. Cached
prompts give way when blocks are wanted: those in the way of the run asked for, least recently used
stretch first.

Why consecutive blocks rather than vLLM's scattered blocks with a block table: a request's cache
is then a strided view of the pool, which attention on the CPU reads in place (scaled dot-product
attention and the C++ layer take the view; a block table would need a gather, or a paged attention
kernel, per layer and step). The cost is fragmentation: a request may wait although enough blocks
are free, only not together; they come together as neighbours leave (freed runs merge).
"""
from __future__ import annotations

import bisect
import math
import re

import torch

from ..model import huge_pages
from ..model.config import ModelConfig
from ..model.kv_cache import KVCache
from .prefix_cache import BLOCK_SIZE, CachedPrompt, PrefixCache
SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B?|B)?\s*", re.IGNORECASE)  # "512MiB", "2GB", "1.5GiB"
DEFAULT_KV_MEMORY = 1 << 30  # bytes, unless the context needs more (one full-context request always fits)
MAX_KV_MEMORY = 1 << 50  # bytes (1 PiB): past any machine's memory, and past what mmap's size can say


def size_bytes(value: str) -> int:
    """Bytes of a size string ("512MiB", "2GB", "1.5GiB", "4096" bytes); a one-line error otherwise."""
    m = SIZE.fullmatch(value)
    if not m:
        raise ValueError(f"kv_cache_memory (--kv-cache-memory): {value!r} is not a size like 512MiB or 2GB")
    unit = (m.group(2) or "B").upper().rstrip("B").rstrip("I") or "B"
    size = int(float(m.group(1)) * {"B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}[unit])
    if not 0 < size <= MAX_KV_MEMORY:
        raise ValueError(f"kv_cache_memory (--kv-cache-memory): {value!r} is {'no memory' if size <= 0 else 'past 1 PiB'}")
    return size


def kv_bytes_per_token(cfg: ModelConfig, dtype: torch.dtype) -> int:
    """A slot's K and V in every layer, and its per-layer fill flag."""
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * dtype.itemsize + cfg.num_layers


def check_kv_budget(value: int | str | None) -> None:
    """What can be said of a `kv_cache_memory` without the model (LLM checks it before loading)."""
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 1:
            raise ValueError(f"kv_cache_memory (--kv-cache-memory) must be at least 1 token, got {value}")
    elif isinstance(value, str):
        size_bytes(value)
    elif value is not None:
        raise TypeError(f"kv_cache_memory (--kv-cache-memory) must be a token count or a size string, got {value!r}")


def parse_kv_budget(value: int | str | None, cfg: ModelConfig, dtype: torch.dtype, extra_rows: int = 0) -> int:
    """The pool's size in tokens from `--kv-cache-memory`: None (the default: at least one full-context
    request with the decoding's `extra_rows`), a token count (int), or bytes as a string with a unit
    ("512MiB", "2GB", "1.5GiB")."""
    check_kv_budget(value)
    per_token = kv_bytes_per_token(cfg, dtype)
    if value is None:
        return max(cfg.context_limit + extra_rows, DEFAULT_KV_MEMORY // per_token)
    # a size in bytes is a bound: whole blocks within it (the pool is made of blocks)
    tokens = value if isinstance(value, int) else size_bytes(value) // per_token // BLOCK_SIZE * BLOCK_SIZE
    if tokens < 1:
        raise ValueError(f"kv_cache_memory (--kv-cache-memory) holds no block of {BLOCK_SIZE} tokens ({per_token} "
                         f"bytes per token for this model)")
    if tokens * per_token > MAX_KV_MEMORY:
        raise ValueError(f"kv_cache_memory (--kv-cache-memory): {tokens} tokens are past 1 PiB for this model")
    return tokens


class KVCacheManager:
    """A pool of `num_blocks` blocks of BLOCK_SIZE slots for every layer; `allocate` hands out runs
    of consecutive blocks as one-row KVCache views, `free` takes them back (first fit, merged)."""

    def __init__(self, cfg: ModelConfig, device: torch.device, dtype: torch.dtype, max_tokens: int):
        self.num_blocks = max(1, self.blocks_for(max_tokens))
        shape = self.pool_shape(cfg, max_tokens)
        slots = shape[3]
        # on the CPU uninitialised (untouched memory costs nothing): `allocate` zeroes a run before handing
        # it out; on huge pages, which attention's reads stream as the weights' do (model/huge_pages.py).
        # On a GPU zeros: a graphed decode step reads the slots between its requests' runs, masked but
        # multiplied (engine/cuda_graphs.py)
        try:
            if device.type == "cpu":
                self.k, self.v = huge_pages.empty(shape, dtype, device), huge_pages.empty(shape, dtype, device)
            else:
                self.k = torch.zeros(shape, dtype=dtype, device=device)
                self.v = torch.zeros(shape, dtype=dtype, device=device)
        except (MemoryError, OSError, OverflowError, RuntimeError) as e:  # torch's out-of-memory is a RuntimeError
            size = 2 * math.prod(shape) * dtype.itemsize / 2**30
            raise ValueError(f"the KV cache pool of {slots} tokens ({size:.1f} GiB) cannot be allocated "
                             f"({' '.join(str(e).split())[:120]}); lower kv_cache_memory (--kv-cache-memory)") from None
        self.filled = torch.zeros(cfg.num_layers, 1, slots, dtype=torch.bool, device=device)
        self.slot_ids = torch.arange(slots, device=device)
        self.free_runs: list[tuple[int, int]] = [(0, self.num_blocks)]  # (first block, blocks), by first block
        self.owned: dict[str, tuple[int, int]] = {}  # request id -> its run
        self.prefixes = PrefixCache()  # finished requests' prompt rows kept in the pool
        self.releases = 0  # runs given back so far (free or kept): parked requests wait for one to try again

    @classmethod
    def reusing(cls, previous: KVCacheManager | None, cfg: ModelConfig, device: torch.device, dtype: torch.dtype,
                max_tokens: int) -> KVCacheManager:
        """A pool of `max_tokens`: `previous` itself where it has that size and no request holds blocks in
        it, else a new one. Why: a pool's pages are faulted in as requests first write them (SmolLM2 Q4_1,
        AMD EPYC Zen 4: 0.4-0.6 s for the first request, then 10-15 ms for each new request's run), and an LLM
        that switched modes (a new engine) paid that again after every switch."""
        if (previous is not None and not previous.owned and previous.k.dtype == dtype and previous.k.device == device
                and previous.k.shape == cls.pool_shape(cfg, max_tokens)):
            # cached prompts and all: the same model's rows, and no change to a pool that the engine thread may
            # still be reading (the caller's thread makes the new engine)
            return previous
        return cls(cfg, device, dtype, max_tokens)

    @classmethod
    def pool_shape(cls, cfg: ModelConfig, max_tokens: int) -> tuple[int, ...]:
        """K's and V's shape for `max_tokens`: [layers, 1, kv heads, slots, head dim] (whole blocks)."""
        return cfg.num_layers, 1, cfg.num_kv_heads, max(1, cls.blocks_for(max_tokens)) * BLOCK_SIZE, cfg.head_dim

    @property
    def capacity(self) -> int:
        """Tokens the whole pool holds."""
        return self.num_blocks * BLOCK_SIZE

    @property
    def free_blocks(self) -> int:
        """Blocks a request may take: free ones and those of cached prompts (given up first)."""
        return sum(n for _, n in self.free_runs) + self.prefixes.blocks

    def touch(self) -> None:
        """Fault the whole pool in now (zeros in the free blocks; a run is zeroed when taken anyway)."""
        for first, n in self.free_runs:
            self._clear(first, n)

    @staticmethod
    def blocks_for(tokens: int) -> int:
        return -(-tokens // BLOCK_SIZE)

    def allocate(self, owner: str, tokens: int, prefix: tuple[CachedPrompt, int] | None = None) -> KVCache | None:
        """A cache of at least `tokens` slots for request `owner`, or None while no run of free
        blocks is long enough (the request waits). prefix: a cached prompt and how many of its first
        blocks to copy in (`match`), kept while room is made."""
        need = self.blocks_for(tokens)
        cached, blocks = prefix or (None, 0)
        first = self._take(need, keep=cached)
        if first is None:
            return None
        self.owned[owner] = (first, need)
        self._clear(first + blocks, need - blocks)
        if blocks:
            self._move(cached.first, blocks, first)
        return self.view(first * BLOCK_SIZE, (first + need) * BLOCK_SIZE)

    def keep(self, owner: str, tokens: list[int], keys: list[int]) -> None:
        """Free `owner`'s run but keep its first whole blocks, which hold the K/V of `tokens` (prompt rows
        a prefill wrote; `keys`: their block_hashes), as a cached prompt; not where one holds them all, and
        in place of those it holds all of (a chat's earlier turns: each turn kept them all again)."""
        run = self.owned.pop(owner, None)
        if run is None:
            return
        self.releases += 1  # a cached prompt's blocks are there to take too
        first, held = run
        blocks = min(held, len(tokens) // BLOCK_SIZE, len(keys))
        if blocks and not self.prefixes.holds(keys[blocks - 1]):
            tokens, keys = tokens[: blocks * BLOCK_SIZE], keys[:blocks]
            for p in self.prefixes.covered(tokens, keys):  # its blocks again: this prompt serves them now
                self._give_up(p)
            self.prefixes.add(tokens, keys, first)
            first, held = first + blocks, held - blocks
        if held:
            self._release((first, held))

    def drop_prompts(self) -> None:
        """Give every cached prompt's blocks back."""
        for p in list(self.prefixes.prompts):
            self._give_up(p)

    def grow(self, owner: str, cache: KVCache, tokens: int) -> bool:
        """Give `owner`'s cache at least `tokens` slots: its run extended where the blocks after it
        are free, else moved (its own rows copied) to a free run that long, or to one its run makes
        with the free runs either side, cached prompts given up as needed (first those in the blocks
        after it); False if none fits (it stays as it was)."""
        first, held = self.owned[owner]
        need = self.blocks_for(tokens)
        if need > held and self.prefixes:
            for p in self._cached_in(first + held, need - held) or ():
                self._give_up(p)
        while not self._grow(owner, cache, tokens):
            if not self.prefixes:
                return False
            self._give_up(next(iter(self.prefixes.prompts)))  # its own run with neighbours, at last
        return True

    def _grow(self, owner: str, cache: KVCache, tokens: int) -> bool:
        first, held = self.owned[owner]
        need = self.blocks_for(tokens)
        if need <= held:
            return True
        i = bisect.bisect(self.free_runs, (first + held, -1))
        if i < len(self.free_runs) and self.free_runs[i][0] == first + held and self.free_runs[i][1] >= need - held:
            at, n = self.free_runs[i]
            if n == need - held:
                del self.free_runs[i]
            else:
                self.free_runs[i] = (at + need - held, n - need + held)
            self._clear(first + held, need - held)
            to = first
        else:
            to = self._take(need)
            if to is None:  # none elsewhere: perhaps its own run with the free runs either side of it
                beside = sum(n for at, n in self.free_runs if at + n == first or at == first + held)
                if held + beside < need:
                    return False
                self._release((first, held))
                to = self._first_fit(need)
                self._move(first, held, to)
            else:
                self._move(first, held, to)
                self._release((first, held))
            self._clear(to + held, need - held)
        self.owned[owner] = (to, need)
        self._rebind(cache, to, need)
        return True

    def park_bytes(self, cache: KVCache, written: int) -> int:
        """Host memory `park` takes for these rows."""
        per_slot = (self.k[:, :, :, :1].numel() * 2 * self.k.element_size()) + self.filled[:, :, :1].numel()
        return self._park_slots(cache, written) * per_slot

    def _park_slots(self, cache: KVCache, written: int) -> int:
        """The slots `park` keeps: the first `written`, rounded up to blocks (later ones hold nothing read)."""
        return min(cache.max_len, self.blocks_for(max(written, 1)) * BLOCK_SIZE)

    def relocate(self, owner: str, cache: KVCache) -> bool:
        """Move `owner`'s run, with its rows, to free blocks elsewhere, so that the run before it can grow in
        place (cheaper than parking either); False where no free run is that long."""
        first, held = self.owned[owner]
        to = self._take(held)
        if to is None:
            return False
        self._move(first, held, to)
        self._release((first, held))
        self.owned[owner] = (to, held)
        self._rebind(cache, to, held)
        return True

    def park(self, owner: str, cache: KVCache, written: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Move `owner`'s first `written` slots out of the pool, to host memory outside the pool's budget
        (the scheduler's `swap_space`, scheduling.py), and free its run; `restore` puts them back."""
        slots = self._park_slots(cache, written)
        saved = tuple(t.to("cpu", copy=True) for t in (cache.k[:, :, :, :slots], cache.v[:, :, :, :slots],
                                                           cache.filled[:, :, :slots]))
        self.free(owner)
        return saved

    def restore(self, owner: str, cache: KVCache, saved: tuple[torch.Tensor, ...], tokens: int) -> bool:
        """Put parked rows back in a run of at least `tokens` slots; False while no free run is that long."""
        slots, need = saved[0].shape[3], self.blocks_for(max(tokens, saved[0].shape[3]))
        first = self._take(need)
        if first is None:
            return False
        self.owned[owner] = (first, need)
        lo = first * BLOCK_SIZE
        for pool, rows in zip((self.k, self.v), saved[:2]):
            pool[:, :, :, lo : lo + slots] = rows
        self.filled[:, :, lo : lo + slots] = saved[2]
        self._clear(first + slots // BLOCK_SIZE, need - slots // BLOCK_SIZE)
        self._rebind(cache, first, need)
        return True

    def view(self, lo: int, hi: int) -> KVCache:
        """A one-row cache over the pool's slots [lo, hi) (a request's run; a graphed step's span)."""
        return KVCache.over(*self._slices(lo, hi), self.slot_ids, lo)

    def free(self, owner: str, zero: bool = False) -> None:
        """Return `owner`'s run to the pool, merged with free neighbours (a no-op if it has none); zero: clear
        it first (rows of a request that went wrong may hold NaN, which a graphed CUDA step's span reads
        between its own runs: masked, but multiplied, and 0 x NaN is NaN)."""
        run = self.owned.pop(owner, None)
        if run is not None:
            if zero:
                self._clear(*run)
            self._release(run)

    def _take(self, need: int, keep: CachedPrompt | None = None) -> int | None:
        """The first block of a run of `need` free blocks, giving up the cached prompts in the way of one
        (never `keep`) where no free run is that long."""
        first = self._first_fit(need)
        if first is None and self.prefixes:
            oldest = next(iter(self.prefixes.prompts))
            if oldest is not keep and self._room_around(oldest) >= need:  # most often (steady traffic): no scan
                self._give_up(oldest)
            else:
                for p in self.prefixes.in_the_way(self.free_runs, need, keep=keep) or ():
                    self._give_up(p)
            first = self._first_fit(need)
        return first

    def _cached_in(self, at: int, n: int) -> list[CachedPrompt] | None:
        """The cached prompts in blocks [at, at + n); None where a request's run lies there too (or the pool ends)."""
        if at + n > self.num_blocks or any(f < at + n and at < f + h for f, h in self.owned.values()):
            return None
        return [p for p in self.prefixes.prompts if p.first < at + n and at < p.first + p.blocks]

    def _room_around(self, p: CachedPrompt) -> int:
        """Blocks a cached prompt's run makes with the free runs either side of it."""
        i = bisect.bisect(self.free_runs, (p.first, -1))
        after = self.free_runs[i][1] if i < len(self.free_runs) and self.free_runs[i][0] == p.first + p.blocks else 0
        before = self.free_runs[i - 1][1] if i and sum(self.free_runs[i - 1]) == p.first else 0
        return before + p.blocks + after

    def _give_up(self, p: CachedPrompt) -> None:
        """A cached prompt's blocks back to the free runs."""
        self.prefixes.remove(p)
        self._release((p.first, p.blocks))

    def _first_fit(self, need: int) -> int | None:
        """The first block of a run of `need` free blocks, taken from the first free run that long."""
        for i, (first, n) in enumerate(self.free_runs):
            if n >= need:
                if n == need:
                    del self.free_runs[i]
                else:
                    self.free_runs[i] = (first + need, n - need)
                return first
        return None

    def _release(self, run: tuple[int, int]) -> None:
        self.releases += 1
        i = bisect.bisect(self.free_runs, run)
        self.free_runs.insert(i, run)
        if i + 1 < len(self.free_runs) and run[0] + run[1] == self.free_runs[i + 1][0]:
            self.free_runs[i] = (run[0], run[1] + self.free_runs.pop(i + 1)[1])
        if i > 0 and self.free_runs[i - 1][0] + self.free_runs[i - 1][1] == self.free_runs[i][0]:
            prev = self.free_runs.pop(i - 1)
            self.free_runs[i - 1] = (prev[0], prev[1] + self.free_runs[i - 1][1])

    def _move(self, first: int, blocks: int, to: int) -> None:
        """Copy a run's contents to the blocks from `to` on (the two may overlap)."""
        lo, hi, dst = first * BLOCK_SIZE, (first + blocks) * BLOCK_SIZE, to * BLOCK_SIZE
        for t in (self.k, self.v):
            t[:, :, :, dst : dst + hi - lo] = t[:, :, :, lo:hi].clone()
        self.filled[:, :, dst : dst + hi - lo] = self.filled[:, :, lo:hi].clone()

    def _clear(self, first: int, blocks: int) -> None:
        """Zeros, never garbage, in blocks a request takes: a masked (unfilled) slot still enters
        attention's products, weighted 0."""
        lo, hi = first * BLOCK_SIZE, (first + blocks) * BLOCK_SIZE
        self.k[:, :, :, lo:hi] = 0
        self.v[:, :, :, lo:hi] = 0
        self.filled[:, :, lo:hi] = False

    def _rebind(self, cache: KVCache, first: int, blocks: int) -> None:
        """Point `cache` at the run of `blocks` blocks from `first` (the one object its holders share)."""
        cache.rebind(*self._slices(first * BLOCK_SIZE, (first + blocks) * BLOCK_SIZE), self.slot_ids, first * BLOCK_SIZE)

    def _slices(self, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.k[:, :, :, lo:hi], self.v[:, :, :, lo:hi], self.filled[:, :, lo:hi]
