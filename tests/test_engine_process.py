"""The engine-core process's loop helpers (the loop itself runs in every server test)."""

from __future__ import annotations

import ctypes

import pytest

from atb_plugin.engine import process as engine_process


def test_the_heap_is_trimmed_once_per_interval(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(engine_process.time, "monotonic", lambda: now[0])
    trims = []
    trimmer = engine_process.HeapTrimmer(interval_s=10.0)
    trimmer._malloc_trim = lambda pad: trims.append(pad)
    assert not trimmer.maybe_trim()  # not before the first interval has passed
    now[0] = 110.0
    assert trimmer.maybe_trim() and trims == [0]  # pad 0: give back every free page
    now[0] = 115.0
    assert not trimmer.maybe_trim()
    now[0] = 120.5
    assert trimmer.maybe_trim() and trims == [0, 0]


def test_without_glibc_the_trimmer_does_nothing(monkeypatch):
    def no_libc(name):
        raise OSError(f"{name}: cannot open shared object file")

    monkeypatch.setattr(engine_process.ctypes, "CDLL", no_libc)
    trimmer = engine_process.HeapTrimmer(interval_s=0.0)
    assert not trimmer.maybe_trim()


def test_glibc_trim_is_found_and_callable_here():
    try:
        ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        pytest.skip("not a glibc system")
    trimmer = engine_process.HeapTrimmer(interval_s=0.0)
    assert trimmer.maybe_trim()  # the real malloc_trim(0): returns, and the loop goes on
