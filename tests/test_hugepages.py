"""runtime/hugepages.py: weights copied at load move into one map of huge pages, in place,
values and views intact; weights mapped from a file stay where they are."""

import mmap
import sys

import numpy as np
import pytest
import torch

from infer.runtime import hugepages

needs_thp = pytest.mark.skipif(not hugepages.available(), reason="no transparent huge pages")


@needs_thp
def test_rehome_keeps_values_views_and_identity():
    a = torch.randn(300, 100)
    b = a[10:20]  # a view: moves with a
    c = torch.arange(5002, dtype=torch.int32).to(torch.uint8)[1:].view(-1, 3)  # view of a view
    d = torch.ones(7, dtype=torch.float16)
    expect = [t.clone() for t in (a, b, c, d)]
    ids = [id(t) for t in (a, b, c, d)]

    moved = hugepages.rehome([a, b, c, d, a])  # twice: once is enough
    assert moved >= a.nbytes + c._base.nbytes + d.nbytes
    assert [id(t) for t in (a, b, c, d)] == ids
    for t, e in zip((a, b, c, d), expect, strict=True):
        assert t.dtype == e.dtype and t.shape == e.shape and torch.equal(t, e)
        assert not t.untyped_storage().resizable()  # no longer torch's allocation
    assert a.data_ptr() % hugepages.ALIGN == 0 and d.data_ptr() % hugepages.ALIGN == 0
    # one map: a view still shares its base's memory, and the bases moved too
    assert b.data_ptr() == a.data_ptr() + 10 * 100 * 4
    assert c._base.untyped_storage().data_ptr() == c.untyped_storage().data_ptr()
    assert a.untyped_storage().data_ptr() == d.untyped_storage().data_ptr()
    assert a.data_ptr() % hugepages.HUGE_PAGE == 0  # the first starts the huge page
    a.add_(1)  # still writable, and b sees it
    assert torch.equal(b, expect[1] + 1)

    assert hugepages.rehome([a, b, c, d]) == 0  # already there


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/smaps_rollup")
def test_mapped_bytes_reads_this_process():
    n = hugepages.mapped_bytes()
    assert isinstance(n, int) and n >= 0


def test_rehome_leaves_mapped_tensors(tmp_path):
    path = tmp_path / "w.bin"
    path.write_bytes(np.arange(4096, dtype=np.float32).tobytes())
    mapped = torch.from_numpy(np.memmap(path, dtype=np.float32, mode="c"))
    ptr = mapped.data_ptr()
    assert hugepages.rehome([mapped, None]) == 0
    assert mapped.data_ptr() == ptr


def test_nothing_moves_without_huge_pages(monkeypatch):
    monkeypatch.setattr(hugepages, "available", lambda: False)
    a = torch.randn(64, 64)
    ptr = a.data_ptr()
    assert hugepages.rehome([a]) == 0
    assert a.data_ptr() == ptr and a.untyped_storage().resizable()


def test_nothing_moves_when_the_map_fails(monkeypatch):
    def refuse(*args, **kwargs):
        raise OSError(12, "Cannot allocate memory")

    monkeypatch.setattr(hugepages, "available", lambda: True)
    monkeypatch.setattr(hugepages.mmap, "mmap", refuse)
    a = torch.randn(64, 64)
    expect, ptr = a.clone(), a.data_ptr()
    assert hugepages.rehome([a]) == 0
    assert a.data_ptr() == ptr and torch.equal(a, expect)


def test_available_reads_the_kernel_mode(monkeypatch, tmp_path):
    mode = tmp_path / "enabled"
    monkeypatch.setattr(hugepages, "THP_MODE", mode)
    assert not hugepages.available()  # no such file: not Linux, or no THP
    if hasattr(mmap, "MADV_HUGEPAGE"):
        mode.write_text("always [madvise] never\n")
        assert hugepages.available()
        mode.write_text("always madvise [never]\n")
        assert not hugepages.available()


@needs_thp
def test_a_gguf_models_copied_weights_move(tmp_path):
    """Q4_0 / Q8_0 blocks split into codes and scales at load end in the huge-page map;
    the model still computes what it did (test_gguf checks it against the reference)."""
    from gguf import GGMLQuantizationType as T
    from test_gguf import tiny_model

    from infer.quant.base import QuantLinear
    from infer.runtime.loader import inspect_model, load_weights

    path, _ = tiny_model(tmp_path / "m.gguf", "llama", True, embed=T.Q8_0, output=None)
    lm = load_weights(inspect_model(path), torch.float32, 64)
    buffers = [b for m in lm.modules() if isinstance(m, QuantLinear) for b in m.buffers()]
    assert buffers and not any(b.untyped_storage().resizable() for b in buffers)
    assert len({b.untyped_storage().data_ptr() for b in buffers}) == 1
