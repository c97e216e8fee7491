"""The HTTP server: FastAPI routes in vLLM's OpenAI dialect, on top of the frontend's ``AsyncLLM``.

    POST /v1/chat/completions   POST /v1/completions   GET /v1/models
    POST /tokenize  POST /detokenize   GET /health  GET /version  GET /metrics
    pooling models: POST /v1/embeddings  /pooling  /classify  /score  /rerank  (pooling_api)

HTTP only: a route parses its body (``protocol``), turns it into the frontend's terms (ids
through ``AsyncLLM``'s input processing, ``SamplingParams``), runs it and shapes the answer
(``dialects``). The rules a request must meet are the frontend's, shared with the offline
``LLM``. The routes are module-level functions over ``app.state.service`` (``Service``);
``create_app`` wires them with the middleware and the error handlers.

Every error is OpenAI error JSON (``errors``), its message redacted (``Service.redact``: the
served model's name, never the checkpoint's directory or the installation's). ``--api-key`` guards
every route but ``/health`` (``Authorization: Bearer KEY``, the scheme in any case); a POST body
must be declared JSON (``http.check_json_content_type``: 415). ``X-Request-Id`` is honoured (it
names the request in logs) and echoed back.

Shutdown (SIGTERM): uvicorn stops accepting, lets in-flight requests finish for
--shutdown-timeout, then cancels what is left. Just before that, ``Service`` fails the requests
still running with a 503 "the server is shutting down" (a stream: an error event, then
``[DONE]``), one log line each, so no client sees a stream simply stop.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from atb_plugin.engine.sampling_params import StructuredOutputsParams
from atb_plugin.frontend.async_llm import AsyncLLM, Deadlines
from atb_plugin.frontend.errors import RequestError
from atb_plugin.frontend.input_processor import InputLimits, PreparedPrompt, validate_client_token_ids
from atb_plugin.frontend.output_processor import RequestOutput
from atb_plugin.frontend.tokenizer_pool import WorkerSettings
from atb_plugin.lora import LoRAError, LoRARequest
from atb_plugin.lora.registry import LoRAModule, ServedAdapters
from atb_plugin.server import protocol, tool_parsers
from atb_plugin.server.config import ServerConfig
from atb_plugin.server.dialects import ChatDialect, ChatOptions, CompletionDialect, usage_of
from atb_plugin.server.errors import APIError, Redactor, error_body, error_json
from atb_plugin.server.http import admit, parse, service_of, until_answered
from atb_plugin.server.metrics import ServerMetrics
from atb_plugin.server.pooling_api import pooling_routes
from shm.segment import SHM_DIR
from shm.store import shm_space

logger = logging.getLogger("atb_plugin.server")
VERSION = "0.1.0"
# Rough bytes of one image in shared memory, per wire dtype (uint8: a 448x448 image is 0.6 MB, a
# 1288x728 Qwen2-VL one 2.8 MB; float32: 2.4 MB and 22.5 MB): only for the start-up warning
# about a small /dev/shm.
_TYPICAL_IMAGE_BYTES = {"uint8": 2 << 20, "float32": 8 << 20}
# How long before uvicorn's --shutdown-timeout runs out the requests still running are failed
# (at most; half the timeout when it is shorter), so their answers are out before it cancels them.
_SHUTDOWN_CUT_MARGIN_S = 1.0
# The dummy conversation and tool the start-up check renders the chat template with.
_PROBE_MESSAGES = [{"role": "user", "content": "What is the weather in Oslo?"}]
_PROBE_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


class Service:
    """What the routes share: the config, the frontend (``AsyncLLM``: input processing, tokenizer
    workers, engine-core process, output processing) and the metrics."""

    def __init__(self, config: ServerConfig):
        self.config = config
        self.metrics = ServerMetrics(config.served_model_name, config.engine.max_model_len,
                                     config.engine.data_parallel_size)
        # The LoRA adapters served by name (docs/lora.md): --lora-modules now (a bad one stops the
        # start-up), runtime loads later.
        engine = config.engine
        self.adapters = ServedAdapters(engine.checkpoint_config(), engine.max_lora_rank, config.served_model_name,
                                       reserved=(engine.model,))
        for module in config.lora_modules:
            self.adapters.add(module)
        settings = WorkerSettings(config.engine, config.media_config(), config.chat_template)
        self.llm = AsyncLLM(config.engine, settings, num_workers=config.tokenizer_workers,
                            shm_budget_bytes=config.shm_budget_bytes,
                            limits=InputLimits(config.max_input_tokens, config.max_parallel_samples),
                            metrics=self.metrics, max_queued_requests=config.max_queued_requests,
                            on_engine_death=self._on_engine_death,
                            data_parallel_routing=config.data_parallel_routing,
                            num_media_workers=config.media_workers,
                            shm_help=" (in Docker: run with --shm-size=1g or more)")
        self.tokenizer = self.llm.tokenizer
        # Every error message a client gets passes through it (errors.Redactor).
        self.redact = Redactor(config.engine.model, config.served_model_name)
        self.uvicorn_server = None
        self.exit_code = 0
        self._shutdown_watch: asyncio.Task | None = None

    @property
    def started(self) -> bool:
        return self.llm.started

    async def start(self) -> None:
        await self.llm.start()
        config = self.config
        info = self.llm.client.info
        logger.info("ready: model %s (%s), %d KV blocks of %d tokens (up to %d tokens per request), "
                    "%d tokenizer worker(s), %d media worker(s), shm budget %s", config.served_model_name,
                    config.engine.model_type,
                    info["kv_cache_blocks"], config.engine.block_size, info["max_tokens_per_request"],
                    config.tokenizer_workers, config.media_workers,
                    "unlimited" if config.shm_budget_bytes is None else f"{config.shm_budget_bytes} bytes")
        if config.enable_auto_tool_choice and template_renders_tools(self.tokenizer, config.chat_template) is False:
            logger.warning("--enable-auto-tool-choice is set but the chat template of %s does not render tools (the "
                           "prompt is the same with and without them): with tool_choice \"auto\" the model never "
                           "sees the tools and will not call them. Give a template that renders them "
                           "(--chat-template), or have clients send tool_choice \"required\" or a named function "
                           "(the output is then constrained to the tools' schemas)", config.served_model_name)
        if self.uvicorn_server is not None:
            self._shutdown_watch = asyncio.create_task(self._cut_at_shutdown_timeout(self.uvicorn_server))

    async def _cut_at_shutdown_timeout(self, server) -> None:
        """On SIGTERM uvicorn waits --shutdown-timeout for the open connections, then cancels their
        handlers: a stream would just stop, with no error event and no [DONE], and the cancelled
        handlers log CancelledError tracebacks. A little before that, fail each request still
        running with a 503 (one warning line each), so every one ends through its own route: a
        stream sends an error event and [DONE], a whole answer is a 503 JSON error. Runs until the
        lifespan's shutdown cancels it (requests still being tokenised when the time is up are cut
        as they reach the engine)."""
        while not server.should_exit:
            await asyncio.sleep(0.1)
        timeout = self.config.shutdown_timeout
        await asyncio.sleep(max(0.0, timeout - min(_SHUTDOWN_CUT_MARGIN_S, timeout / 2)))
        error = shutdown_error(timeout)

        def cut(request_id: str) -> bool:
            logger.warning("request %s cut by the shutdown: still running after --shutdown-timeout (%g s)",
                           request_id, timeout)
            return True

        while True:
            # The frontend's own path for failing requests (what an engine death uses): each is
            # aborted in the core, its lease released once, and its stream raises ``error``.
            self.llm.fail_all(error, cut)
            await asyncio.sleep(0.1)

    def _on_engine_death(self, exit_code) -> None:
        # In-flight requests got 5xx, /health turns 503; then the service exits non-zero so a
        # supervisor (systemd, Kubernetes) restarts it with a fresh engine.
        self.exit_code = 1
        if self.uvicorn_server is not None:
            asyncio.get_running_loop().call_later(1.0, setattr, self.uvicorn_server, "should_exit", True)

    async def stop(self) -> None:
        if self._shutdown_watch is not None:
            self._shutdown_watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._shutdown_watch
        await self.llm.shutdown()


def shutdown_error(timeout: float) -> RequestError:
    return RequestError(503, f"the server is shutting down: the request did not finish within its --shutdown-timeout "
                             f"of {timeout:g} s and was aborted")


def _shutting_down(scope) -> bool:
    app = scope.get("app")
    service = getattr(getattr(app, "state", None), "service", None)
    server = getattr(service, "uvicorn_server", None)
    return bool(server is not None and server.should_exit)


def template_renders_tools(tokenizer, chat_template: str | None) -> bool | None:
    """Whether the chat template (``chat_template``, the --chat-template text, or the checkpoint's)
    puts tools in the prompt: one user message rendered with and without a dummy tool. None when
    it cannot be told (no template, or one that refuses this probe)."""
    kwargs = {"tokenize": False, "add_generation_prompt": True}
    if chat_template is not None:
        kwargs["chat_template"] = chat_template
    try:
        plain = tokenizer.apply_chat_template(_PROBE_MESSAGES, **kwargs)
        with_tools = tokenizer.apply_chat_template(_PROBE_MESSAGES, tools=[_PROBE_TOOL], **kwargs)
    except Exception as error:  # noqa: BLE001 - a probe only; real requests report their own errors
        logger.debug("could not render the chat template with a tool: %s", error)
        return None
    return plain != with_tools


def log_shm_capacity(config: ServerConfig) -> None:
    space = shm_space()
    if space is None:
        logger.warning("%s cannot be measured (missing?): images cannot be served", SHM_DIR)
        return
    free, total = space
    images = config.limit_mm_per_prompt if config.limit_mm_per_prompt is not None else 4
    needed = images * config.engine.max_num_seqs * _TYPICAL_IMAGE_BYTES[config.engine.mm_wire_dtype]
    logger.info("%s: %.0f MiB, %.0f MiB free", SHM_DIR, total / 2**20, free / 2**20)
    if free < needed:
        logger.warning("/dev/shm has %.0f MiB free; %d images x %d sequences need about %.0f MiB: requests with "
                       "images may get 503. In Docker, pass --shm-size (e.g. --shm-size=2g); or lower "
                       "--limit-mm-per-prompt / --max-num-seqs, or cap use with --shm-budget-bytes",
                       free / 2**20, images, config.engine.max_num_seqs, needed / 2**20)


# -- the app ---------------------------------------------------------------------------------------


def create_app(config: ServerConfig) -> FastAPI:
    service = Service(config)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        try:
            await service.start()
            yield
        finally:
            # Also after a failed start: a tokenizer worker left running would keep this process
            # from ever exiting (and a supervisor from restarting it).
            await service.stop()

    app = FastAPI(title="atb-plugin", version=VERSION, lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.service = service
    app.add_middleware(GuardMiddleware, config=config)
    app.add_exception_handler(APIError, on_api_error)
    app.add_exception_handler(StarletteHTTPException, on_http_error)
    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(Exception, on_bug)
    app.include_router(routes)
    app.include_router(pooling_routes)
    return app


class GuardMiddleware:
    """Auth, body size and X-Request-Id, as a plain ASGI middleware (it must see every route,
    unknown ones included, and count a chunked body's bytes as they arrive)."""

    def __init__(self, app, config: ServerConfig):
        self.app = app
        self.config = config

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        request_id = headers.get("x-request-id")
        if request_id is not None:
            async def send_with_id(message, _send=send):
                if message["type"] == "http.response.start":
                    message["headers"] = list(message.get("headers", [])) + [(b"x-request-id", request_id.encode())]
                await _send(message)
            send = send_with_id
        try:
            if self.config.api_key and scope["path"] != "/health":
                auth = headers.get("authorization", "")
                if not self._authorized(auth):
                    raise APIError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'"
                                   if auth else "missing API key: send 'Authorization: Bearer <key>'")
            limit = self.config.max_request_body_bytes
            length = headers.get("content-length")
            if length is not None and length.isdigit() and int(length) > limit:
                raise APIError(413, f"the request body has {length} bytes; the limit is {limit} "
                                    "(--max-request-body-bytes)")
        except APIError as error:
            return await error_json(error)(scope, receive, send)
        received = 0

        async def counting_receive():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise APIError(413, f"the request body exceeds {limit} bytes (--max-request-body-bytes)")
            return message

        response = {"started": False, "stream": False, "complete": False}

        async def watched_send(message, _send=send):
            if message["type"] == "http.response.start":
                response["started"] = True
                response["stream"] = any(k.lower() == b"content-type" and v.startswith(b"text/event-stream")
                                         for k, v in message.get("headers", []))
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                response["complete"] = True
            await _send(message)

        try:
            await self.app(scope, counting_receive, watched_send)
        except asyncio.CancelledError:
            if not _shutting_down(scope):
                raise
            # uvicorn cancels the handlers still running when --shutdown-timeout runs out (what
            # Service's cut did not end: a request still being tokenised, a client not reading).
            # Its task ends here, answered as well as it still can be, with one line in the log
            # rather than uvicorn's "Exception in ASGI application" CancelledError traceback.
            logger.warning("%s %s cut by the shutdown: its handler was cancelled at --shutdown-timeout (%g s)",
                           scope.get("method"), scope["path"], self.config.shutdown_timeout)
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await asyncio.wait_for(self._answer_cut(response, scope, receive, watched_send), 1.0)

    async def _answer_cut(self, response: dict, scope, receive, send) -> None:
        """A cut request's last words: a 503 if nothing was sent yet, a stream's error event and
        ``[DONE]`` if it was streaming."""
        error = shutdown_error(self.config.shutdown_timeout)
        if not response["started"]:
            await error_json(error)(scope, receive, send)
        elif response["stream"] and not response["complete"]:
            body = f"data: {json.dumps(error_body(error))}\n\ndata: [DONE]\n\n".encode()
            await send({"type": "http.response.body", "body": body, "more_body": False})

    def _authorized(self, auth: str) -> bool:
        """``Bearer KEY``: the scheme in any case (RFC 9110: auth schemes are case-insensitive),
        the key compared in constant time (the header is latin-1 decoded: encoding it back gives
        the bytes sent)."""
        scheme, _, token = auth.strip().partition(" ")
        return hmac.compare_digest(token.strip().encode("latin-1"), self.config.api_key.encode("utf-8")) \
            and scheme.lower() == "bearer"


# -- errors ----------------------------------------------------------------------------------------


async def on_api_error(request: Request, error: APIError):
    if error.status >= 500:  # the log keeps the unredacted message
        logger.error("%s %s -> %d: %s", request.method, request.url.path, error.status, error.message)
    return error_json(error, service_of(request).redact)


async def on_http_error(request: Request, error: StarletteHTTPException):
    message = {404: f"no route {request.method} {request.url.path}", 405: f"{request.method} is not allowed "
               f"on {request.url.path}"}.get(error.status_code, str(error.detail))
    return error_json(APIError(error.status_code, message), service_of(request).redact)


async def on_validation_error(request: Request, error: RequestValidationError):
    message, param = protocol.format_validation_error(error)
    return error_json(APIError(400, message, param=param), service_of(request).redact)


async def on_bug(request: Request, error: Exception):
    logger.exception("unhandled error on %s %s", request.method, request.url.path)
    return error_json(APIError(500, f"internal error: {type(error).__name__}: {error}"), service_of(request).redact)


# -- from a request body to SamplingParams -----------------------------------------------------------


def check_generates(service: Service) -> None:
    """Chat and completions need a generative model; a pooling one answers 400 naming its tasks."""
    try:
        service.config.engine.check_task(None)
    except ValueError as error:
        raise APIError(400, str(error)) from None


def sampling_params(llm: AsyncLLM, req, num_prompt_tokens: int, structured=None):
    """The request's SamplingParams and the field its structured-output constraint came from
    (None without one). The rules are the input processor's (``check_prompt`` / ``finalize``:
    the context window, max_tokens, the KV capacity, n's cap, the vocabulary); the mapping of
    OpenAI's fields, with the checkpoint's defaults for unset ones, is ``protocol``'s; bad words
    become token ids, and the constraint is the request's own or ``structured`` = (params,
    field) a tool choice needs (``AsyncLLM.check_grammar`` compiles it)."""
    processor = llm.processor
    processor.check_prompt(num_prompt_tokens, req.requested_max_tokens, req.max_tokens_param)
    params = req.to_sampling_params(processor.room(num_prompt_tokens), processor.generation_defaults)
    requested = req.structured_outputs_params()
    if requested is not None and structured is not None:
        raise APIError(400, f"{requested[1]} cannot be combined with tool_choice={json.dumps(req.tool_choice)}: "
                            "a forced tool call already constrains the output", param=requested[1])
    structured = structured or requested
    if structured is not None:
        params.structured_outputs = structured[0]
    if req.bad_words:
        params.bad_words_token_ids = processor.bad_words_token_ids(req.bad_words)
    if req.echo and req.logprobs and isinstance(req, protocol.CompletionRequest):
        params.prompt_logprobs = params.logprobs  # echoed tokens get logprobs too (vLLM)
    params = processor.finalize(num_prompt_tokens, params, explicit_max_tokens=req.requested_max_tokens is not None,
                                max_tokens_param=req.max_tokens_param)
    return params, None if structured is None else structured[1]


def chat_options(config: ServerConfig, req: protocol.ChatCompletionRequest) -> tuple[ChatOptions, Any]:
    """How the answer's text is read (tool calls, reasoning, echo), and the structured-output
    constraint a forced tool call needs ((params, "tool_choice") or None)."""
    choice, tools = req.effective_tool_choice, req.tool_dicts
    try:
        tool_parsers.check_tools(tools, choice)
    except ValueError as error:
        raise APIError(400, str(error), param="tool_choice" if str(error).startswith("tool_choice") else "tools") from None
    if choice == "auto" and req.tools and not (config.enable_auto_tool_choice and config.tool_call_parser):
        raise APIError(400, '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be '
                            "set on the server; send tool_choice \"none\", \"required\" or a named function, "
                            "or start the server with those flags", param="tool_choice")
    mode = "none" if not req.tools or choice == "none" else choice if isinstance(choice, str) else "named"
    structured = None
    if mode in ("required", "named"):
        schema = tool_parsers.tool_choice_schema(tools, choice, req.parallel_tool_calls is not False)
        structured = (StructuredOutputsParams(json=schema), "tool_choice")
    last = req.messages[-1]
    echo = last.content if req.echo and last.role == "assistant" and isinstance(last.content, str) else None
    return ChatOptions(tool_mode=mode, tools=tools, tool_choice=choice,
                       tool_parser=config.tool_call_parser if mode == "auto" else None,
                       reasoning_parser=config.reasoning_parser, echo=echo or None), structured


# -- running a generate request ----------------------------------------------------------------------


def deadlines(config: ServerConfig, req, start: float) -> Deadlines | None:
    """The request's time limits from ``start`` (its arrival): the server's, lowered by the
    request's own ``request_timeout`` / ``token_timeout``; None when there are none."""
    def lower(server: float | None, asked: float | None) -> float | None:
        given = [value for value in (server, asked) if value is not None]
        return min(given) if given else None

    request_timeout = lower(config.request_timeout, req.request_timeout)
    token_timeout = lower(config.token_timeout, req.token_timeout)
    if request_timeout is None and token_timeout is None:
        return None
    return Deadlines(request_timeout, token_timeout, start)


@dataclass(frozen=True)
class Generation:
    """A chat or completion request as ``admit_generation`` admitted it: the parsed body, the
    frontend, its id and arrival time (its time limits count from it), and what both dialects
    are made with, the served model's name and a token's text (for logprobs)."""

    req: Any
    llm: AsyncLLM
    request_id: str
    start: float
    model_name: str
    token_text: Callable[[int], str]
    lora_request: LoRARequest | None = None  # the adapter `model` named (None: the base model)


async def admit_generation(raw: Request, model_cls, prefix: str) -> Generation:
    """How chat and completions open: the body parsed and admitted (``http.admit``), refused with
    a 400 unless the model generates."""
    start = time.monotonic()
    service = service_of(raw)
    req, llm, request_id = await admit(raw, model_cls, prefix)
    check_generates(service)
    lora = service.adapters.get(req.model)
    return Generation(req, llm, request_id, start, lora.lora_name if lora else service.config.served_model_name,
                      lambda token_id: service.tokenizer.decode([token_id]), lora)


async def respond(raw: Request, generation: Generation, make_dialect, prompt: PreparedPrompt, structured=None):
    """Run a request's prepared prompt and answer in the route's dialect (``make_dialect(n)``):
    one JSON body, or SSE."""
    req, llm, request_id, start = generation.req, generation.llm, generation.request_id, generation.start
    try:
        params, structured_field = sampling_params(llm, req, len(prompt.ids), structured)
        await llm.check_grammar(params, structured_field)
    except APIError:
        llm.release(prompt)
        raise
    dialect = make_dialect(params.n)
    limits = deadlines(service_of(raw).config, req, start)
    lora, kv_params = generation.lora_request, req.kv_transfer_params
    if not req.stream:
        outputs = await until_answered(raw, last_outputs(llm.generate(request_id, prompt, params, limits, lora,
                                                                      kv_params)))
        failed = next((o for o in outputs if o.outputs[0].finish_reason == "error"), None)
        if failed is not None:
            raise APIError(500, f"the request failed: {failed.error}")
        return JSONResponse(dialect.response(outputs).model_dump(exclude_none=True))
    choices = llm.generate(request_id, prompt, params, limits, lora, kv_params)

    async def events():
        for chunk in dialect.first_chunks():
            yield chunk.model_dump(exclude_none=True)
        latest: dict[int, RequestOutput] = {}
        async for index, output in choices:
            latest[index] = output
            if output.outputs[0].finish_reason == "error":
                raise APIError(500, f"the request failed: {output.error}")
            continuous = usage_of(latest) if req.continuous_usage_stats else None
            for chunk in dialect.delta_chunks(index, output, continuous):
                yield chunk.model_dump(exclude_none=True)
        if req.include_usage:
            yield dialect.usage_chunk(usage_of(latest)).model_dump(exclude_none=True)

    return StreamingResponse(sse(events(), choices, service_of(raw).redact), media_type="text/event-stream")


async def last_outputs(choices) -> list[RequestOutput]:
    """Every choice's last output, in index order."""
    latest: dict[int, RequestOutput] = {}
    try:
        async for index, output in choices:
            latest[index] = output
    finally:
        await choices.aclose()
    return [latest[i] for i in sorted(latest)]


# -- routes ------------------------------------------------------------------------------------------

routes = APIRouter()


@routes.get("/health")
async def health(raw: Request):
    service = service_of(raw)
    problem = service.llm.health_problem
    if problem is not None:
        return error_json(APIError(503, f"unhealthy: {problem}"), service.redact)
    return Response(status_code=200)


@routes.get("/version")
async def version():
    return {"version": VERSION}


@routes.get("/v1/models")
async def models(raw: Request):
    config = service_of(raw).config
    # root stays for vLLM compatibility: vLLM puts it on every card (the --model value; a LoRA
    # card's parent names the base card), and clients written against vLLM read card["root"] as
    # the base model's name, which a missing key would break. Its value is the served name, not
    # vLLM's path: where the checkpoint lies is this machine's business.
    card = protocol.ModelCard(id=config.served_model_name, root=config.served_model_name,
                              max_model_len=config.engine.max_model_len)
    # Each LoRA adapter as vLLM lists it: its own card, `parent` the base model's.
    cards = [card] + [protocol.ModelCard(id=lora.lora_name, root=lora.lora_name, parent=lora.base_model_name,
                                         max_model_len=config.engine.max_model_len)
                      for lora in service_of(raw).adapters]
    return JSONResponse(protocol.ModelList(data=cards).model_dump(exclude_none=True))


def _runtime_lora(raw: Request):
    service = service_of(raw)
    if not service.config.allow_runtime_lora_updating:
        raise APIError(404, "runtime LoRA updating is off: start the server with --allow-runtime-lora-updating (or "
                            "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True) and --enable-lora")
    return service


@routes.post("/v1/load_lora_adapter")
async def load_lora_adapter(raw: Request):
    """vLLM's route: ``{"lora_name", "lora_path"}``; the path must lie under --allowed-lora-dir."""
    service = _runtime_lora(raw)
    req = await parse(raw, protocol.LoadLoRAAdapterRequest)
    try:
        # The adapter's files are read off the event loop (a large header or a slow disk).
        await asyncio.to_thread(service.adapters.add, LoRAModule(req.lora_name, req.lora_path, req.base_model_name),
                                service.config.allowed_lora_dirs)
    except LoRAError as error:
        raise APIError(400, str(error), param="lora_path") from None
    return Response(f"Success: LoRA adapter '{req.lora_name}' added successfully.", media_type="text/plain")


@routes.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(raw: Request):
    service = _runtime_lora(raw)
    req = await parse(raw, protocol.UnloadLoRAAdapterRequest)
    try:
        service.adapters.remove(req.lora_name)
    except KeyError as error:
        raise APIError(404, error.args[0], param="lora_name") from None
    return Response(f"Success: LoRA adapter '{req.lora_name}' removed successfully.", media_type="text/plain")


@routes.get("/metrics")
async def metrics(raw: Request):
    service = service_of(raw)
    if service.started:
        pool = service.llm.pool
        try:
            stats = await asyncio.wait_for(pool.stats(), 2.0)
            service.metrics.set_shm(stats["segments"], stats["bytes"], stats["leased_segments"])
        except asyncio.TimeoutError:
            pass
        service.metrics.set_tokenizer_queue_depth(pool.queue_depth)
    body, content_type = service.metrics.render(raw.headers.get("accept"))
    return Response(body, media_type=content_type)


@routes.post("/v1/chat/completions")
async def chat_completions(raw: Request):
    generation = await admit_generation(raw, protocol.ChatCompletionRequest, "chatcmpl")
    req = generation.req
    options, structured = chat_options(service_of(raw).config, req)
    # A client that leaves while its request waits for a tokenizer worker drops it there.
    prompt = await until_answered(raw, generation.llm.chat_ids(
        generation.request_id, req.to_conversation(), add_generation_prompt=req.add_generation_prompt,
        chat_template_kwargs=req.chat_template_kwargs, tools=options.tools, mm_processor_kwargs=req.mm_processor_kwargs))

    def make_dialect(n: int) -> ChatDialect:
        return ChatDialect(generation.request_id, generation.model_name, generation.token_text, n, options)

    return await respond(raw, generation, make_dialect, prompt, structured)


@routes.post("/v1/completions")
async def completions(raw: Request):
    generation = await admit_generation(raw, protocol.CompletionRequest, "cmpl")
    req, llm = generation.req, generation.llm
    prompt = await until_answered(raw, llm.prompt_ids(generation.request_id, req.prompt,
                                                      add_special_tokens=req.add_special_tokens))
    echo = None
    if req.echo:
        echo = req.prompt if isinstance(req.prompt, str) else llm.tokenizer.decode(prompt.ids)

    def make_dialect(n: int) -> CompletionDialect:
        return CompletionDialect(generation.request_id, generation.model_name, generation.token_text, n, echo)

    return await respond(raw, generation, make_dialect, prompt)


@routes.post("/tokenize")
async def tokenize(raw: Request):
    service = service_of(raw)
    req, llm, request_id = await admit(raw, protocol.TokenizeRequest, "tokenize")
    if req.is_chat:
        prompt = await llm.chat_ids(request_id, req.to_conversation(), add_generation_prompt=req.add_generation_prompt,
                                    chat_template_kwargs=req.chat_template_kwargs, release_now=True)
    else:
        prompt = await llm.prompt_ids(request_id, req.prompt, add_special_tokens=req.effective_add_special_tokens,
                                      release_now=True)
    ids = prompt.ids
    strs = service.tokenizer.convert_ids_to_tokens([max(t, 0) for t in ids]) if req.return_token_strs else None
    return protocol.TokenizeResponse(count=len(ids), max_model_len=service.config.engine.max_model_len, tokens=ids,
                                     token_strs=strs).model_dump(exclude_none=True)


@routes.post("/detokenize")
async def detokenize(raw: Request):
    service = service_of(raw)
    req = await parse(raw, protocol.DetokenizeRequest)
    ids = validate_client_token_ids(req.tokens, service.config.engine.vocab_size, "tokens") if req.tokens else []
    return {"prompt": service.tokenizer.decode(ids)}


async def sse(events: AsyncIterator[dict], generator, redact=None) -> AsyncIterator[str]:
    """Server-sent events in OpenAI's framing; an error after the stream began is sent as an
    ``{"error": ...}`` event (the status line is already out; its message through ``redact``),
    then ``[DONE]``."""
    try:
        async for event in events:
            yield f"data: {json.dumps(event, ensure_ascii=False)}\n\n"
    except APIError as error:
        yield f"data: {json.dumps(error_body(error, redact))}\n\n"
    except Exception as error:  # noqa: BLE001 - our bug, reported in-band as a 500
        logger.exception("stream failed")
        yield f"data: {json.dumps(error_body(APIError(500, f'internal error: {error}'), redact))}\n\n"
    finally:
        await generator.aclose()  # a client gone mid-stream: aborts the request in the core
    yield "data: [DONE]\n\n"
