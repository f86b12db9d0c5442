"""Helpers every command shares: threads, dtypes, and output that suits a terminal or a pipe.

Only typer-free standard library at import; torch, psutil and rich load inside the
functions, so `infer --help` stays instant.
"""

from __future__ import annotations

import json
import os
import sys
from contextlib import contextmanager, nullcontext
from pathlib import Path

from .. import InferError
from .options import DType


def is_tty() -> bool:
    """Rich output (tables, spinners, colour) only when both streams are terminals."""
    return sys.stdout.isatty() and sys.stderr.isatty()


def utf8_text(data: bytes, what: str) -> str:
    """`data` as UTF-8 text, or an InferError naming `what` and the first bad byte."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InferError(f"{what}: not UTF-8 text ({e.reason} at byte {e.start})") from None


def utf8_arg(value: str | None, what: str) -> str | None:
    """A command-line argument checked to be UTF-8 text. Python decodes argv with
    surrogate escapes, so bytes that are not UTF-8 arrive as lone surrogates; give
    back the bytes to name the first bad one."""
    if value is None:
        return None
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return utf8_text(os.fsencode(value), what)
    return value


def read_format(value: str | None) -> str | dict | None:
    """--format: "json", or the JSON schema in the file `value` names."""
    if value is None or value == "json":
        return value
    try:
        data = Path(value).read_bytes()
    except OSError as e:
        raise InferError(f"--format {value}: cannot read the schema ({e.strerror})") from None
    try:
        schema = json.loads(utf8_text(data, f"--format {value}"))
    except json.JSONDecodeError as e:
        raise InferError(f"--format {value}: not valid JSON ({e})") from None
    if not isinstance(schema, dict):
        raise InferError(
            f"--format {value}: a JSON schema is an object, not {type(schema).__name__}"
        )
    return schema


def read_grammar(value: str | None) -> str | None:
    """--grammar-file: the text of the GBNF grammar in the file `value` names."""
    if value is None:
        return None
    try:
        data = Path(value).read_bytes()
    except OSError as e:
        raise InferError(f"--grammar-file {value}: cannot read it ({e.strerror})") from None
    return utf8_text(data, f"--grammar-file {value}")


@contextmanager
def quiet_broken_pipe():
    """A reader that leaves early (`infer run ... | head -n 1`) ends the command quietly
    with status 141, as a process killed by SIGPIPE would (SIGPIPE itself stays ignored:
    it would also kill a download whose connection drops)."""
    try:
        yield
    except BrokenPipeError:
        # stdout to /dev/null, or the flush at exit fails again and says so on stderr.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        raise SystemExit(141) from None


class _Terminated(BaseException):
    """SIGTERM, raised where the main thread is, so cleanup runs as for Ctrl-C."""


@contextmanager
def sigterm_unwinds():
    """While files are being written: SIGTERM (`kill`, a service stop) unwinds the stack
    instead of ending the process at once, so temporaries are removed; then exit 143 as
    a killed process would."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield  # signal handlers can only be set from the main thread
        return

    def terminated(signum, frame):
        raise _Terminated

    old = signal.signal(signal.SIGTERM, terminated)
    try:
        yield
    except _Terminated:
        raise InferError("terminated", exit_code=143) from None
    finally:
        signal.signal(signal.SIGTERM, old)


def import_torch():
    """Import torch with Ctrl-C held back until it is done: an interrupt inside its
    import can abort the process from C++ (exit 134) or leave numpy half-imported.
    The held-back Ctrl-C arrives right after, as a KeyboardInterrupt."""
    import signal

    blocked = hasattr(signal, "pthread_sigmask")
    if blocked:
        old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        import torch
    finally:
        if blocked:
            signal.pthread_sigmask(signal.SIG_SETMASK, old)
    return torch


def set_threads(threads: int | None) -> int:
    import psutil

    torch = import_torch()

    n = threads or psutil.cpu_count(logical=False) or os.cpu_count() or 1
    torch.set_num_threads(n)
    return n


def torch_dtype(dtype: DType):
    import torch

    return {DType.float32: torch.float32, DType.bfloat16: torch.bfloat16}[dtype]


def status(message: str):
    """A spinner on stderr while something slow runs, on a terminal only."""
    if not is_tty():
        return nullcontext()
    from rich.console import Console

    return Console(stderr=True).status(message)


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def human_count(n: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.1f}{unit}"
    return str(n)


def print_table(headers: list[str] | None, rows: list[list[str]], title: str | None = None):
    """A rich table on a terminal; aligned plain columns otherwise."""
    if sys.stdout.isatty():
        from rich import box
        from rich.console import Console
        from rich.table import Table

        table = Table(title=title, show_header=bool(headers), box=box.SIMPLE_HEAD)
        for i, h in enumerate(headers or [""] * (len(rows[0]) if rows else 0)):
            table.add_column(h, style="bold" if i == 0 else None)
        for row in rows:
            table.add_row(*row)
        Console().print(table)
        return
    lines = ([headers] if headers else []) + rows
    if not lines:
        return
    widths = [max(len(line[i]) for line in lines) for i in range(len(lines[0]))]
    for line in lines:
        cells = [c.ljust(w) for c, w in zip(line[:-1], widths)] + [line[-1]]
        print("  ".join(cells).rstrip())


def print_json(obj) -> None:
    print(json.dumps(obj, indent=2, default=str))
