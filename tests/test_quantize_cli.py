"""`infer quantize` end to end: a tiny model -> our format -> `infer run` and `infer info`."""

import json
import signal
import subprocess
import sys
import time

import pytest
from tiny import make_hf_model


def infer(*args, **kw):
    return subprocess.run(
        [sys.executable, "-m", "infer.cli.main", *map(str, args)],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
        **kw,
    )


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny") / "llama"
    make_hf_model("llama", path)
    return path


@pytest.mark.slow
@pytest.mark.parametrize("to", ["int8", "int4", "mixed"])
def test_quantize_then_run(tiny_dir, tmp_path, to):
    out = tmp_path / to
    r = infer("quantize", tiny_dir, "-o", out, "--to", to, "--group-size", "32", "--json")
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    assert report["bytes_after"] < report["bytes_before"]
    assert {t["name"] for t in report["tensors"]} >= {"lm_head", "layers.0.mlp.up_proj"}
    assert all(t["rel_rms_error"] < 0.2 for t in report["tensors"])

    r = infer("info", out, "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["format"] == "infer"

    r = infer("run", out, "hello", "-n", "4", "--temperature", "0", "--no-chat", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["tokens_generated"] == 4


@pytest.mark.slow
def test_refuses_to_overwrite_without_force(tiny_dir, tmp_path):
    out = tmp_path / "q"
    assert infer("quantize", tiny_dir, "-o", out, "--to", "int8").returncode == 0
    r = infer("quantize", tiny_dir, "-o", out, "--to", "int8")
    assert r.returncode == 2 and "--force" in r.stderr and len(r.stderr.splitlines()) == 1
    assert infer("quantize", tiny_dir, "-o", out, "--to", "int4", "--force").returncode == 0


@pytest.mark.slow
def test_requantizes_a_quantized_checkpoint(tiny_dir, tmp_path):
    assert infer("quantize", tiny_dir, "-o", tmp_path / "a", "--to", "int8").returncode == 0
    r = infer("quantize", tmp_path / "a", "-o", tmp_path / "b", "--to", "int4", "--json")
    assert r.returncode == 0, r.stderr
    assert {t["format"] for t in json.loads(r.stdout)["tensors"]} >= {"int4"}


def test_unknown_format_is_one_line(tiny_dir, tmp_path):
    r = infer("quantize", tiny_dir, "-o", tmp_path / "x", "--to", "int3")
    assert r.returncode == 2 and len(r.stderr.splitlines()) == 1, r.stderr
    assert not (tmp_path / "x").exists()


@pytest.mark.slow
def test_low_bit_without_calibration_warns(tmp_path):
    src = tmp_path / "src"
    make_hf_model("llama", src, intermediate_size=128)  # widths a multiple of lut's 64
    r = infer("quantize", src, "-o", tmp_path / "l2", "--to", "lut2", "--json")
    assert r.returncode == 0, r.stderr
    assert "warning: lut2 rounded without --calibrate" in r.stderr
    json.loads(r.stdout)  # stdout stays clean
    r = infer("quantize", src, "-o", tmp_path / "i4", "--to", "int4", "--group-size", "32")
    assert r.returncode == 0 and "warning" not in r.stderr, r.stderr


@pytest.mark.slow
def test_sigterm_while_writing_leaves_no_temp_folder(tmp_path):
    src = tmp_path / "src"
    # Big enough (~50 MB of int8) that the write lasts well past the poll below.
    make_hf_model("llama", src, hidden_size=512, intermediate_size=2048, num_hidden_layers=12)
    out = tmp_path / "q"
    cmd = [sys.executable, "-m", "infer.cli.main", "quantize", src, "-o", out, "--to", "int8"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    tmp = tmp_path / f".q.tmp-{proc.pid}"
    deadline = time.monotonic() + 100
    while not tmp.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.001)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 143, stderr  # not 0: the signal came mid-write
    assert stderr.splitlines() == ["error: terminated"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


@pytest.mark.slow
def test_summary_by_default_table_with_verbose(tiny_dir, tmp_path):
    r = infer("quantize", tiny_dir, "-o", tmp_path / "a", "--to", "int8")
    assert r.returncode == 0, r.stderr
    summary = r.stdout.splitlines()
    assert len(summary) == 4, r.stdout
    assert summary[0] == "int8: 16 tensors quantized"  # 2 layers of 7, embeddings, lm_head
    assert "-> " in summary[1] and "bits per weight" in summary[1]
    assert summary[2].startswith("relative RMS error: mean ") and "worst" in summary[2]
    assert summary[3] == f"wrote {tmp_path / 'a'}"
    r = infer("quantize", tiny_dir, "-o", tmp_path / "b", "--to", "int8", "-v")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].split()[:2] == ["tensor", "format"] and len(lines) == 1 + 16 + 4
    assert lines[-4:-1] == summary[:3]  # the same summary below the table
