"""ShmStore: dedup by key, leases, LRU of unleased segments, capacity, close, threads."""

from __future__ import annotations

import gc
import os
import threading

import numpy as np
import pytest

import shm
from shm.segment import HEADER_SIZE, list_segment_names

ITEM = np.arange(256, dtype=np.float32)  # 1 KiB payload
ITEM_SIZE = HEADER_SIZE + ITEM.nbytes


def make_store(**config) -> shm.ShmStore:
    return shm.ShmStore(shm.ShmStoreConfig(reap_on_start=False, **config))


def item(value: int) -> np.ndarray:
    return ITEM + value


def on_disk(store: shm.ShmStore) -> set[str]:
    prefix = "psm_" + store.instance_id
    return {n for n in list_segment_names() if n.startswith(prefix) and n != prefix}


def test_handle_decodes_to_its_name_and_shape():
    with make_store() as store:
        handle = store.put(np.zeros((1, 3, 8, 8), np.float32), request_id="r")
        assert shm.decode_shm_name_from_int64(handle.name_value) == handle.name
        assert shm.decode_shape_from_int64(handle.shape_value) == [1, 3, 8, 8]
        assert handle.nbytes == 4 * 3 * 64


def test_same_key_reuses_the_segment_without_writing():
    with make_store() as store:
        first = store.put(item(1), key="img-a", request_id="r1")
        second = store.put(item(1), key="img-a", request_id="r2")
        assert first == second
        assert on_disk(store) == {first.name}
        assert store.get("img-a") == first
        assert store.get("img-b") is None
        other = store.put(item(2), key="img-b", request_id="r1")
        assert other.name != first.name


def test_same_key_with_different_shape_is_an_error():
    with make_store() as store:
        store.put(item(1), key="k", request_id="r")
        with pytest.raises(ValueError, match="key must identify the content"):
            store.put(np.zeros(3, np.float32), key="k", request_id="r")


def test_leases_keep_a_segment_until_every_request_releases_it():
    with make_store(cache_bytes=0) as store:  # nothing is cached: unleased means unlinked
        handle = store.put(item(1), key="k", request_id="r1")
        assert store.get("k", request_id="r2") == handle
        assert store.release("r1") == 1
        assert on_disk(store) == {handle.name}  # r2 still holds it
        assert store.release("r2") == 1
        assert on_disk(store) == set()
        assert store.get("k") is None
        with pytest.raises(shm.ShmHandleError, match="does not exist"):
            shm.read_array(handle.name_value, handle.shape_value)


def test_release_of_unknown_request_is_a_no_op():
    with make_store() as store:
        assert store.release("never-seen") == 0


def test_unleased_segments_form_an_lru_bounded_by_bytes():
    with make_store(cache_bytes=3 * ITEM_SIZE) as store:
        handles = {k: store.put(item(i), key=k, request_id=k) for i, k in enumerate("abcd")}
        for k in "abc":
            store.release(k)  # cached, oldest first: a, b, c
        store.get("a")  # touch a: now b is the oldest
        store.release("d")  # a fourth cached segment pushes out the oldest
        assert store.get("b") is None
        assert on_disk(store) == {handles[k].name for k in "acd"}
        assert store.stats()["cached_bytes"] == 3 * ITEM_SIZE


def test_a_cached_segment_is_leased_again_by_key():
    with make_store() as store:
        handle = store.put(item(5), key="k", request_id="turn-1")
        store.release("turn-1")
        assert store.stats()["cached_segments"] == 1
        assert store.put(item(5), key="k", request_id="turn-2") == handle  # multi-turn resend
        assert store.stats()["leased_segments"] == 1 and store.stats()["cached_segments"] == 0
        np.testing.assert_array_equal(shm.read_array(handle.name_value, handle.shape_value), item(5))


def test_capacity_evicts_cached_then_refuses_with_a_clear_error():
    with make_store(capacity_bytes=2 * ITEM_SIZE) as store:
        store.put(item(1), key="a", request_id="r1")
        store.put(item(2), key="b", request_id="r2")
        with pytest.raises(shm.ShmStoreFullError, match="capacity_bytes"):
            store.put(item(3), key="c", request_id="r3")
        store.release("r1")  # a becomes cached, so it can be evicted to make room
        store.put(item(3), key="c", request_id="r3")
        assert store.get("a") is None and store.get("b") is not None


def test_oversized_array_is_refused_naming_the_limit():
    with make_store(max_segment_bytes=1000) as store:
        with pytest.raises(ValueError, match="max_segment_bytes=1000"):
            store.put(ITEM, request_id="r")
        assert on_disk(store) == set()


