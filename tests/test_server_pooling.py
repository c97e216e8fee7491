"""The pooling endpoints end to end: real servers on localhost ports (API process + engine-core
process + tokenizer worker), CPU, answers compared with the offline ``LLM`` on the same texts.

Three servers, one per model, each started once for the module:

- all-MiniLM-L6-v2 (the real embedding model), declared Matryoshka through ``--hf-overrides`` so
  ``dimensions`` can be checked, behind an API key: /v1/embeddings, /pooling, cosine /score;
- tiny BERT cross-encoder (one label): /score, /rerank;
- tiny Qwen2 sequence classifier (three named labels): /classify.
"""

from __future__ import annotations

import asyncio
import base64
import json
from types import SimpleNamespace

import httpx
import numpy as np
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from atb_plugin import LLM
from atb_plugin.default_model import embedding_model_dir
from atb_plugin.engine.config import EngineConfig
from atb_plugin.frontend.async_llm import AsyncLLM
from atb_plugin.frontend.errors import RequestError
from atb_plugin.pooling.params import PoolingParams
from atb_plugin.server.cli import parse_config
from atb_plugin.server.config import ServerConfig
from atb_plugin.server.errors import APIError
from atb_plugin.frontend.input_processor import InputLimits, InputProcessor
from atb_plugin.server.metrics import ServerMetrics
from atb_plugin.server.pooling_api import pool_prompts, pooling_window, run_all, scores
from atb_plugin.testing.tiny import tiny_checkpoint

API_KEY = "pool-key"
MINILM = "minilm"
MINILM_MAX_LEN = 256  # its tokenizer's model_max_length
TEXTS = ["The cat sat on the mat.", "A dog barked at the mailman.", "Stock markets fell sharply today."]
QUERY = "Where is the cat?"
DOCUMENTS = ["Dogs chase cats.", "The cat is on the mat.", "Markets fell today.", "A kitten sleeps."]
TOL = 1e-5  # float32, the same code path in a different batch


# -- servers and offline references ------------------------------------------------------------------


@pytest.fixture(scope="module")
def minilm(serve):
    with serve(embedding_model_dir(), "--served-model-name", MINILM,
               "--hf-overrides", json.dumps({"is_matryoshka": True}), api_key=API_KEY) as server:
        yield server


@pytest.fixture(scope="module")
def cross_encoder(serve):
    with serve(tiny_checkpoint("bert_cross_encoder"), "--served-model-name", "ce") as server:
        yield server


@pytest.fixture(scope="module")
def classifier(serve):
    with serve(tiny_checkpoint("qwen2_seq_cls"), "--served-model-name", "cls",
               "--max-queued-requests", "4", "--max-pooling-inputs", "6") as server:
        yield server


@pytest.fixture(scope="module")
def minilm_offline():
    with LLM(str(embedding_model_dir())) as llm:
        yield llm


def embeddings(response) -> np.ndarray:
    return np.array([d.embedding for d in response.data], dtype=np.float32)


def error_of(response: httpx.Response, status: int) -> str:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["code"] == status
    return error["message"]


# -- /v1/embeddings ----------------------------------------------------------------------------------


