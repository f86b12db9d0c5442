"""runtime/files/hugepages.py: weights copied at load are written into one map of huge pages
(an arena), values intact; without huge pages they stay in torch's memory."""

import mmap
import sys

import pytest
import torch

from infer.runtime.files import hugepages

needs_thp = pytest.mark.skipif(not hugepages.available(), reason="no transparent huge pages")


def _copy(arena, t):
    return arena.empty(t.shape, t.dtype).copy_(t)


@needs_thp
def test_an_arena_holds_copies_in_huge_pages():
    arena = hugepages.Arena.of(1 << 20)
    blocks = torch.arange(4 * 6 * 34, dtype=torch.int32).to(torch.uint8).view(4, 6, 34)
    codes = _copy(arena, blocks[:, :, 2:])  # a strided view, as GGUF blocks are split
    scales = _copy(arena, blocks[:, :, :2].view(torch.int16))
    floats = torch.randn(3, 5, dtype=torch.float64)
    placed = _copy(arena, floats)
    for t, want in ((codes, blocks[:, :, 2:]), (scales, blocks[:, :, :2].view(torch.int16))):
        assert t.is_contiguous() and t.dtype == want.dtype and torch.equal(t, want)
    assert torch.equal(placed, floats)
    # one map, laid out in order, each at a cache line; the first starts a huge page
    assert codes.data_ptr() % hugepages.HUGE_PAGE == 0
    assert scales.data_ptr() == codes.data_ptr() + -(-codes.nbytes // 64) * 64
    assert placed.data_ptr() % hugepages.ALIGN == 0 and placed.data_ptr() > scales.data_ptr()
    assert len({t.untyped_storage().data_ptr() for t in (codes, scales, placed)}) == 1
    assert not codes.untyped_storage().resizable()  # not torch's allocation


@needs_thp
def test_a_full_arena_copies_into_torchs_memory():
    arena = hugepages.Arena.of(100)
    first = _copy(arena, torch.ones(25, dtype=torch.float32))  # 100 bytes: fits
    second = _copy(arena, torch.ones(2, 3).t())  # no room: torch's memory, same values
    assert not first.untyped_storage().resizable()
    assert second.untyped_storage().resizable() and second.is_contiguous()
    assert torch.equal(second, torch.ones(3, 2))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/smaps_rollup")
def test_mapped_bytes_reads_this_process():
    n = hugepages.mapped_bytes()
    # counted in whole huge pages (AnonHugePages, FilePmdMapped, ShmemPmdMapped)
    assert isinstance(n, int) and n % hugepages.HUGE_PAGE == 0


def test_no_arena_without_huge_pages(monkeypatch):
    monkeypatch.setattr(hugepages, "available", lambda: False)
    assert hugepages.Arena.of(1 << 20) is None
    monkeypatch.setattr(hugepages, "available", lambda: True)
    assert hugepages.Arena.of(0) is None  # nothing to hold


def test_no_arena_when_the_map_fails(monkeypatch):
    def refuse(*args, **kwargs):
        raise OSError(12, "Cannot allocate memory")

    monkeypatch.setattr(hugepages, "available", lambda: True)
    monkeypatch.setattr(hugepages.mmap, "mmap", refuse)
    assert hugepages.Arena.of(1 << 20) is None


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
def test_a_gguf_models_copied_weights_lie_in_one_map(tmp_path):
    """Q4_0 / Q8_0 blocks split into codes and scales at load are written into one
    huge-page map; the model still computes what it did (test_gguf checks it against the
    reference)."""
    from gguf import GGMLQuantizationType as T
    from test_gguf import tiny_model

    from infer.quant.formats.base import QuantLinear
    from infer.runtime.files.build import build
    from infer.runtime.files.sources import open_source

    path, _ = tiny_model(tmp_path / "m.gguf", "llama", True, embed=T.Q8_0, output=None)
    lm = build(open_source(path), torch.float32, 64)
    buffers = [b for m in lm.modules() if isinstance(m, QuantLinear) for b in m.buffers()]
    assert buffers and not any(b.untyped_storage().resizable() for b in buffers)
    assert len({b.untyped_storage().data_ptr() for b in buffers}) == 1


# A layer's three activations of about 18 MiB (their sizes varying a little from layer to
# layer) allocated, written and freed, as a prompt's chunk does layer after layer: the
# page faults of 20 layers after 30, in MiB.
_LAYERS = """
import resource, sys, torch
from infer.runtime.files import hugepages
hugepages.reuse_freed_heap(keep=True)
if sys.argv[1] == "exact":  # then a model under a memory budget
    hugepages.reuse_freed_heap(keep=False)
def layer(i):
    xs = [torch.ones((18 << 18) + 1024 * (i % 3)) for _ in range(3)]
    del xs
for i in range(30):
    layer(i)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for i in range(20):
    layer(i)
print((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) * 4 // 1024)
"""


def _layers_faults_mib(mode: str) -> int:
    import subprocess

    command = [sys.executable, "-c", _LAYERS, mode]
    out = subprocess.run(command, check=False, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return int(out.stdout)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_freed_activations_are_reused_not_faulted_in_again():
    # glibc's adaptive thresholds alone give such blocks back and fault them in again
    # (100-360 MiB here in most runs); reuse_freed_heap keeps them for the next layer
    assert _layers_faults_mib("reuse") < 4


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_under_a_memory_budget_freed_activations_go_back():
    # each layer's 54 MiB returned to the system (and faulted in again): the footprint
    # is what is in use, as a budget's plan counts it
    assert _layers_faults_mib("exact") > 20 * 48
