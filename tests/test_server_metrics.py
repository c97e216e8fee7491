"""ServerMetrics: vLLM's exposed names and labels, parsed back from the rendered text."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from atb_plugin.server.metrics import ITL_BUCKETS, TTFT_BUCKETS, ServerMetrics, build_1_2_5_buckets

MODEL = "tiny-llama"


def samples(metrics: ServerMetrics) -> dict[tuple[str, frozenset], float]:
    body, content_type = metrics.render()
    assert content_type.startswith("text/plain; version=0.0.4")
    out = {}
    for family in text_string_to_metric_families(body.decode()):
        for sample in family.samples:
            out[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return out


def value(metrics, name, **labels):
    return samples(metrics)[(name, frozenset({"model_name": MODEL, **labels}.items()))]


def test_every_metric_is_exposed_under_vllms_name_from_the_start():
    body, _ = ServerMetrics(MODEL).render()
    text = body.decode()
    names = {s.name for f in text_string_to_metric_families(text) for s in f.samples}
    expected = {
        "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
        "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
        "vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:request_success_total",
        "vllm:time_to_first_token_seconds_bucket", "vllm:time_to_first_token_seconds_count",
        "vllm:inter_token_latency_seconds_sum", "vllm:e2e_request_latency_seconds_count",
        "vllm:request_queue_time_seconds_count", "vllm:request_prompt_tokens_count",
        "vllm:request_generation_tokens_count",
        "atb_plugin:shm_live_segments", "atb_plugin:shm_live_bytes", "atb_plugin:tokenizer_queue_depth",
    }
    assert expected <= names, expected - names
    # Counters get exactly one _total (none doubled), and the TYPE lines keep vLLM's colon.
    assert not any(name.endswith("_total_total") for name in names)
    assert "# TYPE vllm:prompt_tokens_total counter" in text
    assert 'vllm:request_success_total{finished_reason="length",model_name="tiny-llama"} 0.0' in text
    assert 'vllm:num_requests_running{model_name="tiny-llama"} 0.0' in text


def test_scheduler_and_gauges():
    m = ServerMetrics(MODEL)
    m.set_scheduler_stats(running=3, waiting=5, kv_usage=0.25)
    m.set_shm(segments=2, nbytes=4096)
    m.set_tokenizer_queue_depth(7)
    m.add_prefix_cache(queries=128, hits=64)
    m.add_prefix_cache(queries=16, hits=0)
    assert value(m, "vllm:num_requests_running") == 3
    assert value(m, "vllm:num_requests_waiting") == 5
    assert value(m, "vllm:kv_cache_usage_perc") == 0.25
    assert value(m, "atb_plugin:shm_live_segments") == 2
    assert value(m, "atb_plugin:shm_live_bytes") == 4096
    assert value(m, "atb_plugin:tokenizer_queue_depth") == 7
    assert value(m, "vllm:prefix_cache_queries_total") == 144
    assert value(m, "vllm:prefix_cache_hits_total") == 64
    m.set_scheduler_stats(running=0, waiting=0, kv_usage=0.0)
    assert value(m, "vllm:num_requests_running") == 0


def test_record_finished():
    m = ServerMetrics(MODEL, max_model_len=100)
    m.record_finished("stop", e2e=1.2, queue_time=0.05, prompt_tokens=10, generation_tokens=4,
                      ttft=0.03, itls=[0.02, 0.02, 0.3])
    m.record_finished("length", e2e=0.4, prompt_tokens=3, generation_tokens=2)
    assert value(m, "vllm:request_success_total", finished_reason="stop") == 1
    assert value(m, "vllm:request_success_total", finished_reason="length") == 1
    assert value(m, "vllm:request_success_total", finished_reason="abort") == 0
    assert value(m, "vllm:prompt_tokens_total") == 13
    assert value(m, "vllm:generation_tokens_total") == 6
    assert value(m, "vllm:e2e_request_latency_seconds_count") == 2
    assert abs(value(m, "vllm:e2e_request_latency_seconds_sum") - 1.6) < 1e-9
    assert value(m, "vllm:request_queue_time_seconds_count") == 1
    assert value(m, "vllm:time_to_first_token_seconds_count") == 1
    assert value(m, "vllm:time_to_first_token_seconds_bucket", le="0.04") == 1
    assert value(m, "vllm:time_to_first_token_seconds_bucket", le="0.02") == 0
    assert value(m, "vllm:inter_token_latency_seconds_count") == 3
    assert value(m, "vllm:inter_token_latency_seconds_bucket", le="0.025") == 2
    assert value(m, "vllm:request_prompt_tokens_bucket", le="10.0") == 2
    assert value(m, "vllm:request_prompt_tokens_bucket", le="5.0") == 1


def test_tokens_counted_as_they_happen_are_not_counted_twice():
    m = ServerMetrics(MODEL)
    m.add_tokens(prompt_tokens=10)
    m.add_tokens(generation_tokens=1)
    m.observe_time_to_first_token(0.1)
    m.add_tokens(generation_tokens=2)
    m.observe_inter_token_latencies([0.05, 0.05])
    m.record_finished("abort", e2e=0.5, prompt_tokens=10, generation_tokens=3, count_tokens=False)
    assert value(m, "vllm:prompt_tokens_total") == 10
    assert value(m, "vllm:generation_tokens_total") == 3
    assert value(m, "vllm:request_generation_tokens_count") == 1
    assert value(m, "vllm:request_success_total", finished_reason="abort") == 1
    assert value(m, "vllm:inter_token_latency_seconds_count") == 2


def test_openmetrics_accept_header_still_gets_the_text_format():
    m = ServerMetrics(MODEL)
    body, content_type = m.render("application/openmetrics-text; version=1.0.0; charset=utf-8")
    assert content_type.startswith("text/plain; version=0.0.4")
    assert 'vllm:num_requests_waiting{model_name="tiny-llama"} 0.0' in body.decode()


def test_registries_are_independent():
    a, b = ServerMetrics("a"), ServerMetrics("b")  # a second one must not clash with the first
    a.add_tokens(prompt_tokens=5)
    assert samples(b)[("vllm:prompt_tokens_total", frozenset({"model_name": "b"}.items()))] == 0
    assert samples(a)[("vllm:prompt_tokens_total", frozenset({"model_name": "a"}.items()))] == 5


def test_vllm_buckets():
    assert TTFT_BUCKETS[0] == 0.001 and TTFT_BUCKETS[-1] == 2560.0 and len(TTFT_BUCKETS) == 22
    assert ITL_BUCKETS[0] == 0.01 and ITL_BUCKETS[-1] == 80.0
    assert build_1_2_5_buckets(100) == [1, 2, 5, 10, 20, 50, 100]
    assert build_1_2_5_buckets(4096)[-1] == 2000


def test_under_data_parallelism_request_success_carries_the_engine():
    """vLLM labels every series with ``engine`` (issue 45, item 5): a finished request counts
    under the engine core that ran it; one engine keeps the series without the label."""
    m = ServerMetrics(MODEL, engines=2)
    m.record_finished("stop", e2e=0.1, engine=1)
    m.record_finished("stop", e2e=0.1, engine=1)
    m.record_finished("length", e2e=0.1)  # engine 0
    assert value(m, "vllm:request_success_total", finished_reason="stop", engine="1") == 2
    assert value(m, "vllm:request_success_total", finished_reason="stop", engine="0") == 0
    assert value(m, "vllm:request_success_total", finished_reason="length", engine="0") == 1
    assert value(m, "vllm:request_success_total", finished_reason="abort", engine="1") == 0  # from the start
    assert all(dict(labels).get("engine") in ("0", "1") for name, labels in samples(m)
               if name == "vllm:request_success_total")
    single = ServerMetrics(MODEL)
    single.record_finished("stop", e2e=0.1)
    assert value(single, "vllm:request_success_total", finished_reason="stop") == 1