def test_embeddings_float_and_base64_agree_and_match_offline(minilm, minilm_offline):
    client = minilm.client()
    as_float = client.embeddings.create(model=MINILM, input=TEXTS, encoding_format="float")
    decoded_by_sdk = client.embeddings.create(model=MINILM, input=TEXTS)  # the SDK asks for base64 and decodes
    raw = minilm.post("/v1/embeddings", {"model": MINILM, "input": TEXTS, "encoding_format": "base64"}).json()
    from_base64 = np.stack([np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4") for d in raw["data"]])
    offline = minilm_offline.embed(TEXTS)

    assert [d.index for d in as_float.data] == [0, 1, 2] and as_float.object == "list"
    assert as_float.model == MINILM and as_float.id.startswith("embd-")
    # Batches may be split differently from one request to the next (float32 sums in another
    # order): equal within TOL. One input alone runs the same way every time: base64 is exact.
    np.testing.assert_allclose(embeddings(as_float), from_base64, atol=TOL)
    np.testing.assert_allclose(embeddings(decoded_by_sdk), from_base64, atol=TOL)
    single = {"model": MINILM, "input": TEXTS[0]}
    as_list = minilm.post("/v1/embeddings", {**single, "encoding_format": "float"}).json()["data"][0]["embedding"]
    as_text = minilm.post("/v1/embeddings", {**single, "encoding_format": "base64"}).json()["data"][0]["embedding"]
    np.testing.assert_array_equal(np.frombuffer(base64.b64decode(as_text), dtype="<f4"),
                                  np.array(as_list, dtype=np.float32))
    np.testing.assert_allclose(from_base64, np.array([o.outputs.embedding for o in offline]), atol=TOL)
    assert from_base64.shape == (3, 384)
    tokens = sum(len(o.prompt_token_ids) for o in offline)
    assert as_float.usage.prompt_tokens == as_float.usage.total_tokens == tokens


def test_token_id_inputs_embed_like_their_text(minilm, minilm_offline):
    ids = [o.prompt_token_ids for o in minilm_offline.embed(TEXTS[:2])]
    client = minilm.client()
    by_text = embeddings(client.embeddings.create(model=MINILM, input=TEXTS[:2], encoding_format="float"))
    by_ids = embeddings(client.embeddings.create(model=MINILM, input=ids, encoding_format="float"))
    one = embeddings(client.embeddings.create(model=MINILM, input=ids[0], encoding_format="float"))
    np.testing.assert_allclose(by_ids, by_text, atol=TOL)
    np.testing.assert_allclose(one[0], by_text[0], atol=TOL)


def test_matryoshka_dimensions_are_the_normalised_first_ones(minilm):
    client = minilm.client()
    full = embeddings(client.embeddings.create(model=MINILM, input=TEXTS[0], encoding_format="float"))[0]
    cut = embeddings(client.embeddings.create(model=MINILM, input=TEXTS[0], dimensions=32, encoding_format="float"))[0]
    assert cut.shape == (32,)
    np.testing.assert_allclose(cut, full[:32] / np.linalg.norm(full[:32]), atol=TOL)


def test_dimensions_need_a_matryoshka_model():
    config = EngineConfig(model=str(tiny_checkpoint("bert")), block_size=16)
    with pytest.raises(ValueError, match="matryoshka"):
        config.check_task(PoolingParams("embed", dimensions=8))


def test_too_long_input_is_refused_unless_truncated(minilm):
    long_text = "word " * 400
    message = error_of(minilm.post("/v1/embeddings", {"input": long_text}), 400)
    assert str(MINILM_MAX_LEN) in message and "truncate_prompt_tokens" in message
    # In a batch, the message names the input.
    assert "input[1]" in error_of(minilm.post("/v1/embeddings", {"input": ["short", long_text]}), 400)
    whole = minilm.post("/v1/embeddings", {"input": long_text, "truncate_prompt_tokens": -1})
    assert whole.status_code == 200, whole.text
    assert whole.json()["usage"]["prompt_tokens"] == MINILM_MAX_LEN
    cut = minilm.post("/v1/embeddings", {"input": long_text, "truncate_prompt_tokens": 10}).json()
    assert cut["usage"]["prompt_tokens"] == 10


@pytest.mark.parametrize("body, words", [
    ({"input": []}, "not empty"),
    ({"input": 5}, "input"),
    ({"input": ["text", [1, 2]]}, "not a mix"),
    ({"input": [[]]}, "empty list of token ids"),
    ({"input": [10**7]}, "outside the vocabulary"),
    ({"input": "x", "encoding_format": "hex"}, "encoding_format"),
    ({"input": "x", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ({"input": "x", "dimensions": 0}, "dimensions"),
    ({"input": "x", "dimensions": 999}, "exceeds the embedding size 384"),
    ({"messages": [{"role": "user", "content": "x"}]}, "messages"),
])
def test_bad_embedding_requests_are_400(minilm, body, words):
    assert words in error_of(minilm.post("/v1/embeddings", body), 400)


def test_the_api_key_guards_the_pooling_routes(minilm):
    for path in ("/v1/embeddings", "/pooling", "/score", "/rerank"):
        response = httpx.post(minilm.base_url + path, json={"input": "x"}, timeout=30)
        assert "API key" in error_of(response, 401)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=minilm.base_url + "/v1", api_key="wrong", max_retries=0).embeddings.create(
            model=MINILM, input="x")


def test_generation_and_other_tasks_on_an_embedding_model_are_400(minilm):
    chat = {"model": MINILM, "messages": [{"role": "user", "content": "hi"}]}
    message = error_of(minilm.post("/v1/chat/completions", chat), 400)
    assert "pooling model" in message and "embed" in message
    assert "pooling model" in error_of(minilm.post("/v1/completions", {"prompt": "hi"}), 400)
    message = error_of(minilm.post("/classify", {"input": "hi"}), 400)
    assert "'classify'" in message and "embed, token_embed" in message
    assert "does not exist" in error_of(minilm.post("/v1/embeddings", {"model": "other", "input": "x"}), 404)


def test_a_generative_model_refuses_pooling_tasks():
    config = EngineConfig(model=str(tiny_checkpoint("qwen2")), block_size=16)
    with pytest.raises(ValueError, match="generative model.*--runner pooling"):
        config.check_task(PoolingParams("embed"))


@pytest.mark.slow
def test_2048_inputs_in_one_request_equal_batches_of_32(minilm):
    """Issue 30: OpenAI's limit (2048 inputs) in one request, which runs in windows of the
    queue; the same vectors as 64 requests of 32."""
    texts = [f"{i}" for i in range(2048)]  # 3-4 tokens each: the test is about the count
    one = httpx.post(minilm.base_url + "/v1/embeddings", json={"input": texts, "encoding_format": "base64"},
                     headers=minilm.headers, timeout=600)
    assert one.status_code == 200, one.text
    body = one.json()
    assert [d["index"] for d in body["data"]] == list(range(2048))
    whole = np.stack([np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4") for d in body["data"]])
    pieces, tokens = [], 0
    for start in range(0, len(texts), 32):
        answer = minilm.post("/v1/embeddings", {"input": texts[start:start + 32], "encoding_format": "base64"})
        assert answer.status_code == 200, answer.text
        pieces += [np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4") for d in answer.json()["data"]]
        tokens += answer.json()["usage"]["prompt_tokens"]
    np.testing.assert_allclose(whole, np.stack(pieces), atol=TOL)
    assert body["usage"]["prompt_tokens"] == tokens
    # /rerank's documents run the same way: more than the old cap of --max-queued-requests (256).
    reranked = minilm.post("/rerank", {"query": "7", "documents": texts[:257]})
    assert reranked.status_code == 200, reranked.text
    results = reranked.json()["results"]
    assert len(results) == 257 and results[0]["index"] == 7  # the query's own text is the best match


def test_more_than_max_pooling_inputs_is_a_400_naming_the_flag(minilm):
    texts = [f"{i}" for i in range(2049)]
    message = error_of(minilm.post("/v1/embeddings", {"input": texts}), 400)
    assert "has 2049 inputs" in message and "at most 2048" in message and "(--max-pooling-inputs)" in message
    # /score and /rerank count pairs: their second side.
    assert "(--max-pooling-inputs)" in error_of(minilm.post("/score", {"text_1": "q", "text_2": texts}), 400)
    message = error_of(minilm.post("/rerank", {"query": "q", "documents": texts}), 400)
    assert "2049 inputs (documents)" in message and "(--max-pooling-inputs)" in message


def test_max_pooling_inputs_flag():
    model = ["--model", str(tiny_checkpoint("bert"))]
    assert parse_config(model).max_pooling_inputs == 2048
    assert parse_config(model + ["--max-pooling-inputs", "10"]).max_pooling_inputs == 10
    with pytest.raises(ValueError, match="--max-pooling-inputs"):
        ServerConfig(engine=EngineConfig(model=str(tiny_checkpoint("bert")), block_size=16), max_pooling_inputs=0)


def test_pooling_route_and_cosine_scores(minilm, minilm_offline):
    pooled = minilm.post("/pooling", {"input": TEXTS[:2]}).json()
    assert [d["object"] for d in pooled["data"]] == ["pooling", "pooling"]
    embedded = minilm.post("/v1/embeddings", {"input": TEXTS[:2]}).json()
    np.testing.assert_allclose([d["data"] for d in pooled["data"]], [d["embedding"] for d in embedded["data"]],
                               atol=TOL)
    tokens = minilm.post("/pooling", {"input": TEXTS[0], "task": "token_embed"}).json()["data"][0]["data"]
    assert np.array(tokens).shape == (len(minilm_offline.embed(TEXTS[0])[0].prompt_token_ids), 384)
    scores = minilm.post("/score", {"text_1": QUERY, "text_2": DOCUMENTS}).json()
    offline = [s.outputs.score for s in minilm_offline.score(QUERY, DOCUMENTS)]
    np.testing.assert_allclose([d["score"] for d in scores["data"]], offline, atol=TOL)


def test_pooling_requests_are_counted_in_the_vllm_metrics(minilm):
    minilm.post("/v1/embeddings", {"input": TEXTS})
    samples = {(s.name, s.labels.get("finished_reason")): s.value
               for family in text_string_to_metric_families(minilm.get("/metrics").text) for s in family.samples}
    assert samples[("vllm:request_success_total", "stop")] >= 3
    assert samples[("vllm:prompt_tokens_total", None)] > 0


# -- /score and /rerank on a cross-encoder -------------------------------------------------------------


@pytest.fixture(scope="module")
def cross_encoder_offline():
    with LLM(str(tiny_checkpoint("bert_cross_encoder")), block_size=16) as llm:
        yield llm


def test_score_one_to_n_and_n_to_n_match_offline(cross_encoder, cross_encoder_offline):
    one_to_n = cross_encoder.post("/score", {"model": "ce", "text_1": QUERY, "text_2": DOCUMENTS}).json()
    assert one_to_n["object"] == "list" and one_to_n["id"].startswith("score-")
    assert [d["index"] for d in one_to_n["data"]] == [0, 1, 2, 3]
    offline = [s.outputs.score for s in cross_encoder_offline.score(QUERY, DOCUMENTS)]
    np.testing.assert_allclose([d["score"] for d in one_to_n["data"]], offline, atol=TOL)
    firsts = [QUERY, "cats", "markets", "sleep"]
    n_to_n = cross_encoder.post("/v1/score", {"text_1": firsts, "text_2": DOCUMENTS}).json()
    offline = [s.outputs.score for s in cross_encoder_offline.score(firsts, DOCUMENTS)]
    np.testing.assert_allclose([d["score"] for d in n_to_n["data"]], offline, atol=TOL)
    assert n_to_n["usage"]["prompt_tokens"] == sum(len(s.prompt_token_ids)
                                                   for s in cross_encoder_offline.score(firsts, DOCUMENTS))
    message = error_of(cross_encoder.post("/score", {"text_1": ["a", "b"], "text_2": DOCUMENTS}), 400)
    assert "1 -> N or N -> N" in message


def test_rerank_sorts_cuts_and_matches_offline_scores(cross_encoder, cross_encoder_offline):
    offline = [s.outputs.score for s in cross_encoder_offline.score(QUERY, DOCUMENTS)]
    expected = sorted(range(len(DOCUMENTS)), key=lambda i: -offline[i])
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        answer = cross_encoder.post(path, {"model": "ce", "query": QUERY, "documents": DOCUMENTS, "top_n": 2}).json()
        assert answer["id"].startswith("rerank-") and answer["model"] == "ce"
        results = answer["results"]
        assert [r["index"] for r in results] == expected[:2]
        assert [r["document"]["text"] for r in results] == [DOCUMENTS[i] for i in expected[:2]]
        np.testing.assert_allclose([r["relevance_score"] for r in results], [offline[i] for i in expected[:2]],
                                   atol=TOL)
        assert answer["usage"]["total_tokens"] > 0
    every = cross_encoder.post("/rerank", {"query": QUERY, "documents": DOCUMENTS, "return_documents": False}).json()
    assert [r["index"] for r in every["results"]] == expected
    assert all("document" not in r for r in every["results"])
    assert "documents" in error_of(cross_encoder.post("/rerank", {"query": QUERY, "documents": []}), 400)


# -- /classify ---------------------------------------------------------------------------------------


def test_each_input_counts_toward_max_queued_requests(classifier):
    ok = classifier.post("/classify", {"model": "cls", "input": ["a", "b", "c", "d"]})
    assert ok.status_code == 200 and len(ok.json()["data"]) == 4
    # More inputs than the queue holds run a window at a time (issue 30: no longer a 400); the
    # per-request limit is --max-pooling-inputs.
    more = classifier.post("/classify", {"model": "cls", "input": ["a", "b", "c", "d", "a"]})
    assert more.status_code == 200, more.text
    probs = [d["probs"] for d in more.json()["data"]]
    np.testing.assert_allclose(probs[:4], [d["probs"] for d in ok.json()["data"]], atol=TOL)
    np.testing.assert_allclose(probs[4], probs[0], atol=TOL)
    message = error_of(classifier.post("/classify", {"model": "cls", "input": ["a"] * 7}), 400)
    assert "has 7 inputs" in message and "(--max-pooling-inputs)" in message


def test_classify_returns_probabilities_and_the_argmax_label(classifier):
    checkpoint = tiny_checkpoint("qwen2_seq_cls")
    id2label = json.loads((checkpoint / "config.json").read_text())["id2label"]
    answer = classifier.post("/classify", {"model": "cls", "input": TEXTS}).json()
    assert answer["id"].startswith("classify-") and len(answer["data"]) == 3
    with LLM(str(checkpoint), block_size=16) as llm:
        offline = llm.classify(TEXTS)
    for item, reference in zip(answer["data"], offline):
        probs = item["probs"]
        assert item["num_classes"] == 3 and abs(sum(probs) - 1) < 1e-5
        assert item["label"] == id2label[str(int(np.argmax(probs)))]
        np.testing.assert_allclose(probs, reference.outputs.probs, atol=TOL)
    message = error_of(classifier.post("/score", {"text_1": "a", "text_2": "b"}), 400)
    assert "3 labels" in message


# -- many inputs, one HTTP request -------------------------------------------------------------------


class _FakeEngine:
    """``encode`` of ``failing`` fails at once; the others wait until cancelled (and say so)."""

    max_queued_requests = 8

    def __init__(self, failing: str | None):
        self.failing = failing
        self.cancelled = []

    def check_admission(self, new_requests: int = 1) -> None:
        assert new_requests == 3

    async def encode(self, request_id, prompt, params):
        if request_id == self.failing:
            raise APIError(500, f"{request_id} failed")
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            self.cancelled.append(request_id)
            raise


@pytest.mark.parametrize("gone, message", [(False, "r-1 failed"), (True, "disconnected")])
def test_a_failing_input_or_a_gone_client_aborts_the_others(gone, message):
    engine = _FakeEngine(failing=None if gone else "r-1")
    raw = SimpleNamespace(is_disconnected=lambda: asyncio.sleep(0, gone))
    config = EngineConfig(model=str(tiny_checkpoint("bert")), block_size=16)
    router = SimpleNamespace(eos_token_ids=[], generation_config={})
    engine.processor = InputProcessor(config, router, InputLimits(max_tokens_per_request=64))

    async def main():
        with pytest.raises(APIError, match=message):
            await run_all(raw, engine, "r", [([1, 2], None)] * 3, PoolingParams("embed"))
        await asyncio.sleep(0.01)  # the cancelled ones run their abort

    asyncio.run(main())
    assert sorted(engine.cancelled) == (["r-0", "r-1", "r-2"] if gone else ["r-0", "r-2"])


class _QueueEngine:
    """A queue of 8 places, as ``AsyncLLM.check_admission`` counts them: this request's running
    inputs plus ``others`` (another client's requests, which fill the queue for a moment once the
    first input finishes)."""

    max_queued_requests = 8

    def __init__(self):
        self.running = self.most = self.others = 0
        self.admissions, self.refused = [], 0

    def check_admission(self, new_requests: int = 1) -> None:
        self.admissions.append(new_requests)
        if self.running + self.others + new_requests > self.max_queued_requests:
            self.refused += 1
            raise RequestError(429, "too many requests in flight", retry_after=1)

    async def encode(self, request_id, prompt, params):
        self.running += 1
        self.most = max(self.most, self.running)
        try:
            await asyncio.sleep(0.001)
            index = int(request_id.rsplit("-", 1)[1])
            if index == 0:
                self.others = self.max_queued_requests
                asyncio.get_running_loop().call_later(0.1, setattr, self, "others", 0)
            return SimpleNamespace(outputs=SimpleNamespace(data=np.array([index], dtype=np.float32)))
        finally:
            self.running -= 1


def test_many_inputs_run_in_a_window_that_waits_for_room_in_the_queue():
    engine = _QueueEngine()
    engine.processor = InputProcessor(EngineConfig(model=str(tiny_checkpoint("bert")), block_size=16),
                                      SimpleNamespace(eos_token_ids=[], generation_config={}),
                                      InputLimits(max_tokens_per_request=64))
    raw = SimpleNamespace(is_disconnected=lambda: asyncio.sleep(0, False))
    window = pooling_window(engine)
    assert window == 4  # half the queue (2 x max_num_seqs is 128)

    arrays = asyncio.run(run_all(raw, engine, "r", [([1, 2], None)] * 50, PoolingParams("embed")))
    assert [int(a[0]) for a in arrays] == list(range(50))  # input order
    assert engine.admissions[0] == window  # the first window admitted whole
    assert engine.most == window  # never more in flight
    assert engine.refused > 0  # the full queue was waited out, not a 429


# -- a client that leaves while its texts wait for a tokenizer worker ---------------------------------


class _StuckWorkers:
    """A tokenizer pool whose workers never answer: a job waits until it is cancelled (noted)."""

    def __init__(self):
        self.cancelled = []

    async def call(self, job):
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            self.cancelled.append(type(job).__name__)
            raise


class _InputHalf:
    """``AsyncLLM``'s own input half (its jobs on the pool and their abort accounting, with real
    metrics) over ``_StuckWorkers``: no engine core, no worker process."""

    _prepare = AsyncLLM._prepare
    pooling_ids = AsyncLLM.pooling_ids
    pair_ids = AsyncLLM.pair_ids

    def __init__(self, family: str):
        config = EngineConfig(model=str(tiny_checkpoint(family)), block_size=16)
        self.processor = InputProcessor(config, SimpleNamespace(eos_token_ids=[], generation_config={}))
        self.metrics = ServerMetrics("m")
        self.pool = _StuckWorkers()
        self.num_preparing = 0

    def aborts(self) -> float:
        return sum(s.value for family in text_string_to_metric_families(self.metrics.render()[0].decode())
                   for s in family.samples
                   if s.name == "vllm:request_success_total" and s.labels["finished_reason"] == "abort")


def _departed_client():
    config = SimpleNamespace(max_pooling_inputs=8)
    return SimpleNamespace(is_disconnected=lambda: asyncio.sleep(0, True),
                           app=SimpleNamespace(state=SimpleNamespace(service=SimpleNamespace(config=config))))


@pytest.mark.parametrize("family, route, job", [
    ("bert", "embeddings", "PoolJob"),  # /v1/embeddings, /pooling, /classify: pool_prompts
    ("bert", "score", "PoolJob"),  # /score, /rerank on an embedding model: both sides' texts
    ("bert_cross_encoder", "score", "PairJob"),  # on a cross-encoder: the pairs
])
def test_a_client_that_leaves_while_its_texts_wait_for_a_worker_drops_the_job(family, route, job):
    """As the generate routes do (``until_answered``): the job is cancelled on the pool (which
    sends the worker a CancelJob), counted as an abort, and the handler ends with the disconnect,
    not after the worker gets round to it."""
    llm, raw = _InputHalf(family), _departed_client()

    async def handle():
        if route == "embeddings":
            request = SimpleNamespace(prompts=["a", "b"], truncate_prompt_tokens=None)
            return await pool_prompts(raw, llm, "r", request, llm.processor.pooling_params("embed"))
        return await scores(raw, llm, "r", ["q"], ["a", "b"], None, None, ("query", "documents"))

    async def main():
        with pytest.raises(APIError, match="disconnected") as caught:
            await asyncio.wait_for(handle(), 5.0)  # the worker would answer in 60 s
        return caught.value

    error = asyncio.run(main())
    assert error.status == 400
    assert llm.pool.cancelled == [job]
    assert llm.aborts() == 1 and llm.num_preparing == 0


@pytest.mark.slow  # a real server
def test_a_pooling_request_whose_client_left_while_queued_is_counted_as_an_abort(classifier):
    """Through the service: its only tokenizer worker is stopped, a /classify client gives up
    waiting, and the abort is counted while the worker is still stopped (the request was dropped
    then, not run once the worker came back)."""
    import os
    import signal
    import time

    def aborts() -> float:
        return sum(s.value for family in text_string_to_metric_families(classifier.get("/metrics").text)
                   for s in family.samples
                   if s.name == "vllm:request_success_total" and s.labels.get("finished_reason") == "abort")

    before = aborts()
    worker = classifier.pid_of("tokenizer worker 0")
    os.kill(worker, signal.SIGSTOP)
    try:
        with pytest.raises(httpx.TimeoutException):
            httpx.post(classifier.base_url + "/classify", json={"model": "cls", "input": ["a", "b"]}, timeout=1.0)
        deadline = time.monotonic() + 10
        while aborts() < before + 1:
            assert time.monotonic() < deadline, classifier.log()
            time.sleep(0.2)
    finally:
        os.kill(worker, signal.SIGCONT)
    assert aborts() == before + 1
    answer = classifier.post("/classify", {"model": "cls", "input": ["a"]})  # the worker serves on
    assert answer.status_code == 200, answer.text


# -- the CLI -----------------------------------------------------------------------------------------


def test_cli_flags_reach_the_engine_config():
    config = parse_config(["--model", str(tiny_checkpoint("qwen2")), "--runner", "pooling",
                           "--hf-overrides", '{"is_matryoshka": true}', "--block-size", "16"])
    assert config.engine.runner == "pooling" and config.engine.convert == "embed"
    assert config.engine.tasks == ("embed", "token_embed") and config.engine.is_matryoshka
    with pytest.raises(SystemExit):
        parse_config(["--model", str(tiny_checkpoint("qwen2")), "--hf-overrides", "[1]"])
