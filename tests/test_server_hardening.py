"""Issue 30's hardening of the HTTP door, with real servers (tiny qwen2):

- POST bodies must be declared JSON: any other Content-Type, or none, is a 415 (a text/plain POST
  is a CORS "simple request" any web page can send to a keyless server on localhost);
- no response names a filesystem path: /v1/models and error messages name the served model, not
  the checkpoint's directory, nor the venv's;
- a shutdown past --shutdown-timeout ends each cut request with an error (a stream: an error event
  and [DONE]), one log line each and no CancelledError traceback;
- --enable-auto-tool-choice with a chat template that drops tools is warned about at start-up;
- the Authorization scheme is case-insensitive ("bearer KEY");
- a cleanly stopped test server leaves no log file behind.
"""

from __future__ import annotations

import json
import os
import signal
import site
import sys
import threading
import time

import httpx
import pytest

from atb_plugin.server.errors import Redactor
from atb_plugin.testing.tiny import QWEN2_5_CHAT_TEMPLATE, tiny_checkpoint
from tests.server_helpers import ServerProcess

pytestmark = pytest.mark.slow

NAME = "tiny-qwen2"
KEY = "sekret-key"
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
AUTO_TOOLS = ("--enable-auto-tool-choice", "--tool-call-parser", "hermes")
TOOLS_WARNING = "--enable-auto-tool-choice is set but the chat template of"


@pytest.fixture(scope="module")
def server(serve):
    # The tiny qwen2's own template is Qwen2's ChatML, which ignores `tools`.
    with serve(tiny_checkpoint("qwen2"), "--served-model-name", NAME, *AUTO_TOOLS, api_key=KEY) as server:
        yield server


def post_raw(server: ServerProcess, path: str, body: bytes, content_type: str | None) -> httpx.Response:
    headers = dict(server.headers)
    if content_type is not None:
        headers["Content-Type"] = content_type
    return httpx.post(server.base_url + path, content=body, headers=headers, timeout=60)


def private_paths() -> list[str]:
    model = str(tiny_checkpoint("qwen2"))
    return sorted({model, os.path.realpath(model), sys.prefix, os.path.realpath(sys.prefix)}, key=len, reverse=True)


def assert_no_paths(text: str) -> None:
    for path in private_paths():
        assert path not in text, f"{path} leaked in {text}"


# -- 415: the body must be declared JSON ---------------------------------------------------------


POST_ROUTES = ["/v1/chat/completions", "/v1/completions", "/tokenize", "/detokenize", "/v1/embeddings", "/score"]


@pytest.mark.parametrize("path", POST_ROUTES)
@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded",
                                          "multipart/form-data; boundary=x", None])
def test_a_body_not_declared_json_is_a_415(server, path, content_type):
    response = post_raw(server, path, json.dumps({**CHAT, "prompt": "hi", "tokens": [1]}).encode(), content_type)
    assert response.status_code == 415, response.text
    error = response.json()["error"]
    assert error["code"] == 415 and error["type"] == "UnsupportedMediaType"
    assert "application/json" in error["message"]
    assert (content_type.split(";")[0] if content_type else "no Content-Type") in error["message"]


@pytest.mark.parametrize("content_type", ["application/json", "application/json; charset=utf-8",
                                          "Application/JSON;charset=UTF-8", "application/vnd.api+json"])
def test_json_content_types_are_accepted(server, content_type):
    response = post_raw(server, "/v1/chat/completions", json.dumps(CHAT).encode(), content_type)
    assert response.status_code == 200, response.text


def test_the_415_comes_after_auth(server):
    response = httpx.post(server.base_url + "/v1/completions", content=b"{}", headers={"Content-Type": "text/plain"})
    assert response.status_code == 401


# -- no filesystem paths in answers --------------------------------------------------------------


def test_v1_models_names_the_served_model_not_its_path(server):
    response = server.get("/v1/models")
    assert response.status_code == 200
    card = response.json()["data"][0]
    assert card["id"] == NAME and card["root"] == NAME
    assert_no_paths(response.text)


