"""ShmStore when shared memory runs out: the store's own cache is evicted before it gives up.

Three ways to hit "full": ``capacity_bytes``; ``ENOSPC`` from the write, simulated by a
``os.pwrite`` that refuses to grow this store's segments past a fake limit; and, where this
process may mount one (root), a real 4 MiB tmpfs standing in for ``/dev/shm``.
"""

from __future__ import annotations

import errno
import logging
import os
import subprocess
import types

import numpy as np
import pytest

import shm
import shm.segment

from tests.test_shm_store import ITEM, ITEM_SIZE, item, make_store, on_disk  # one copy of the helpers

MIB = 1 << 20


def assert_books_match_disk(store: shm.ShmStore) -> None:
    """No segment leaked or lost: one file per tracked segment, and the byte counts agree."""
    assert on_disk(store) == set(store.names())
    stats = store.stats()
    assert stats["segments"] == stats["leased_segments"] + stats["cached_segments"]
    assert store._owned_bytes == stats["leased_bytes"] + stats["cached_bytes"]


def fill_cache(store: shm.ShmStore, keys: str) -> dict[str, shm.ShmHandle]:
    """Put one segment per key, each leased to its own request, then end every request."""
    handles = {k: store.put(item(i), key=k, request_id=k) for i, k in enumerate(keys)}
    for k in keys:
        store.release(k)
    return handles


# -- ENOSPC, simulated ------------------------------------------------------------------------


class FakeFullShm:
    """``os.pwrite`` that fails with ENOSPC once one instance's segments would exceed ``limit``.

    Like tmpfs: ``ftruncate`` allocates nothing, writing the pages does; the file being written
    already has its final size, so it counts in full.
    """

    def __init__(self, monkeypatch, store: shm.ShmStore, limit: int):
        self.prefix = "psm_" + store.instance_id
        self.limit = limit
        self.refusals = 0
        self._pwrite = os.pwrite
        monkeypatch.setattr(os, "pwrite", self.pwrite)

    def used(self) -> int:
        total = 0
        for name in os.listdir(shm.segment.SHM_DIR):
            if name.startswith(self.prefix) and name != self.prefix:
                try:
                    total += os.stat(os.path.join(shm.segment.SHM_DIR, name)).st_size
                except FileNotFoundError:
                    pass
        return total

    def pwrite(self, fd, data, offset):
        target = os.path.basename(os.readlink(f"/proc/self/fd/{fd}"))
        if target.startswith(self.prefix) and target != self.prefix and self.used() > self.limit:
            self.refusals += 1
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return self._pwrite(fd, data, offset)


def test_enospc_evicts_the_oldest_cached_segment_and_retries(monkeypatch):
    with make_store(cache_bytes=1 << 30) as store:
        fake = FakeFullShm(monkeypatch, store, limit=4 * ITEM_SIZE)
        handles = fill_cache(store, "abcd")  # /dev/shm is now "full" of cached segments
        store.get("a")  # touch a: b is now the least recently used
        new = store.put(item(9), key="e", request_id="r")
        assert fake.refusals == 1
        assert store.get("b") is None and handles["b"].name not in on_disk(store)
        assert {store.get(k) for k in "acd"} == {handles[k] for k in "acd"}
        np.testing.assert_array_equal(shm.read_array(new.name_value, new.shape_value), item(9))
        assert_books_match_disk(store)


def test_enospc_evicts_as_many_cached_segments_as_a_large_put_needs(monkeypatch):
    with make_store(cache_bytes=1 << 30) as store:
        fake = FakeFullShm(monkeypatch, store, limit=6 * ITEM_SIZE)
        fill_cache(store, "abcdef")
        big = np.zeros(3 * ITEM.size, np.float32)  # needs the room of three cached segments
        store.put(big, key="big", request_id="r")
        assert fake.refusals >= 1
        assert [store.get(k) is None for k in "abcdef"] == [True] * 3 + [False] * 3
        assert_books_match_disk(store)


def test_enospc_keeps_serving_requests_after_the_cache_filled_shm(monkeypatch):
    # The reported defect: after the cache filled /dev/shm, every later image request failed.
    with make_store(cache_bytes=1 << 30) as store:
        FakeFullShm(monkeypatch, store, limit=8 * ITEM_SIZE)
        for step in range(50):
            store.put(item(step), key=f"img-{step}", request_id=f"req-{step}")
            store.release(f"req-{step}")
        assert store.stats()["cached_bytes"] <= 8 * ITEM_SIZE
        assert store.get("img-49") is not None
        assert_books_match_disk(store)


