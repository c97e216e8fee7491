"""benchmarks/bench_serving.py: its arithmetic on canned timings, its arrival generator, its
/metrics deltas and SSE parsing on canned text, its error kinds against a mock transport, its
server lifecycle, and one real run against the service on a tiny checkpoint.

No assertion here is about speed: the canned numbers are hand-computed, the real run checks
counts only."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import math
import random
import statistics
import sys

import httpx
import pytest
from PIL import Image

from atb_plugin.server.metrics import ServerMetrics
from atb_plugin.testing.tiny import tiny_checkpoint
from tests.helpers import load_benchmark
from tests.server_helpers import free_port


bench = load_benchmark("bench_serving")
Record = bench.RequestRecord


# -- percentiles and the per-request arithmetic ------------------------------------------------------


def test_percentiles_interpolate_linearly_between_order_statistics():
    values = [40.0, 10.0, 30.0, 20.0]
    assert bench.summarize(values) == pytest.approx({"mean": 25.0, "median": 25.0, "p90": 37.0, "p99": 39.7})
    assert bench.summarize([7.0]) == {"mean": 7.0, "median": 7.0, "p90": 7.0, "p99": 7.0}
    assert bench.summarize([]) == {"mean": None, "median": None, "p90": None, "p99": None}
    assert bench.percentile([1.0, 2.0, 3.0], 0) == 1.0 and bench.percentile([1.0, 2.0, 3.0], 100) == 3.0


def canned_records() -> list:
    """Three successes and three failures with hand-picked times (seconds)."""
    return [
        # ttft 100 ms, chunks 50 and 100 ms apart, e2e 300 ms, 3 tokens: TPOT (300-100)/2 = 100 ms
        Record(start=0.0, ttft=0.1, chunk_times=[0.1, 0.15, 0.25], end=0.3, output_tokens=3, prompt_tokens=10,
               usage_reported=True),
        # one token: no TPOT, no ITL; ttft 200 ms = e2e
        Record(start=1.0, ttft=0.2, chunk_times=[1.2], end=1.2, output_tokens=1, prompt_tokens=20,
               usage_reported=True),
        # ttft 50 ms, four 50 ms gaps, e2e 250 ms, 5 tokens: TPOT (250-50)/4 = 50 ms
        Record(start=2.0, ttft=0.05, chunk_times=[2.05, 2.10, 2.15, 2.20, 2.25], end=2.25, output_tokens=5,
               prompt_tokens=30, usage_reported=True),
        Record(start=0.5, end=0.6, error="http_4xx:429", error_detail="too many requests"),
        Record(start=0.7, end=1.7, error="timeout", error_detail="no complete answer in 1s"),
        Record(start=0.8, end=0.9, error="http_4xx:429", error_detail="later one"),
    ]


def test_tpot_excludes_the_first_token_and_needs_two():
    first, single, third = canned_records()[:3]
    assert bench.request_tpot(first) == pytest.approx(0.1)
    assert bench.request_tpot(single) is None
    assert bench.request_tpot(third) == pytest.approx(0.05)
    assert bench.request_itls(first) == pytest.approx([0.05, 0.1])
    assert bench.request_itls(single) == []


def test_aggregate_on_canned_records():
    result = bench.aggregate(canned_records(), duration_s=2.5)
    assert result["completed"] == 3 and result["failed"] == 3
    assert result["total_input_tokens"] == 60 and result["total_output_tokens"] == 9
    assert result["request_throughput"] == pytest.approx(3 / 2.5)
    assert result["output_throughput"] == pytest.approx(9 / 2.5)
    assert result["total_token_throughput"] == pytest.approx(69 / 2.5)
    # TTFT [100, 200, 50] ms; sorted [50, 100, 200]: p90 at rank 1.8 -> 100 + 0.8 * 100
    assert result["ttft_ms"] == pytest.approx({"mean": 350 / 3, "median": 100.0, "p90": 180.0, "p99": 198.0})
    # TPOT [100, 50] ms (the one-token request has none)
    assert result["tpot_ms"] == pytest.approx({"mean": 75.0, "median": 75.0, "p90": 95.0, "p99": 99.5})
    # ITL pooled: [50, 100] + [50, 50, 50, 50]; sorted, p90 at rank 4.5 -> 50 + 0.5 * 50
    assert result["itl_ms"] == pytest.approx({"mean": 350 / 6, "median": 50.0, "p90": 75.0, "p99": 97.5})
    # E2E [300, 200, 250] ms
    assert result["e2e_ms"] == pytest.approx({"mean": 250.0, "median": 250.0, "p90": 290.0, "p99": 299.0})
    assert result["errors"] == {"http_4xx:429": 2, "timeout": 1}
    assert result["error_examples"] == {"http_4xx:429": "too many requests", "timeout": "no complete answer in 1s"}
    assert result["usage_missing"] == 0


def test_aggregate_of_nothing_reports_no_numbers_rather_than_dividing_by_zero():
    result = bench.aggregate([], duration_s=0.0)
    assert result["completed"] == 0 and result["request_throughput"] is None
    assert result["ttft_ms"]["mean"] is None and result["errors"] == {}


def test_finish_record_falls_back_to_chunks_and_planned_length():
    no_usage = Record(start=0.0, ttft=0.1, chunk_times=[0.1, 0.2], end=0.2)
    bench.finish_record(no_usage, planned_prompt_tokens=12)
    assert (no_usage.output_tokens, no_usage.prompt_tokens, no_usage.ok) == (2, 12, True)
    empty = Record(start=0.0, end=0.1)
    bench.finish_record(empty, planned_prompt_tokens=12)
    assert empty.error == "no_output"
    assert bench.http_error_kind(503) == "http_5xx:503" and bench.http_error_kind(404) == "http_4xx:404"


# -- arrivals ----------------------------------------------------------------------------------------


def gaps(count, rate, burstiness, seed=0):
    return bench.inter_arrival_gaps(count, rate, burstiness, random.Random(seed))


def test_gaps_are_seeded_and_average_one_over_the_rate():
    assert gaps(50, 4.0, 1.0, seed=3) == gaps(50, 4.0, 1.0, seed=3)
    assert gaps(50, 4.0, 1.0, seed=3) != gaps(50, 4.0, 1.0, seed=4)
    for burstiness in (0.5, 1.0, 3.0):
        assert statistics.fmean(gaps(20000, 4.0, burstiness)) == pytest.approx(0.25, rel=0.05)


def test_burstiness_is_the_gamma_shape_variance_one_over_rate_squared_times_shape():
    rate = 4.0
    variances = {b: statistics.variance(gaps(20000, rate, b)) for b in (0.25, 1.0, 4.0)}
    for burstiness, variance in variances.items():
        assert variance == pytest.approx(1 / (rate**2 * burstiness), rel=0.15)
    assert variances[0.25] > variances[1.0] > variances[4.0]  # burstier = more spread


def test_infinite_rate_sends_everything_at_once_and_offsets_start_at_zero():
    assert gaps(5, math.inf, 1.0) == [0.0] * 5
    assert bench.arrival_offsets(5, math.inf, 1.0, random.Random(0)) == [0.0] * 5
    offsets = bench.arrival_offsets(100, 10.0, 1.0, random.Random(0))
    assert len(offsets) == 100 and offsets[0] == 0.0
    assert all(later >= earlier for earlier, later in zip(offsets, offsets[1:]))
    assert bench.arrival_offsets(0, 10.0, 1.0, random.Random(0)) == []
    with pytest.raises(ValueError):
        gaps(3, 1.0, 0.0)


# -- /metrics ----------------------------------------------------------------------------------------

BEFORE = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="m"} 0.0
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{model_name="m"} 100.0
# TYPE vllm:prompt_tokens_created gauge
vllm:prompt_tokens_created{model_name="m"} 1.7e+09
# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{model_name="m"} 40.0
# TYPE vllm:request_success_total counter
vllm:request_success_total{finished_reason="stop",model_name="m"} 2.0
vllm:request_success_total{finished_reason="length",model_name="m"} 1.0
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{le="0.1",model_name="m"} 3.0
vllm:time_to_first_token_seconds_bucket{le="+Inf",model_name="m"} 3.0
vllm:time_to_first_token_seconds_count{model_name="m"} 3.0
vllm:time_to_first_token_seconds_sum{model_name="m"} 0.15
# TYPE vllm:e2e_request_latency_seconds histogram
vllm:e2e_request_latency_seconds_count{model_name="m"} 3.0
vllm:e2e_request_latency_seconds_sum{model_name="m"} 1.5
"""

