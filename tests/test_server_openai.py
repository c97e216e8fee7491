"""The service end to end with the official ``openai`` client: a real server on a localhost port
(API process + engine-core process + tokenizer worker), tiny Qwen2 checkpoint, CPU."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from atb_plugin import LLM, SamplingParams
from atb_plugin.testing.tiny import tiny_checkpoint

MESSAGES = [{"role": "user", "content": "Tell me about the cat on the mat."}]


@pytest.fixture(scope="module")
def server(serve):
    with serve(tiny_checkpoint("qwen2"), "--served-model-name", "tiny-qwen2") as server:
        yield server


@pytest.fixture(scope="module")
def client(server):
    return server.client()


def test_models_lists_the_served_name(client):
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny-qwen2"]


def test_chat_matches_the_offline_engine(client):
    response = client.chat.completions.create(model="tiny-qwen2", messages=MESSAGES, max_tokens=12, temperature=0)
    choice = response.choices[0]
    assert choice.message.role == "assistant" and choice.finish_reason in ("stop", "length")
    # The server applies the checkpoint's generation_config.json defaults to unset fields, as vLLM
    # does: the tiny Qwen2's repetition_penalty is 1.05.
    with LLM(tiny_checkpoint("qwen2"), block_size=16) as llm:
        offline = llm.chat(MESSAGES, SamplingParams(temperature=0, max_tokens=12, repetition_penalty=1.05))[0]
    assert choice.message.content == offline.outputs[0].text
    usage = response.usage
    assert usage.prompt_tokens == len(offline.prompt_token_ids)
    assert usage.completion_tokens == len(offline.outputs[0].token_ids)
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


def test_streamed_chunks_reassemble_the_greedy_text(client):
    full = client.chat.completions.create(model="tiny-qwen2", messages=MESSAGES, max_tokens=16, temperature=0,
                                          extra_body={"ignore_eos": True})
    stream = client.chat.completions.create(model="tiny-qwen2", messages=MESSAGES, max_tokens=16, temperature=0,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True})
    pieces, reasons, usage, roles = [], [], None, []
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            roles.append(choice.delta.role)
            pieces.append(choice.delta.content or "")
            reasons.append(choice.finish_reason)
    assert roles[0] == "assistant"
    assert "".join(pieces) == full.choices[0].message.content
    assert reasons[-1] == "length" and all(r is None for r in reasons[:-1])
    assert usage.completion_tokens == 16 == full.usage.completion_tokens


def test_continuous_usage_stats_count_up(client):
    stream = client.chat.completions.create(model="tiny-qwen2", messages=MESSAGES, max_tokens=5, temperature=0,
                                            stream=True, extra_body={"ignore_eos": True},
                                            stream_options={"include_usage": True, "continuous_usage_stats": True})
    counts = [chunk.usage.completion_tokens for chunk in stream if chunk.usage is not None and chunk.choices]
    assert counts == sorted(counts) and counts[-1] == 5


def test_completions_with_text_and_with_token_ids(client, server):
    text = client.completions.create(model="tiny-qwen2", prompt="the cat sat", max_tokens=8, temperature=0,
                                     extra_body={"ignore_eos": True})
    ids = server.post("/tokenize", {"prompt": "the cat sat"}).json()["tokens"]
    by_ids = client.completions.create(model="tiny-qwen2", prompt=ids, max_tokens=8, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert text.choices[0].text == by_ids.choices[0].text
    assert text.usage.prompt_tokens == len(ids) and text.usage.completion_tokens == 8
    with LLM(tiny_checkpoint("qwen2"), block_size=16) as llm:
        offline = llm.generate(ids, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
    assert text.choices[0].text == offline.outputs[0].text


def test_completion_stream_reassembles(client):
    full = client.completions.create(model="tiny-qwen2", prompt="numbers: 1 2 3", max_tokens=10, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="tiny-qwen2", prompt="numbers: 1 2 3", max_tokens=10, temperature=0, stream=True,
        extra_body={"ignore_eos": True}) if c.choices)
    assert streamed == full


def test_stop_strings_seed_and_logprobs(client):
    base = client.completions.create(model="tiny-qwen2", prompt="hello world", max_tokens=12, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    stop = base[len(base) // 2:len(base) // 2 + 2]
    cut = client.completions.create(model="tiny-qwen2", prompt="hello world", max_tokens=12, temperature=0,
                                    stop=[stop], extra_body={"ignore_eos": True}).choices[0]
    assert cut.finish_reason == "stop" and stop not in cut.text and base.startswith(cut.text)
    seeded = [client.completions.create(model="tiny-qwen2", prompt="hello", max_tokens=8, temperature=1.0, seed=42,
                                        extra_body={"ignore_eos": True}).choices[0].text for _ in range(2)]
    assert seeded[0] == seeded[1]
    # Logprobs are the raw ones: with the checkpoint's default repetition penalty the greedy token
    # need not be the raw top one, so the penalty is off here.
    chat = client.chat.completions.create(model="tiny-qwen2", messages=MESSAGES, max_tokens=4, temperature=0,
                                          logprobs=True, top_logprobs=3,
                                          extra_body={"ignore_eos": True, "repetition_penalty": 1.0})
    content = chat.choices[0].logprobs.content
    assert len(content) == 4 and all(len(entry.top_logprobs) == 3 for entry in content)
    assert all(entry.logprob <= 0 and entry.logprob == entry.top_logprobs[0].logprob for entry in content)
    completion = client.completions.create(model="tiny-qwen2", prompt="hello", max_tokens=3, temperature=0,
                                           logprobs=2, extra_body={"ignore_eos": True})
    logprobs = completion.choices[0].logprobs
    assert len(logprobs.tokens) == 3 and len(logprobs.token_logprobs) == 3 and len(logprobs.top_logprobs[0]) == 2


def test_request_id_header_is_echoed(server):
    response = server.post("/v1/completions", {"prompt": "hi", "max_tokens": 2}, headers={"X-Request-Id": "abc-123"})
    assert response.status_code == 200 and response.headers["x-request-id"] == "abc-123"
    assert "abc-123" in response.json()["id"]


def test_tokenize_detokenize_version_health(server):
    tokens = server.post("/tokenize", {"prompt": "hello world"}).json()
    assert tokens["count"] == len(tokens["tokens"]) and tokens["max_model_len"] > 0
    assert server.post("/detokenize", {"tokens": tokens["tokens"]}).json()["prompt"].endswith("hello world")
    chat_tokens = server.post("/tokenize", {"messages": MESSAGES}).json()
    assert chat_tokens["count"] > tokens["count"]
    assert server.get("/version").json()["version"]
    assert server.get("/health").status_code == 200


def test_metrics_use_vllm_names_and_count_requests(server, client):
    client.completions.create(model="tiny-qwen2", prompt="count me", max_tokens=3, temperature=0,
                              extra_body={"ignore_eos": True})
    text = server.get("/metrics").text
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append(sample)
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "vllm:prompt_tokens_total",
                 "vllm:generation_tokens_total", "vllm:request_success_total",
                 "vllm:time_to_first_token_seconds_bucket", "vllm:inter_token_latency_seconds_bucket",
                 "vllm:e2e_request_latency_seconds_bucket", "vllm:request_queue_time_seconds_bucket",
                 "atb_plugin:shm_live_segments", "atb_plugin:shm_live_bytes", "atb_plugin:shm_leased_segments",
                 "atb_plugin:tokenizer_queue_depth"):
        assert name in samples, name
    assert sum(s.value for s in samples["vllm:generation_tokens_total"]) >= 3
    by_reason = {s.labels["finished_reason"]: s.value for s in samples["vllm:request_success_total"]}
    assert by_reason["length"] >= 1
    assert all(s.labels["model_name"] == "tiny-qwen2" for s in samples["vllm:prompt_tokens_total"])
    assert samples["vllm:num_requests_running"][0].value == 0
