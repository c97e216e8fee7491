"""The pooling endpoints (vLLM's routes and shapes) on top of ``AsyncEngine.encode``.

    POST /v1/embeddings            task embed        -> one vector per input (float or base64)
    POST /pooling                  any served task   -> the raw tensor per input
    POST /classify                 task classify     -> probabilities + the argmax's label
    POST /score, /v1/score         text_1 x text_2   -> one score per pair
    POST /rerank, /v1/rerank, /v2/rerank  query x documents -> scores, best first, top_n

A request flows: parse (pydantic, ``pooling_protocol``) -> ``PoolingParams`` checked against what
the model serves (``EngineConfig.check_task``: 400 naming its tasks) -> texts tokenised in a
tokenizer worker (one job for all of a request's inputs; truncation and the max_model_len check
are ``atb_plugin.pooling.inputs``') -> one engine request per input, run concurrently, results in
input order; one failing or the client leaving aborts the rest.

Scores: a cross-encoder (a model serving "score") reads each pair together; an embedding model
scores by the cosine similarity of the two embeddings (``LLM.score``'s rule).
"""

from __future__ import annotations

import asyncio
import base64

import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from atb_plugin.engine.llm import validate_client_token_ids
from atb_plugin.pooling import inputs as pooling_inputs
from atb_plugin.pooling.outputs import cosine_similarity
from atb_plugin.pooling.params import PoolingParams
from atb_plugin.server import pooling_protocol as pp
from atb_plugin.server.async_engine import AsyncEngine
from atb_plugin.server.errors import APIError
from atb_plugin.server.protocol import UsageInfo

__all__ = ["add_pooling_routes", "PoolingRoutes"]

# How often a waiting request checks whether its client is still there.
_DISCONNECT_POLL_S = 0.25


def add_pooling_routes(app: FastAPI, service, admit, prepare) -> "PoolingRoutes":
    """Register the pooling routes. ``admit(raw, model_cls, prefix)`` and ``prepare(engine, op,
    request_id, **job)`` are the API server's own helpers (parse + auth'd model check +
    admission; a tokenizer-worker job)."""
    routes = PoolingRoutes(service, admit, prepare)
    app.post("/v1/embeddings")(routes.embeddings)
    app.post("/pooling")(routes.pooling)
    app.post("/classify")(routes.classify)
    for path in ("/score", "/v1/score"):
        app.post(path)(routes.score)
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        app.post(path)(routes.rerank)
    return routes


def encode_array(array: np.ndarray, encoding_format: str):
    """``float``: nested lists; ``base64``: the float32 little-endian bytes, as OpenAI and vLLM send."""
    if encoding_format == "base64":
        return base64.b64encode(np.ascontiguousarray(array, dtype="<f4").tobytes()).decode("ascii")
    return array.tolist()


def _usage(ids: list[list[int]]) -> UsageInfo:
    tokens = sum(len(i) for i in ids)
    return UsageInfo(prompt_tokens=tokens, total_tokens=tokens)


