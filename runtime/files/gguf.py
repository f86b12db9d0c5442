"""A GGUF file: its header read as a Hugging Face checkpoint (gguf_meta.py, over
gguf_header.py's parse), its tensors views of one memory map of the file.

The `gguf` package is used only for its type constants and, for K-quants and other types
dequantized nowhere else here, `gguf.quants.dequantize` (gguf_tensor.py).
"""

from __future__ import annotations

import mmap
from collections.abc import Container, Iterable

import numpy as np
import torch
from gguf import GGMLQuantizationType

from ... import InferError
from . import hugepages
from .gguf_header import TensorInfo
from .gguf_meta import GGUFMeta
from .gguf_tensor import PLAIN_DTYPES, GGUFTensor, block_bytes, dequantize

# llama.cpp's converter stores Gemma's RMSNorm weights plus one (conversion/gemma.py,
# Gemma3Model.norm_shift); Hugging Face's (and ours) are without.
_NORM_SHIFT = {"gemma3": 1.0}


def _unpermute_rows(rows: int, n_head: int) -> np.ndarray:
    """Row order that undoes llama.cpp's q/k permutation (HF rotate-half -> interleaved pairs).

    convert_hf_to_gguf.py LlamaModel.permute writes
        w.reshape(n_head, 2, rows // n_head // 2, *rest).swapaxes(1, 2).reshape(w.shape)
    so GGUF row (h, j, s) holds HF row (h, s, j). HF row (h, s, j) is therefore GGUF row
    (h, j, s): index GGUF rows with arange viewed as (n_head, half, 2) swapped to (n_head, 2, half).
    """
    half = rows // n_head // 2
    return np.arange(rows).reshape(n_head, half, 2).swapaxes(1, 2).reshape(-1)