@pytest.mark.parametrize(
    "array, message",
    [
        (np.float32(1.0), "0 dimensions"),
        (np.zeros((1,) * 6, np.float32), "6 dimensions"),
        (np.zeros(2, np.complex64), "cannot be stored"),
        (np.zeros(2, ">f4"), "cannot be stored"),
    ],
)
def test_unstorable_arrays_are_refused(array, message):
    with make_store() as store:
        with pytest.raises(ValueError, match=message):
            store.put(array, request_id="r")


def test_non_contiguous_input_is_stored_contiguously():
    with make_store() as store:
        source = np.arange(24, dtype=np.int32).reshape(4, 6)[:, ::2]
        handle = store.put(source, request_id="r")
        np.testing.assert_array_equal(shm.read_array(handle.name_value, handle.shape_value), source)


def test_unleased_put_is_cached_only():
    with make_store(cache_bytes=ITEM_SIZE) as store:
        first = store.put(item(1), key="a")
        store.put(item(2), key="b")  # evicts a: unleased segments can go at any time
        assert store.get("a") is None
        assert first.name not in on_disk(store)


def test_close_unlinks_everything_and_is_idempotent():
    store = make_store()
    store.put(item(1), key="a", request_id="r")
    store.put(item(2), key="b")
    marker = "psm_" + store.instance_id
    assert marker in list_segment_names()
    store.close()
    store.close()
    assert on_disk(store) == set() and marker not in list_segment_names()
    with pytest.raises(RuntimeError, match="closed"):
        store.put(item(3), request_id="r")


def test_a_forgotten_store_cleans_up_when_collected():
    store = make_store()
    store.put(item(1), request_id="r")
    prefix = "psm_" + store.instance_id
    del store
    gc.collect()
    assert not [n for n in list_segment_names() if n.startswith(prefix)]


def test_stats_track_leased_and_cached_bytes():
    with make_store() as store:
        store.put(item(1), key="a", request_id="r1")
        store.put(item(2), key="b", request_id="r1")
        store.put(item(3), key="c", request_id="r2")
        store.release("r1")
        stats = store.stats()
        assert stats == {
            "segments": 3,
            "leased_segments": 1,
            "leased_bytes": ITEM_SIZE,
            "cached_segments": 2,
            "cached_bytes": 2 * ITEM_SIZE,
            "requests": 1,
        }


def test_instances_get_distinct_ids():
    stores = [make_store() for _ in range(5)]
    try:
        assert len({s.instance_id for s in stores}) == 5
    finally:
        for s in stores:
            s.close()


def test_concurrent_puts_and_releases_from_threads():
    keys = [f"k{i}" for i in range(12)]
    errors = []
    with make_store(cache_bytes=6 * ITEM_SIZE) as store:
        def worker(thread: int):
            try:
                for step in range(40):
                    request = f"t{thread}-{step}"
                    for key in keys[(thread + step) % 12:][:3]:
                        value = int(key[1:])
                        handle = store.put(item(value), key=key, request_id=request)
                        # While leased, the segment holds exactly this key's content.
                        np.testing.assert_array_equal(
                            shm.read_array(handle.name_value, handle.shape_value), item(value)
                        )
                    store.release(request)
            except Exception as error:  # reported below; a thread's exception is otherwise lost
                errors.append(error)

        threads = [threading.Thread(target=worker, args=(t,)) for t in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        stats = store.stats()
        assert stats["leased_segments"] == 0 and stats["requests"] == 0
        assert stats["cached_bytes"] <= 6 * ITEM_SIZE
        # The store's books match /dev/shm: one file per tracked segment, none orphaned.
        assert on_disk(store) == set(store.names())
        assert len(store.names()) == stats["cached_segments"]


def test_segments_are_private_to_the_user():
    with make_store() as store:
        handle = store.put(item(1), request_id="r")
        assert os.stat(os.path.join("/dev/shm", handle.name)).st_mode & 0o077 == 0


def test_a_forked_child_exiting_does_not_unlink_its_parents_segments():
    from tests.helpers import run_python

    result = run_python("""
        import os, sys, numpy as np, shm
        store = shm.ShmStore(shm.ShmStoreConfig(reap_on_start=False))
        handle = store.put(np.ones(4, np.float32), request_id="r")
        pid = os.fork()
        if pid == 0:
            sys.exit(0)  # a normal exit: atexit hooks and finalizers run in the child
        os.waitpid(pid, 0)
        print("alive" if os.path.exists("/dev/shm/" + handle.name) else "unlinked")
        store.close()
    """)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "alive"


@pytest.mark.parametrize(
    "config, message",
    [
        ({"max_segment_bytes": 0}, "max_segment_bytes must be > 0"),
        ({"cache_bytes": -1}, "cache_bytes must be >= 0"),
        ({"capacity_bytes": 0}, "capacity_bytes must be > 0"),
    ],
)
def test_invalid_config_is_refused(config, message):
    with pytest.raises(ValueError, match=message):
        shm.ShmStoreConfig(**config)
