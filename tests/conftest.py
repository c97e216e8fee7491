"""Suite-wide rules: every test leaves /dev/shm as it found it.

A running service or benchmark beside the suite is fine (live owners are ignored); two test
runs at once on one machine are not supported: each would see the other's crashed-on-purpose
children as its own leaks, and the reaper tests would reap each other's fixtures.
"""

from __future__ import annotations

import pytest

import shm

from shm.errors import ShmHandleError
from shm.process import ProcessIdentity
from shm.segment import list_segment_names, marker_name, parse_name, read_header, unlink_segment
from tests.helpers import write_test_images

_ME = ProcessIdentity.current()


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
