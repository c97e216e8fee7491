"""Suite-wide rules and the fixtures several test modules share.

- Every test leaves /dev/shm as it found it. A running service or benchmark beside the suite is
  fine (live owners are ignored); two test runs at once on one machine are not supported: each
  would see the other's crashed-on-purpose children as its own leaks, and the reaper tests would
  reap each other's fixtures.
- A test that starts a real server is slow, so ``-m "not slow"`` starts none: a test whose
  fixtures include ``serve`` (every server fixture requests it) or that is marked ``server`` (one
  that starts a server in its body) is marked ``slow`` at collection, and any other test that
  starts one fails on the spot.
"""

from __future__ import annotations

import subprocess

import pytest

import shm

from shm.errors import ShmHandleError
from shm.process import ProcessIdentity
from shm.segment import list_segment_names, marker_name, parse_name, read_header, unlink_segment
from tests import server_helpers
from tests.helpers import write_test_images

_ME = ProcessIdentity.current()


# -- servers only in slow tests ------------------------------------------------------------------


def pytest_configure(config):
    config.addinivalue_line("markers", "server: starts a real server in its body (marked slow with it)")


@pytest.hookimpl(tryfirst=True)  # before -m selects: the slow marker must already be there
def pytest_collection_modifyitems(config, items):
    for item in items:
        if "serve" in item.fixturenames or item.get_closest_marker("server"):
            item.add_marker(pytest.mark.slow)


_running: list = [None]  # the test whose setup, call or teardown runs now


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    _running[0] = item
    try:
        return (yield)
    finally:
        _running[0] = None


class _GuardedPopen(subprocess.Popen):
    """subprocess.Popen that refuses to start the service for a test not marked slow (a server
    fixture that forgot ``serve``, a test body that forgot ``server``): the quick loop would
    silently grow by a server start per test."""

    def __init__(self, *args, **kwargs):
        command = args[0] if args else kwargs.get("args", ())
        item = _running[0]
        if item is not None and item.get_closest_marker("slow") is None and server_helpers.starts_a_server(command):
            pytest.fail(f"{item.nodeid} starts a server but is not slow: request the `serve` fixture "
                        f"(a server fixture) or mark the test `@pytest.mark.server`", pytrace=False)
        super().__init__(*args, **kwargs)


@pytest.fixture(scope="session", autouse=True)
def servers_only_in_slow_tests():
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(subprocess, "Popen", _GuardedPopen)
        yield


@pytest.fixture(scope="session")
def serve():
    """``with serve(model_dir, *flags, **kwargs) as server:`` a real server, stopped and its exit
    code checked at the block's end (tests/server_helpers.py). Requesting it marks the test slow."""
    return server_helpers.serve


# -- shared fixtures -------------------------------------------------------------------------------


def _left_by_this_run(name: str) -> bool:
    """True for a segment this test session answers for: created here or by a process that has
    died (a test's child). Segments of other live processes (a benchmark, a service, a second
    test run) appear and vanish on their own schedule and are none of our business."""
    try:
        owner = read_header(name).owner
    except ShmHandleError:
        # Headerless: a write in flight elsewhere (its instance marker is live) or a test's fake.
        try:
            owner = read_header(marker_name(parse_name(name)[0])).owner
        except ShmHandleError:
            return True
    return owner == _ME or not owner.is_alive()


@pytest.fixture(autouse=True)
def no_leaked_segments():
    """Fail any test that leaves a segment of ours in /dev/shm (then clean up after it)."""
    before = set(list_segment_names())
    yield
    new = sorted(set(list_segment_names()) - before)
    # Counted only if it was still there to unlink: one that vanished meanwhile did not leak.
    leaked = [name for name in new if _left_by_this_run(name) and unlink_segment(name)]
    assert not leaked, f"test leaked shared-memory segments: {leaked}"


@pytest.fixture
def store():
    """A ShmStore for one test (no reaping: other instances on the machine are not its business)."""
    with shm.ShmStore(shm.ShmStoreConfig(reap_on_start=False)) as store:
        yield store


@pytest.fixture
def images(tmp_path):
    """Two PNG files of different sizes and aspect ratios."""
    return write_test_images(tmp_path)


@pytest.fixture
def clean_platform(monkeypatch):
    """No forced device, no cached platform choice, before and after."""
    from atb_plugin.platform import reset_current_platform

    monkeypatch.delenv("ATB_PLUGIN_DEVICE", raising=False)
    reset_current_platform()
    yield
    reset_current_platform()


@pytest.fixture
def fake_npu(clean_platform):
    """The simulated NPU (fake torch_npu, an A2 chip by default) installed for one test."""
    import sys

    from atb_plugin.platform import reset_current_platform
    from atb_plugin.testing import fake_torch_npu

    handle = fake_torch_npu.install()
    try:
        yield handle
    finally:
        handle.uninstall()
        reset_current_platform()
    assert "torch_npu" not in sys.modules


@pytest.fixture
def atb_kernel_set(monkeypatch):
    """The ATB kernel set for the simulated NPU, which on its default A2 chip would pick the
    fused-infer-attention set (tests/test_npu_fia_kernels.py covers that one). A module whose
    tests exercise the ATB set: ``pytestmark = pytest.mark.usefixtures("atb_kernel_set")``."""
    monkeypatch.setenv("ATB_PLUGIN_NPU_KERNELS", "atb")


@pytest.fixture(scope="module")
def models():
    """Loaded tiny models by family, each loaded once per test module: ``models("qwen2_vl")``."""
    from atb_plugin.engine.config import EngineConfig
    from atb_plugin.models import registry
    from atb_plugin.testing.tiny import tiny_checkpoint

    loaded = {}

    def get(family):
        if family not in loaded:
            config = EngineConfig(tiny_checkpoint(family), kv_cache_blocks=8, device="cpu")
            loaded[family] = registry.import_model_class(config.model_cls_path).from_pretrained(config.model)
        return loaded[family]

    return get
