"""Errors as the HTTP server reports them: every ``RequestError`` as OpenAI error JSON.

The frontend decides what is wrong and its status (``atb_plugin.frontend.errors``: a client's
mistake is 4xx and says what to fix; a full resource is 429 / 503 with ``Retry-After``; our own
bug or a dead process is 5xx, never dressed as a 400). ``APIError`` is the same type, the name
the routes raise; the JSON itself (and vLLM's error "type" per status) is
``protocol.error_response``'s.

A message leaves the server through ``Redactor`` (the service's ``redact``): the frontend and the
engine name the model by its checkpoint directory (``EngineConfig.model``) and a 500's text may
quote the installation's files, none of which a client should learn; the server log keeps them.
"""

from __future__ import annotations

import os
import re
import site
import sys
from collections.abc import Callable
from pathlib import Path

from fastapi.responses import JSONResponse

from atb_plugin.frontend.errors import RequestError
from atb_plugin.server.protocol import error_response

__all__ = ["APIError", "Redactor", "error_body", "error_json"]

APIError = RequestError


class Redactor:
    """``redact(message)``: the server's own filesystem paths in ``message`` replaced by what a
    client may know. The checkpoint's directory becomes the served model's name; the venv
    (``sys.prefix``), the interpreter's installation, site-packages and atb-plugin's source
    directory become ``<venv>``, ``<python>``, ``<site-packages>`` and ``<atb-plugin>``. The
    longest path wins (a file in site-packages reads ``<site-packages>/torch/...``), and a path is
    replaced only as a whole (``/models/m`` is left alone inside ``/models/m-2`` or ``file:///models/m``,
    which a client wrote itself)."""

    def __init__(self, model_path: str | None = None, served_model_name: str | None = None):
        replacements: dict[str, str] = {}

        def add(path: str | None, replacement: str) -> None:
            if not path:
                return
            for variant in (path, os.path.abspath(path), os.path.realpath(path)):
                variant = variant.rstrip("/")
                if len(variant) > 1:
                    replacements.setdefault(variant, replacement)  # the first (most specific) name wins

        add(model_path, served_model_name or os.path.basename(str(model_path).rstrip("/")))
        for packages in (*_site_packages(), site.getusersitepackages() if site.ENABLE_USER_SITE else None):
            add(packages, "<site-packages>")
        add(str(Path(__file__).resolve().parents[2]), "<atb-plugin>")
        if sys.prefix != sys.base_prefix:
            add(sys.prefix, "<venv>")
        for prefix in (sys.base_prefix, sys.base_exec_prefix, sys.prefix, sys.exec_prefix):
            add(prefix, "<python>")
        # An identity replacement (the model served under its own path) still takes part: the
        # longest match wins, so a checkpoint inside the source tree keeps its name.
        self._replacements = replacements
        paths = sorted(replacements, key=len, reverse=True)
        self._pattern = re.compile(r"(?<![\w.~/-])(?:" + "|".join(map(re.escape, paths)) + r")(?![\w.~-])") \
            if paths else None

    def __call__(self, message: str) -> str:
        if self._pattern is None or not message:
            return message
        return self._pattern.sub(lambda match: self._replacements[match.group(0)], message)


def _site_packages() -> list[str]:
    try:
        return list(site.getsitepackages())
    except AttributeError:  # some embedded interpreters' site module lacks it
        return []


def error_body(error: RequestError, redact: Callable[[str], str] | None = None) -> dict:
    message = error.message if redact is None else redact(error.message)
    return error_response(message, error.status, param=error.param).model_dump()


def error_json(error: RequestError, redact: Callable[[str], str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(error, redact), status_code=error.status, headers=error.headers())
