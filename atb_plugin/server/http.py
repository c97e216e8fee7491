"""What every route does before and after its own work: parse the body, check the model name,
admit the request, name it, and wait for an answer while watching for a client that leaves.

The routes reach the service through ``request.app.state.service`` (``api_server.Service``).
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import uuid

import pydantic
import pydantic_core
from fastapi import Request

from atb_plugin.server import protocol
from atb_plugin.server.errors import APIError

__all__ = ["admit", "check_json_content_type", "json_error_message", "new_request_id", "parse", "service_of",
           "until_answered"]

_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
# How often a waiting request checks whether its client is still there.
DISCONNECT_POLL_S = 0.25


def service_of(raw: Request):
    return raw.app.state.service


def json_error_message(body: bytes, error: ValueError) -> str:
    """The 400's message for a body the JSON parser refused, in the client's terms."""
    text = str(error)
    if "recursion limit" in text:  # jiter stops at 200 levels: no OpenAI request nests that deep
        return "the body's JSON is nested too deeply"
    if "surrogate" in text or ("hex escape" in text and _SURROGATE_ESCAPE.search(body)):
        # JSON may spell an unpaired UTF-16 surrogate ("\ud800"); it is no character, and no
        # tokenizer or encoder downstream could take it. (Paired ones decode to real characters.)
        return "the body holds an unpaired UTF-16 surrogate escape (such as \\ud800), which is not a character"
    return f"the body is not valid JSON: {text}"


def check_json_content_type(raw: Request) -> None:
    """A POST body must be declared JSON (415 otherwise): ``application/json``, with parameters
    (``; charset=utf-8``) or as a ``+json`` suffix type, in any case.

    Why refuse the rest, though the body may parse: a POST whose Content-Type is text/plain,
    application/x-www-form-urlencoded or multipart/form-data, or that has none, is a CORS "simple
    request". A browser sends it from any web page without asking the server first, so without
    this check any page open on a machine that can reach a keyless server (localhost!) could make
    it generate. A missing Content-Type is refused too: ``fetch`` with a Blob or ArrayBuffer body
    sends none and is still a simple request; the OpenAI and vLLM clients (and FastAPI's JSON
    clients) always send ``application/json``. ``application/json`` itself makes the browser ask
    first (a CORS preflight), which this server never grants."""
    received = raw.headers.get("content-type")
    media_type = (received or "").split(";", 1)[0].strip().lower()
    if media_type == "application/json" or (media_type.startswith("application/") and media_type.endswith("+json")):
        return
    what = "the request has no Content-Type" if not received else \
        f"the request's Content-Type is {received.strip()[:100]!r}"
    raise APIError(415, f"{what}; {raw.url.path} takes a JSON body: send 'Content-Type: application/json'")


async def parse(raw: Request, model_cls):
    """The body as ``model_cls`` (400 naming the field at fault), for the served model (404);
    declared as JSON (415, ``check_json_content_type``: every POST route parses its body here)."""
    check_json_content_type(raw)
    body = await raw.body()
    try:
        # pydantic's Rust parser (jiter), not json.loads: an image chat's body is megabytes of
        # base64 in one string, which jiter copies out many times faster (benchmarks/RESULTS.md, P5).
        data = pydantic_core.from_json(body)
    except ValueError as error:
        raise APIError(400, json_error_message(body, error)) from None
    if not isinstance(data, dict):
        raise APIError(400, f"the body must be a JSON object, got {type(data).__name__}")
    try:
        req = model_cls.model_validate(data)
    except pydantic.ValidationError as error:
        message, param = protocol.format_validation_error(error)
        raise APIError(400, message, param=param) from None
    except ValueError as error:
        raise APIError(400, str(error), param=getattr(error, "param", None)) from None
    service = service_of(raw)
    config = service.config
    if req.model is not None and req.model not in (config.served_model_name, config.engine.model) \
            and req.model not in service.adapters:  # a LoRA adapter's name picks it (docs/lora.md)
        raise APIError(404, f"The model `{req.model}` does not exist. This server serves "
                            f"`{config.served_model_name}`.", param="model")
    return req


def new_request_id(raw: Request, prefix: str) -> str:
    given = raw.headers.get("x-request-id")
    return f"{prefix}-{given or uuid.uuid4().hex}-{uuid.uuid4().hex[:6]}" if given else f"{prefix}-{uuid.uuid4().hex}"


async def admit(raw: Request, model_cls, prefix: str):
    """Every route that runs a request: the parsed body, the frontend (or 503 / 429), an id."""
    req = await parse(raw, model_cls)
    llm = service_of(raw).llm
    llm.check_admission()
    return req, llm, new_request_id(raw, prefix)


async def until_answered(raw: Request, work):
    """``await work`` (a coroutine), cancelling it with a 400 if the client goes away first: nobody
    would read the answer (cancelling aborts its requests in the core)."""
    task = asyncio.ensure_future(work)
    try:
        while not task.done():
            await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if not task.done() and await raw.is_disconnected():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
                raise APIError(400, "the client disconnected before the answer was ready")
        return task.result()
    finally:
        task.cancel()  # a no-op once done; stops the work if this handler was cancelled
