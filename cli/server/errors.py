"""The one error type the handlers raise; each API shapes it its own way."""

from __future__ import annotations


class ApiError(Exception):
    """A request that cannot be served: an HTTP status and a one-line message naming
    what is wrong (`param`: the request field at fault, when there is one)."""

    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
