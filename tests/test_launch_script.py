"""``scripts/launch_npu_server.sh`` as a newcomer runs it: it prepares the default model
(SmolLM2-135M-Instruct, real weights; with ``--runner pooling`` all-MiniLM-L6-v2), starts the
service, prints a curl example, and that example — run as printed — gets an answer. SIGTERM
then exits 0. Its banner names the scheme, address and port a MindIE ``--config`` gives; a port
already in use stops the server before the model loads; the first bootstrap says what each of
its pip steps does."""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from atb_plugin.server.cli import check_listen_address
from atb_plugin.testing.tiny import tiny_checkpoint
from tests.server_helpers import REPO_ROOT, free_port
from tests.test_server_tls import pki  # noqa: F401 - the fixture: throwaway certificates laid out as MindIE's


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


@pytest.mark.slow
def test_the_printed_curl_example_gets_an_answer(tmp_path):
    answer = _run_printed_example(tmp_path)
    assert answer["model"] == "SmolLM2-135M-Instruct"
    assert answer["choices"][0]["message"]["content"].strip(), answer


@pytest.mark.slow
def test_runner_pooling_serves_the_default_embedding_model(tmp_path):
    answer = _run_printed_example(tmp_path, "--runner", "pooling")
    assert answer["model"] == "all-MiniLM-L6-v2" and answer["object"] == "list"
    assert [len(d["embedding"]) for d in answer["data"]] == [384, 384], answer


# -- issue 45, item 5: the banner's scheme, a port in use, the first bootstrap --------------------------

def _installed_env(venv: Path) -> dict:
    """An environment whose virtualenv (``venv``, a bare folder) bootstrap.sh takes as already
    installed: its stamp matches, so the launcher installs nothing; python is this one."""
    venv.mkdir(exist_ok=True)
    stamp = hashlib.sha256((REPO_ROOT / "setup.py").read_bytes() + (REPO_ROOT / "scripts/bootstrap.sh").read_bytes())
    (venv / ".atb-plugin-install-stamp").write_text(stamp.hexdigest() + "\n")
    return dict(os.environ, VIRTUAL_ENV=str(venv), PYTHONPATH=str(REPO_ROOT),
                PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}")


@pytest.fixture
def busy_port():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        yield busy.getsockname()[1]


def test_a_port_in_use_is_found_by_the_start_up_check(busy_port):
    with pytest.raises(ValueError, match=rf"--port {busy_port}: 127.0.0.1:{busy_port}: address already in use"):
        check_listen_address("127.0.0.1", busy_port)
    check_listen_address("127.0.0.1", free_port())  # a free one passes
    with pytest.raises(ValueError, match="--host 192.0.2.1: no interface of this machine has that address"):
        check_listen_address("192.0.2.1", free_port())  # TEST-NET-1: no interface has it


@pytest.mark.server  # the command exits at once, but it is the server's
def test_a_port_in_use_stops_the_server_before_the_model_loads(busy_port):
    result = subprocess.run([sys.executable, "-m", "atb_plugin.server", "--model", str(tiny_checkpoint("qwen2")),
                             "--port", str(busy_port)], capture_output=True, text=True, cwd=REPO_ROOT, timeout=120,
                            env=dict(os.environ, PYTHONPATH=str(REPO_ROOT)))
    assert result.returncode == 2, result.stderr
    assert f"--port {busy_port}" in result.stderr and "address already in use" in result.stderr
    assert "server configuration" not in result.stderr  # serve() never started: no model was loaded


@pytest.mark.server  # the launcher execs the server, which stops at once on the busy port
def test_the_banner_says_https_for_a_mindie_config_that_serves_https(tmp_path, pki, busy_port):  # noqa: F811
    """TLS fields and no httpsEnabled: HTTPS (issue 45, item 3), and the banner says so, with the
    config's address and port; the server then stops at once on that (busy) port."""
    config = Path(pki["root"]) / "launcher.json"
    config.write_text(json.dumps({"ServerConfig": {
        "ipAddress": "127.0.0.1", "port": busy_port, "tlsCaPath": "security/ca/", "tlsCaFile": ["ca.pem"],
        "tlsCert": "security/certs/server.pem", "tlsPk": "security/keys/server.key.pem",
        "tlsPkPwd": "security/pass/key_pwd.txt"}}))
    result = subprocess.run(["bash", "scripts/launch_npu_server.sh", "--config", str(config),
                             "--model", str(tiny_checkpoint("qwen2"))], capture_output=True, text=True,
                            cwd=REPO_ROOT, timeout=120, env=_installed_env(tmp_path / "venv"))
    assert f"serving on https://127.0.0.1:{busy_port}" in result.stdout, result.stdout + result.stderr
    assert f"curl https://127.0.0.1:{busy_port}/v1/chat/completions" in result.stdout
    assert "--cacert ca.pem --cert client.pem --key client.key" in result.stdout  # mutual TLS: a CA is named
    assert result.returncode == 2 and "address already in use" in result.stderr, result.stderr


def test_the_first_bootstrap_says_what_each_pip_step_does(tmp_path):
    """pip runs quietly for minutes on a fresh machine: every pip command is announced on its
    own line first (pip itself stubbed here: nothing is installed)."""
    stub = tmp_path / "bin"
    stub.mkdir()
    (stub / "python").write_text('#!/bin/sh\necho "PIP: $*" >&2\n')
    (stub / "python").chmod(0o755)
    venv = tmp_path / "venv"
    venv.mkdir()
    result = subprocess.run(["bash", "-c", "source scripts/bootstrap.sh"], capture_output=True, text=True,
                            cwd=REPO_ROOT, timeout=60,
                            env=dict(os.environ, VIRTUAL_ENV=str(venv), PATH=f"{stub}:{os.environ['PATH']}"))
    assert result.returncode == 0, result.stderr
    lines = result.stderr.splitlines()
    pips = [i for i, line in enumerate(lines) if line.startswith("PIP: -m pip install")]
    assert len(pips) == 5, lines
    for i in pips:
        assert lines[i - 1].startswith("bootstrap: ") and lines[i - 1].endswith("..."), lines[i - 1]
    assert "first run: a few minutes" in lines[0] and lines[-1] == "bootstrap: done"
    assert (venv / ".atb-plugin-install-stamp").exists()