AFTER = """\
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="m"} 4.0
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{model_name="m"} 160.0
# TYPE vllm:prompt_tokens_created gauge
vllm:prompt_tokens_created{model_name="m"} 1.7e+09
# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{model_name="m"} 64.0
# TYPE vllm:request_success_total counter
vllm:request_success_total{finished_reason="stop",model_name="m"} 3.0
vllm:request_success_total{finished_reason="length",model_name="m"} 4.0
vllm:request_success_total{finished_reason="abort",model_name="m"} 1.0
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{le="0.1",model_name="m"} 5.0
vllm:time_to_first_token_seconds_bucket{le="+Inf",model_name="m"} 8.0
vllm:time_to_first_token_seconds_count{model_name="m"} 8.0
vllm:time_to_first_token_seconds_sum{model_name="m"} 1.15
# TYPE vllm:e2e_request_latency_seconds histogram
vllm:e2e_request_latency_seconds_count{model_name="m"} 8.0
vllm:e2e_request_latency_seconds_sum{model_name="m"} 4.0 1700000000000
"""


def test_prometheus_deltas_keep_counters_and_histogram_sums_and_counts_only():
    deltas = bench.metric_deltas(bench.parse_prometheus_text(BEFORE), bench.parse_prometheus_text(AFTER))
    names = {bench.series_name(key): value for key, value in deltas.items()}
    assert names['vllm:prompt_tokens_total{model_name="m"}'] == 60.0
    assert names['vllm:request_success_total{finished_reason="abort",model_name="m"}'] == 1.0  # new series
    assert not any("num_requests_running" in n or "_bucket" in n or "_created" in n for n in names)

    summary = bench.summarize_server_metrics(deltas)
    assert summary["available"] is True
    assert summary["prompt_tokens"] == 60.0 and summary["generation_tokens"] == 24.0
    assert summary["request_success"] == {"abort": 1.0, "length": 3.0, "stop": 1.0}
    assert summary["mean_ttft_ms"] == pytest.approx(1000 * 1.0 / 5)  # (1.15 - 0.15) s over 5 requests
    assert summary["mean_e2e_ms"] == pytest.approx(1000 * 2.5 / 5)
    assert summary["mean_itl_ms"] is None  # this server has no such histogram


