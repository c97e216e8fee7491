"""``RequestError``: how the frontend refuses a request, the same way through both doors.

The rule: a client's mistake is ``InvalidRequestError`` (status 400, a ``ValueError``, so the
offline ``LLM`` raises what Python users expect) and says what to fix, naming the field in
``param``; a full resource is 429 / 503 with ``retry_after``; our own bug or a dead process is
5xx, never dressed as a 400. The HTTP server turns any of them into OpenAI error JSON with that
status (``atb_plugin.server.errors``).
"""

from __future__ import annotations

__all__ = ["RequestError", "InvalidRequestError"]


class RequestError(Exception):
    def __init__(self, status: int, message: str, *, param: str | None = None, retry_after: int | None = None):
        super().__init__(message)
        self.status = int(status)
        self.message = message
        self.param = param
        self.retry_after = retry_after

    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(self.retry_after)} if self.retry_after is not None else {}


class InvalidRequestError(RequestError, ValueError):
    """A request that parses but cannot be served as asked; ``param`` names the field at fault
    (vLLM's ``VLLMValidationError.parameter``)."""

    def __init__(self, message: str, *, param: str | None = None):
        super().__init__(400, message, param=param)
