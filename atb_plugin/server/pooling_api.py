"""The pooling endpoints (vLLM's routes and shapes) on top of ``AsyncLLM.encode``.

    POST /v1/embeddings            task embed        -> one vector per input (float or base64)
    POST /pooling                  any served task   -> the raw tensor per input
    POST /classify                 task classify     -> probabilities + the argmax's label
    POST /score, /v1/score         text_1 x text_2   -> one score per pair
    POST /rerank, /v1/rerank, /v2/rerank  query x documents -> scores, best first, top_n

A request flows: parse (pydantic, ``pooling_protocol``) -> ``PoolingParams`` checked against what
the model serves (``InputProcessor.pooling_params``: 400 naming its tasks) -> texts tokenised in
a tokenizer worker (one job for all of a request's inputs: ``InputProcessor.pooling_ids``, the
offline ``LLM``'s too) -> one engine request per input, at most ``pooling_window`` of them in
flight at once, results in input order; one failing or the client leaving aborts the rest. A
client that leaves while its texts wait for (or are in) a tokenizer worker drops the job there
(``http.until_answered``, as the generate routes do: counted as an abort).

A request takes at most --max-pooling-inputs inputs (2048, OpenAI's limit for /v1/embeddings;
for /score and /rerank the pairs: text_2 / documents), refused with a 400 before anything is
tokenised. The tokenisation stays one job however many inputs: the body limit
(--max-request-body-bytes) bounds its size, and one job is one round trip.

Scores: ``InputProcessor.score_mode`` (``LLM.score``'s rule too): a cross-encoder (a model
serving "score") reads each pair together; an embedding model scores by the cosine similarity
of the two embeddings.
"""

from __future__ import annotations

import asyncio
import base64

import numpy as np
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from atb_plugin.frontend.async_llm import AsyncLLM
from atb_plugin.frontend.errors import RequestError
from atb_plugin.frontend.input_processor import PreparedPrompt, pooled_data
from atb_plugin.pooling import inputs as pooling_inputs
from atb_plugin.pooling.outputs import cosine_similarity
from atb_plugin.pooling.params import PoolingParams
from atb_plugin.server import pooling_protocol as pp
from atb_plugin.server.errors import APIError
from atb_plugin.server.http import DISCONNECT_POLL_S, admit, service_of, until_answered
from atb_plugin.server.protocol import UsageInfo

__all__ = ["pooling_routes", "encode_array", "pooling_window", "run_all"]

pooling_routes = APIRouter()


def encode_array(array: np.ndarray, encoding_format: str):
    """``float``: nested lists; ``base64``: the float32 little-endian bytes, as OpenAI and vLLM send."""
    if encoding_format == "base64":
        return base64.b64encode(np.ascontiguousarray(array, dtype="<f4").tobytes()).decode("ascii")
    return array.tolist()


def _usage(ids: list[list[int]]) -> UsageInfo:
    tokens = sum(len(i) for i in ids)
    return UsageInfo(prompt_tokens=tokens, total_tokens=tokens)


def _respond(response) -> JSONResponse:
    return JSONResponse(response.model_dump(exclude_none=True))


# -- shared steps ------------------------------------------------------------------------------------


