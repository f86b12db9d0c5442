"""Embeddings: a text's vector, pooled from the model's last states (after the final
norm) as the file says: an embedding model's GGUF pooling type (mean, the first token's,
or the last's: Qwen3-Embedding), the mean for any other model; scaled to unit length
unless asked not to (ollama's legacy /api/embeddings).

    vector = embed(session, tok.encode_embedded(text), pooling_of(config))
"""

from __future__ import annotations

import torch

from .session import Session

POOLINGS = ("mean", "cls", "last")


def pooling_of(config: dict) -> str:
    """How a model's embeddings pool: its file's pooling type, else the mean."""
    pooling = config.get("pooling", "mean")
    return pooling if pooling in POOLINGS else "mean"


def pool(states: torch.Tensor, pooling: str, normalize: bool = True) -> list[float]:
    """One vector from states (T, dim) in float32; unit length with `normalize`."""
    x = states.float()
    v = {"mean": lambda: x.mean(0), "cls": lambda: x[0], "last": lambda: x[-1]}[pooling]()
    if normalize:
        v = v / v.norm().clamp_min(1e-12)
    return v.tolist()


def embed(session: Session, ids: list[int], pooling: str, normalize: bool = True) -> list[float]:
    """The embedding of the tokens `ids`, computed in `session` (its cache then holds them)."""
    return pool(session.states(ids), pooling, normalize)