def test_prometheus_labels_with_escapes_and_openmetrics_counter_families():
    text = ('# TYPE foo counter\nfoo_total{path="/a,b",quote="say \\"hi\\""} 3\n'
            'foo_created{path="/a,b"} 1.7e9\nnot a sample line\n')
    scrape = bench.parse_prometheus_text(text)
    assert scrape.samples[("foo_total", (("path", "/a,b"), ("quote", 'say "hi"')))] == 3.0
    assert bench.is_cumulative("foo_total", scrape.types) and not bench.is_cumulative("foo_created", scrape.types)


def test_deltas_of_our_own_servers_metrics_text():
    metrics = ServerMetrics("tiny")
    before = bench.parse_prometheus_text(metrics.render()[0].decode())
    for _ in range(2):
        metrics.record_finished("length", e2e=0.5, prompt_tokens=7, generation_tokens=4, ttft=0.1)
    after = bench.parse_prometheus_text(metrics.render()[0].decode())
    summary = bench.summarize_server_metrics(bench.metric_deltas(before, after))
    assert summary["prompt_tokens"] == 14 and summary["generation_tokens"] == 8
    assert summary["request_success"]["length"] == 2
    assert summary["mean_ttft_ms"] == pytest.approx(100.0) and summary["mean_e2e_ms"] == pytest.approx(500.0)


