"""Helpers shared by the shm tests: run a snippet in a fresh interpreter, tamper with files."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


def run_python(code: str, timeout: float = 60) -> subprocess.CompletedProcess:
    """Run ``code`` in a new interpreter (a real separate process) and capture its output."""
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT), PYTHONWARNINGS="default")
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO_ROOT,
    )


def shm_path(name: str) -> str:
    return os.path.join("/dev/shm", name)


def patch_bytes(name: str, offset: int, data: bytes) -> None:
    """Overwrite bytes of a segment file in place (the owner may; tests play the attacker)."""
    fd = os.open(shm_path(name), os.O_RDWR)
    try:
        os.pwrite(fd, data, offset)
    finally:
        os.close(fd)
