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
import time
import uuid
from collections.abc import AsyncIterator

import pydantic
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from atb_plugin.engine.llm import validate_client_token_ids
from atb_plugin.engine.output_processor import RequestOutput
from atb_plugin.server import protocol
from atb_plugin.server.async_engine import AsyncEngine
from atb_plugin.server.config import ServerConfig
from atb_plugin.server.engine_client import EngineClient
from atb_plugin.server.errors import APIError
from atb_plugin.server.metrics import ServerMetrics
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
        await asyncio.gather(self.engine_client.start(), self.pool.start())
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
        await service.start()
        try:
            yield
        finally:
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
            data = json.loads(body)
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            raise APIError(400, f"the body is not valid JSON: {error}") from None
        except RecursionError:
            raise APIError(400, "the body's JSON is nested too deeply") from None
        if not isinstance(data, dict):
            raise APIError(400, f"the body must be a JSON object, got {type(data).__name__}")
        if _SURROGATE_ESCAPE.search(body):
            # JSON may spell an unpaired UTF-16 surrogate ("\ud800"); it is no character, and no
            # tokenizer or encoder downstream can take it. (Paired ones decode to real characters.)
            try:
                json.dumps(data, ensure_ascii=False).encode("utf-8")
            except UnicodeEncodeError:
                raise APIError(400, "the body holds an unpaired UTF-16 surrogate escape (such as \\ud800), "
                                    "which is not a character") from None
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

    def sampling_params(req, num_prompt_tokens: int):
        max_model_len = config.engine.max_model_len
        try:
            protocol.check_context_length(num_prompt_tokens, max_model_len, req.requested_max_tokens,
                                          max_input_tokens=config.max_input_tokens,
                                          max_tokens_param=req.max_tokens_param)
            params = req.to_sampling_params(max_model_len - num_prompt_tokens, service.generation_config)
        except ValueError as error:
            raise APIError(400, str(error), param=getattr(error, "param", None)) from None
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
        return params

    async def run(raw: Request, engine: AsyncEngine, request_id: str, ids, params, worker, instance, stream: bool):
        """The request's outputs; for a non-stream request only the last, and a client that goes
        away while waiting aborts it."""
        generator = engine.generate(request_id, ids, params, worker, instance)
        if stream:
            return generator
        consume = asyncio.ensure_future(_last(generator))
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

    def usage(output: RequestOutput) -> protocol.UsageInfo:
        return protocol.UsageInfo.from_counts(len(output.prompt_token_ids), len(output.outputs[0].token_ids),
                                              output.num_cached_tokens or None)

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

    async def respond(raw: Request, req, engine: AsyncEngine, dialect, request_id: str, ids, worker, instance):
        """Run a prepared request and answer in the route's dialect: one JSON body, or SSE."""
        try:
            params = sampling_params(req, len(ids))
        except APIError:
            if worker is not None:
                service.pool.release(worker, request_id)
            raise
        worker = 0 if worker is None else worker  # a token-id prompt holds no segments: releasing is a no-op
        if not req.stream:
            output = await run(raw, engine, request_id, ids, params, worker, instance, False)
            if output.outputs[0].finish_reason == "error":
                raise APIError(500, f"the request failed: {output.error}")
            return JSONResponse(dialect.response(output, usage(output)).model_dump(exclude_none=True))
        generator = await run(raw, engine, request_id, ids, params, worker, instance, True)

        async def events():
            first = dialect.first_chunk()
            if first is not None:
                yield first.model_dump(exclude_none=True)
            async for output in generator:
                completion = output.outputs[0]
                if completion.finish_reason == "error":
                    raise APIError(500, f"the request failed: {output.error}")
                if completion.delta_text or completion.finish_reason or completion.delta_logprobs:
                    chunk = dialect.delta_chunk(output, usage(output) if req.continuous_usage_stats else None)
                    yield chunk.model_dump(exclude_none=True)
                if output.finished and req.include_usage:
                    yield dialect.usage_chunk(usage(output)).model_dump(exclude_none=True)

        return StreamingResponse(sse(events(), generator), media_type="text/event-stream")

    @app.post("/v1/chat/completions")
    async def chat_completions(raw: Request):
        req, engine, request_id = await admit(raw, protocol.ChatCompletionRequest, "chatcmpl")
        check_generates()
        worker, instance, ids = await prepare(engine, "chat", request_id, messages=req.to_conversation(),
                                              add_generation_prompt=req.add_generation_prompt,
                                              chat_template_kwargs=req.chat_template_kwargs)
        dialect = ChatDialect(request_id, config.served_model_name, token_text)
        return await respond(raw, req, engine, dialect, request_id, ids, worker, instance)

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
        dialect = CompletionDialect(request_id, config.served_model_name, token_text)
        return await respond(raw, req, engine, dialect, request_id, ids, worker, instance)

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