def test_enospc_with_everything_leased_fails_with_a_clear_message(monkeypatch):
    with make_store(cache_bytes=1 << 30) as store:
        FakeFullShm(monkeypatch, store, limit=3 * ITEM_SIZE)
        fill_cache(store, "a")
        for k in "bcd":
            store.put(item(ord(k)), key=k, request_id=k)  # evicts cached a, then all is leased
        before = on_disk(store)
        with pytest.raises(shm.ShmStoreFullError) as raised:
            store.put(item(5), key="e", request_id="r")
        message = str(raised.value)
        assert f"{3 * ITEM_SIZE} bytes leased" in message
        assert "0 bytes cached" in message
        assert "free" in message and shm.segment.SHM_DIR in message
        assert "--shm-size" in message and "cache_bytes" in message
        assert isinstance(raised.value.__cause__, shm.ShmStoreFullError)  # the ENOSPC underneath
        assert on_disk(store) == before  # the failed write left nothing behind
        assert store.get("e") is None
        assert_books_match_disk(store)
        store.release("b")  # a request ends: its segment becomes cached, and can make room
        store.put(item(5), key="e", request_id="r")
        assert store.get("b") is None
        assert_books_match_disk(store)


def test_other_write_errors_do_not_evict(monkeypatch):
    with make_store(cache_bytes=1 << 30) as store:
        handles = fill_cache(store, "ab")

        def broken(fd, data, offset):
            raise OSError(errno.EIO, os.strerror(errno.EIO))

        monkeypatch.setattr(os, "pwrite", broken)
        with pytest.raises(OSError, match="Input/output error"):
            store.put(item(3), key="c", request_id="r")
        monkeypatch.undo()
        assert {store.get(k) for k in "ab"} == set(handles.values())
        assert_books_match_disk(store)


# -- capacity_bytes ---------------------------------------------------------------------------


def test_capacity_full_of_cache_evicts_the_oldest_and_put_succeeds():
    with make_store(capacity_bytes=4 * ITEM_SIZE, cache_bytes=1 << 30) as store:
        handles = fill_cache(store, "abcd")
        store.get("a")
        store.put(item(9), key="e", request_id="r")
        assert store.get("b") is None and handles["b"].name not in on_disk(store)
        assert all(store.get(k) is not None for k in "acde")
        assert_books_match_disk(store)


def test_capacity_full_of_leases_fails_with_a_clear_message_and_keeps_the_cache():
    with make_store(capacity_bytes=4 * ITEM_SIZE, cache_bytes=1 << 30) as store:
        handles = fill_cache(store, "a")
        for k in "bcd":
            store.put(item(ord(k)), key=k, request_id=k)
        big = np.zeros(2 * ITEM.size, np.float32)  # evicting a would not make enough room
        with pytest.raises(shm.ShmStoreFullError) as raised:
            store.put(big, key="big", request_id="r")
        message = str(raised.value)
        assert f"capacity_bytes={4 * ITEM_SIZE}" in message
        assert f"{3 * ITEM_SIZE} bytes leased" in message and f"{ITEM_SIZE} bytes cached" in message
        assert "free" in message
        assert store.get("a") == handles["a"]  # a failing put does not throw the cache away
        assert_books_match_disk(store)


def test_capacity_larger_than_one_segment_is_refused_without_evicting():
    with make_store(capacity_bytes=2 * ITEM_SIZE, cache_bytes=1 << 30) as store:
        fill_cache(store, "ab")
        with pytest.raises(shm.ShmStoreFullError, match="capacity_bytes"):
            store.put(np.zeros(4 * ITEM.size, np.float32), request_id="r")
        assert store.stats()["cached_segments"] == 2
        assert_books_match_disk(store)


# -- the default cache size -------------------------------------------------------------------


def fake_statvfs(monkeypatch, total_bytes: int | None):
    real = os.statvfs

    def statvfs(path):
        if os.fspath(path) != shm.segment.SHM_DIR:
            return real(path)
        if total_bytes is None:
            raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), path)
        blocks = total_bytes // 4096
        return types.SimpleNamespace(f_frsize=4096, f_bsize=4096, f_blocks=blocks, f_bfree=blocks,
                                     f_bavail=blocks)

    monkeypatch.setattr(os, "statvfs", statvfs)


def test_cache_bytes_defaults_to_auto():
    assert shm.ShmStoreConfig().cache_bytes is None
    assert shm.ShmStoreConfig(cache_bytes=None).cache_bytes is None


