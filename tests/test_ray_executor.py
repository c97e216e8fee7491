"""Multi-node ranks on Ray (``--distributed-executor-backend ray``, engine/executor/ray.py).

The cluster checks run in ``tests/ray_netns_checks.py`` inside a network namespace with only a
loopback interface (``unshare -n``, then ``ip link set lo up``): Ray would otherwise advertise
the host's own address, and no test may send traffic outside 127.0.0.0/8. There a real local Ray
cluster of two logical nodes runs TP = 2 with one rank on each node, so rank 1's collectives
cross nodes over gloo and its media come with each step instead of from shared memory; its
greedy tokens must equal TP = 1's (the same exact-equality argument as tests/test_tensor_parallel.py:
float32 differences of a few ulps are far below the greedy margins on these prompts). Then the
service on the same cluster: a SIGKILLed rank actor fails the in-flight streams and ends the
service with a non-zero exit, leaving no actor behind.

The pieces the cluster run relies on are also checked here directly: reading handles out of a
prompt, shipping them, and a remote rank's reader (including a handle the core could not read).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import shm
from atb_plugin.engine.config import EngineConfig, check_executor_backend
from atb_plugin.multimodal.shipped import media_handles, read_shared_memory, ship, shipped_reader
from atb_plugin.testing.tiny import tiny_checkpoint
from tests.helpers import checked_section, run_checks_in_netns

REPO_ROOT = Path(__file__).resolve().parents[1]
CLUSTER_TIMEOUT_S = 900


@pytest.fixture(scope="module")
def cluster_run():
    pytest.importorskip("ray")
    return run_checks_in_netns("tests.ray_netns_checks", "the Ray cluster must not run on the host's network",
                               CLUSTER_TIMEOUT_S)


_section = checked_section


@pytest.mark.slow
def test_the_cluster_ran_on_loopback_only(cluster_run):
    assert cluster_run["interfaces"] == ["lo"]
    assert cluster_run["ray_address"].startswith("127.0.0.1:")


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen2", "qwen2_vl"])
def test_tp2_across_two_ray_nodes_equals_tp1(cluster_run, family):
    result = _section(cluster_run, "llm")[family]
    ray, tp1 = result["ray"], result["tp1"]
    assert ray["remote_ranks"] == [1], "rank 1 must sit on the other node and take the shipped-media path"
    assert ray["actors_while_open"] == 2 and ray["actors_after_close"] == 0
    assert ray["text"] == tp1["text"]
    if family == "qwen2_vl":
        assert ray["image"] == tp1["image"]  # the image through the step to rank 1; turn 2 from the prefix cache
        assert ray["image"][0] == ray["image"][1]


@pytest.mark.slow
def test_a_killed_rank_actor_fails_in_flight_streams_and_ends_the_service(cluster_run):
    result = _section(cluster_run, "kill")
    assert result["in_flight"], "no stream had started when the actor was killed"
    assert len(result["streams"]) == 2
    assert all(outcome.startswith("raised") for outcome in result["streams"]), result["streams"]
    assert result["exit_code"] not in (0, None), result["log_tail"]
    # The dead actor is named (its peer, failing in the collective a moment earlier, is not the cause).
    assert result["rank_failed"] and result["rank_failed"][0].startswith("tensor-parallel rank 1 (a Ray actor)"), \
        result["rank_failed"]
    assert "its actor died" in result["rank_failed"][0]
    assert result["actors_left"] == []


# -- the pieces, without a cluster ---------------------------------------------------------------


def _block(name: int, shape: int, pad: int = 7, count: int = 3) -> list[int]:
    return [name, shape, *([pad] * count)]


def test_media_handles_are_the_first_two_slots_of_every_block():
    ids = [1, 2, *_block(-11, -12), 3, *_block(-21, -22), -31, -32, -33, 5]
    assert media_handles(ids) == [(-11, -12), (-21, -22), (-31, -32)]
    assert media_handles([1, 2, 3]) == []
    assert media_handles([4, -1]) == []  # a lone slot at the end is no handle (the runner reports the block)


def test_shipped_media_equal_what_shared_memory_holds_and_failures_travel_as_text():
    store = shm.ShmStore()
    try:
        array = np.arange(2 * 3 * 4, dtype=np.uint8).reshape(2, 3, 4)
        handle = store.put(array)
        name, shape = handle.name_value, handle.shape_value
        prompt = [1, *_block(name, shape), 2, *_block(-5, -6)]
        shipped = ship([(prompt, store.instance_id)])
        assert set(shipped) == {(name, shape), (-5, -6)}
        np.testing.assert_array_equal(shipped[(name, shape)], read_shared_memory(name, shape, store.instance_id))
        assert isinstance(shipped[(-5, -6)], str)
        read = shipped_reader(shipped)
        np.testing.assert_array_equal(read(name, shape, None), array)
        with pytest.raises(shm.ShmHandleError, match=shipped[(-5, -6)][:20]):
            read(-5, -6, None)
        with pytest.raises(shm.ShmHandleError, match="another node"):
            shipped_reader(None)(name, shape, None)
    finally:
        store.close()


def test_an_unknown_executor_backend_is_refused_naming_the_choices():
    with pytest.raises(ValueError, match="expected one of mp, ray"):
        check_executor_backend("threads")
    with pytest.raises(ValueError, match="distributed_executor_backend"):
        EngineConfig(model=tiny_checkpoint("qwen2"), distributed_executor_backend="slurm")


def test_ray_without_ray_installed_says_how_to_install_it(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "ray" else real(name, *a))
    with pytest.raises(ValueError, match=r"pip install 'atb-plugin\[ray\]'"):
        check_executor_backend("ray")