class ChatDialect:
    """How /v1/chat/completions shapes a request's outputs (a role chunk first, then deltas)."""

    def __init__(self, request_id: str, model: str, token_text):
        self.request_id, self.model, self.token_text = request_id, model, token_text
        self.created = int(time.time())

    def _logprobs(self, entries):
        return protocol.chat_logprobs(entries, self.token_text) if entries is not None else None

    def response(self, output: RequestOutput, usage_info) -> protocol.ChatCompletionResponse:
        completion = output.outputs[0]
        choice = protocol.ChatCompletionResponseChoice(
            index=0, message=protocol.ChatMessage(role="assistant", content=completion.text),
            logprobs=self._logprobs(completion.logprobs), finish_reason=completion.finish_reason)
        return protocol.ChatCompletionResponse(id=self.request_id, created=self.created, model=self.model,
                                               choices=[choice], usage=usage_info)

    def _chunk(self, choices, usage_info=None) -> protocol.ChatCompletionStreamResponse:
        return protocol.ChatCompletionStreamResponse(id=self.request_id, created=self.created, model=self.model,
                                                     choices=choices, usage=usage_info)

    def first_chunk(self):
        return self._chunk([protocol.ChatCompletionResponseStreamChoice(
            index=0, delta=protocol.DeltaMessage(role="assistant", content=""))])

    def delta_chunk(self, output: RequestOutput, usage_info):
        completion = output.outputs[0]
        return self._chunk([protocol.ChatCompletionResponseStreamChoice(
            index=0, delta=protocol.DeltaMessage(content=completion.delta_text),
            logprobs=self._logprobs(completion.delta_logprobs), finish_reason=completion.finish_reason)], usage_info)

    def usage_chunk(self, usage_info):
        return self._chunk([], usage_info)


class CompletionDialect(ChatDialect):
    """How /v1/completions shapes them (text deltas; logprobs with text offsets)."""

    def __init__(self, request_id: str, model: str, token_text):
        super().__init__(request_id, model, token_text)
        self._offset = 0  # text already streamed: the next logprobs' text_offset starts here

    def _completion_logprobs(self, entries, offset: int = 0):
        return protocol.completion_logprobs(entries, self.token_text, offset) if entries is not None else None

    def response(self, output: RequestOutput, usage_info) -> protocol.CompletionResponse:
        completion = output.outputs[0]
        choice = protocol.CompletionResponseChoice(index=0, text=completion.text,
                                                   finish_reason=completion.finish_reason,
                                                   logprobs=self._completion_logprobs(completion.logprobs))
        return protocol.CompletionResponse(id=self.request_id, created=self.created, model=self.model,
                                           choices=[choice], usage=usage_info)

    def _chunk(self, choices, usage_info=None) -> protocol.CompletionStreamResponse:
        return protocol.CompletionStreamResponse(id=self.request_id, created=self.created, model=self.model,
                                                 choices=choices, usage=usage_info)

    def first_chunk(self):
        return None

    def delta_chunk(self, output: RequestOutput, usage_info):
        completion = output.outputs[0]
        logprobs = self._completion_logprobs(completion.delta_logprobs, self._offset)
        self._offset += len(completion.delta_text)
        return self._chunk([protocol.CompletionResponseStreamChoice(
            index=0, text=completion.delta_text, logprobs=logprobs, finish_reason=completion.finish_reason)],
            usage_info)


async def _last(generator: AsyncIterator[RequestOutput]) -> RequestOutput:
    last = None
    async for output in generator:
        last = output
    return last


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
