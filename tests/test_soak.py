"""benchmarks/soak.py: its pure pieces on canned data (flatness of per-second series, the
client-vs-metrics consistency check, the seeded traffic mix, the request bodies, how a request's
outcome is classified), then two short real runs against the service on the tiny Qwen2-VL
checkpoint: a plain soak and one whose engine core is killed and restarted.

No assertion here is about speed or timing: series are hand-made, the real runs check counts,
consistency, exit codes and leftovers only."""

from __future__ import annotations

import json
import random
from collections import Counter

import pytest

from atb_plugin.server.metrics import ServerMetrics
from tests.helpers import load_benchmark

soak = load_benchmark("soak")
TIGHT = soak.Tolerance(relative=0.03, absolute=1.0)


# -- flatness of the per-second samples ----------------------------------------------------------------


def test_a_flat_noisy_series_is_flat_and_its_numbers_are_reported():
    times = list(range(121))
    values = [1000 + (7 if t % 2 else -7) for t in times]  # +-7 around 1000, no trend
    summary = soak.summarize_series(times, values, window_start=60, tolerance=TIGHT)
    assert summary["flat"] is True
    assert summary["start"] == 993 and summary["end"] == 993 and summary["max"] == 1007 and summary["min"] == 993
    assert abs(summary["slope_per_min"]) < 1


def test_a_steadily_growing_series_is_not_flat_and_its_slope_is_per_minute():
    times = list(range(121))
    values = [1000 + 2 * t for t in times]  # a leak: +2 a second
    summary = soak.summarize_series(times, values, window_start=60, tolerance=TIGHT)
    assert summary["flat"] is False
    assert summary["slope_per_min"] == pytest.approx(120)
    assert summary["growth"] == pytest.approx(120)  # over the 60 s window
    assert (summary["start"], summary["end"], summary["max"]) == (1120, 1240, 1240)


def test_growth_during_warm_up_only_is_flat():
    """A cache filling in the first minute and then bounded is the steady state, not a leak."""
    times = list(range(121))
    values = [min(t, 50) * 10 for t in times]
    assert soak.summarize_series(times, values, window_start=60, tolerance=TIGHT)["flat"] is True
    assert soak.summarize_series(times, values, window_start=0, tolerance=TIGHT)["flat"] is False


def test_growth_within_the_tolerance_is_flat_and_shrinking_always_is():
    times = list(range(61))
    assert soak.summarize_series(times, [100 + t / 30 for t in times], 0, soak.Tolerance(0.03, 0))["flat"] is True
    assert soak.summarize_series(times, [100 + t / 10 for t in times], 0, soak.Tolerance(0.03, 0))["flat"] is False
    assert soak.summarize_series(times, [500 - t for t in times], 0, TIGHT)["flat"] is True


def test_a_window_too_short_to_judge_gives_none_and_no_samples_give_nones():
    times = list(range(10))
    assert soak.summarize_series(times, [t * 100 for t in times], 5, TIGHT)["flat"] is None
    empty = soak.summarize_series([], [], 0, TIGHT)
    assert empty["flat"] is None and empty["start"] is None


def test_slope_is_least_squares():
    assert soak.slope([0, 1, 2, 3], [1, 3, 5, 7]) == pytest.approx(2)
    assert soak.slope([0, 1, 2], [5, 9, 5]) == pytest.approx(0)
    assert soak.slope([4], [1]) == 0 and soak.slope([2, 2], [1, 5]) == 0


def test_summarize_samples_judges_the_last_incarnation_after_its_warm_up():
    def sample(t, incarnation, value):
        return soak.Sample(t, incarnation, *[value] * 7)

    leaking_before_restart = [sample(t, 0, 10 * t) for t in range(0, 40)]
    flat_after = [sample(t, 1, 100) for t in range(40, 140)]
    final = soak.Incarnation(1, service=None, up_at=40.0)
    series = soak.summarize_samples(leaking_before_restart + flat_after, final, warmup=30, ended=140,
                                    tolerances=soak.series_tolerances(8))
    assert series["segments"]["window_start_s"] == 70.0
    assert all(s["flat"] is True and s["start"] == 100 for s in series.values())


# -- the service's metrics against the clients' tallies --------------------------------------------------


def metrics_text(stop=0, length=0, abort=0, error=0, running=0, waiting=0, leased=0) -> str:
    """Real /metrics text, written by the service's own ServerMetrics."""
    metrics = ServerMetrics("m", 4096)
    for reason, count in (("stop", stop), ("length", length), ("abort", abort), ("error", error)):
        for _ in range(count):
            metrics.record_finished(reason, e2e=0.1)
    metrics.set_scheduler_stats(running, waiting, 0.0)
    metrics.set_shm(segments=leased + 3, nbytes=1000, leased_segments=leased)
    return metrics.render()[0].decode()


