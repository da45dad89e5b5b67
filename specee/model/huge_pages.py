"""Weights and the KV cache on 2 MiB pages (Linux transparent huge pages, asked for by madvise).

A decode step streams every weight once. On 4 KiB pages SmolLM2's 84 MB are 21,000 pages a token,
each a TLB miss (a two-level walk in a VM) and a restart of the hardware prefetcher, which stops at
a page's end. Most distributions give huge pages only where a mapping asks (`madvise` mode), and
neither PyTorch nor glibc asks for the sub-2 MB tensors a layer's weights are. Moving the weights
here made SmolLM2 Q4_1 decode 10-18% faster in each of 4 alternating pairs of processes (192-201 ->
218-226 tokens/s, Intel Xeon, 2 threads); a 1 GiB read got 4-8% faster on huge pages.

Elsewhere (another OS, a device other than the CPU, THP off) the buffers are ordinary memory.
"""
from __future__ import annotations

import ctypes
import math
import mmap
import weakref

import torch

HUGE_PAGE = 2 << 20
CHUNK = 64 << 20  # weights are moved a chunk at a time: the peak is one chunk more than the model
ALIGN = 64  # each storage starts on a cache line (and on its element size)


_AREAS: list[tuple[int, int, weakref.ref]] = []  # advised areas: first and end address, their mapping


def on_huge_pages(t: torch.Tensor) -> bool:
    """Whether t's storage lies in an area `advised_bytes` made (and that area is alive)."""
    _AREAS[:] = [a for a in _AREAS if a[2]() is not None]
    ptr = t.untyped_storage().data_ptr()
    return any(first <= ptr < end for first, end, _ in _AREAS)


def _round_up(n: int, unit: int) -> int:
    return -(-n // unit) * unit


def advised_bytes(nbytes: int) -> torch.Tensor:
    """An uninitialised uint8 CPU tensor of `nbytes` on fresh anonymous memory, 2 MiB-aligned and
    advised for huge pages (its pages are faulted in, huge, on first write)."""
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.empty(nbytes, dtype=torch.uint8)
    size = _round_up(max(nbytes, 1), HUGE_PAGE)
    # private and anonymous (mmap's default is shared, which THP's `madvise` mode leaves on small
    # pages): untouched, so no 4 KiB page is in yet
    area = mmap.mmap(-1, size + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    whole = torch.frombuffer(area, dtype=torch.uint8)  # keeps `area` alive as long as any view lives
    _AREAS.append((whole.data_ptr(), whole.data_ptr() + len(area), weakref.ref(area)))
    start = -whole.data_ptr() % HUGE_PAGE
    try:
        area.madvise(mmap.MADV_HUGEPAGE, start, size)
    except OSError:  # THP compiled out: ordinary pages
        pass
    return whole[start:start + nbytes]


def empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """torch.empty on advised pages where `device` is the CPU (the KV cache pool)."""
    if torch.device(device).type != "cpu":
        return torch.empty(shape, dtype=dtype, device=device)
    return advised_bytes(math.prod(shape) * dtype.itemsize).view(dtype).view(shape)


def move_to_huge_pages(tensors: list[torch.Tensor]) -> None:
    """Move the storage behind each CPU tensor onto advised pages, in place (`Tensor.set_`; those there
    already stay): every holder of these tensor objects follows, tensors sharing a storage keep
    sharing it, and nothing else changes (same values, shapes and strides). Call it before anything
    keeps a raw pointer."""
    storages: dict[int, tuple[torch.UntypedStorage, list[torch.Tensor]]] = {}
    for t in tensors:
        if t.device.type == "cpu" and t.numel() and not on_huge_pages(t):
            s = t.untyped_storage()
            storages.setdefault(s.data_ptr(), (s, []))[1].append(t)
    chunk: list[tuple[torch.UntypedStorage, list[torch.Tensor]]] = []
    filled = 0
    for entry in storages.values():
        size = _round_up(entry[0].nbytes(), ALIGN)
        if chunk and filled + size > CHUNK:
            _move_chunk(chunk)
            chunk, filled = [], 0
        chunk.append(entry)
        filled += size
    if chunk:
        _move_chunk(chunk)
    _trim_heap()


def _trim_heap() -> None:
    """Hand the freed copies back to the OS (glibc keeps freed heap memory: SmolLM2's process stayed
    138 MB larger without this)."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def _move_chunk(chunk: list[tuple[torch.UntypedStorage, list[torch.Tensor]]]) -> None:
    offsets, total = [], 0
    for storage, _ in chunk:
        offsets.append(total)
        total += _round_up(storage.nbytes(), ALIGN)
    area = advised_bytes(total)
    new = area.untyped_storage()
    with torch.no_grad():
        for (storage, views), offset in zip(chunk, offsets):
            start = area.storage_offset() + offset  # bytes into `new`
            area[offset:offset + storage.nbytes()].copy_(torch.empty(0, dtype=torch.uint8).set_(storage))
            for t in views:
                t.set_(new, start // t.element_size() + t.storage_offset(), t.size(), t.stride())