class GGUFFile(GGUFMeta):
    """A GGUF file: metadata as python values, tensors as views of one memory map."""

    tensors: dict[str, GGUFTensor]

    def __init__(self, path):
        super().__init__(path)
        self.tensors = {name: self._tensor(t) for name, t in self.tensors.items()}

    def _map_file(self) -> memoryview:
        # Copy-on-write map (MAP_PRIVATE, as torch uses for mmapped checkpoints): the file is
        # opened read-only and never written, and torch.from_numpy gets a writable array, so
        # zero-copy tensors need no warning and an accidental in-place op copies a page
        # instead of faulting. Pages are read from disk only when touched.
        self._map = np.memmap(self.path, dtype=np.uint8, mode="c")
        # Pages read from now on come in 2 MiB folios, mapped whole (runtime/files/hugepages.py).
        hugepages.advise(self._map)
        return memoryview(self._map)

    def _tensor(self, t: TensorInfo) -> GGUFTensor:
        """The header's tensor with its data: a view of the map."""
        try:
            ggml_type = GGMLQuantizationType(t.ggml_type)
        except ValueError:  # a type newer than the installed gguf package
            raise InferError(f"{self.path}: tensor {t.name!r} has unknown ggml type {t.ggml_type}")
        raw = self._map[t.offset : t.offset + t.nbytes]
        if ggml_type in PLAIN_DTYPES:
            data = raw.view(PLAIN_DTYPES[ggml_type]).reshape(t.shape)
        else:
            data = raw.reshape(block_bytes(ggml_type, t.shape))
        return GGUFTensor(t.name, ggml_type, t.shape, data, t.offset)

    def release(self, t: GGUFTensor) -> None:
        """Let the whole pages of `t`, copied elsewhere, go: they stop counting in this
        process's memory and are read from the file again if touched."""
        raw = getattr(self._map, "_mmap", None)
        if t.offset < 0 or raw is None or not hasattr(mmap, "MADV_DONTNEED"):
            return
        page = mmap.PAGESIZE
        start = -(-t.offset // page) * page
        end = (t.offset + t.nbytes) // page * page
        if end > start:
            raw.madvise(mmap.MADV_DONTNEED, start, end - start)

    def hold_only(self, tensors: Iterable[torch.Tensor]) -> None:
        """Let go every page of the map but those that `tensors` (the weights used in
        place, and any other tensor) lie in.

        A kernel that keeps a file in large folios (Linux 6.18 on ext4) maps a folio whole
        when one page of it faults: a weight used in place would bring back the copied
        tensors' pages in the same 2 MiB. So each 2 MiB where held pages meet pages let go
        is mapped in small pages, its held pages now, and nothing faults there after.
        """
        raw = getattr(self._map, "_mmap", None)
        if raw is None or not hasattr(mmap, "MADV_NOHUGEPAGE"):  # not Linux
            return
        base, size, huge = self._map.ctypes.data, self._map.nbytes, hugepages.HUGE_PAGE
        held = _page_spans(tensors, base, size)
        edges = [0, *(x for span in held for x in span), size]
        gaps = [(a, b) for a, b in zip(edges[::2], edges[1::2]) if b > a]
        for start, end in gaps:  # a huge page that a gap cuts goes whole, held pages too
            raw.madvise(mmap.MADV_DONTNEED, start, end - start)
        cut = {(base + x) // huge * huge - base for x in edges[1:-1] if (base + x) % huge}
        for w in sorted(cut):  # each 2 MiB (of addresses) that an edge falls inside
            lo, hi = max(0, w), min(size, w + huge)
            raw.madvise(mmap.MADV_NOHUGEPAGE, lo, hi - lo)
            for start, end in _within(held, lo, hi):
                self._map[start : end : mmap.PAGESIZE].max()  # a byte a page: mapped
            for start, end in _within(gaps, lo, hi):  # what that mapped beside them
                raw.madvise(mmap.MADV_DONTNEED, start, end - start)

    def hf_tensor(self, hf_name: str) -> GGUFTensor:
        """The raw tensor for a Hugging Face name, still in its ggml type, q/k rows un-permuted,
        an expert's slice of a stacked tensor.

        Rows are whole runs of blocks (blocks run along the input dim), so reordering rows of
        quantized data, or taking one expert's rows, is lossless: the result can be imported
        block for block.
        """
        name, expert = self.gguf_name(hf_name)
        t = self.tensors[name]
        if expert is not None:  # a view of the map: expert E's rows follow expert E-1's
            data = t.data[expert]
            return GGUFTensor(
                f"{name}[{expert}]", t.ggml_type, t.shape[1:], data, t.offset + expert * data.nbytes
            )
        if name.endswith(".ffn_gate_inp_shexp.weight") and len(t.shape) == 1:
            # Qwen2-MoE's shared expert gate: llama.cpp stores the (1, dim) Linear as a vector.
            return GGUFTensor(name, t.ggml_type, (1, *t.shape), t.data[None], t.offset)
        n_head = self.permuted_heads(t.name)
        if n_head is None:
            return t
        rows = t.shape[0]
        if t.data.shape[0] != rows or rows % (2 * n_head):
            raise InferError(
                f"{self.path}: cannot un-permute {t.name!r} of shape {t.shape} over {n_head} heads"
            )
        data = t.data[_unpermute_rows(rows, n_head)]
        return GGUFTensor(t.name, t.ggml_type, t.shape, data)

    def hf_state_dict(
        self, dtype: torch.dtype = torch.float32, skip: Container[str] = ()
    ) -> dict[str, torch.Tensor]:
        """All tensors by Hugging Face name but those in `skip`, dequantized to `dtype`,
        q/k un-permuted.

        Tensors already stored in `dtype` (e.g. F32 norms) share memory with the map.
        """
        self.config()  # fail early, with the list of supported architectures
        shift = _NORM_SHIFT.get(self.arch)
        state = {}
        for name in self.tensors:
            for hf in self.hf_names(name):
                if hf not in skip:
                    state[hf] = dequantize(self.hf_tensor(hf), dtype)
                    if shift and hf.endswith("norm.weight"):
                        state[hf] = state[hf] - shift
        return state


def _page_spans(tensors: Iterable[torch.Tensor], base: int, size: int) -> list[tuple[int, int]]:
    """The whole pages that those of `tensors` lying in [base, base + size) cover: sorted,
    disjoint (start, end) offsets from base."""
    page, spans = mmap.PAGESIZE, []
    for t in tensors:
        start = t.data_ptr() - base
        if t.numel() and 0 <= start < size:
            extent = 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
            end = min(size, -(-(start + extent * t.element_size()) // page) * page)
            spans.append((start // page * page, end))
    merged = []
    for start, end in sorted(spans):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(end, merged[-1][1]))
        else:
            merged.append((start, end))
    return merged


def _within(spans: list[tuple[int, int]], lo: int, hi: int) -> list[tuple[int, int]]:
    """The parts of `spans` within [lo, hi)."""
    return [(max(a, lo), min(b, hi)) for a, b in spans if a < hi and b > lo]