@pytest.mark.parametrize("path, body", [
    ("/v1/embeddings", {"input": "hi"}),
    ("/pooling", {"input": "hi"}),
    ("/classify", {"input": "hi"}),
    ("/score", {"text_1": "a", "text_2": "b"}),
    ("/rerank", {"query": "a", "documents": ["b"]}),
])
def test_a_pooling_request_to_a_generative_model_names_the_served_model(server, path, body):
    response = server.post(path, body)
    assert response.status_code == 400, response.text
    assert NAME in response.json()["error"]["message"]
    assert_no_paths(response.text)


@pytest.mark.parametrize("body", [
    {**CHAT, "model": "nope"},
    {**CHAT, "max_tokens": 10**6},
    {**CHAT, "messages": []},
    {**CHAT, "temperature": -1},
])
def test_bad_requests_name_no_paths(server, body):
    response = server.post("/v1/chat/completions", body)
    assert 400 <= response.status_code < 500, response.text
    assert_no_paths(response.text)


def test_redactor_hides_the_checkpoint_and_the_venv():
    model = str(tiny_checkpoint("qwen2"))
    redact = Redactor(model, NAME)
    torch_file = os.path.join(site.getsitepackages()[0], "torch", "nn", "functional.py")
    stdlib_file = os.path.join(sys.base_prefix, "lib", "asyncio", "tasks.py")
    message = redact(f"internal error: {model}/config.json broke in '{torch_file}', line 3, called from "
                     f"{stdlib_file}; see {os.path.realpath(model)}")
    assert_no_paths(message)
    assert sys.base_prefix not in message
    assert f"{NAME}/config.json" in message and "'<site-packages>/torch/nn/functional.py'" in message
    assert "from <python>/lib/asyncio/tasks.py" in message and message.endswith(f"see {NAME}")
    # A client's own path that merely starts like a private one is left alone.
    assert redact(f"file://{model}-other/x.png") == f"file://{model}-other/x.png"
    assert redact("nothing to hide") == "nothing to hide"


# -- Authorization -----------------------------------------------------------------------------


@pytest.mark.parametrize("scheme", ["Bearer", "bearer", "BEARER", "bEaReR"])
def test_the_auth_scheme_is_case_insensitive(server, scheme):
    response = httpx.get(server.base_url + "/v1/models", headers={"Authorization": f"{scheme} {KEY}"})
    assert response.status_code == 200, response.text


@pytest.mark.parametrize("auth", [f"bearer {KEY}x", f"bearer {KEY.upper()}", f"Basic {KEY}", KEY, "bearer", ""])
def test_a_wrong_key_or_scheme_is_still_a_401(server, auth):
    response = httpx.get(server.base_url + "/v1/models", headers={"Authorization": auth} if auth else {})
    assert response.status_code == 401, response.text
    assert response.json()["error"]["code"] == 401


# -- tools the template drops ---------------------------------------------------------------------


def test_auto_tool_choice_with_a_template_that_drops_tools_is_warned_about(server):
    lines = [line for line in server.log(tail=None).splitlines() if TOOLS_WARNING in line]
    assert len(lines) == 1, server.log()
    assert "WARNING" in lines[0] and NAME in lines[0] and "tool_choice" in lines[0]
    assert_no_paths(lines[0])


# -- shutdown past --shutdown-timeout -------------------------------------------------------------


def running(server: ServerProcess) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    return sum(sample.value for family in text_string_to_metric_families(server.get("/metrics").text)
               for sample in family.samples if sample.name == "vllm:num_requests_running")


class Stream:
    def __init__(self, server: ServerProcess, body: dict):
        self.events: list[str] = []
        self.status: int | None = None
        self.error: Exception | None = None
        self.started = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(server, body), daemon=True)
        self.thread.start()

    def _run(self, server, body):
        try:
            with httpx.stream("POST", server.base_url + "/v1/chat/completions", json=body, headers=server.headers,
                              timeout=60) as response:
                self.status = response.status_code
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        self.events.append(line[6:])
                        if len(self.events) >= 3:
                            self.started.set()
        except Exception as error:  # noqa: BLE001 - for the test to inspect
            self.error = error
        finally:
            self.started.set()