def pooling_window(llm: AsyncLLM) -> int:
    """How many of one request's inputs are in flight at once (``run_all``).

    Two engine steps' worth, 2 x --max-num-seqs: while the core runs one step of them the next
    is already waiting there, so a large batch keeps the engine busy (with one step's worth the
    core would idle while each step's results travel back and the next inputs come in); and a
    request another client sends meanwhile, queued first come first served, waits behind at most
    one step of ours rather than behind the whole batch. At most half of --max-queued-requests:
    one large request leaves the other half of the queue to other clients instead of filling it
    (their 429s). At least 1."""
    return max(1, min(2 * llm.processor.config.max_num_seqs, llm.max_queued_requests // 2))


def _room(llm: AsyncLLM, wanted: int) -> int:
    """How many of ``wanted`` more engine requests the queue takes now without a 429 (other
    errors, a 503 for a dead engine, are raised)."""
    granted = 0
    while granted < wanted:
        try:
            llm.check_admission(granted + 1)
        except RequestError as error:
            if error.status != 429:
                raise
            break
        granted += 1
    return granted


_ROOM_POLL_S = 0.02  # how often a request with nothing in flight looks for room in a full queue


async def run_all(raw: Request, llm: AsyncLLM, request_id: str, prompts: list[tuple[list[int], int | None]],
                  params: PoolingParams) -> list[np.ndarray]:
    """Each ``(ids, token_type_start)`` as its own engine request, at most ``pooling_window``
    at once (a sliding window: one starts as another finishes); their tensors in input order.
    The first window is admitted whole (a 429 before anything ran when it does not fit); each
    later input takes a free place in the queue, and when other clients' requests hold them all
    it waits for one rather than failing half done. One failing, the client leaving, or this
    handler being cancelled aborts the others (each ``encode`` aborts its request in the core
    when cancelled; those not yet started never start). The number of inputs is the route's
    to limit (--max-pooling-inputs)."""
    llm.processor.check_pooling_prompts([ids for ids, _ in prompts])
    window = pooling_window(llm)
    tasks: list[asyncio.Future] = []

    def start(count: int) -> None:
        for _ in range(count):
            i = len(tasks)
            ids, token_type_start = prompts[i]
            tasks.append(asyncio.ensure_future(
                llm.encode(f"{request_id}-{i}", PreparedPrompt(ids, token_type_start=token_type_start), params)))
            pending.add(tasks[-1])

    loop = asyncio.get_running_loop()
    pending: set[asyncio.Future] = set()
    first = min(window, len(prompts))
    llm.check_admission(first)  # its inputs count one each, as they run
    start(first)
    next_poll = loop.time() + DISCONNECT_POLL_S
    try:
        while pending or len(tasks) < len(prompts):
            if pending:
                done, pending = await asyncio.wait(pending, timeout=max(0.0, next_poll - loop.time()),
                                                   return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    if task.exception() is not None:
                        raise task.exception()
                poll_due = not done or loop.time() >= next_poll
            else:
                await asyncio.sleep(_ROOM_POLL_S)  # the queue is full of other clients' requests
                poll_due = loop.time() >= next_poll
            # Those started before have reached the tracker (they ran while we waited), so the
            # queue's count includes them.
            start(_room(llm, min(window - len(pending), len(prompts) - len(tasks))))
            if poll_due and (pending or len(tasks) < len(prompts)):
                next_poll = loop.time() + DISCONNECT_POLL_S
                if await raw.is_disconnected():
                    # Nobody reads this answer; the finally below aborts what still runs.
                    raise APIError(400, "the client disconnected before the answer was ready")
        return [pooled_data(task.result()) for task in tasks]
    finally:
        for task in tasks:
            if not task.done():
                task.cancel()
                # Retrieve its outcome, so a late failure is not logged as "never retrieved".
                task.add_done_callback(lambda t: t.cancelled() or t.exception())


def _check_count(raw: Request, llm: AsyncLLM, count: int, label: str) -> None:
    """At most --max-pooling-inputs inputs (or scored pairs), before any is tokenised."""
    llm.processor.check_pooling_count(count, service_of(raw).config.max_pooling_inputs, label)


async def pool_prompts(raw: Request, llm: AsyncLLM, request_id: str, req,
                       params: PoolingParams) -> tuple[list[list[int]], list[np.ndarray]]:
    """The request's ``prompts`` (truncated as it asks), each pooled on its own: their ids and
    tensors, in input order (/v1/embeddings, /pooling, /classify)."""
    _check_count(raw, llm, len(req.prompts), "input")
    ids = await until_answered(raw, llm.pooling_ids(request_id, req.prompts,
                                                    llm.processor.truncation(req.truncate_prompt_tokens)))
    return ids, await run_all(raw, llm, request_id, [(i, None) for i in ids], params)


async def scores(raw: Request, llm: AsyncLLM, request_id: str, first: list[str], second: list[str],
                 truncate_prompt_tokens: int | None, activation: bool | None,
                 names: tuple[str, str]) -> tuple[list[float], int]:
    """One score per pair of ``first`` (one text, or as many as ``second``) and ``second``,
    and the tokens read. ``names``: the two sides' fields, for error messages (a pair is
    named by its second text's index)."""
    processor = llm.processor
    mode, params = processor.score_mode(activation)
    _check_count(raw, llm, len(second), names[1])  # one pair per second text
    truncate_to = processor.truncation(truncate_prompt_tokens)
    if mode == "pair":
        pairs = pooling_inputs.score_pairs(first, second)  # the request validated the shapes
        encoded = await until_answered(raw, llm.pair_ids(request_id, pairs, truncate_to, names[1]))
        arrays = await run_all(raw, llm, request_id, encoded, params)
        if arrays[0].shape != (1,):
            raise APIError(400, f"{processor.config.model} has {arrays[0].shape[-1]} labels; scores need a "
                                "one-label cross-encoder (use /classify for its class probabilities)")
        return [float(a[0]) for a in arrays], sum(len(ids) for ids, _ in encoded)
    # Each distinct side once: 1 -> N embeds the query a single time.
    ids_1 = await until_answered(raw, llm.pooling_ids(request_id, first, truncate_to, names[0]))
    ids_2 = await until_answered(raw, llm.pooling_ids(request_id, second, truncate_to, names[1]))
    arrays = await run_all(raw, llm, request_id, [(i, None) for i in ids_1 + ids_2], params)
    pairs = pooling_inputs.score_pairs(arrays[:len(ids_1)], arrays[len(ids_1):])
    return [cosine_similarity(u, v) for u, v in pairs], sum(len(i) for i in ids_1 + ids_2)


def _labels(config) -> dict[int, str]:
    """Class names for /classify, as transformers saves them (id2label); LABEL_i without them."""
    id2label = config.checkpoint_config().get("id2label") or {}
    return {int(k): str(v) for k, v in id2label.items() if str(k).lstrip("-").isdigit()}


# -- routes ------------------------------------------------------------------------------------------


@pooling_routes.post("/v1/embeddings")
async def embeddings(raw: Request):
    req, llm, request_id = await admit(raw, pp.EmbeddingRequest, "embd")
    params = llm.processor.pooling_params("embed", dimensions=req.dimensions, normalize=req.normalize)
    ids, arrays = await pool_prompts(raw, llm, request_id, req, params)
    data = [pp.EmbeddingResponseData(index=i, embedding=encode_array(a, req.encoding_format))
            for i, a in enumerate(arrays)]
    return _respond(pp.EmbeddingResponse(id=request_id, model=service_of(raw).config.served_model_name, data=data,
                                         usage=_usage(ids)))


@pooling_routes.post("/pooling")
async def pooling(raw: Request):
    req, llm, request_id = await admit(raw, pp.PoolingRequest, "pool")
    config = llm.config
    # No task: the model's first (as LLM.encode); on a generative model "embed", so that the
    # answer is check_task's "this is a generative model".
    default = config.tasks[0] if config.runner == "pooling" else "embed"
    params = llm.processor.pooling_params(req.task or default, dimensions=req.dimensions, normalize=req.normalize,
                                          activation=req.activation)
    ids, arrays = await pool_prompts(raw, llm, request_id, req, params)
    data = [pp.PoolingResponseData(index=i, data=encode_array(a, req.encoding_format)) for i, a in enumerate(arrays)]
    return _respond(pp.PoolingResponse(id=request_id, model=service_of(raw).config.served_model_name, data=data,
                                       usage=_usage(ids)))


@pooling_routes.post("/classify")
async def classify(raw: Request):
    req, llm, request_id = await admit(raw, pp.ClassificationRequest, "classify")
    params = llm.processor.pooling_params("classify", activation=req.activation)
    ids, arrays = await pool_prompts(raw, llm, request_id, req, params)
    labels = _labels(llm.config)
    data = []
    for i, probs in enumerate(arrays):
        best = int(np.argmax(probs))
        data.append(pp.ClassificationData(index=i, label=labels.get(best, f"LABEL_{best}"), probs=probs.tolist(),
                                          num_classes=len(probs)))
    return _respond(pp.ClassificationResponse(id=request_id, model=service_of(raw).config.served_model_name,
                                              data=data, usage=_usage(ids)))


@pooling_routes.post("/score")
@pooling_routes.post("/v1/score")
async def score(raw: Request):
    req, llm, request_id = await admit(raw, pp.ScoreRequest, "score")
    values, num_tokens = await scores(raw, llm, request_id, req.text_1, req.text_2, req.truncate_prompt_tokens,
                                      req.activation, ("text_1", "text_2"))
    data = [pp.ScoreResponseData(index=i, score=s) for i, s in enumerate(values)]
    return _respond(pp.ScoreResponse(id=request_id, model=service_of(raw).config.served_model_name, data=data,
                                     usage=UsageInfo(prompt_tokens=num_tokens, total_tokens=num_tokens)))


@pooling_routes.post("/rerank")
@pooling_routes.post("/v1/rerank")
@pooling_routes.post("/v2/rerank")
async def rerank(raw: Request):
    req, llm, request_id = await admit(raw, pp.RerankRequest, "rerank")
    values, num_tokens = await scores(raw, llm, request_id, [req.query], req.documents, req.truncate_prompt_tokens,
                                      req.activation, ("query", "documents"))
    order = sorted(range(len(values)), key=lambda i: -values[i])  # stable: ties keep document order
    results = [pp.RerankResult(index=i, relevance_score=values[i],
                               document=pp.RerankDocument(text=req.documents[i]) if req.return_documents else None)
               for i in order[:req.top_n or len(order)]]
    return _respond(pp.RerankResponse(id=request_id, model=service_of(raw).config.served_model_name,
                                      usage=pp.RerankUsage(total_tokens=num_tokens), results=results))
