"""Start the real service (``python -m atb_plugin.server``) on a free localhost port for a test module.

Tests reach it through ``serve`` (the fixture of that name in tests/conftest.py hands out
:func:`serve`): requesting it is what marks a test as one that starts a server, so ``-m "not slow"``
starts none.
"""

from __future__ import annotations

import base64
import contextlib
import io
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import httpx
import numpy as np
from PIL import Image


REPO_ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ServerProcess:
    """The service in its own process group (API process + engine core + tokenizer workers)."""

    def __init__(self, model_dir, *args: str, api_key: str | None = None, workers: int = 1, start_timeout: float = 120,
                 client_tls=None):
        """``client_tls`` (an ``ssl.SSLContext``): the server serves HTTPS (its args say how) and
        the helpers' clients connect with this context (the CA they trust, their certificate)."""
        self.api_key = api_key
        self.verify = client_tls if client_tls is not None else True
        self._final_log: str | None = None
        env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
        env.pop("ATB_PLUGIN_API_KEY", None)
        for attempt in range(3):
            # free_port() only finds a port free now: another process on the machine may bind it
            # before the server does (uvicorn then exits with "address already in use"); take another.
            self.port = free_port()
            self.base_url = f"{'https' if client_tls is not None else 'http'}://127.0.0.1:{self.port}"
            self.log_path = Path(os.environ.get("TMPDIR", "/tmp")) / f"atb-plugin-test-server-{self.port}.log"
            command = [sys.executable, "-m", "atb_plugin.server", "--model", str(model_dir), "--port", str(self.port),
                       "--tokenizer-workers", str(workers), "--block-size", "16", "--kv-cache-memory", "64M",
                       "--shutdown-timeout", "5", *args]
            if api_key:
                command += ["--api-key", api_key]
            self._log = open(self.log_path, "w")
            self.process = subprocess.Popen(command, stdout=self._log, stderr=subprocess.STDOUT, cwd=REPO_ROOT,
                                            env=env, start_new_session=True)
            try:
                self._wait_ready(start_timeout)
                return
            except RuntimeError:
                if attempt == 2 or "address already in use" not in self.log(tail=None):
                    raise
                self.stop()
                self.log_path.unlink(missing_ok=True)

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the server exited with {self.process.returncode}:\n{self.log()}")
            try:
                if httpx.get(self.base_url + "/health", timeout=2, verify=self.verify).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        self.stop()
        raise RuntimeError(f"the server did not become healthy in {timeout}s:\n{self.log()}")

    @property
    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def client(self, **kwargs):
        import openai

        if self.verify is not True:
            kwargs.setdefault("http_client", httpx.Client(verify=self.verify))
        return openai.OpenAI(base_url=self.base_url + "/v1", api_key=self.api_key or "none", max_retries=0,
                             timeout=60, **kwargs)

    def post(self, path: str, json=None, **kwargs) -> httpx.Response:
        headers = {**self.headers, **kwargs.pop("headers", {})}
        kwargs.setdefault("verify", self.verify)
        return httpx.post(self.base_url + path, json=json, headers=headers, timeout=60, **kwargs)

    def get(self, path: str, **kwargs) -> httpx.Response:
        headers = {**self.headers, **kwargs.pop("headers", {})}
        kwargs.setdefault("verify", self.verify)
        return httpx.get(self.base_url + path, headers=headers, timeout=30, **kwargs)

    def pid_of(self, what: str) -> int:
        """The pid the service logged for ``what``: "engine core" or "tokenizer worker 0" (the
        newest, after a restart)."""
        import re

        pids = re.findall(rf"{what} pid (\d+)", self.log(tail=None))
        if not pids:
            raise LookupError(f"the log names no {what} pid:\n{self.log()}")
        return int(pids[-1])

    def shm_instances(self) -> list[str]:
        """Every shm instance id the service's tokenizer workers have had (replacements too)."""
        import re

        return re.findall(r"shm instance (\w+)", self.log(tail=None))

    def log(self, tail: int | None = 6000) -> str:
        if self._final_log is not None:  # stopped cleanly: the file is gone, its text kept here
            text = self._final_log
        else:
            if not self._log.closed:
                self._log.flush()
            text = self.log_path.read_text(errors="replace")
        return text[-tail:] if tail else text

    def stop(self, sig=signal.SIGTERM, timeout: float = 30) -> int:
        if self.process.poll() is None:
            self.process.send_signal(sig)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(10)
        self._log.close()
        if self.process.returncode == 0 and self._final_log is None:
            # A clean stop leaves no file behind (test runs used to leave dozens in /tmp); the text
            # stays readable through log(). Any other exit keeps the file for debugging (a failing
            # test's message already holds the log's tail).
            self._final_log = self.log_path.read_text(errors="replace")
            self.log_path.unlink(missing_ok=True)
        return self.process.returncode


@contextlib.contextmanager
def serve(model_dir, *args: str, check_exit: bool = True, **kwargs) -> Iterator[ServerProcess]:
    """A started, healthy server (``ServerProcess``'s arguments) for the ``with`` block, stopped
    at its end. A server that crashed, or whose SIGTERM stop exits non-zero, fails the block with
    the tail of its log (in a module fixture: an error at the module's teardown), so a test that
    passed against a dying server is not green. ``check_exit=False`` for tests that kill parts of
    the server on purpose and check its exit code themselves."""
    server = ServerProcess(model_dir, *args, **kwargs)
    try:
        yield server
    finally:
        code = server.stop()
    if check_exit and code != 0:
        import pytest

        pytest.fail(f"the server ({model_dir} {' '.join(args)}) exited with {code}:\n{server.log()}", pytrace=False)


def starts_a_server(args) -> bool:
    """Whether a subprocess command line starts the service (``python -m atb_plugin.server``,
    ``atb-plugin serve`` or the launch script); ``--help`` only prints."""
    words = [str(a) for a in args] if isinstance(args, (list, tuple)) else str(args).split()
    text = " ".join(words)
    starts = ("atb_plugin.server" in words or "launch_npu_server.sh" in text
              or (any(Path(w).name == "atb-plugin" for w in words) and "serve" in words))
    return starts and "--help" not in words


def data_url(height: int = 64, width: int = 96, seed: int = 0, fmt: str = "PNG") -> str:
    rng = np.random.default_rng(seed)
    buffer = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(buffer, format=fmt)
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(buffer.getvalue()).decode()
