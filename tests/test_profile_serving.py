"""benchmarks/profile_serving.py: reading py-spy's raw samples and sorting them into phases (on
canned stacks; the profile itself is a benchmark, never run in the suite)."""

from __future__ import annotations

import pytest

from tests.helpers import load_benchmark

load_benchmark("bench_serving")  # profile_serving imports these two as sibling modules
load_benchmark("bench_serving_overhead")
profile = load_benchmark("profile_serving")

ROOT = 'process 10:"python -m atb_plugin.server --model m"'
TRACKER = 'process 11:"python -B -c from multiprocessing.resource_tracker import main;main(22)"'
ENGINE = 'process 12:"python -B -c from multiprocessing.spawn import spawn_main; spawn_main(pipe_handle=25)"'
WORKER = 'process 13:"python -B -c from multiprocessing.spawn import spawn_main; spawn_main(pipe_handle=30)"'
ENGINE_LOOP = "run_engine_core (atb_plugin/engine/process.py:64);_loop (atb_plugin/engine/process.py:100)"
STEP = "EngineCore.step (atb_plugin/engine/core.py:146)"
EXECUTE = "ModelRunner.execute (atb_plugin/engine/model_runner.py:158)"


def line(processes: list[str], thread: str, frames: list[str], count: int) -> str:
    return ";".join([*processes, thread, *frames]) + f" {count}"


RAW = "\n".join([
    line([ROOT, TRACKER], "thread (11): MainThread", ["main (multiprocessing/resource_tracker.py:227)"], 50),
    line([ROOT, ENGINE], "thread (12): MainThread",
         [ENGINE_LOOP, STEP, EXECUTE, "DecoderModel.forward (atb_plugin/models/decoder.py:150)"], 60),
    line([ROOT, ENGINE], "thread (12): MainThread",
         [ENGINE_LOOP, STEP, EXECUTE, "Sampler.sample (atb_plugin/engine/sampler.py:90)"], 10),
    line([ROOT, ENGINE], "thread (12): MainThread",
         [ENGINE_LOOP, STEP, EXECUTE, "prepare_inputs (atb_plugin/engine/prepare_inputs.py:40)"], 5),
    line([ROOT, ENGINE], "thread (12): MainThread",
         [ENGINE_LOOP, STEP, "Scheduler.schedule (atb_plugin/engine/scheduler.py:200)"], 5),
    line([ROOT, ENGINE], "thread (12): MainThread",
         ["run_engine_core (atb_plugin/engine/process.py:64)",
          "_loop (atb_plugin/engine/process.py:103)", "encode (atb_plugin/engine/messages.py:154)"], 4),
    line([ROOT, ENGINE], "thread (12): MainThread",
         ["run_engine_core (atb_plugin/engine/process.py:64)",
          "_loop (atb_plugin/engine/process.py:84)", "decode_request (atb_plugin/engine/messages.py:158)"], 1),
    line([ROOT, ENGINE], "thread (12): MainThread",
         ["run_engine_core (atb_plugin/engine/process.py:64)", "Poller.poll (zmq/sugar/poll.py:106)"], 15),
    line([ROOT, ENGINE], "thread (99): compile", ["Thread.run (threading.py:982)"], 100),  # not the main thread
    line([ROOT, WORKER], "thread (13): MainThread",
         ["run_tokenizer_worker (atb_plugin/frontend/tokenizer_pool.py:87)", "Poller.poll (zmq/sugar/poll.py:106)"], 100),
    line([ROOT], "thread (10): MainThread",
         ["MPClient._read_outputs (atb_plugin/engine/client.py:71)",
          "AsyncLLM.on_outputs (atb_plugin/frontend/async_llm.py:214)",
          "IncrementalDetokenizer.update (atb_plugin/frontend/detokenizer.py:80)"], 30),
    line([ROOT], "thread (10): MainThread",
         ["MPClient._read_outputs (atb_plugin/engine/client.py:71)",
          "decode_outputs (atb_plugin/engine/messages.py:162)"], 10),
    line([ROOT], "thread (10): MainThread",
         ["BaseEventLoop._run_once (asyncio/base_events.py:1884)", "EpollSelector.select (selectors.py:468)"], 60),
    "a line py-spy never writes",
])


def test_raw_lines_parse_even_with_semicolons_in_command_lines():
    samples = profile.parse_raw(RAW)
    assert len(samples) == 13  # the malformed line is skipped
    tracker = samples[0]
    assert (tracker.pid, tracker.thread, tracker.count) == (11, "MainThread", 50)
    assert tracker.frames == ("main (multiprocessing/resource_tracker.py:227)",)
    assert [s.pid for s in samples[1:9]] == [12] * 8 and samples[8].thread == "compile"


def test_samples_sort_into_each_process_phases():
    processes = profile.breakdown(profile.parse_raw(RAW))
    assert set(processes) == {"api", "engine", "worker"}  # the resource tracker is left out
    engine = processes["engine"]
    assert engine["samples"] == 100  # main thread only: the compile thread's 100 are not counted
    assert engine["shares"] == pytest.approx({
        "model forward + LM head": 0.60, "sampler": 0.10, "prepare_inputs": 0.05,
        "scheduler (schedule + update)": 0.05, "IPC out: encode + send outputs": 0.04,
        "IPC in: receive + decode requests": 0.01, "idle: waiting for work": 0.15})
    assert processes["api"]["shares"] == pytest.approx({
        "idle: event loop waiting": 0.6, "detokenise + output processing": 0.3,
        "IPC in: receive + decode outputs": 0.1})
    assert processes["worker"]["shares"] == {"idle: waiting for jobs": 1.0}


def test_the_step_in_milliseconds_and_the_non_forward_share_of_busy_time():
    engine = profile.breakdown(profile.parse_raw(RAW))["engine"]
    assert profile.step_breakdown_ms(engine, 200.0)["model forward + LM head"] == pytest.approx(120.0)
    # busy = 85 %, forward 60 % of the wall: 25 / 85 of the busy time is outside the forward
    assert profile.non_forward_share(engine) == pytest.approx(25 / 85)
    assert profile.non_forward_share({"shares": {"idle: waiting for work": 1.0}}) == 0.0


def test_two_processes_of_one_role_are_told_apart():
    second_worker = 'process 14:"python -B -c from multiprocessing.spawn import spawn_main; spawn_main(pipe_handle=31)"'
    raw = RAW + "\n" + line([ROOT, second_worker], "thread (14): MainThread",
                            ["run_tokenizer_worker (atb_plugin/frontend/tokenizer_pool.py:113)",
                             "run_job (atb_plugin/frontend/tokenizer_pool.py:113)"], 7)
    processes = profile.breakdown(profile.parse_raw(raw))
    assert {"worker 13", "worker 14"} <= set(processes)
    assert processes["worker 14"]["shares"] == {"render + tokenise + images": 1.0}
