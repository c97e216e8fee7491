"""Errors as the HTTP server reports them: every ``RequestError`` as OpenAI error JSON.

The frontend decides what is wrong and its status (``atb_plugin.frontend.errors``: a client's
mistake is 4xx and says what to fix; a full resource is 429 / 503 with ``Retry-After``; our own
bug or a dead process is 5xx, never dressed as a 400). ``APIError`` is the same type, the name
the routes raise; the JSON itself (and vLLM's error "type" per status) is
``protocol.error_response``'s.
"""

from __future__ import annotations

from fastapi.responses import JSONResponse

from atb_plugin.frontend.errors import RequestError
from atb_plugin.server.protocol import error_response

__all__ = ["APIError", "error_body", "error_json"]

APIError = RequestError


def error_body(error: RequestError) -> dict:
    return error_response(error.message, error.status, param=error.param).model_dump()


def error_json(error: RequestError) -> JSONResponse:
    return JSONResponse(error_body(error), status_code=error.status, headers=error.headers())
