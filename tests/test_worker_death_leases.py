"""Issue #45: a worker killed for exceeding its budget fails only its own request, never an
unrelated one. The requests a dead media worker built earlier keep their media: the API process
adopts their segments (``shm.AdoptedSegments``), the reaper spares them, and they are unlinked as
each request ends; the job that was running on the worker still fails (504 when it overran its
budget), and nothing of the dead instance is left once the adopted requests are over."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import signal
from types import SimpleNamespace

import numpy as np
import pytest

import shm
from atb_plugin.engine.config import EngineConfig
from atb_plugin.frontend.async_llm import AsyncLLM
from atb_plugin.frontend.errors import RequestError
from atb_plugin.frontend.input_processor import Lease
from atb_plugin.frontend.tokenizer_pool import ChatJob, TokenizerPool, WorkerSettings
from atb_plugin.testing.tiny import tiny_checkpoint
from atb_plugin.testing.videos import many_frames_video_bytes, video_bytes
from input_builders.media_config import MediaConfig
from shm.codec import encode_shape_to_int64, encode_shm_name_to_int64
from shm.segment import list_segment_names, marker_name, parse_name, read_header
from tests.test_media_workers import data_url, video_chat


def _of(instance: str) -> list[str]:
    """Every name of ``instance`` in /dev/shm, its marker included."""
    return [name for name in list_segment_names() if parse_name(name)[0] == instance]


def _readable(name: str, instance: str) -> bool:
    header = read_header(name)
    array = shm.read_array(encode_shm_name_to_int64(name), encode_shape_to_int64(header.shape),
                           expected_instance=[instance])  # what the engine verifies
    return array.shape == header.shape


# -- the shm side -----------------------------------------------------------------------------------

def _store_then_hang(connection) -> None:
    """A store's process: writes four segments, reports them, and waits to be killed."""
    store = shm.ShmStore(shm.ShmStoreConfig(reap_on_start=False))
    own = store.put(np.arange(8, dtype=np.int32), "own", request_id="a").name
    shared = store.put(np.ones((2, 3), np.float32), "shared", request_id="a").name
    store.put(np.ones((2, 3), np.float32), "shared", request_id="b")
    ended = store.put(np.zeros(4, np.uint8), "ended", request_id="c").name
    store.release("c")  # cached: nobody reads it any more
    leased = store.put(np.zeros(5, np.uint8), "other", request_id="d").name
    connection.send((store.instance_id, own, shared, ended, leased))
    signal.pause()


def _dead_instance():
    context = multiprocessing.get_context("fork")
    parent, child = context.Pipe()
    process = context.Process(target=_store_then_hang, args=(child,), daemon=True)
    process.start()
    names = parent.recv()
    os.kill(process.pid, signal.SIGKILL)
    process.join(10)
    return names


def test_adopted_segments_outlive_their_writer_until_their_leases_end():
    instance, own, shared, _, _ = _dead_instance()
    adopted = shm.AdoptedSegments()
    try:
        assert adopted.adopt(instance, {"a": [own, shared], "b": [shared]})
        # Unreferenced segments go now: a cached one, and one whose request is not among the adopted.
        assert sorted(_of(instance)) == sorted([marker_name(instance), own, shared])
        assert not any(parse_name(name)[0] == instance for name in shm.reap_orphans()), "the reaper spares them"
        assert _readable(own, instance) and _readable(shared, instance)
        assert adopted.holds("a") and adopted.release("a") and not adopted.holds("a")
        assert sorted(_of(instance)) == sorted([marker_name(instance), shared]), "b still reads the shared one"
        assert adopted.release("b") and not adopted.release("b")
        assert _of(instance) == [], "the last release unlinks the marker too"
    finally:
        adopted.close()


def test_closing_unlinks_what_is_still_adopted_and_a_reaped_instance_cannot_be_adopted():
    instance, own, shared, _, _ = _dead_instance()
    adopted = shm.AdoptedSegments()
    assert adopted.adopt(instance, {"a": [own, shared]})
    adopted.close()
    assert _of(instance) == []

    instance, own, _, _, _ = _dead_instance()
    shm.reap_orphans()
    assert not adopted.adopt(instance, {"a": [own]})
    assert _of(instance) == []


def _adopt_then_hang(instance: str, names: list, connection) -> None:
    adopted = shm.AdoptedSegments()
    connection.send(adopted.adopt(instance, {"a": names}))
    signal.pause()


def test_an_adopters_death_leaves_the_segments_to_the_reaper():
    instance, own, shared, _, _ = _dead_instance()
    context = multiprocessing.get_context("fork")
    parent, child = context.Pipe()
    process = context.Process(target=_adopt_then_hang, args=(instance, [own, shared], child), daemon=True)
    process.start()
    assert parent.recv()
    assert not any(parse_name(name)[0] == instance for name in shm.reap_orphans()), "its adopter lives"
    os.kill(process.pid, signal.SIGKILL)
    process.join(10)
    shm.reap_orphans()
    assert _of(instance) == []


# -- the pool and the API process -------------------------------------------------------------------

def test_a_media_worker_killed_for_its_budget_fails_only_its_job():
    async def run():
        settings = WorkerSettings(EngineConfig(model=str(tiny_checkpoint("qwen2_vl"))),
                                  MediaConfig(media_decode_timeout=0.5, http_timeout_s=0.1))
        pool = TokenizerPool(settings, 1, None, on_worker_death=lambda index, instance: None,
                             num_media_workers=1, stuck_after_s=1.0)
        await pool.start()
        try:
            index, instance, _ = await pool.call(ChatJob("A", video_chat(data_url(video_bytes(8, 2, seed=3)))))
            names = pool._workers[index].leases["A"]
            os.kill(pool._workers[index].process.pid, signal.SIGSTOP)  # the next decode never returns
            with pytest.raises(RequestError) as overran:
                await pool.call(ChatJob("B", video_chat(data_url(many_frames_video_bytes(20_000)))))
            while not pool._live(media=True):  # the replacement has started: its store has reaped
                await asyncio.sleep(0.1)
            shm.reap_orphans()
            kept = [name for name in names if name in _of(instance) and _readable(name, instance)]
            adopted = pool.lease_adopted(index, "A")
            pool.release(index, "A")  # A ends
            return index, instance, names, kept, adopted, overran.value, _of(instance)
        finally:
            await pool.shutdown()

    index, instance, names, kept, adopted, error, left = asyncio.run(run())
    assert index == 1 and names and kept == names and adopted
    assert error.status == 504, error
    assert left == [], "no segment of the dead instance remains once A has ended"


def test_a_worker_death_fails_the_requests_whose_media_were_not_adopted():
    leases = {"A": Lease("A", 1), "B": Lease("B", 1), "C": Lease("C", 0), "D": None}
    failed = []
    llm = SimpleNamespace(tracker=SimpleNamespace(lease_of=leases.get),
                          pool=SimpleNamespace(lease_adopted=lambda index, request_id: (index, request_id) == (1, "A")),
                          fail_all=lambda error, which: failed.extend(r for r in leases if which(r)))
    AsyncLLM.on_worker_death(llm, 1, "inst")
    assert failed == ["B"]
