"""The `infer` command line. `main` is its entry point: it watches for Ctrl-C before the
command line's imports begin, so that an interrupt at any moment exits 130 quietly."""

import signal
import sys


def record_interrupts() -> list:
    """Ctrl-C still raises KeyboardInterrupt, and is also recorded in the list returned:
    one that lands inside an import (torch's, numpy's) can surface later as some other
    error, which is then known to be the interrupt it is."""
    interrupted: list = []

    def on_sigint(signum, frame):
        interrupted.append(signum)
        raise KeyboardInterrupt

    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, on_sigint)
    return interrupted


def main() -> None:
    interrupted = record_interrupts()
    try:
        from .main import main as run
    except BaseException:
        if interrupted:
            sys.exit(130)
        raise
    run(interrupted)