def test_a_shutdown_past_its_timeout_ends_each_cut_request_with_an_error(tmp_path):
    # A template that renders tools (Qwen2.5's), given by --chat-template: no tools warning.
    template = tmp_path / "template.jinja"
    template.write_text(QWEN2_5_CHAT_TEMPLATE)
    server = ServerProcess(tiny_checkpoint("qwen2"), "--chat-template", str(template), *AUTO_TOOLS,
                           "--shutdown-timeout", "2")
    long = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4000, "temperature": 0,
            "ignore_eos": True}
    try:
        assert TOOLS_WARNING not in server.log(tail=None)
        stream = Stream(server, {**long, "stream": True})
        whole: dict = {}
        waiter = threading.Thread(target=lambda: whole.update(response=server.post("/v1/chat/completions", long)),
                                  daemon=True)
        waiter.start()
        assert stream.started.wait(30) and stream.status == 200, (stream.error, server.log())
        deadline = time.monotonic() + 30
        while running(server) < 2:  # both are in the engine before the SIGTERM
            assert time.monotonic() < deadline, server.log()
            time.sleep(0.05)
    finally:
        code = server.stop(signal.SIGTERM)
    log = server.log(tail=None)
    assert code == 0, log
    stream.thread.join(10)
    waiter.join(10)
    assert stream.error is None, stream.error
    assert stream.events[-1] == "[DONE]", stream.events[-3:]
    last = json.loads(stream.events[-2])
    assert last["error"]["code"] == 503 and "shutting down" in last["error"]["message"], last
    response = whole["response"]
    assert response.status_code == 503 and "shutting down" in response.json()["error"]["message"], response.text
    cut = [line for line in log.splitlines() if "cut by the shutdown" in line]
    assert len(cut) == 2, log
    assert "CancelledError" not in log and "Traceback" not in log, log
    # A clean stop leaves no log file behind (its text stays readable).
    assert not server.log_path.exists()


def cancelled_at_shutdown(app_sends: list[dict], should_exit: bool = True) -> list[dict]:
    """What a client receives from GuardMiddleware when uvicorn cancels a handler that sent
    ``app_sends`` so far (at shutdown when ``should_exit``)."""
    import asyncio
    import types

    from atb_plugin.server.api_server import GuardMiddleware
    from atb_plugin.server.config import ServerConfig
    from atb_plugin.engine.config import EngineConfig

    async def app(scope, receive, send):
        for message in app_sends:
            await send(message)
        raise asyncio.CancelledError("Task cancelled, timeout graceful shutdown exceeded")

    sent: list[dict] = []

    async def send(message):
        sent.append(message)

    async def receive():
        return {"type": "http.disconnect"}

    server = types.SimpleNamespace(should_exit=should_exit)
    owner = types.SimpleNamespace(state=types.SimpleNamespace(service=types.SimpleNamespace(uvicorn_server=server)))
    config = ServerConfig(engine=EngineConfig(model=str(tiny_checkpoint("qwen2"))), shutdown_timeout=2)
    scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions", "headers": [], "app": owner}
    asyncio.run(GuardMiddleware(app, config)(scope, receive, send))
    return sent


STREAM_START = {"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]}


def test_a_stream_whose_handler_uvicorn_cancels_at_shutdown_still_ends_with_an_error_and_done(caplog):
    sent = cancelled_at_shutdown([STREAM_START, {"type": "http.response.body", "body": b"data: {}\n\n",
                                                 "more_body": True}])
    last = sent[-1]
    assert last["type"] == "http.response.body" and not last.get("more_body", False)
    events = [line[6:] for line in last["body"].decode().splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] == 503 and "shutting down" in error["message"]
    assert [r.message for r in caplog.records if "cut by the shutdown" in r.message] == [
        "POST /v1/chat/completions cut by the shutdown: its handler was cancelled at --shutdown-timeout (2 s)"]


def test_a_request_cancelled_at_shutdown_before_its_answer_gets_a_503():
    sent = cancelled_at_shutdown([])
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 503
    assert "shutting down" in json.loads(sent[1]["body"])["error"]["message"]


def test_a_cancellation_outside_shutdown_is_not_swallowed():
    import asyncio

    with pytest.raises(asyncio.CancelledError):
        cancelled_at_shutdown([], should_exit=False)
