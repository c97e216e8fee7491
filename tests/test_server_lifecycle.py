"""The service's lifecycle with real processes: a client that disconnects mid-stream frees its
request; a killed engine core turns into 5xx, an unhealthy /health and a non-zero exit; a killed
tokenizer worker is replaced, its requests fail with 5xx and its segments are reaped; SIGTERM
drains and exits 0 with no segment left; a full shared-memory budget is a 503 with Retry-After."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import pytest

from atb_plugin.testing.tiny import tiny_checkpoint
from shm.segment import list_segment_names
from tests.server_helpers import ServerProcess, data_url

LONG = {"max_tokens": 3000, "temperature": 0, "ignore_eos": True}


def image_chat(seed: int = 0, **fields) -> dict:
    return {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(seed=seed)}},
                                                      {"type": "text", "text": "describe"}]}], **fields}


def metric(server: ServerProcess, name: str, **labels) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    total = 0.0
    for family in text_string_to_metric_families(server.get("/metrics").text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total


def wait_until(condition, timeout: float = 20.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def wait_until_gone(pids, timeout: float = 15.0) -> None:
    """Until none of ``pids`` exists any more."""
    def gone(pid: int) -> bool:
        try:
            os.kill(pid, 0)
            return False
        except ProcessLookupError:
            return True

    wait_until(lambda: all(gone(pid) for pid in pids), timeout=timeout, what=f"processes {list(pids)} to exit")


def wait_until_group_gone(leader: int, timeout: float = 15.0) -> None:
    """Until every process of the group ``leader`` leads (a service and all it started) has exited."""
    def gone() -> bool:
        try:
            os.killpg(leader, 0)
            return False
        except ProcessLookupError:
            return True

    wait_until(gone, timeout=timeout, what="every process of the service's group to exit")


def ipc_sockets_of(server: ServerProcess) -> list[str]:
    """The ZeroMQ ipc:// socket files the service (named by its API process id) left in the temp directory."""
    import glob
    import tempfile

    return glob.glob(os.path.join(tempfile.gettempdir(), f"atb-plugin-{server.process.pid}-*"))


def segments_of(server: ServerProcess) -> list[str]:
    instances = server.shm_instances()
    return [name for name in list_segment_names() if any(name.startswith("psm_" + i) for i in instances)]


class StreamInThread:
    """A streaming request read in a background thread: collects the SSE events."""

    def __init__(self, server: ServerProcess, body: dict, path: str = "/v1/chat/completions"):
        self.events: list[str] = []
        self.status: int | None = None
        self.error: Exception | None = None
        self.first_chunk = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(server, path, {**body, "stream": True}), daemon=True)
        self.thread.start()

    def _run(self, server, path, body):
        try:
            with httpx.stream("POST", server.base_url + path, json=body, headers=server.headers, timeout=60) as response:
                self.status = response.status_code
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        self.events.append(line[6:])
                        if len(self.events) >= 2:
                            self.first_chunk.set()
        except Exception as error:  # noqa: BLE001 - recorded for the test to inspect
            self.error = error
        finally:
            self.first_chunk.set()


@pytest.fixture
def server(serve):
    # Each test checks the exit code itself (one kills the engine core: the service exits 1). No media
    # worker: the tests count and kill the tokenizer worker's shm instance (tests/test_media_workers.py
    # has the media workers').
    with serve(tiny_checkpoint("qwen2_vl"), "--media-workers", "0", check_exit=False) as server:
        yield server


