"""The HTTP frontend: FastAPI routes in vLLM's OpenAI dialect, on top of ``AsyncEngine``.

    POST /v1/chat/completions   POST /v1/completions   GET /v1/models
    POST /tokenize  POST /detokenize   GET /health  GET /version  GET /metrics
    pooling models: POST /v1/embeddings  /pooling  /classify  /score  /rerank  (pooling_api)

Every error is OpenAI error JSON (``errors.APIError``). ``--api-key`` guards every route but
``/health``. ``X-Request-Id`` is honoured (it names the request in logs) and echoed back.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pydantic
import pydantic_core
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from atb_plugin.engine import structured_output
from atb_plugin.engine.llm import validate_client_token_ids
from atb_plugin.engine.sampling_params import StructuredOutputsParams
from atb_plugin.engine.output_processor import RequestOutput
from atb_plugin.server import protocol
from atb_plugin.server.async_engine import AsyncEngine
from atb_plugin.server.config import ServerConfig
from atb_plugin.server.dialects import ChatDialect, ChatOptions, CompletionDialect, usage_of
from atb_plugin.server.engine_client import EngineClient
from atb_plugin.server.errors import APIError
from atb_plugin.server.metrics import ServerMetrics
from atb_plugin.server import tool_parsers
from atb_plugin.server.pooling_api import add_pooling_routes
from atb_plugin.server.workers import TokenizerPool, WorkerSettings
from shm.segment import SHM_DIR
from shm.store import shm_space

logger = logging.getLogger("atb_plugin.server")
VERSION = "0.1.0"
# Rough bytes of one image in shared memory, per wire dtype (uint8: a 448x448 image is 0.6 MB, a
# 1288x728 Qwen2-VL one 2.8 MB; float32: 2.4 MB and 22.5 MB): only for the start-up warning
# about a small /dev/shm.
_TYPICAL_IMAGE_BYTES = {"uint8": 2 << 20, "float32": 8 << 20}
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


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


class Service:
    """Everything the routes share: config, tokenizer, engine client, worker pool, metrics."""

    def __init__(self, config: ServerConfig):
        from routers import get_router

        self.config = config
        self.engine_config = config.engine
        # The API process needs the tokenizer (detokenising outputs) and the family's EOS ids;
        # it never builds inputs, so its router never creates a shared-memory store.
        self.router = get_router(config.engine.model)
        self.tokenizer = self.router.tokenizer
        self.generation_config = self.router.generation_config
        self.metrics = ServerMetrics(config.served_model_name, config.engine.max_model_len)
        self.uvicorn_server = None
        self.exit_code = 0
        self.started = False
        self.engine_client: EngineClient | None = None
        self.pool: TokenizerPool | None = None
        self.engine: AsyncEngine | None = None

    async def start(self) -> None:
        config = self.config
        settings = WorkerSettings(config.engine.model, config.media_config(), config.limit_mm_per_prompt,
                                  config.engine.mm_wire_dtype, config.chat_template)
        self.pool = TokenizerPool(settings, config.tokenizer_workers, config.shm_budget_bytes,
                                  on_worker_death=self._on_worker_death,
                                  shm_help=" (in Docker: run with --shm-size=1g or more)")
        self.engine_client = EngineClient(config.engine, on_outputs=self._on_outputs, on_death=self._on_engine_death)
        # Both run to the end before a failure is raised, so stop() never races a half-started part.
        for result in await asyncio.gather(self.engine_client.start(), self.pool.start(), return_exceptions=True):
            if isinstance(result, BaseException):
                raise result
        self.engine = AsyncEngine(self.engine_client, self.pool, self.tokenizer, self.router.eos_token_ids,
                                  self.metrics, config.max_queued_requests)
        self.started = True
        info = self.engine_client.info
        logger.info("ready: model %s (%s), %d KV blocks of %d tokens (up to %d tokens per request), "
                    "%d tokenizer worker(s), shm budget %s", config.served_model_name, config.engine.model_type,
                    info["kv_cache_blocks"], config.engine.block_size, info["max_tokens_per_request"],
                    config.tokenizer_workers,
                    "unlimited" if config.shm_budget_bytes is None else f"{config.shm_budget_bytes} bytes")

    def _on_outputs(self, outputs) -> None:
        if self.engine is not None:
            self.engine.on_outputs(outputs)

    def _on_worker_death(self, index: int, instance_id) -> None:
        if self.engine is not None:
            self.engine.on_worker_death(index, instance_id)

    def _on_engine_death(self, exit_code) -> None:
        # In-flight requests get 5xx, /health turns 503; then the service exits non-zero so a
        # supervisor (systemd, Kubernetes) restarts it with a fresh engine.
        self.exit_code = 1
        if self.engine is not None:
            self.engine.on_engine_death(exit_code)
        if self.uvicorn_server is not None:
            asyncio.get_running_loop().call_later(1.0, setattr, self.uvicorn_server, "should_exit", True)

    async def stop(self) -> None:
        if self.engine is not None:
            await self.engine.abort_all()
        if self.engine_client is not None:
            await self.engine_client.shutdown()
        if self.pool is not None:
            await self.pool.shutdown()  # each worker's store unlinks its segments

    @property
    def healthy(self) -> bool:
        return self.started and self.engine_client.alive and self.engine.dead_reason is None

    @property
    def max_tokens_per_request(self) -> int:
        return self.engine_client.info["max_tokens_per_request"]


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


# -- middleware ------------------------------------------------------------------------------------


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
                if auth != f"Bearer {self.config.api_key}":
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

        await self.app(scope, counting_receive, send)


def error_json(error: APIError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers())


# -- the app ---------------------------------------------------------------------------------------


def build_app(config: ServerConfig) -> FastAPI:
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

    @app.exception_handler(APIError)
    async def on_api_error(request, error: APIError):
        if error.status >= 500:
            logger.error("%s %s -> %d: %s", request.method, request.url.path, error.status, error.message)
        return error_json(error)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request, error: StarletteHTTPException):
        message = {404: f"no route {request.method} {request.url.path}", 405: f"{request.method} is not allowed "
                   f"on {request.url.path}"}.get(error.status_code, str(error.detail))
        return error_json(APIError(error.status_code, message))

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request, error: RequestValidationError):
        message, param = protocol.format_validation_error(error)
        return error_json(APIError(400, message, param=param))

    @app.exception_handler(Exception)
    async def on_bug(request, error: Exception):
        logger.exception("unhandled error on %s %s", request.method, request.url.path)
        return error_json(APIError(500, f"internal error: {type(error).__name__}: {error}"))

    # -- helpers ---------------------------------------------------------------------------------

    async def parse(raw: Request, model_cls):
        body = await raw.body()
        try:
            # pydantic's Rust parser (jiter), not json.loads: an image chat's body is megabytes of
            # base64 in one string, which json.loads took ~20 ms to copy out and jiter ~0.5 ms.
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
        check_model(req.model)
        return req

    async def admit(raw: Request, model_cls, prefix: str):
        """Every route that runs a request: the parsed body, the engine (or 503/429), an id."""
        req = await parse(raw, model_cls)
        return req, ready_engine(), new_request_id(raw, prefix)

    def check_generates() -> None:
        """Chat and completions need a generative model; a pooling one answers 400 naming its tasks."""
        try:
            config.engine.check_task(None)
        except ValueError as error:
            raise APIError(400, str(error)) from None

    def check_model(name: str | None) -> None:
        if name is not None and name not in (config.served_model_name, config.engine.model):
            raise APIError(404, f"The model `{name}` does not exist. This server serves "
                                f"`{config.served_model_name}`.", param="model")

    def ready_engine() -> AsyncEngine:
        if not service.started:
            raise APIError(503, "the service is starting", retry_after=5)
        service.engine.check_admission()
        return service.engine

    def new_request_id(raw: Request, prefix: str) -> str:
        given = raw.headers.get("x-request-id")
        return f"{prefix}-{given or uuid.uuid4().hex}-{uuid.uuid4().hex[:6]}" if given else f"{prefix}-{uuid.uuid4().hex}"

    async def prepare(engine: AsyncEngine, op: str, request_id: str, **fields):
        engine.num_preparing += 1
        try:
            return await service.pool.call(op, request_id=request_id, **fields)
        finally:
            engine.num_preparing -= 1

    def sampling_params(req, num_prompt_tokens: int, structured=None):
        """The request's SamplingParams and the field its structured-output constraint came from
        (None without one): context-window and KV-capacity checks, n's cap, bad words as token
        ids, ids checked against the vocabulary, and the constraint (the request's own, or
        ``structured`` = (params, field) a tool choice needs; ``check_grammar`` checks it)."""
        max_model_len = config.engine.max_model_len
        try:
            protocol.check_context_length(num_prompt_tokens, max_model_len, req.requested_max_tokens,
                                          max_input_tokens=config.max_input_tokens,
                                          max_tokens_param=req.max_tokens_param)
            params = req.to_sampling_params(max_model_len - num_prompt_tokens, service.generation_config)
            requested = req.structured_outputs_params()
        except ValueError as error:
            raise APIError(400, str(error), param=getattr(error, "param", None)) from None
        if params.n > config.max_parallel_samples:
            raise APIError(400, f"n={params.n} is above this server's limit of {config.max_parallel_samples} "
                                "parallel samples (--max-parallel-samples)", param="n")
        if requested is not None and structured is not None:
            raise APIError(400, f"{requested[1]} cannot be combined with tool_choice={json.dumps(req.tool_choice)}: "
                                "a forced tool call already constrains the output", param=requested[1])
        structured = structured or requested
        if structured is not None:
            params.structured_outputs = structured[0]
        if req.bad_words:
            params.bad_words_token_ids = bad_words_token_ids(req.bad_words)
        if req.echo and req.logprobs and isinstance(req, protocol.CompletionRequest):
            params.prompt_logprobs = params.logprobs  # echoed tokens get logprobs too (vLLM)
        check_vocabulary(params)
        capacity = service.max_tokens_per_request
        if num_prompt_tokens + (params.max_tokens or 0) > capacity:
            if req.requested_max_tokens is not None:
                raise APIError(400, f"the prompt ({num_prompt_tokens} tokens) plus max_tokens ({params.max_tokens}) "
                                    f"exceeds the {capacity} tokens the KV cache can hold for one request "
                                    "(--kv-cache-memory / --max-model-len); lower max_tokens", param="max_tokens")
            params.max_tokens = capacity - num_prompt_tokens
            if params.max_tokens < 1:
                raise APIError(400, f"the prompt ({num_prompt_tokens} tokens) fills the {capacity} tokens the KV "
                                    "cache can hold for one request", param="input_tokens")
        return params, None if structured is None else structured[1]

    async def check_grammar(params, field_name: str | None) -> None:
        """A bad schema, regex or grammar is the client's 400, found before the engine sees it.
        Off the event loop: the first check imports xgrammar (seconds), a large schema takes a
        while to compile."""
        if params.structured_outputs is None:
            return
        try:
            await asyncio.to_thread(structured_output.check, params.structured_outputs)
        except ValueError as error:
            raise APIError(400, f"{field_name}: {error}", param=field_name) from None

    def bad_words_token_ids(words: list[str]) -> list[list[int]]:
        """Each bad word as the tokens it is written with, alone and after a space (vLLM's two
        spellings: a word mid-sentence is usually tokenised with its leading space)."""
        sequences: list[list[int]] = []
        for word in words:
            for text in (word.lstrip(), " " + word.lstrip()):
                ids = service.tokenizer.encode(text, add_special_tokens=False)
                if ids and ids not in sequences:
                    sequences.append(ids)
        return sequences

    def check_vocabulary(params) -> None:
        try:
            params.check_vocabulary(config.engine.vocab_size)
        except ValueError as error:
            raise APIError(400, str(error), param=str(error).split()[0]) from None

    async def run(raw: Request, engine: AsyncEngine, request_id: str, ids, params, worker, instance):
        """Every choice's last output, in index order; a client that goes away while waiting
        aborts the request."""
        async def last_outputs():
            latest: dict[int, RequestOutput] = {}
            async for index, output in engine.generate_choices(request_id, ids, params, worker, instance):
                latest[index] = output
            return [latest[i] for i in sorted(latest)]

        consume = asyncio.ensure_future(last_outputs())
        try:
            while not consume.done():
                await asyncio.wait({consume}, timeout=0.25)
                if not consume.done() and await raw.is_disconnected():
                    consume.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await consume
                    # Nobody reads this answer; the request is already aborted in the core.
                    raise APIError(400, "the client disconnected before the answer was ready")
            return consume.result()
        finally:
            consume.cancel()  # a no-op once done; stops the consumer if this handler was cancelled

    token_text = lambda token_id: service.tokenizer.decode([token_id])  # noqa: E731

    # -- routes ----------------------------------------------------------------------------------

    @app.get("/health")
    async def health():
        if not service.healthy:
            reason = service.engine.dead_reason if service.engine and service.engine.dead_reason else "not ready"
            return error_json(APIError(503, f"unhealthy: {reason}"))
        return Response(status_code=200)

    @app.get("/version")
    async def version():
        return {"version": VERSION}

    @app.get("/v1/models")
    async def models():
        card = protocol.ModelCard(id=config.served_model_name, root=config.engine.model,
                                  max_model_len=config.engine.max_model_len)
        return JSONResponse(protocol.ModelList(data=[card]).model_dump(exclude_none=True))

    @app.get("/metrics")
    async def metrics(raw: Request):
        if service.started:
            try:
                stats = await asyncio.wait_for(service.pool.stats(), 2.0)
                service.metrics.set_shm(stats["segments"], stats["bytes"], stats["leased_segments"])
            except asyncio.TimeoutError:
                pass
            service.metrics.set_tokenizer_queue_depth(service.pool.queue_depth)
        body, content_type = service.metrics.render(raw.headers.get("accept"))
        return Response(body, media_type=content_type)

    async def respond(raw: Request, req, engine: AsyncEngine, make_dialect, request_id: str, ids, worker, instance,
                      structured=None):
        """Run a prepared request and answer in the route's dialect (``make_dialect(n)``): one
        JSON body, or SSE."""
        try:
            params, structured_field = sampling_params(req, len(ids), structured)
            await check_grammar(params, structured_field)
        except APIError:
            if worker is not None:
                service.pool.release(worker, request_id)
            raise
        worker = 0 if worker is None else worker  # a token-id prompt holds no segments: releasing is a no-op
        dialect = make_dialect(params.n)
        if not req.stream:
            outputs = await run(raw, engine, request_id, ids, params, worker, instance)
            failed = next((o for o in outputs if o.outputs[0].finish_reason == "error"), None)
            if failed is not None:
                raise APIError(500, f"the request failed: {failed.error}")
            return JSONResponse(dialect.response(outputs).model_dump(exclude_none=True))
        choices = engine.generate_choices(request_id, ids, params, worker, instance)

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

        return StreamingResponse(sse(events(), choices), media_type="text/event-stream")

    def chat_options(req: protocol.ChatCompletionRequest) -> tuple[ChatOptions, Any]:
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

    @app.post("/v1/chat/completions")
    async def chat_completions(raw: Request):
        req, engine, request_id = await admit(raw, protocol.ChatCompletionRequest, "chatcmpl")
        check_generates()
        options, structured = chat_options(req)
        worker, instance, ids = await prepare(engine, "chat", request_id, messages=req.to_conversation(),
                                              add_generation_prompt=req.add_generation_prompt,
                                              chat_template_kwargs=req.chat_template_kwargs, tools=options.tools)
        make_dialect = lambda n: ChatDialect(request_id, config.served_model_name, token_text, n, options)  # noqa: E731
        return await respond(raw, req, engine, make_dialect, request_id, ids, worker, instance, structured)

    @app.post("/v1/completions")
    async def completions(raw: Request):
        req, engine, request_id = await admit(raw, protocol.CompletionRequest, "cmpl")
        check_generates()
        if isinstance(req.prompt, list):
            try:
                ids = validate_client_token_ids(req.prompt, config.engine.vocab_size)
            except ValueError as error:
                raise APIError(400, str(error), param="prompt") from None
            worker, instance = None, None
        else:
            worker, instance, ids = await prepare(engine, "prompt", request_id, prompt=req.prompt,
                                                  add_special_tokens=req.add_special_tokens)
        echo = None
        if req.echo:
            echo = req.prompt if isinstance(req.prompt, str) else service.tokenizer.decode(ids)
        make_dialect = lambda n: CompletionDialect(request_id, config.served_model_name, token_text, n, echo)  # noqa: E731
        return await respond(raw, req, engine, make_dialect, request_id, ids, worker, instance)

    @app.post("/tokenize")
    async def tokenize(raw: Request):
        req, engine, request_id = await admit(raw, protocol.TokenizeRequest, "tokenize")
        if req.is_chat:
            _, _, ids = await prepare(engine, "chat", request_id, messages=req.to_conversation(),
                                      add_generation_prompt=req.add_generation_prompt,
                                      chat_template_kwargs=req.chat_template_kwargs, release_now=True)
        else:
            _, _, ids = await prepare(engine, "prompt", request_id, prompt=req.prompt,
                                      add_special_tokens=req.effective_add_special_tokens, release_now=True)
        strs = service.tokenizer.convert_ids_to_tokens([max(t, 0) for t in ids]) if req.return_token_strs else None
        return protocol.TokenizeResponse(count=len(ids), max_model_len=config.engine.max_model_len, tokens=ids,
                                         token_strs=strs).model_dump(exclude_none=True)

    @app.post("/detokenize")
    async def detokenize(raw: Request):
        req = await parse(raw, protocol.DetokenizeRequest)
        try:
            ids = validate_client_token_ids(req.tokens, config.engine.vocab_size) if req.tokens else []
        except ValueError as error:
            raise APIError(400, str(error), param="tokens") from None
        return {"prompt": service.tokenizer.decode(ids)}

    add_pooling_routes(app, service, admit, prepare)
    return app


async def sse(events: AsyncIterator[dict], generator) -> AsyncIterator[str]:
    """Server-sent events in OpenAI's framing; an error after the stream began is sent as an
    ``{"error": ...}`` event (the status line is already out), then ``[DONE]``."""
    try:
        async for event in events:
            yield f"data: {json.dumps(event, ensure_ascii=False)}\n\n"
    except APIError as error:
        yield f"data: {json.dumps(error.body())}\n\n"
    except Exception as error:  # noqa: BLE001 - our bug, reported in-band as a 500
        logger.exception("stream failed")
        yield f"data: {json.dumps(APIError(500, f'internal error: {error}').body())}\n\n"
    finally:
        await generator.aclose()  # a client gone mid-stream: aborts the request in the core
    yield "data: [DONE]\n\n"