# -- server-sent events ------------------------------------------------------------------------------

STREAM = (
    'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}\n\n'
    'data: {"choices":[{"index":0,"delta":{"content":"Caf\u00e9 \u65e5\u672c"}}]}\n\n'
    ": a comment line\n"
    'data:{"choices":[{"index":0,"delta":{"content":" two"}}]}\n\n'
    'event: ignored\ndata: {"choices":[],"usage":{"prompt_tokens":9,"completion_tokens":2}}\n\n'
    "data: [DONE]\n\n"
).encode()


def decode_in_chunks(data: bytes, cuts: list[int]) -> list[str]:
    decoder, events, previous = bench.SSEDecoder(), [], 0
    for cut in [*cuts, len(data)]:
        events += decoder.feed(data[previous:cut])
        previous = cut
    return events + decoder.close()


def test_sse_events_survive_every_split_point_and_crlf_line_ends():
    expected = decode_in_chunks(STREAM, [])
    assert len(expected) == 5 and expected[-1] == "[DONE]"
    assert json.loads(expected[1])["choices"][0]["delta"]["content"] == "Caf\u00e9 \u65e5\u672c"
    for stream in (STREAM, STREAM.replace(b"\n", b"\r\n")):
        # inside "data:", between \r and \n, inside a multi-byte character: every place once
        for cut in range(1, len(stream)):
            assert decode_in_chunks(stream, [cut]) == expected, cut
        assert decode_in_chunks(stream, list(range(1, len(stream)))) == expected  # byte by byte


def test_sse_multiline_data_and_a_last_event_without_blank_line():
    assert decode_in_chunks(b"data: a\ndata: b\n\ndata: tail", [9]) == ["a\nb", "tail"]


def test_events_fold_into_a_record():
    record = Record(start=10.0)
    times = iter([10.1, 10.3, 10.4, 10.5, 10.6])
    done = [bench.apply_event(record, bench.parse_event(p), next(times)) for p in decode_in_chunks(STREAM, [])]
    assert done == [False, False, False, False, True]
    assert record.ttft == pytest.approx(0.3)  # the role chunk carries no text: not the first token
    assert record.chunk_times == [10.3, 10.4]
    assert (record.output_tokens, record.prompt_tokens, record.usage_reported) == (2, 9, True)
    completion = bench.parse_event('{"choices":[{"index":0,"text":"hi"}]}')
    assert completion.kind == "chunk" and completion.text == "hi"


def test_error_event_and_unparsable_data_are_their_own_error_kinds():
    error = bench.parse_event('{"error": {"message": "the request failed: boom", "code": 500}}')
    assert error.kind == "error" and error.message == "the request failed: boom"
    with pytest.raises(bench.StreamError) as raised:
        bench.apply_event(Record(start=0.0), error, 1.0)
    assert raised.value.kind == "stream_error"
    with pytest.raises(bench.StreamError) as raised:
        bench.parse_event('{"choices": [')
    assert raised.value.kind == "parse_error"


# -- requests through a mock transport ---------------------------------------------------------------


def send_with(handler, timeout: float = 5.0):
    """One send_request against an in-process httpx transport."""
    async def run():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler), base_url="http://test") as client:
            return await bench.send_request(client, "/v1/chat/completions", {"stream": True}, timeout, 5)
    return asyncio.run(run())


async def chunked(*parts: bytes, delay: float = 0.0):
    for part in parts:
        if delay:
            await asyncio.sleep(delay)
        yield part