def test_a_client_disconnect_mid_stream_aborts_the_request(server):
    aborted_before = metric(server, "vllm:request_success_total", finished_reason="abort")
    with httpx.stream("POST", server.base_url + "/v1/chat/completions", json={**image_chat(seed=5, **LONG),
                                                                             "stream": True}, timeout=60) as response:
        lines = response.iter_lines()
        for _ in range(6):
            next(lines)
        assert metric(server, "vllm:num_requests_running") == 1
    # The connection is closed: within a step the core drops the request and the lease ends.
    wait_until(lambda: metric(server, "vllm:request_success_total", finished_reason="abort") == aborted_before + 1,
               what="the abort to be counted")
    wait_until(lambda: metric(server, "vllm:num_requests_running") == 0, what="the engine to drop the request")
    wait_until(lambda: metric(server, "atb_plugin:shm_leased_segments") == 0, what="the image's lease to end")
    assert metric(server, "atb_plugin:shm_live_segments") == 1  # still cached for a resend
    # Still serving; then a clean stop unlinks the cached image segment.
    assert server.post("/v1/chat/completions", image_chat(seed=5, max_tokens=2)).status_code == 200
    assert server.stop() == 0
    assert segments_of(server) == []


def test_n_choices_share_one_lease_and_a_disconnect_aborts_them_all(server):
    # n = 2, answered whole: both choices finish, then the one lease of the image ends.
    response = server.post("/v1/chat/completions", image_chat(seed=6, n=2, max_tokens=3, temperature=1.0))
    assert response.status_code == 200 and [c["index"] for c in response.json()["choices"]] == [0, 1]
    wait_until(lambda: metric(server, "atb_plugin:shm_leased_segments") == 0, what="the shared lease to end")
    aborted_before = metric(server, "vllm:request_success_total", finished_reason="abort")
    with httpx.stream("POST", server.base_url + "/v1/chat/completions",
                      json={**image_chat(seed=7, n=3, **LONG), "stream": True}, timeout=60) as response:
        lines = response.iter_lines()
        for _ in range(12):
            next(lines)
        assert metric(server, "vllm:num_requests_running") == 3
    wait_until(lambda: metric(server, "vllm:request_success_total", finished_reason="abort") == aborted_before + 3,
               what="the three choices' aborts")
    wait_until(lambda: metric(server, "vllm:num_requests_running") == 0, what="the engine to drop them")
    wait_until(lambda: metric(server, "atb_plugin:shm_leased_segments") == 0, what="the shared lease to end")
    assert server.stop() == 0
    assert segments_of(server) == []


def test_a_dead_engine_core_fails_requests_and_the_service_exits_nonzero(server):
    stream = StreamInThread(server, image_chat(seed=6, **LONG))
    assert stream.first_chunk.wait(30) and stream.status == 200
    os.kill(server.pid_of("engine core"), signal.SIGKILL)
    stream.thread.join(30)
    errors = [json.loads(e)["error"] for e in stream.events if e != "[DONE]" and "error" in json.loads(e)]
    assert errors and errors[0]["code"] == 500 and "engine-core process died" in errors[0]["message"]
    assert stream.events[-1] == "[DONE]"
    # /health turns 503 until the process exits (it exits on its own, for a supervisor to restart it).
    try:
        health = server.get("/health")
        assert health.status_code == 503 and "unhealthy" in health.json()["error"]["message"]
    except httpx.HTTPError:
        pass  # already gone
    server.process.wait(30)
    assert server.process.returncode == 1, server.log()
    assert segments_of(server) == [], "the workers unlink their segments on the way out"
    assert ipc_sockets_of(server) == []


def test_a_dead_tokenizer_worker_is_replaced_and_its_segments_reaped(server):
    stream = StreamInThread(server, image_chat(seed=7, **LONG))
    assert stream.first_chunk.wait(30) and stream.status == 200
    dead_instance = server.shm_instances()[0]
    assert any(n.startswith("psm_" + dead_instance) for n in list_segment_names())
    os.kill(server.pid_of("tokenizer worker 0"), signal.SIGKILL)
    stream.thread.join(30)
    errors = [json.loads(e)["error"] for e in stream.events if e != "[DONE]" and "error" in json.loads(e)]
    assert errors and errors[0]["code"] == 500 and "tokenizer worker 0 died" in errors[0]["message"]
    # A replacement starts; its store reaps the dead instance's segments.
    wait_until(lambda: len(server.shm_instances()) == 2, timeout=60, what="the replacement worker")
    wait_until(lambda: not any(n.startswith("psm_" + dead_instance) for n in list_segment_names()),
               what="the dead worker's segments to be reaped")
    response = server.post("/v1/chat/completions", image_chat(seed=7, max_tokens=2))
    assert response.status_code == 200, response.text
    assert server.get("/health").status_code == 200
    assert server.stop() == 0
    assert segments_of(server) == []
    assert ipc_sockets_of(server) == [], "the dead worker's endpoint is unlinked too"