class PoolingRoutes:
    def __init__(self, service, admit, prepare):
        self.service = service
        self.engine_config = service.config.engine
        self.model_name = service.config.served_model_name
        self.admit, self.prepare = admit, prepare
        # Class names for /classify, as transformers saves them (id2label); LABEL_i without them.
        id2label = self.engine_config.checkpoint_config().get("id2label") or {}
        self.id2label = {int(k): str(v) for k, v in id2label.items() if str(k).lstrip("-").isdigit()}

    # -- shared steps ----------------------------------------------------------------------------

    def params(self, task: str, **fields) -> PoolingParams:
        """The request's PoolingParams, refused (400) unless the model serves them."""
        try:
            params = PoolingParams(task, **{k: v for k, v in fields.items() if v is not None})
            self.engine_config.check_task(params)
        except ValueError as error:
            raise APIError(400, str(error)) from None
        return params

    def truncate_to(self, truncate_prompt_tokens: int | None) -> int | None:
        try:
            return pooling_inputs.truncation_length(truncate_prompt_tokens, self.engine_config.max_model_len)
        except ValueError as error:
            raise APIError(400, str(error), param="truncate_prompt_tokens") from None

    def check_capacity(self, ids: list[list[int]]) -> None:
        capacity = self.service.max_tokens_per_request
        longest = max(len(i) for i in ids)
        if longest > capacity:
            raise APIError(400, f"an input has {longest} tokens; the KV cache holds at most {capacity} tokens per "
                                "request (--kv-cache-memory); shorten it or set truncate_prompt_tokens")

    async def prompt_ids(self, engine: AsyncEngine, request_id: str, prompts: list, truncate_to: int | None,
                         label: str = "input") -> list[list[int]]:
        """Token ids of each prompt: texts tokenised in a worker (one job for all of them), a
        client's token ids checked here (no tokenizer needed). ``normalize_inputs`` made them all
        texts or all ids."""
        max_model_len = self.engine_config.max_model_len
        if isinstance(prompts[0], str):
            _, _, ids = await self.prepare(engine, "pool", request_id, items=prompts, max_model_len=max_model_len,
                                           truncate_to=truncate_to, label=label)
            return ids
        result = []
        for i, prompt in enumerate(prompts):
            try:
                ids = validate_client_token_ids(prompt, self.engine_config.vocab_size)
                result.append(pooling_inputs.token_ids(ids, max_model_len, truncate_to))
            except ValueError as error:
                raise APIError(400, f"{label}[{i}]: {error}" if len(prompts) > 1 else str(error), param=label) from None
        return result

    async def pool_prompts(self, raw: Request, engine: AsyncEngine, request_id: str, req,
                           params: PoolingParams) -> tuple[list[list[int]], list[np.ndarray]]:
        """The request's ``prompts`` (truncated as it asks), each pooled on its own: their ids and
        tensors, in input order (/v1/embeddings, /pooling, /classify)."""
        ids = await self.prompt_ids(engine, request_id, req.prompts, self.truncate_to(req.truncate_prompt_tokens))
        return ids, await self.run(raw, engine, request_id, [(i, None) for i in ids], params)

    async def run(self, raw: Request, engine: AsyncEngine, request_id: str, prompts: list[tuple[list[int], int | None]],
                  params: PoolingParams) -> list[np.ndarray]:
        """Each ``(ids, token_type_start)`` as its own engine request, all at once; their tensors
        in input order. One failing, the client leaving, or this handler being cancelled aborts
        the others (each ``encode`` aborts its request in the core when cancelled)."""
        self.check_capacity([ids for ids, _ in prompts])
        limit = engine.max_queued_requests
        if len(prompts) > limit:
            raise APIError(400, f"the request has {len(prompts)} inputs; the server runs at most {limit} at once "
                                "(--max-queued-requests): split it into smaller requests")
        engine.check_admission(len(prompts))  # its inputs count one each, as they run
        tasks = [asyncio.ensure_future(engine.encode(f"{request_id}-{i}", ids, params, None, token_type_start))
                 for i, (ids, token_type_start) in enumerate(prompts)]
        try:
            pending = set(tasks)
            while pending:
                done, pending = await asyncio.wait(pending, timeout=_DISCONNECT_POLL_S,
                                                   return_when=asyncio.FIRST_EXCEPTION)
                for task in done:
                    if task.exception() is not None:
                        raise task.exception()
                if pending and await raw.is_disconnected():
                    # Nobody reads this answer; the finally below aborts what still runs.
                    raise APIError(400, "the client disconnected before the answer was ready")
            return [self._data(task.result()) for task in tasks]
        finally:
            for task in tasks:
                if not task.done():
                    task.cancel()
                    # Retrieve its outcome, so a late failure is not logged as "never retrieved".
                    task.add_done_callback(lambda t: t.cancelled() or t.exception())

    @staticmethod
    def _data(output) -> np.ndarray:
        if output.outputs.data is not None:
            return output.outputs.data
        if output.finish_reason == "abort":
            raise APIError(503, "the request was aborted (the service is shutting down); retry it", retry_after=5)
        raise APIError(500, f"the request failed: {output.error or output.finish_reason}")

    def respond(self, response) -> JSONResponse:
        return JSONResponse(response.model_dump(exclude_none=True))

    # -- routes ----------------------------------------------------------------------------------

    async def embeddings(self, raw: Request):
        req, engine, request_id = await self.admit(raw, pp.EmbeddingRequest, "embd")
        params = self.params("embed", dimensions=req.dimensions, normalize=req.normalize)
        ids, arrays = await self.pool_prompts(raw, engine, request_id, req, params)
        data = [pp.EmbeddingResponseData(index=i, embedding=encode_array(a, req.encoding_format))
                for i, a in enumerate(arrays)]
        return self.respond(pp.EmbeddingResponse(id=request_id, model=self.model_name, data=data, usage=_usage(ids)))

    async def pooling(self, raw: Request):
        req, engine, request_id = await self.admit(raw, pp.PoolingRequest, "pool")
        # No task: the model's first (as LLM.encode); on a generative model "embed", so that the
        # answer is check_task's "this is a generative model".
        default = self.engine_config.tasks[0] if self.engine_config.runner == "pooling" else "embed"
        params = self.params(req.task or default, dimensions=req.dimensions, normalize=req.normalize,
                             activation=req.activation)
        ids, arrays = await self.pool_prompts(raw, engine, request_id, req, params)
        data = [pp.PoolingResponseData(index=i, data=encode_array(a, req.encoding_format))
                for i, a in enumerate(arrays)]
        return self.respond(pp.PoolingResponse(id=request_id, model=self.model_name, data=data, usage=_usage(ids)))

    async def classify(self, raw: Request):
        req, engine, request_id = await self.admit(raw, pp.ClassificationRequest, "classify")
        params = self.params("classify", activation=req.activation)
        ids, arrays = await self.pool_prompts(raw, engine, request_id, req, params)
        data = []
        for i, probs in enumerate(arrays):
            best = int(np.argmax(probs))
            data.append(pp.ClassificationData(index=i, label=self.id2label.get(best, f"LABEL_{best}"),
                                              probs=probs.tolist(), num_classes=len(probs)))
        return self.respond(pp.ClassificationResponse(id=request_id, model=self.model_name, data=data,
                                                      usage=_usage(ids)))

    async def score(self, raw: Request):
        req, engine, request_id = await self.admit(raw, pp.ScoreRequest, "score")
        scores, num_tokens = await self.scores(raw, engine, request_id, req.text_1, req.text_2,
                                               req.truncate_prompt_tokens, req.activation, ("text_1", "text_2"))
        data = [pp.ScoreResponseData(index=i, score=s) for i, s in enumerate(scores)]
        return self.respond(pp.ScoreResponse(id=request_id, model=self.model_name, data=data,
                                             usage=UsageInfo(prompt_tokens=num_tokens, total_tokens=num_tokens)))

    async def rerank(self, raw: Request):
        req, engine, request_id = await self.admit(raw, pp.RerankRequest, "rerank")
        scores, num_tokens = await self.scores(raw, engine, request_id, [req.query], req.documents,
                                               req.truncate_prompt_tokens, req.activation, ("query", "documents"))
        order = sorted(range(len(scores)), key=lambda i: -scores[i])  # stable: ties keep document order
        results = [pp.RerankResult(index=i, relevance_score=scores[i],
                                   document=pp.RerankDocument(text=req.documents[i]) if req.return_documents else None)
                   for i in order[:req.top_n or len(order)]]
        return self.respond(pp.RerankResponse(id=request_id, model=self.model_name,
                                              usage=pp.RerankUsage(total_tokens=num_tokens), results=results))

    # -- scoring ---------------------------------------------------------------------------------

    async def scores(self, raw: Request, engine: AsyncEngine, request_id: str, first: list[str], second: list[str],
                     truncate_prompt_tokens: int | None, activation: bool | None,
                     names: tuple[str, str]) -> tuple[list[float], int]:
        """One score per pair of ``first`` (one text, or as many as ``second``) and ``second``,
        and the tokens read. ``names``: the two sides' fields, for error messages (a pair is
        named by its second text's index)."""
        tasks = self.engine_config.tasks
        if "score" in tasks:
            return await self._cross_encoder_scores(raw, engine, request_id, first, second, truncate_prompt_tokens,
                                                    activation, names[1])
        if "embed" in tasks:
            if activation is not None:
                raise APIError(400, f"{self.engine_config.model} is an embedding model: it scores by cosine "
                                    "similarity, which has no activation; leave activation out", param="activation")
            return await self._embedding_scores(raw, engine, request_id, first, second, truncate_prompt_tokens, names)
        self.params("score")  # refuses, naming what the model serves
        raise AssertionError("unreachable: check_task accepted a task the model does not serve")

    async def _cross_encoder_scores(self, raw, engine, request_id, first, second, truncate_prompt_tokens, activation,
                                    label):
        params = self.params("score", activation=activation)
        truncate_to = self.truncate_to(truncate_prompt_tokens)
        pairs = [list(pair) for pair in pooling_inputs.score_pairs(first, second)]  # validated by the request
        _, _, encoded = await self.prepare(engine, "pair", request_id, items=pairs,
                                           max_model_len=self.engine_config.max_model_len, truncate_to=truncate_to,
                                           label=label)
        arrays = await self.run(raw, engine, request_id, [(ids, start) for ids, start in encoded], params)
        if arrays[0].shape != (1,):
            raise APIError(400, f"{self.engine_config.model} has {arrays[0].shape[-1]} labels; scores need a "
                                "one-label cross-encoder (use /classify for its class probabilities)")
        return [float(a[0]) for a in arrays], sum(len(ids) for ids, _ in encoded)

    async def _embedding_scores(self, raw, engine, request_id, first, second, truncate_prompt_tokens, names):
        params = self.params("embed")
        truncate_to = self.truncate_to(truncate_prompt_tokens)
        # Each distinct side once: 1 -> N embeds the query a single time.
        ids_1 = await self.prompt_ids(engine, request_id, first, truncate_to, names[0])
        ids_2 = await self.prompt_ids(engine, request_id, second, truncate_to, names[1])
        arrays = await self.run(raw, engine, request_id, [(i, None) for i in ids_1 + ids_2], params)
        left, right = arrays[:len(ids_1)], arrays[len(ids_1):]
        if len(left) == 1:
            left = left * len(right)
        return [cosine_similarity(u, v) for u, v in zip(left, right)], sum(len(i) for i in ids_1 + ids_2)

