"""The prefill/decode checks of tests/test_pd.py, run inside a network namespace with only a
loopback interface (the Mooncake Transfer Engine's listeners bind every interface):

    python -m tests.pd_netns_checks OUT.json

Tiny Qwen2-VL everywhere (text and image prompts). Phase 1, TP = 1: a producer, a consumer
(``kv_load_failure_policy`` recompute) and ``atb-plugin proxy``; the producer alone answers the
reference. Through the proxy with the ``openai`` client, completions and an image chat, streamed
and not; the consumer's counters; the producer SIGKILLed after it handed out its blocks (the
consumer recomputes), then behind the proxy (an error, at once). Phase 2, TP = 2 on both sides
(policy fail): the same tokens; the producer killed: the consumer's clear 5xx.

Everything observed goes to OUT.json (tracebacks included), for the test to assert on.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback

import httpx

from atb_plugin.testing.tiny import tiny_checkpoint
from tests.server_helpers import REPO_ROOT, ServerProcess, data_url, free_port

PROMPT = "The capital of France is"
GREEDY = dict(temperature=0.0, max_tokens=8, extra_body={"ignore_eos": True})


def image_chat() -> list[dict]:
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(seed=3)}},
                                         {"type": "text", "text": "What is in this picture?"}]}]


def kv_config(role: str, port: int, policy: str = "recompute") -> str:
    return json.dumps({"kv_connector": "MooncakeConnector", "kv_role": role, "kv_load_failure_policy": policy,
                       "kv_connector_extra_config": {"side_channel_port": port, "transfer_timeout_s": 2,
                                                     "abort_timeout_s": 30}})


def start_pair(model, *args: str, policy: str) -> tuple[ServerProcess, ServerProcess]:
    """A producer and a consumer, started side by side."""
    servers: dict[str, ServerProcess] = {}
    errors: list[BaseException] = []

    def start(name: str, role: str) -> None:
        try:
            servers[name] = ServerProcess(model, "--max-model-len", "512", "--kv-transfer-config",
                                          kv_config(role, free_port(), policy), *args, start_timeout=240)
        except BaseException as error:  # reported below
            errors.append(error)

    threads = [threading.Thread(target=start, args=item) for item in (("p", "kv_producer"), ("d", "kv_consumer"))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        for server in servers.values():
            server.stop()
        raise errors[0]
    return servers["p"], servers["d"]


class ProxyProcess:
    def __init__(self, prefill: list[str], decode: list[str]):
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.process = subprocess.Popen(
            [sys.executable, "-m", "atb_plugin.server", "proxy", "--prefill", *prefill, "--decode", *decode,
             "--port", str(self.port), "--timeout", "60"],
            cwd=REPO_ROOT, env=dict(os.environ, PYTHONPATH=str(REPO_ROOT)), stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE, start_new_session=True)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the proxy exited: {self.process.stderr.read().decode()[-3000:]}")
            try:
                httpx.get(self.base_url + "/v1/models", timeout=2)
                return
            except httpx.HTTPError:
                time.sleep(0.2)
        raise RuntimeError("the proxy did not start")

    def client(self):
        import openai

        return openai.OpenAI(base_url=self.base_url + "/v1", api_key="none", max_retries=0, timeout=60)

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(10)


def metric(server: ServerProcess, name: str) -> float:
    total = 0.0
    for line in server.get("/metrics").text.splitlines():
        if line.startswith(name):
            total += float(line.rsplit(" ", 1)[1])
    return total


def completion(client, stream: bool) -> dict:
    if not stream:
        answer = client.completions.create(model=client.models.list().data[0].id, prompt=PROMPT, **GREEDY)
        details = answer.usage.prompt_tokens_details
        return {"text": answer.choices[0].text, "prompt_tokens": answer.usage.prompt_tokens,
                "cached_tokens": details.cached_tokens if details else None}
    chunks = client.completions.create(model=client.models.list().data[0].id, prompt=PROMPT, stream=True, **GREEDY)
    return {"text": "".join(chunk.choices[0].text for chunk in chunks if chunk.choices)}


def chat(client, stream: bool) -> dict:
    model = client.models.list().data[0].id
    if not stream:
        answer = client.chat.completions.create(model=model, messages=image_chat(), **GREEDY)
        details = answer.usage.prompt_tokens_details
        return {"text": answer.choices[0].message.content, "prompt_tokens": answer.usage.prompt_tokens,
                "cached_tokens": details.cached_tokens if details else None}
    chunks = client.chat.completions.create(model=model, messages=image_chat(), stream=True, **GREEDY)
    return {"text": "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)}


def runs(client) -> dict:
    return {"completion": completion(client, False), "completion_stream": completion(client, True),
            "chat": chat(client, False), "chat_stream": chat(client, True)}


def raw_completion(server: ServerProcess, **extra) -> httpx.Response:
    return server.post("/v1/completions", {"prompt": PROMPT, "temperature": 0, "ignore_eos": True, **extra})


@contextlib.contextmanager
def deployment(*args: str, policy: str):
    """A producer, a consumer and the proxy in front, stopped at the end."""
    producer, consumer = start_pair(tiny_checkpoint("qwen2_vl"), *args, policy=policy)
    proxy = None
    try:
        proxy = ProxyProcess([producer.base_url], [consumer.base_url])
        yield producer, consumer, proxy
    finally:
        if proxy is not None:
            proxy.stop()
        producer.stop()
        consumer.stop()


def hand_out_then_kill(producer: ServerProcess) -> dict:
    """The producer runs the prompt and says where its KV lies, then dies (SIGKILL, before any pull)."""
    handed = raw_completion(producer, max_tokens=1, kv_transfer_params={"do_remote_decode": True}).json()
    os.killpg(producer.process.pid, signal.SIGKILL)
    producer.process.wait(10)
    return handed.get("kv_transfer_params")


def phase_one(out: dict) -> None:
    with deployment(policy="recompute") as (producer, consumer, proxy):
        out["reference"] = runs(producer.client())  # one instance, no connector in play
        out["health"] = httpx.get(proxy.base_url + "/health", timeout=10).status_code
        out["models"] = httpx.get(proxy.base_url + "/v1/models", timeout=10).json()["data"][0]["id"]
        out["pd"] = runs(proxy.client())
        out["consumer_external_hits"] = metric(consumer, "vllm:external_prefix_cache_hits_total")
        out["consumer_bytes_loaded"] = metric(consumer, "atb_plugin:kv_bytes_loaded_total")
        # The producer freed every block it handed out (the consumer acknowledged each pull): a
        # plain request refreshes the gauge, its own blocks freed before the stats are taken.
        time.sleep(0.5)
        raw_completion(producer, max_tokens=1)
        out["producer_kv_usage"] = metric(producer, "vllm:kv_cache_usage_perc")

        # The producer dies after handing out its blocks: the consumer recomputes.
        out["handed_params"] = hand_out_then_kill(producer)
        started = time.monotonic()
        answer = raw_completion(consumer, max_tokens=8, kv_transfer_params=out["handed_params"])
        out["recompute_seconds"] = time.monotonic() - started
        out["recompute_status"] = answer.status_code
        out["recompute_text"] = answer.json()["choices"][0]["text"] if answer.status_code == 200 else answer.text
        out["consumer_failed_loads"] = metric(consumer, "atb_plugin:kv_failed_loads_total")
        started = time.monotonic()
        answer = httpx.post(proxy.base_url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 4}, timeout=30)
        out["dead_producer_proxy"] = {"status": answer.status_code, "body": answer.json(),
                                      "seconds": time.monotonic() - started}
        out["health_after_kill"] = httpx.get(proxy.base_url + "/health", timeout=10).status_code


def phase_two(out: dict) -> None:
    with deployment("--tensor-parallel-size", "2", policy="fail") as (producer, consumer, proxy):
        client = proxy.client()
        out["pd"] = {"completion": completion(client, False), "chat_stream": chat(client, True)}
        out["handed_params"] = hand_out_then_kill(producer)
        answer = raw_completion(consumer, max_tokens=8, kv_transfer_params=out["handed_params"])
        out["fail_status"] = answer.status_code
        out["fail_body"] = answer.text
        out["consumer_healthy_after"] = consumer.get("/health").status_code


def main(path: str) -> None:
    results: dict = {"interfaces": sorted(name for _, name in socket.if_nameindex())}
    for name, phase in (("tp1", phase_one), ("tp2", phase_two)):
        section = results[name] = {}
        started = time.monotonic()
        try:
            phase(section)
        except Exception:
            section["error"] = traceback.format_exc()
        section["seconds"] = time.monotonic() - started
        with open(path, "w") as handle:
            json.dump(results, handle)


if __name__ == "__main__":
    main(sys.argv[1])
