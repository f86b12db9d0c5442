"""A short seeded run of the loader fuzzer (fuzz_loaders.py; its long run is by hand):
every mutated GGUF file, Hugging Face folder and checkpoint loads and answers, or fails
with one line of InferError, each case in a child process within its time limit."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

FUZZER = Path(__file__).with_name("fuzz_loaders.py")


@pytest.mark.slow  # about 30 s: 200 cases, each a load and a forward pass in a child
def test_every_mutation_loads_or_fails_in_one_line(tmp_path):
    # A fresh process: the fuzzer forks per case, which wants no thread pool running.
    r = subprocess.run(
        [sys.executable, FUZZER, "--cases", "200", "--seed", "0", "--seconds", "15",
         "--only", "gguf", "hf", "checkpoint", "--json"],
        capture_output=True, text=True, timeout=900, cwd=tmp_path, check=False,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout[-5000:] + r.stderr[-2000:]
    counts = json.loads(r.stdout.splitlines()[-1])
    assert counts["cases"] == 200
    # Both ways out are taken: the run tests the checks, not only the happy path.
    outcomes = counts["outcomes"]
    assert outcomes["ok"] >= 10 and outcomes["error"] >= 50, counts
