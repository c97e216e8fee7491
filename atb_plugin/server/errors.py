"""``APIError``: every failure a route reports, with its HTTP status and OpenAI error JSON.

The rule: a client's mistake is 4xx and says what to fix; a full resource is 429/503 with
``Retry-After``; our own bug (or a dead process) is 5xx, never dressed as a 400.
"""

from __future__ import annotations

from http import HTTPStatus

# vLLM's error "type" per status (its ErrorResponse), so clients that branch on it keep working.
_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError", 405: "MethodNotAllowed",
          413: "RequestEntityTooLarge", 429: "RateLimitError", 500: "InternalServerError",
          503: "ServiceUnavailableError"}


class APIError(Exception):
    def __init__(self, status: int, message: str, *, param: str | None = None, retry_after: int | None = None):
        super().__init__(message)
        self.status = int(status)
        self.message = message
        self.param = param
        self.retry_after = retry_after

    @property
    def type(self) -> str:
        return _TYPES.get(self.status, HTTPStatus(self.status).phrase.replace(" ", ""))

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.status}}

    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(self.retry_after)} if self.retry_after is not None else {}


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


def internal_error(message: str) -> APIError:
    return APIError(500, message)


def unavailable(message: str, retry_after: int = 1) -> APIError:
    return APIError(503, message, retry_after=retry_after)
