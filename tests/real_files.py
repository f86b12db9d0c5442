"""Real model files for the slow tests: never fetched by a test, found where they lie."""

from __future__ import annotations

import os
from pathlib import Path

from infer import InferError
from infer.runtime.registry import resolve


def pulled(name: str, env: str) -> Path | None:
    """$env if set, else the copy `infer pull NAME` keeps, else None."""
    if os.environ.get(env):
        return Path(os.environ[env])
    try:
        return resolve(name, download=False, progress=False).path
    except InferError:
        return None