def test_auto_cache_is_a_quarter_of_a_small_shm_and_is_logged(monkeypatch, caplog):
    fake_statvfs(monkeypatch, 64 * MIB)  # Docker's default --shm-size
    with caplog.at_level(logging.INFO, logger="shm"):
        with make_store() as store:
            assert store.cache_bytes == 16 * MIB
            assert store.config.cache_bytes == 16 * MIB
    lines = [r.getMessage() for r in caplog.records if r.name == "shm" and "shm cache" in r.getMessage()]
    assert lines == [f"shm cache: 16 MiB (25% of {shm.segment.SHM_DIR}'s 64 MiB)"]


def test_auto_cache_is_capped_at_one_gib(monkeypatch):
    fake_statvfs(monkeypatch, 64 << 30)
    with make_store() as store:
        assert store.cache_bytes == 1 << 30


def test_auto_cache_when_shm_cannot_be_measured(monkeypatch):
    fake_statvfs(monkeypatch, None)  # statvfs fails; the directory itself still works
    with make_store() as store:
        assert store.cache_bytes == 1 << 30


def test_auto_cache_of_the_real_shm():
    stat = os.statvfs(shm.segment.SHM_DIR)
    with make_store() as store:
        assert store.cache_bytes == min(1 << 30, stat.f_blocks * stat.f_frsize // 4)


def test_explicit_cache_bytes_is_kept(monkeypatch, caplog):
    fake_statvfs(monkeypatch, 64 * MIB)
    with caplog.at_level(logging.INFO, logger="shm"):
        with make_store(cache_bytes=123) as store, make_store(cache_bytes=0) as zero:
            assert store.cache_bytes == 123 and store.config.cache_bytes == 123
            assert zero.cache_bytes == 0
            zero.put(item(1), key="k")  # cache_bytes=0: unleased means unlinked
            assert on_disk(zero) == set()
    assert not [r for r in caplog.records if "25%" in r.getMessage()]


# -- a real small tmpfs -----------------------------------------------------------------------


@pytest.fixture
def small_tmpfs(tmp_path, monkeypatch):
    """A 4 MiB tmpfs in place of /dev/shm; skipped where this process may not mount one."""
    mountpoint = tmp_path / "shm"
    mountpoint.mkdir()
    try:
        result = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m,mode=1777", "tmpfs", str(mountpoint)],
                                capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as error:
        pytest.skip(f"cannot mount a tmpfs: {error}")
    if result.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs: {result.stderr.strip()}")
    monkeypatch.setattr(shm.segment, "SHM_DIR", str(mountpoint))
    try:
        yield str(mountpoint)
    finally:
        monkeypatch.undo()
        if subprocess.run(["umount", str(mountpoint)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(mountpoint)], capture_output=True)


def test_real_tmpfs_full_of_cache_keeps_serving_and_then_fails_clearly(small_tmpfs):
    image = np.zeros(65536, np.float32)  # 256 KiB: about 15 fit in 4 MiB
    with make_store(cache_bytes=1 << 30) as store:  # the old default: far more than the tmpfs
        for step in range(40):
            store.put(image + step, key=f"img-{step}", request_id=f"req-{step}")
            store.release(f"req-{step}")
        assert store.get("img-39") is not None and store.get("img-0") is None
        assert_books_match_disk(store)

        leased = 0
        with pytest.raises(shm.ShmStoreFullError) as raised:
            for step in range(40):
                store.put(image - step, key=f"held-{step}", request_id="long")
                leased += 1
        assert 10 <= leased < 16
        stats = store.stats()
        assert stats["cached_segments"] == 0 and stats["leased_segments"] == leased
        message = str(raised.value)
        assert small_tmpfs in message and "--shm-size" in message
        assert f"{stats['leased_bytes']} bytes leased" in message
        assert sorted(os.listdir(small_tmpfs)) == sorted(set(store.names()) | {"psm_" + store.instance_id})
        store.release("long")
        store.put(image, key="after", request_id="r")  # room again once the request ends
        assert_books_match_disk(store)
    assert os.listdir(small_tmpfs) == []


def test_real_tmpfs_auto_cache_is_a_quarter_of_it(small_tmpfs, caplog):
    with caplog.at_level(logging.INFO, logger="shm"):
        with make_store() as store:
            assert store.cache_bytes == 1 * MIB
    assert f"shm cache: 1 MiB (25% of {small_tmpfs}'s 4 MiB)" in caplog.text
