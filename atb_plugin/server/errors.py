"""``APIError``: every failure a route reports, with its HTTP status and OpenAI error JSON.

The rule: a client's mistake is 4xx and says what to fix; a full resource is 429/503 with
``Retry-After``; our own bug (or a dead process) is 5xx, never dressed as a 400. The JSON itself
(and vLLM's error "type" per status) is ``protocol.error_response``'s.
"""

from __future__ import annotations

from atb_plugin.server.protocol import error_response


class APIError(Exception):
    def __init__(self, status: int, message: str, *, param: str | None = None, retry_after: int | None = None):
        super().__init__(message)
        self.status = int(status)
        self.message = message
        self.param = param
        self.retry_after = retry_after

    def body(self) -> dict:
        return error_response(self.message, self.status, param=self.param).model_dump()

    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(self.retry_after)} if self.retry_after is not None else {}
