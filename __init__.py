"""infer: run large language models locally, CPU first.

`InferError` lives here, below every layer, so any module may raise it.
"""

__version__ = "0.1.0"


class InferError(Exception):
    """A user-facing error: bad input, missing model, unsupported file.

    The CLI prints `str(err)` on one line to stderr and exits with `exit_code`
    (2 for usage and input errors, 1 for everything else).
    """

    def __init__(self, message: str, exit_code: int = 2):
        super().__init__(message)
        self.exit_code = exit_code