def test_core_metrics_are_read_from_the_exposition_text():
    snapshot = soak.CoreMetrics.from_text(metrics_text(stop=3, length=2, abort=1, running=4, waiting=1, leased=2))
    assert snapshot.count("stop", "length") == 5 and snapshot.count("abort") == 1 and snapshot.count("error") == 0
    assert (snapshot.running, snapshot.waiting, snapshot.leased_segments) == (4, 1, 2)
    assert not snapshot.idle() and soak.CoreMetrics.from_text(metrics_text(stop=1)).idle()


def test_consistency_holds_when_every_count_matches():
    before = soak.CoreMetrics.from_text(metrics_text(stop=10, length=5, abort=2))
    after = soak.CoreMetrics.from_text(metrics_text(stop=40, length=15, abort=9))
    result = soak.check_consistency(successes=40, disconnects=7, before=before, after=after)
    assert result["consistent"] is True
    assert result["numbers"]["server_successes"] == 40 and result["numbers"]["server_aborts"] == 7


@pytest.mark.parametrize("after, successes, disconnects, failing", [
    (dict(stop=30, abort=6), 30, 7, "aborts_equal_disconnects"),  # a disconnect never aborted
    (dict(stop=31, abort=7), 30, 7, "successes_equal_client_successes"),  # a success the client did not see
    (dict(stop=30, abort=7, error=1), 30, 7, "no_error_finishes"),
    (dict(stop=30, abort=7, running=1), 30, 7, "nothing_running"),
    (dict(stop=30, abort=7, waiting=2), 30, 7, "nothing_running"),
    (dict(stop=30, abort=7, leased=1), 30, 7, "no_leased_segments"),  # a lease never released
])
def test_consistency_fails_on_each_kind_of_mismatch(after, successes, disconnects, failing):
    before = soak.CoreMetrics.from_text(metrics_text())
    result = soak.check_consistency(successes, disconnects, before, soak.CoreMetrics.from_text(metrics_text(**after)))
    assert result["consistent"] is False
    assert [name for name, value in result.items() if value is False] == [failing, "consistent"]


# -- the traffic mix -------------------------------------------------------------------------------------


def test_the_traffic_mix_is_seeded_per_client():
    mix = soak.TrafficMix()
    assert mix.plan(seed=3, client=5, count=200) == mix.plan(seed=3, client=5, count=200)
    assert mix.plan(seed=3, client=5, count=200) != mix.plan(seed=4, client=5, count=200)
    assert mix.plan(seed=3, client=5, count=200) != mix.plan(seed=3, client=6, count=200)
    # What a client's loop draws is the plan.
    rng = soak.kind_rng(3, 5)
    assert [mix.pick(rng) for _ in range(50)] == mix.plan(3, 5, 50)


def test_the_traffic_mix_matches_its_shares():
    draws = 40_000
    counts = Counter(soak.TrafficMix().plan(seed=0, client=0, count=draws))
    assert set(counts) == set(soak.KIND_SHARES)
    for kind, share in soak.KIND_SHARES.items():
        assert counts[kind] / draws == pytest.approx(share, abs=0.01), kind


def test_a_text_only_mix_sends_the_image_shares_as_text():
    mix = soak.TrafficMix().text_only()
    assert not set(mix.shares) & set(soak.IMAGE_KINDS)
    assert mix.shares["text"] == pytest.approx(0.35 + 0.20 + 0.15)
    assert sum(mix.shares.values()) == pytest.approx(1) and "bad_image" in mix.shares


def test_shares_that_do_not_sum_to_one_are_refused():
    with pytest.raises(ValueError):
        soak.TrafficMix({"text": 0.5, "bad_json": 0.4})
    with pytest.raises(ValueError):
        soak.TrafficMix({"text": 1.2, "bad_json": -0.2})


# -- request bodies and outcomes ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def factory():
    return soak.RequestFactory("m", max_model_len=4096, max_tokens=16, seed=0)


def test_each_kind_builds_the_request_it_names(factory):
    rng = random.Random(0)
    bodies = {kind: factory.build(kind, rng, client=1, sequence=i) for i, kind in enumerate(soak.KIND_SHARES)}
    with pytest.raises(json.JSONDecodeError):
        json.loads(bodies["bad_json"].body)
    parsed = {kind: json.loads(spec.body) for kind, spec in bodies.items() if kind != "bad_json"}
    assert parsed["bad_model"]["model"] != "m" and parsed["text"]["model"] == "m"
    assert parsed["bad_max_tokens"]["max_tokens"] > 4096
    assert parsed["bad_image"]["messages"][0]["content"][0]["image_url"]["url"] == soak.NOT_AN_IMAGE
    assert all(parsed[kind]["stream"] for kind in parsed)
    assert {kind: spec.expect_status for kind, spec in bodies.items() if spec.expect_status != 200} == \
        dict(soak.EXPECTED_STATUS)
    disconnect = bodies["disconnect"]
    low, high = soak.DISCONNECT_EVENTS
    assert low <= disconnect.close_after_events <= high
    assert parsed["disconnect"]["ignore_eos"] and parsed["disconnect"]["max_tokens"] == 2048
    assert all(spec.close_after_events is None for kind, spec in bodies.items() if kind != "disconnect")