def test_send_request_reads_a_split_stream():
    cuts = [7, 60, 61, 130, 200]
    parts = [STREAM[a:b] for a, b in zip([0, *cuts], [*cuts, len(STREAM)])]
    record = send_with(lambda request: httpx.Response(200, content=chunked(*parts)))
    assert record.ok and record.output_tokens == 2 and record.prompt_tokens == 9
    assert record.ttft is not None and record.end >= record.start + record.ttft


def test_send_request_error_kinds():
    def refuse(request):
        raise httpx.ConnectError("connection refused", request=request)

    def stall(request):
        return httpx.Response(200, content=chunked(STREAM[:80], STREAM[80:], delay=2.0))

    failing_stream = b'data: {"choices":[{"delta":{"content":"a"}}]}\n\ndata: {"error":{"message":"boom"}}\n\n'
    cases = {
        "http_4xx:429": lambda request: httpx.Response(429, json={"error": {"message": "busy"}}),
        "http_5xx:503": lambda request: httpx.Response(503, text="unhealthy"),
        "stream_error": lambda request: httpx.Response(200, content=chunked(failing_stream)),
        "parse_error": lambda request: httpx.Response(200, content=chunked(b"data: not json\n\n")),
        "connection_error": refuse,
    }
    for kind, handler in cases.items():
        assert send_with(handler).error == kind
    assert send_with(stall, timeout=0.2).error == "timeout"
    assert "busy" in send_with(cases["http_4xx:429"]).error_detail


# -- requests and datasets ---------------------------------------------------------------------------


def bench_args(*extra: str):
    return bench.parse_args(["--base-url", "http://127.0.0.1:1", *extra])


def test_specs_are_seeded_and_lengths_stay_in_the_range():
    args = bench_args("--input-len", "40", "--output-len", "10", "--range-ratio", "0.5", "--seed", "7")
    specs = bench.build_specs(args, 200, "timed", bench.WordPrompts())
    assert [s.prompt for s in specs] == [s.prompt for s in bench.build_specs(args, 200, "timed", bench.WordPrompts())]
    assert all(20 <= s.input_len <= 60 and 5 <= s.output_len <= 15 for s in specs)
    assert all(len(s.prompt.split()) == s.input_len for s in specs)
    assert len({s.input_len for s in specs}) > 10
    warmup = bench.build_specs(args, 3, "warmup", bench.WordPrompts())
    assert warmup[0].prompt != specs[0].prompt  # warm-up requests are not the timed ones


def test_tokenizer_prompts_hit_the_length_exactly():
    prompts = bench.TokenizerPrompts(str(tiny_checkpoint("qwen2")))
    rng = random.Random(0)
    for length in (1, 7, 64, 300):
        text, actual = prompts.make(length, rng)
        assert actual == length == len(prompts.tokenizer.encode(text, add_special_tokens=False))


def image_size_of(url: str) -> tuple[int, int]:
    assert url.startswith("data:image/png;base64,")
    return Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1]))).size


def test_chat_body_with_images_and_completion_body():
    args = bench_args("--images-per-request", "2", "--image-size", "32x16", "--ignore-eos", "--output-len", "5")
    specs = bench.build_specs(args, 2, "timed", bench.WordPrompts())
    body = bench.request_body(specs[0], args, "m")
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["max_tokens"] == body["max_completion_tokens"] == 5 and body["ignore_eos"] is True
    parts = body["messages"][0]["content"]
    assert [p["type"] for p in parts] == ["image_url", "image_url", "text"]
    assert image_size_of(parts[0]["image_url"]["url"]) == (32, 16)
    assert specs[0].images == specs[1].images and specs[0].images[0] != specs[0].images[1]  # reused set

    unique = bench.build_specs(bench_args("--images-per-request", "1", "--image-size", "8x8", "--unique-images"),
                               2, "timed", bench.WordPrompts())
    assert unique[0].images != unique[1].images

    plain = bench_args("--endpoint", "completions")
    body = bench.request_body(bench.build_specs(plain, 1, "timed", bench.WordPrompts())[0], plain, "m")
    assert isinstance(body["prompt"], str) and "messages" not in body and "ignore_eos" not in body
    assert "logit_bias" not in body


