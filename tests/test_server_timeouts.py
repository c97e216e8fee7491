"""MindIE's timeouts through the real service: a request past its whole-request limit
(``--request-timeout`` / ``request_timeout``) and one that waits too long for a token
(``--token-timeout`` / ``token_timeout``: here it queues behind a long request on a one-sequence
engine, a slow step as the waiting request sees it) end with a 504 (a stream: an error event,
then ``[DONE]``), counted in ``/metrics``, leaving nothing running, waiting or leased."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from atb_plugin.frontend.async_llm import Deadlines
from atb_plugin.server.api_server import deadlines
from atb_plugin.testing.tiny import tiny_checkpoint
from tests.server_helpers import ServerProcess, data_url

# Each module starts real servers: `-m "not slow"` skips them in quick local loops (CI runs them).
pytestmark = pytest.mark.slow

# The served name (no --served-model-name: the checkpoint directory's name), as requests and
# metrics spell it.
MODEL = tiny_checkpoint("qwen2_vl").name
# Runs to the end of the context window (4096 tokens): seconds, far past the limits below.
LONG = {"max_tokens": 4000, "ignore_eos": True, "temperature": 0}


def image_chat(text: str = "Describe it at length.") -> list[dict]:
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(seed=9)}},
                                         {"type": "text", "text": text}]}]


@pytest.fixture(scope="module")
def server(serve):
    with serve(tiny_checkpoint("qwen2_vl"), "--max-num-seqs", "1", "--token-timeout", "60",
               "--request-timeout", "60") as server:
        yield server


def metric(server: ServerProcess, name: str) -> float:
    for line in server.get("/metrics").text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise LookupError(name)


def settled(server: ServerProcess) -> dict[str, float]:
    """Once the engine is idle: what is still running, waiting or leased (all 0 when clean)."""
    deadline = time.monotonic() + 15
    while True:
        values = {name: metric(server, name) for name in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                                                          "atb_plugin:shm_leased_segments")}
        if not any(values.values()) or time.monotonic() > deadline:
            return values
        time.sleep(0.2)


def test_a_request_past_its_limit_is_a_504_and_leaves_nothing_behind(server):
    start = time.monotonic()
    response = server.post("/v1/chat/completions", {"messages": image_chat(), "request_timeout": 1.0, **LONG})
    elapsed = time.monotonic() - start
    assert response.status_code == 504, response.text
    error = response.json()["error"]
    assert "limit of 1 s" in error["message"] and "--request-timeout" in error["message"]
    assert elapsed >= 1.0  # never before its limit
    assert settled(server) == {"vllm:num_requests_running": 0, "vllm:num_requests_waiting": 0,
                               "atb_plugin:shm_leased_segments": 0}
    assert metric(server, 'atb_plugin:request_timeouts_total{kind="request",model_name="' + MODEL + '"}') >= 1


def test_a_stream_past_its_limit_ends_with_an_error_event_then_done(server):
    body = {"messages": image_chat(), "request_timeout": 1.0, "stream": True, **LONG}
    with httpx.stream("POST", server.base_url + "/v1/chat/completions", json=body, timeout=30) as response:
        assert response.status_code == 200
        events = [line[len("data: "):] for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] == 504 and "limit of 1 s" in error["message"]
    assert len(events) > 3  # tokens streamed before the limit
    assert settled(server)["atb_plugin:shm_leased_segments"] == 0


def test_a_request_waiting_too_long_for_a_token_is_a_504(server):
    # One sequence at a time: a long request holds the engine, the next one waits for its first token.
    holder = threading.Thread(target=server.post, args=("/v1/chat/completions",
                                                        {"messages": image_chat("Go on."), **LONG}))
    holder.start()
    try:
        time.sleep(0.5)  # the long request is running
        start = time.monotonic()
        response = server.post("/v1/chat/completions", {"messages": image_chat("Quick?"), "max_tokens": 2,
                                                        "token_timeout": 0.5})
        elapsed = time.monotonic() - start
    finally:
        holder.join(60)
    assert response.status_code == 504, response.text
    assert "no token came within 0.5 s" in response.json()["error"]["message"]
    assert elapsed >= 0.5  # never before its limit
    assert metric(server, 'atb_plugin:request_timeouts_total{kind="token",model_name="' + MODEL + '"}') >= 1
    assert settled(server) == {"vllm:num_requests_running": 0, "vllm:num_requests_waiting": 0,
                               "atb_plugin:shm_leased_segments": 0}


def test_a_requests_own_limit_may_lower_the_servers_not_raise_it():
    class Config:
        request_timeout, token_timeout = 30.0, None

    class Asked:
        request_timeout, token_timeout = 100.0, 2.0

    limits = deadlines(Config, Asked, start=5.0)
    assert limits == Deadlines(request_timeout=30.0, token_timeout=2.0, start=5.0)
    Asked.request_timeout = 1.5
    assert deadlines(Config, Asked, start=5.0).request_timeout == 1.5
    Config.request_timeout, Asked.request_timeout, Asked.token_timeout = None, None, None
    assert deadlines(Config, Asked, start=5.0) is None


def test_timeouts_must_be_positive(server):
    for body in ({"request_timeout": 0}, {"token_timeout": -1}):
        response = server.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], **body})
        assert response.status_code == 400 and next(iter(body)) in response.json()["error"]["message"]