def test_shared_images_repeat_and_unique_ones_do_not(factory):
    def image_of(kind, rng, sequence):
        body = json.loads(factory.build(kind, rng, client=2, sequence=sequence).body)
        return body["messages"][0]["content"][0]["image_url"]["url"]

    rng = random.Random(1)
    shared = [image_of("image_shared", rng, i) for i in range(40)]
    unique = [image_of("image_unique", rng, i) for i in range(40)]
    assert len(set(shared)) <= soak.SHARED_IMAGES and set(shared) <= set(factory.shared_images)
    assert len(set(unique)) == 40 and not set(unique) & set(factory.shared_images)


def test_a_text_only_factory_sends_no_image_with_a_disconnect():
    factory = soak.RequestFactory("m", 4096, 16, seed=0, takes_images=False)
    rng = random.Random(0)
    assert all(isinstance(json.loads(factory.build("disconnect", rng, 0, i).body)["messages"][0]["content"], str)
               for i in range(30))


def spec(kind="text", expect=200, close_after=None):
    return soak.RequestSpec(kind, b"{}", expect, close_after)


@pytest.mark.parametrize("request_spec, seen, disturbed, expected", [
    (spec(), soak.Observation(200, 5, "length", done=True), False, soak.OK),
    (spec(close_after=3), soak.Observation(200, 3, closed_early=True), False, soak.DISCONNECT),
    (spec("bad_model", 404), soak.Observation(404), False, soak.EXPECTED_4XX),
    (spec("bad_json", 400), soak.Observation(500), False, soak.UNEXPECTED),  # a 5xx for bad input
    (spec(), soak.Observation(400), False, soak.UNEXPECTED),  # a 4xx where success was expected
    (spec(), soak.Observation(200, 2, error_event='{"code": 500}', done=True), False, soak.UNEXPECTED),
    (spec(), soak.Observation(200, 4), False, soak.UNEXPECTED),  # broken: no finish_reason, no [DONE]
    (spec(), soak.Observation(200, 4, "stop"), False, soak.UNEXPECTED),  # no [DONE]
    (spec(), soak.Observation(failure="timeout (ReadTimeout)"), False, soak.UNEXPECTED),
    (spec(), soak.Observation(200, 2, error_event='{"code": 500}', done=True), True, soak.FAULT),
    (spec("bad_image", 400), soak.Observation(failure="ConnectError: refused"), True, soak.FAULT),
])
def test_outcomes_are_classified(request_spec, seen, disturbed, expected):
    assert soak.classify(request_spec, seen, disturbed)[0] == expected


def test_a_disconnect_that_saw_its_finish_reads_on_and_counts_a_success():
    seen = soak.Observation(status=200)
    events = ['{"choices": [{"delta": {"role": "assistant"}}]}',
              '{"choices": [{"delta": {}, "finish_reason": "length"}]}', '{"choices": []}', "[DONE]"]
    assert [soak._read_event(seen, data, close_after=2) for data in events] == [False] * 4
    assert soak.classify(spec(close_after=2), seen, False)[0] == soak.OK


# -- real runs ---------------------------------------------------------------------------------------------

SMALL_SERVICE = "--kv-cache-memory 64M --block-size 16 --tokenizer-workers 1"


def assert_clean(result):
    assert result["unexpected"] == 0, result["unexpected_examples"]
    assert result["consistency"]["consistent"] is True, result["consistency"]
    assert result["service"]["exit_codes"][-1] == 0
    assert result["service"]["leftover_segments"] == [] and result["service"]["leftover_processes"] == []
    assert result["passed"] is True, result["checks"]


@pytest.mark.slow
def test_a_short_soak_has_no_unexpected_error_and_consistent_metrics(tmp_path, capsys):
    result = soak.main(["--clients", "8", "--duration", "8", "--server-args", SMALL_SERVICE,
                        "--log-dir", str(tmp_path / "logs"), "--result-json", str(tmp_path / "result.json")])
    assert_clean(result)
    totals = result["totals"]
    assert totals["ok"] > 0 and totals["expected_4xx"] > 0 and totals["disconnect"] > 0 and totals["fault"] == 0
    assert result["service"]["restarts"] == 0 and result["samples"] > 0
    # The last stdout line is the JSON object, the same as --result-json's.
    last_line = capsys.readouterr().out.strip().splitlines()[-1]
    assert json.loads(last_line) == json.loads((tmp_path / "result.json").read_text()) == result


@pytest.mark.slow
def test_a_killed_engine_core_is_restarted_and_leaves_no_segment(tmp_path):
    result = soak.main(["--clients", "8", "--duration", "8", "--kill-engine-at", "3", "--server-args", SMALL_SERVICE,
                        "--log-dir", str(tmp_path / "logs")])
    assert_clean(result)
    service = result["service"]
    assert service["restarts"] == 1 and service["engine_kills"] == 1
    assert service["exit_codes"][0] not in (0, None) and service["exited_by_itself"][0] is True
    assert service["dead_segments_after_restart"] == [0]
    # The restarted incarnation served the rest of the run (the check runs on its counters).
    assert result["consistency"]["numbers"]["client_successes"] > 0
