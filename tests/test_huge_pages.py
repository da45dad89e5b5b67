"""Weights and KV pool moved onto huge-page-advised memory keep every value, shape and sharing."""
import mmap
import sys

import pytest
import torch

from specee.model import huge_pages

linux_thp = pytest.mark.skipif(not sys.platform.startswith("linux") or not hasattr(mmap, "MADV_HUGEPAGE"),
                               reason="madvise(MADV_HUGEPAGE) is Linux's")


def advised(ptr: int) -> bool:
    """Whether the mapping holding address `ptr` was advised for huge pages (VmFlags `hg`)."""
    inside = False
    for line in open("/proc/self/smaps"):
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= ptr < hi
        elif inside and head == "VmFlags:":
            return "hg" in line.split()[1:]
    return False


@linux_thp
def test_moved_tensors_keep_values_views_and_sharing():
    g = torch.Generator().manual_seed(0)
    base = torch.randn(300, 70, generator=g)
    view = base[10:20, 5:]  # a view into the same storage, with an offset and a stride
    packed = torch.randint(0, 255, (1000,), dtype=torch.uint8, generator=g)
    halves = torch.randn(4097, generator=g).to(torch.bfloat16)
    ids = torch.arange(7, dtype=torch.int64)
    before = [t.clone() for t in (base, view, packed, halves, ids)]
    strides = [t.stride() for t in (base, view, packed, halves, ids)]
    huge_pages.move_to_huge_pages([base, view, packed, halves, ids])
    for t, b, s in zip((base, view, packed, halves, ids), before, strides):
        assert torch.equal(t, b) and t.stride() == s
    for t in (base, packed, halves, ids):
        assert advised(t.data_ptr()) and t.data_ptr() % 64 == 0
    assert view.untyped_storage().data_ptr() == base.untyped_storage().data_ptr()  # still one storage
    base[12, 6] = 123.0
    assert view[2, 1] == 123.0


@linux_thp
def test_large_sets_split_into_chunks_each_advised(monkeypatch):
    monkeypatch.setattr(huge_pages, "CHUNK", 1 << 20)
    tensors = [torch.full((300_000,), float(i)) for i in range(5)]  # 1.2 MB each: one chunk apiece
    huge_pages.move_to_huge_pages(tensors)
    for i, t in enumerate(tensors):
        assert advised(t.data_ptr()) and bool((t == i).all())
    assert len({t.untyped_storage().data_ptr() for t in tensors}) == 5


def test_empty_gives_the_shape_and_dtype_asked():
    t = huge_pages.empty((3, 1, 2, 64, 8), torch.float16, torch.device("cpu"))
    assert t.shape == (3, 1, 2, 64, 8) and t.dtype == torch.float16 and t.is_contiguous()
    t.fill_(2.0)
    assert float(t.sum()) == 2.0 * t.numel()
    if sys.platform.startswith("linux") and hasattr(mmap, "MADV_HUGEPAGE"):
        assert advised(t.data_ptr())


@linux_thp
def test_the_default_paths_streamed_weights_and_kv_pool_are_advised(gguf_smollm2):
    model = gguf_smollm2.model
    for lin in (model.layers[0].qkv, model.layers[-1].down):
        assert all(advised(t.data_ptr()) for t in lin.tensors())
    assert all(advised(t.data_ptr()) for t in model.head.tensors())
    assert advised(gguf_smollm2.engine.kv.k.data_ptr()) and advised(gguf_smollm2.engine.kv.v.data_ptr())


@linux_thp
def test_tensors_already_there_are_not_moved():
    there = huge_pages.empty((5000,), torch.float32, torch.device("cpu")).fill_(3.0)
    elsewhere = torch.full((5000,), 4.0)
    assert huge_pages.on_huge_pages(there) and not huge_pages.on_huge_pages(elsewhere)
    ptr = there.data_ptr()
    huge_pages.move_to_huge_pages([there, elsewhere])
    assert there.data_ptr() == ptr and bool((there == 3.0).all())  # left in place
    assert huge_pages.on_huge_pages(elsewhere) and advised(elsewhere.data_ptr()) and bool((elsewhere == 4.0).all())