def test_banned_token_ids_go_out_as_logit_bias():
    args = bench_args("--ban-token-ids", "2,0", "--endpoint", "completions")
    body = bench.request_body(bench.build_specs(args, 1, "timed", bench.WordPrompts())[0], args, "m")
    assert body["logit_bias"] == {"2": -100, "0": -100}  # JSON object keys are strings
    assert bench.run_config(args)["ban_token_ids"] == [2, 0]


@pytest.mark.parametrize("argv", [
    ["--num-prompts", "2"],  # neither --base-url nor --start-server
    ["--base-url", "http://x", "--max-concurrency", "4"],  # a cap without an open loop
    ["--base-url", "http://x", "--concurrency", "2", "--request-rate", "3"],
    ["--base-url", "http://x", "--endpoint", "completions", "--images-per-request", "1"],
    ["--base-url", "http://x", "--ban-token-ids", "2,x"],
    ["--base-url", "http://x", "--ban-token-ids", "-1"],
    ["--base-url", "http://x", "--range-ratio", "1.5"],
    ["--start-server", "--server-cmd", "serve --port 8000"],  # no {port}
])
def test_bad_flag_combinations_are_refused(argv, capsys):
    with pytest.raises(SystemExit) as raised:
        bench.parse_args(argv)
    assert raised.value.code == 2


# -- a server this script starts ---------------------------------------------------------------------


def test_managed_server_waits_for_health_and_stops_its_process_group(tmp_path):
    (tmp_path / "health").write_text("ok")
    port = free_port()
    command = [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1", "--directory", str(tmp_path)]
    server = bench.ManagedServer(command, port, tmp_path / "log", ready_timeout=30, stop_timeout=10)
    with server:
        assert httpx.get(server.base_url + "/health").text == "ok"
    assert server.process.poll() is not None and not server._group_alive()
    assert server.describe()["command"].endswith(str(tmp_path)) and server.describe()["killed"] is False


def test_managed_server_that_exits_early_is_an_error(tmp_path):
    command = [sys.executable, "-c", "import sys; print('no model here'); sys.exit(3)"]
    with pytest.raises(bench.BenchmarkError, match="code 3"):
        with bench.ManagedServer(command, free_port(), tmp_path / "log", ready_timeout=30, stop_timeout=5):
            pass


# -- one real run ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(serve):
    with serve(tiny_checkpoint("qwen2")) as process:
        yield process


def test_a_real_run_against_our_server(server, capsys, tmp_path):
    result_file = tmp_path / "result.json"
    code = bench.main(["--base-url", server.base_url, "--num-prompts", "6", "--concurrency", "2",
                       "--input-len", "16", "--output-len", "4", "--ignore-eos", "--warmup", "1",
                       "--result-json", str(result_file)])
    out = capsys.readouterr().out
    result = json.loads(out.strip().splitlines()[-1])
    assert code == 0, out
    assert result["completed"] == 6 and result["failed"] == 0 and result["errors"] == {}
    assert result["total_output_tokens"] == 24 and result["usage_missing"] == 0
    assert result["total_input_tokens"] >= 6 * 16  # the chat template adds its own tokens
    assert result["ttft_ms"]["mean"] > 0 and result["tpot_ms"]["median"] > 0 and result["e2e_ms"]["p99"] > 0
    metrics = result["server_metrics"]
    assert metrics["available"] is True
    assert metrics["generation_tokens"] == 24  # the warm-up request is not in the delta
    assert metrics["prompt_tokens"] == result["total_input_tokens"]
    assert metrics["request_success"]["length"] == 6
    assert metrics["mean_ttft_ms"] > 0 and metrics["mean_e2e_ms"] > 0
    assert json.loads(result_file.read_text()) == result
    assert "TTFT" in out and "Serving benchmark" in out
