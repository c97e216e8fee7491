"""The OffloadingConnector (docs/kv-transfer.md): with a device KV cache far smaller than the
shared prefixes, a second round of requests loads them from the host tier instead of recomputing
(counted), with the greedy tokens of an unbounded device cache; the disk tier survives an engine
restart and is hit; a corrupt file is detected (checksum), removed, counted and recomputed;
block names do not depend on PYTHONHASHSEED; MultiConnector stacks it; bad configs are refused
with the key's name."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from atb_plugin.engine.config import EngineConfig
from atb_plugin.engine.core import EngineCore
from atb_plugin.engine.messages import EngineCoreRequest
from atb_plugin.engine.sampling_params import SamplingParams
from atb_plugin.testing.tiny import tiny_checkpoint

ROOT = Path(__file__).resolve().parents[1]
BLOCK = 4
GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
# Four shared prefixes of 9 blocks each (36 blocks) over a device cache of 19 usable blocks:
# the second round's prefixes are long gone from the device when they come back.
PREFIXES = [list(range(10 + 40 * i, 10 + 40 * i + 36)) for i in range(4)]
ROUNDS = [[(f"{r}-{i}", PREFIXES[i] + [3 + r, 4]) for i in range(4)] for r in range(2)]
SMALL = dict(kv_cache_blocks=20)


@contextlib.contextmanager
def _engine(**kwargs) -> Iterator[EngineCore]:
    core = EngineCore(EngineConfig(tiny_checkpoint("qwen2"), block_size=BLOCK, max_model_len=64, num_threads=1,
                                   **kwargs))
    try:
        yield core
    finally:
        core.shutdown()  # waits for the disk tier's queued writes


def _round(core: EngineCore, requests) -> dict[str, list[int]]:
    """One request at a time (the device cache holds one prefix at most)."""
    tokens = {}
    for request_id, prompt in requests:
        core.add_request(EngineCoreRequest(request_id, prompt, GREEDY))
        tokens[request_id] = []
        while core.has_unfinished_requests():
            for out in core.step():
                tokens[request_id] += out.new_token_ids
    return tokens


def _assert_clean(core: EngineCore) -> None:
    kv = core.kv_cache_manager
    kv.block_pool.check()
    assert kv.num_free_blocks == kv.num_blocks - 1 and not kv.req_to_blocks


@pytest.fixture(scope="module")
def reference() -> list[dict[str, list[int]]]:
    with _engine(kv_cache_blocks=400) as core:  # every prefix fits
        return [_round(core, requests) for requests in ROUNDS]


def _offload(size_bytes: int = 1 << 20, **extra) -> dict:
    return {"kv_connector": "OffloadingConnector", "kv_connector_extra_config": {"cpu_bytes_to_use": size_bytes,
                                                                               **extra}}


def test_a_small_device_cache_hits_the_host_tier_with_the_reference_tokens(reference):
    with _engine(**SMALL, kv_offloading_size=1 / 1024) as core:  # 1 MiB
        assert _round(core, ROUNDS[0]) == reference[0]
        first = core.make_stats()
        assert first.external_prefix_cache_hits == 0 and first.kv_transfer.num_saves > 0
        assert first.kv_transfer.tier_bytes["cpu"] > 0
        assert _round(core, ROUNDS[1]) == reference[1]
        second = core.make_stats()
        # Each prefix's 9 blocks come back from the host tier (nothing of them is on the device).
        assert second.external_prefix_cache_hits == 4 * 36 and second.prefix_cache_hits == 0
        assert second.kv_transfer.num_loads == 4 * 9 and second.kv_transfer.bytes_loaded > 0
        _assert_clean(core)
    # Without the tier the same budget recomputes everything.
    with _engine(**SMALL) as core:
        _round(core, ROUNDS[0])
        assert _round(core, ROUNDS[1]) == reference[1] and core.make_stats().prefix_cache_hits == 0


def test_the_host_tier_evicts_the_least_recently_used_blocks(reference):
    # Room for 12 blocks: round one's last blocks survive, the first prefix's are gone.
    with _engine(**SMALL, kv_transfer_config=_offload(12 * 2048)) as core:
        _round(core, ROUNDS[0])
        assert core.make_stats().kv_transfer.tier_bytes == {"cpu": 12 * 2048}
        assert _round(core, [ROUNDS[1][0]]) == {"1-0": reference[1]["1-0"]}
        stats = core.make_stats()
        assert stats.external_prefix_cache_hits == 0 and stats.prefix_cache_hits == 0


def _disk_files(root: Path) -> list[Path]:
    return sorted(root.rglob("*.kv"))


def test_the_disk_tier_survives_a_restart_and_a_corrupt_file_is_recomputed(reference, tmp_path):
    config = _offload(4 * 2048, disk_path=str(tmp_path))  # a host tier of 4 blocks: the rest on disk
    with _engine(**SMALL, kv_transfer_config=config) as core:
        assert _round(core, ROUNDS[0]) == reference[0]
    files = _disk_files(tmp_path)
    assert len(files) == 4 * 10  # each request's full blocks: its prefix and its tail
    # A restarted engine finds them (its host tier is empty) ...
    with _engine(**SMALL, kv_transfer_config=config) as core:
        assert core.make_stats().kv_transfer.tier_bytes["disk"] == 40 * 2048
        assert _round(core, ROUNDS[1][:2]) == {k: reference[1][k] for k in ("1-0", "1-1")}
        stats = core.make_stats()
        assert stats.external_prefix_cache_hits == 2 * 36 and stats.kv_transfer.num_loads == 18
        assert stats.kv_transfer.num_failed_loads == 0
    # ... and a corrupt one (a flipped byte) is caught by its checksum: removed, counted, recomputed.
    third = [f for f in files if f.exists()]
    victim = next(f for f in third if bytes.fromhex(f.stem) == _block_hash(PREFIXES[2], 4))
    data = bytearray(victim.read_bytes())
    data[-1] ^= 0xFF
    victim.write_bytes(bytes(data))
    with _engine(**SMALL, kv_transfer_config=config) as core:
        assert _round(core, [ROUNDS[1][2]]) == {"1-2": reference[1]["1-2"]}
        stats = core.make_stats()
        assert stats.kv_transfer.num_failed_loads == 1 and not victim.exists()
        _assert_clean(core)


def _block_hash(prefix: list[int], index: int) -> bytes:
    from atb_plugin.engine.kv_cache_manager import request_block_hashes
    from atb_plugin.engine.request import Request

    return request_block_hashes(Request("x", prefix, GREEDY), BLOCK)[index]


def test_block_names_do_not_depend_on_the_hash_seed():
    code = ("from atb_plugin.engine.kv_cache_manager import request_block_hashes\n"
            "from atb_plugin.engine.request import Request\n"
            "print(request_block_hashes(Request('x', list(range(40)), None, pooling_params=None), 4)[-1].hex())")
    names = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT,
                            env={**os.environ, "PYTHONHASHSEED": seed}).stdout for seed in ("1", "2")}
    assert len(names) == 1 and len(names.pop().strip()) == 64


def test_a_multi_connector_stacks_the_host_tier_behind_another(reference):
    multi = {"kv_connector": "MultiConnector", "kv_connector_extra_config": {"connectors": [
        {"kv_connector": "DictConnector", "kv_connector_module_path": "tests.kv_dict_connector",
         "kv_connector_extra_config": {"store": "empty-for-multi"}},
        _offload()]}}
    with _engine(**SMALL, kv_transfer_config=multi) as core:
        _round(core, ROUNDS[0])
        core.make_stats()
        assert _round(core, ROUNDS[1]) == reference[1]
        assert core.make_stats().external_prefix_cache_hits == 4 * 36
        _assert_clean(core)


@pytest.mark.parametrize("kwargs, words", [
    ({"kv_transfer_config": {"kv_connector": "OffloadingConnector"}}, "cpu_bytes_to_use"),
    ({"kv_transfer_config": _offload(size_bytes=0)}, "cpu_bytes_to_use = 0"),
    ({"kv_transfer_config": _offload(block_size=16)}, "unknown kv_connector_extra_config keys"),
    ({"kv_transfer_config": _offload(disk_bytes_to_use=1 << 20)}, "needs disk_path"),
    ({"kv_offloading_size": 1, "enable_prefix_caching": False}, "enable_prefix_caching"),
    ({"kv_transfer_config": {"kv_connector": "MultiConnector", "kv_connector_extra_config": {"connectors": [
        _offload(size_bytes="lots")]}}}, r"connectors\[0\].*cpu_bytes_to_use"),
    ({"kv_transfer_config": {"kv_connector": "MultiConnector"}}, "non-empty list"),
    ({"kv_offloading_size": 1, "speculative_config": {"method": "draft_model", "model": str(tiny_checkpoint("qwen2")),
                                                      "num_speculative_tokens": 2}}, "draft's own KV"),
])
def test_bad_offloading_configs_name_the_key(kwargs, words):
    with pytest.raises(ValueError, match=words):
        EngineConfig(tiny_checkpoint("qwen2"), block_size=BLOCK, **kwargs)


def test_ngram_drafts_verify_over_loaded_blocks(reference):
    with _engine(**SMALL, kv_offloading_size=1 / 1024,
                 speculative_config={"method": "ngram", "num_speculative_tokens": 2}) as core:
        _round(core, ROUNDS[0])
        assert _round(core, ROUNDS[1]) == reference[1]
        assert core.make_stats().external_prefix_cache_hits == 4 * 36


def test_a_host_tier_too_small_for_one_block_is_refused_at_start():
    with pytest.raises(ValueError, match="holds no KV block"), _engine(**SMALL, kv_transfer_config=_offload(100)):
        pass


def test_tensor_parallel_ranks_each_offload_their_shard(reference, tmp_path):
    config = _offload(4 * 4096, disk_path=str(tmp_path))  # bytes over both ranks: 4 blocks
    with _engine(**SMALL, tensor_parallel_size=2, kv_transfer_config=config) as core:
        assert _round(core, ROUNDS[0]) == reference[0]
        assert _round(core, ROUNDS[1]) == reference[1]
        stats = core.make_stats()
        assert stats.external_prefix_cache_hits == 4 * 36 and stats.kv_transfer.num_failed_loads == 0
        # Each rank loaded its half of every block.
        assert stats.kv_transfer.bytes_loaded == 4 * 9 * 2048 and stats.kv_transfer.num_loads == 2 * 4 * 9
    assert {p.parent.parent.name for p in _disk_files(tmp_path)} == {"rank0", "rank1"}