def test_sigterm_drains_in_flight_requests_and_exits_zero(server):
    stream = StreamInThread(server, image_chat(seed=8, max_tokens=40, temperature=0, ignore_eos=True))
    assert stream.first_chunk.wait(30)
    assert segments_of(server)
    assert server.stop(signal.SIGTERM) == 0, server.log()
    stream.thread.join(10)
    # The in-flight request finished normally within --shutdown-timeout.
    finals = [json.loads(e) for e in stream.events if e != "[DONE]"]
    assert finals[-1]["choices"][0]["finish_reason"] == "length"
    assert segments_of(server) == []


@pytest.mark.server
def test_a_full_shm_budget_is_a_503_with_retry_after():
    server = ServerProcess(tiny_checkpoint("qwen2_vl"), "--shm-budget-bytes", "4096")
    try:
        response = server.post("/v1/chat/completions", image_chat(seed=9, max_tokens=2))
        assert response.status_code == 503, response.text
        assert response.headers["retry-after"] == "1"
        message = response.json()["error"]["message"]
        assert "--shm-budget-bytes" in message and "--shm-size" in message
        # Text still works, and the server stays healthy.
        ok = server.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        assert ok.status_code == 200 and server.get("/health").status_code == 200
    finally:
        assert server.stop() == 0
    assert segments_of(server) == []


@pytest.mark.server
def test_a_full_queue_is_a_429_and_startup_reaps_a_dead_predecessors_segments():
    from tests.helpers import run_python

    # A "crashed predecessor": a process that wrote a segment and died without cleaning up.
    crashed = run_python("""
        import os, numpy as np, shm
        store = shm.ShmStore(shm.ShmStoreConfig(reap_on_start=False))
        handle = store.put(np.ones((4, 4), np.float32), key="k", request_id="r")
        print(handle.name, flush=True)
        os._exit(0)  # no finalizer: the segment and the instance marker stay behind
    """)
    orphan = crashed.stdout.split()[-1]
    assert orphan in list_segment_names()
    server = ServerProcess(tiny_checkpoint("qwen2_vl"), "--max-queued-requests", "1")
    try:
        assert orphan not in list_segment_names(), "the new service reaps what a dead instance left"
        stream = StreamInThread(server, {"messages": [{"role": "user", "content": "hi"}], **LONG})
        assert stream.first_chunk.wait(30)
        response = server.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})
        assert response.status_code == 429 and response.headers["retry-after"] == "1"
        assert "--max-queued-requests" in response.json()["error"]["message"]
    finally:
        assert server.stop() == 0


@pytest.mark.server
def test_a_failed_start_exits_nonzero_and_leaves_no_process():
    """The engine core cannot start (its KV budget cannot hold one request): the service must
    exit by itself, non-zero, with its tokenizer worker gone (a worker left running used to keep
    the API process from ever exiting, so no supervisor restarted it)."""
    import subprocess
    import sys

    from tests.server_helpers import REPO_ROOT, free_port

    command = [sys.executable, "-m", "atb_plugin.server", "--model", str(tiny_checkpoint("qwen2")),
               "--port", str(free_port()), "--tokenizer-workers", "1", "--kv-cache-memory", "1K"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=REPO_ROOT, text=True,
                               env=dict(os.environ, PYTHONPATH=str(REPO_ROOT)), start_new_session=True)
    try:
        log, _ = process.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        raise AssertionError("the service did not exit after a failed start")
    assert process.returncode != 0 and "raise --kv-cache-memory" in log, log[-2000:]

    wait_until_group_gone(process.pid)
