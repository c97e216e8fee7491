"""Helpers shared by the tests: run a snippet in a fresh interpreter, tamper with segment files,
write test images, copy a checkpoint to modify it, load our model next to transformers' reference."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
from PIL import Image

REPO_ROOT = Path(__file__).resolve().parents[1]


def run_python(code: str, timeout: float = 60) -> subprocess.CompletedProcess:
    """Run ``code`` in a new interpreter (a real separate process) and capture its output."""
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT), PYTHONWARNINGS="default")
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO_ROOT,
    )


def netns_prefix() -> list[str] | None:
    """``unshare`` into a new network namespace (as root; else with a user namespace mapping us
    to root), or None where this machine does not allow it. What runs there must raise ``lo``
    (``ip link set lo up``) and can reach nothing but 127.0.0.1: for services that bind every
    interface whatever they are told (Ray, the Mooncake Transfer Engine)."""
    if shutil.which("unshare") is None or shutil.which("ip") is None:
        return None
    prefix = ["unshare", "-n"] if os.geteuid() == 0 else ["unshare", "-rn"]
    probe = subprocess.run([*prefix, "ip", "link", "set", "lo", "up"], capture_output=True)
    return prefix if probe.returncode == 0 else None


def run_checks_in_netns(module: str, why: str, timeout: float) -> dict:
    """Run ``python -m module OUT.json`` in a network namespace of its own (loopback only) and
    return what it wrote there; skipped (with ``why`` the checks need one) where this machine
    allows no namespace. A run that writes nothing fails with its output's tail."""
    import json
    import tempfile

    import pytest

    prefix = netns_prefix()
    if prefix is None:
        pytest.skip(f"this machine does not allow a network namespace (unshare -n): {why}")
    with tempfile.TemporaryDirectory(prefix="atb-netns-test-") as scratch:
        out = Path(scratch) / "out.json"
        command = [*prefix, "sh", "-c", f'ip link set lo up && exec "$0" -m {module} "$1"', sys.executable, str(out)]
        run = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=timeout,
                             env=dict(os.environ, PYTHONPATH=str(REPO_ROOT), TMPDIR=scratch))
        if not out.exists():
            pytest.fail(f"{module} wrote nothing (exit {run.returncode}):\n{run.stdout[-4000:]}\n{run.stderr[-6000:]}")
        return json.loads(out.read_text())


def checked_section(results: dict, name: str) -> dict:
    """One section of a ``run_checks_in_netns`` report, which must hold no traceback."""
    section = results[name]
    assert "error" not in section, section.get("error")
    return section


def shm_path(name: str) -> str:
    return os.path.join("/dev/shm", name)


def patch_bytes(name: str, offset: int, data: bytes) -> None:
    """Overwrite bytes of a segment file in place (the owner may; tests play the attacker)."""
    fd = os.open(shm_path(name), os.O_RDWR)
    try:
        os.pwrite(fd, data, offset)
    finally:
        os.close(fd)


def write_test_images(directory, sizes=((60, 90), (120, 64)), seed: int = 0) -> list:
    """Random RGB PNGs of the given (height, width) sizes in ``directory``."""
    rng = np.random.default_rng(seed)
    paths = []
    for index, (height, width) in enumerate(sizes):
        path = directory / f"image{index}.png"
        Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(path)
        paths.append(path)
    return paths


def copy_checkpoint(source: Path, target: Path, exclude: tuple[str, ...] = ()) -> Path:
    """The files of checkpoint ``source`` copied into ``target`` (tests then break them)."""
    for item in Path(source).iterdir():
        if item.is_file() and item.name not in exclude:
            shutil.copy(item, Path(target) / item.name)
    return Path(target)


def model_pair(checkpoint) -> tuple:
    """Our model and transformers' reference (float32, eval mode) loaded from one checkpoint: a
    tiny family's name (a str) or a checkpoint directory (a Path). The reference is the class the checkpoint's
    config.json names (``architectures[0]``), as transformers itself would pick. A fresh pair per
    call: a module whose tests only read the models caches it (``functools.cache(model_pair)``)."""
    import json

    import torch
    import transformers

    from atb_plugin.testing.tiny import tiny_checkpoint
    from routers import get_router

    path = tiny_checkpoint(checkpoint) if isinstance(checkpoint, str) else Path(checkpoint)
    architecture = json.loads((path / "config.json").read_text())["architectures"][0]
    ours = get_router(path).model_cls.from_pretrained(path)
    reference = getattr(transformers, architecture).from_pretrained(path, dtype=torch.float32).eval()
    return ours, reference


def chunkings(text: str):
    """Ways a stream can cut ``text``: one character at a time, every cut in two, and 20 seeded
    random chunkings (for parsers that must give the same result however the text arrives)."""
    import random

    yield list(text)
    for cut in range(len(text) + 1):
        yield [text[:cut], text[cut:]]
    rng = random.Random(len(text))
    for _ in range(20):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 6)))) if len(text) > 1 else []
        yield [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


def load_benchmark(name: str):
    """A script of benchmarks/ (not a package) as a module, registered under ``name`` before it
    runs (its dataclasses need to find their module)."""
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
