"""``scripts/launch_npu_server.sh`` as a newcomer runs it: it prepares the default model
(SmolLM2-135M-Instruct, real weights; with ``--runner pooling`` all-MiniLM-L6-v2), starts the
service, prints a curl example, and that example — run as printed — gets an answer. SIGTERM
then exits 0."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time

import httpx
import pytest

from tests.server_helpers import REPO_ROOT, free_port

pytestmark = pytest.mark.slow


def _run_printed_example(tmp_path, *flags: str) -> dict:
    """Start the script with ``flags``, wait for health, run the curl example it printed as
    printed, and return its JSON answer; SIGTERM must then exit 0."""
    port = free_port()
    log = tmp_path / "launch.log"
    with open(log, "w") as out:
        process = subprocess.Popen(["bash", "scripts/launch_npu_server.sh", "--port", str(port),
                                    "--tokenizer-workers", "1", "--kv-cache-memory", "512M", *flags],
                                   cwd=REPO_ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            assert process.poll() is None, log.read_text()
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        else:
            raise AssertionError("the service did not start:\n" + log.read_text())
        text = log.read_text()
        assert f"http://127.0.0.1:{port}" in text
        example = re.search(r"^  (curl .*?\}')$", text, re.M | re.S)
        assert example, text
        command = example.group(1).replace("\\\n", " ")
        reply = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=120)
        answer = json.loads(reply.stdout)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)
        code = process.wait(60)
    assert code == 0, log.read_text()[-3000:]
    return answer


def test_the_printed_curl_example_gets_an_answer(tmp_path):
    answer = _run_printed_example(tmp_path)
    assert answer["model"] == "SmolLM2-135M-Instruct"
    assert answer["choices"][0]["message"]["content"].strip(), answer


def test_runner_pooling_serves_the_default_embedding_model(tmp_path):
    answer = _run_printed_example(tmp_path, "--runner", "pooling")
    assert answer["model"] == "all-MiniLM-L6-v2" and answer["object"] == "list"
    assert [len(d["embedding"]) for d in answer["data"]] == [384, 384], answer
