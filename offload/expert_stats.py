"""The figures of an expert-offloaded run: counters and the report `infer bench` prints."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .expert_cache import CacheStats


@dataclass
class ExpertStats:
    """Counters of an expert-offloaded model; `a - b` is what happened between two
    snapshots."""

    layers: list[CacheStats]  # per MoE layer
    tokens: int = 0  # tokens through the model (a prompt's all count)
    passes: int = 0  # forward passes
    read_busy_s: float = 0.0  # the reader: wall time with a read in flight
    check_s: float = 0.0  # crc32 time
    dense_bytes_read: int = 0  # dense layers streamed (0 when resident)
    dense_stall_s: float = 0.0

    def __sub__(self, other: ExpertStats) -> ExpertStats:
        return ExpertStats(
            [a - b for a, b in zip(self.layers, other.layers)],
            *(getattr(self, f.name) - getattr(other, f.name) for f in dataclasses.fields(self)[1:]),
        )

    def __add__(self, other: ExpertStats) -> ExpertStats:
        return ExpertStats(
            [a + b for a, b in zip(self.layers, other.layers)],
            *(getattr(self, f.name) + getattr(other, f.name) for f in dataclasses.fields(self)[1:]),
        )

    @property
    def total(self) -> CacheStats:
        return sum(self.layers, CacheStats())

    @property
    def predicted(self) -> CacheStats:
        """The layers that had predictions (layer 0 only gets the entry refinement)."""
        return sum((s for s in self.layers if s.predicted), CacheStats())


@dataclass
class ExpertReport:
    """An expert-offloaded run's figures, for `infer bench` (table and --json)."""

    budget_bytes: int | None  # None: a cache size given in experts
    planned_bytes: int
    footprint_bytes: int  # measured: RSS + the model file's cached pages not in RSS
    policy: str
    scheme: str
    expert_bytes: int
    experts_total: int
    slots: list[int]  # per MoE layer
    buffers: int
    dense_layers_streamed: int
    read_method: str
    crc32_check: str
    phase: str  # what the counters cover: "decode", "all"
    tokens: int
    hit_rate: float
    hit_rate_per_layer: list[float]
    precision: float
    recall: float
    reads_per_token: float
    bytes_read_per_token: float
    prefetch_reads_per_token: float
    prefetch_reads_used: float  # share of prefetch reads used before eviction
    read_gb_s: float
    stall_s: float
    stall_s_per_token: float
    dense_bytes_read_per_token: float
