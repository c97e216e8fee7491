"""The KV connector seam in the engine (docs/kv-transfer.md), driven by a test connector that
delivers KV blocks from a dict (tests/kv_dict_connector.py): external tokens count as computed
and cached, the greedy tokens equal a run that computed everything, a failed load is recomputed
or fails the request as kv_load_failure_policy says, a delayed free keeps the blocks until the
connector sent them, nothing leaks; configuration errors are clear."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest

from atb_plugin.engine.config import EngineConfig
from atb_plugin.engine.core import EngineCore
from atb_plugin.engine.kv_cache_manager import request_block_hashes
from atb_plugin.engine.messages import EngineCoreRequest
from atb_plugin.engine.request import Request, RequestStatus
from atb_plugin.engine.sampling_params import SamplingParams
from atb_plugin.testing.tiny import tiny_checkpoint
from tests import kv_dict_connector

BLOCK = 4
PROMPT = list(range(7, 7 + 21))  # 21 tokens: 5 full blocks may come from outside, never the last token
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def _config(**kv) -> EngineConfig:
    extra = kv.pop("extra", {})
    transfer = None if kv.pop("none", False) else {
        "kv_connector": "DictConnector", "kv_connector_module_path": "tests.kv_dict_connector",
        "kv_connector_extra_config": extra, **kv}
    return EngineConfig(tiny_checkpoint("qwen2"), block_size=BLOCK, kv_cache_blocks=24, kv_transfer_config=transfer)


@contextlib.contextmanager
def _core(config: EngineConfig) -> Iterator[EngineCore]:
    core = EngineCore(config)
    try:
        yield core
    finally:
        core.shutdown()


def _run(core: EngineCore, requests: dict[str, list[int]], params=GREEDY, max_steps: int = 200):
    for request_id, prompt in requests.items():
        core.add_request(EngineCoreRequest(request_id, prompt, params))
    tokens = {request_id: [] for request_id in requests}
    finals = {}
    for _ in range(max_steps):
        if not (core.has_unfinished_requests() or core.has_pending_kv_transfers()):
            break
        for out in core.step():
            tokens[out.request_id] += out.new_token_ids
            if out.finished:
                finals[out.request_id] = out
    return tokens, finals


@pytest.fixture(scope="module")
def reference():
    """Greedy tokens of PROMPT computed in full, and its blocks captured into store "ref"."""
    with _core(_config(none=True)) as core:
        tokens, _ = _run(core, {"r": PROMPT})
        hashes = request_block_hashes(Request("r", PROMPT, GREEDY), BLOCK, len(PROMPT) - 1)
        pool = core.kv_cache_manager.block_pool
        block_ids = [pool.get_cached_block(h).block_id for h in hashes]
        kv_dict_connector.capture("ref", core.runner.kv_caches, block_ids, hashes)
        return tokens["r"]


def _assert_clean(core: EngineCore) -> None:
    kv = core.kv_cache_manager
    kv.block_pool.check()
    assert kv.num_free_blocks == kv.num_blocks - 1 and not kv.req_to_blocks
    assert not core.has_pending_kv_transfers()


def test_external_tokens_are_loaded_counted_and_give_the_reference_tokens(reference):
    with _core(_config(extra={"store": "ref"})) as core:
        tokens, finals = _run(core, {"a": PROMPT})
        assert tokens["a"] == reference
        assert finals["a"].num_cached_tokens == 20  # vLLM's: local hits + external tokens
        stats = core.make_stats()
        assert (stats.external_prefix_cache_queries, stats.external_prefix_cache_hits) == (21, 20)
        assert stats.kv_transfer is not None and stats.kv_transfer.num_loads == 5
        assert stats.kv_transfer.num_failed_loads == 0
        # The loaded blocks are in the device prefix cache now: a second request hits them
        # locally and asks the connector only for what follows (nothing).
        tokens, finals = _run(core, {"b": PROMPT})
        assert tokens["b"] == reference
        stats = core.make_stats()
        assert stats.prefix_cache_hits == 20 and stats.external_prefix_cache_hits == 0
        assert stats.external_prefix_cache_queries == 1
        _assert_clean(core)


def test_a_connector_that_does_not_know_yet_keeps_the_request_waiting(reference):
    with _core(_config(extra={"store": "ref", "not_ready_steps": 2})) as core:
        tokens, _ = _run(core, {"a": PROMPT, "b": [3, 4, 5]})
        assert tokens["a"] == reference and len(tokens["b"]) == GREEDY.max_tokens
        _assert_clean(core)


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_a_failed_load_is_recomputed_or_fails_the_request(reference, policy):
    with _core(_config(extra={"store": "ref", "fail_loads": True}, kv_load_failure_policy=policy)) as core:
        tokens, finals = _run(core, {"a": PROMPT, "b": [3, 4, 5]})
        stats = core.make_stats()
        assert stats.kv_transfer.num_failed_loads == 1
        if policy == "recompute":
            assert tokens["a"] == reference and finals["a"].finish_reason == "length"
            assert finals["a"].num_cached_tokens == 0  # recomputed, not asked of the connector again
        else:
            assert tokens["a"] == [] and finals["a"].finish_reason == "error"
            assert "DictConnector" in finals["a"].error and "KV load failed" in finals["a"].error
        assert len(tokens["b"]) == GREEDY.max_tokens  # the other request is untouched
        # The garbage blocks left the prefix cache: nothing hits them.
        if policy == "fail":
            assert all(_pool(core).get_cached_block(h) is None for h in _hashes(PROMPT))
        _assert_clean(core)


def test_a_delayed_free_keeps_the_blocks_until_sent_and_returns_the_params(reference):
    with _core(_config(extra={"store": "ref", "delay_free_steps": 3})) as core:
        for request_id in ("a", "b"):
            core.add_request(EngineCoreRequest(request_id, PROMPT, GREEDY))
        finals = {}
        while core.has_unfinished_requests():
            finals.update({o.request_id: o for o in core.step() if o.finished})
        assert finals["a"].kv_transfer_params["store"] == "ref"
        assert core.has_pending_kv_transfers() and core.kv_cache_manager.req_to_blocks
        with pytest.raises(ValueError, match="still in use"):  # its blocks are still under that id
            core.add_request(EngineCoreRequest("a", PROMPT, GREEDY))
        steps = 0
        while core.has_pending_kv_transfers():
            assert core.step() == []  # empty steps: no model rows, the workers polled
            steps += 1
        assert steps <= 3
        _assert_clean(core)
        # An abort of a running request with a pending transfer is handled the same way.
        core.add_request(EngineCoreRequest("c", PROMPT, GREEDY))
        core.step()
        core.abort(["c"])
        assert core.has_pending_kv_transfers()
        while core.has_pending_kv_transfers():
            core.step()
        _assert_clean(core)


@pytest.mark.parametrize("kwargs, words", [
    ({"kv_transfer_config": {"kv_connector": "Nope"}}, "unknown; registered"),
    ({"kv_transfer_config": '{"kv_connector": "DictConnector"'}, "is not JSON"),
    ({"kv_transfer_config": {"kv_connector": "DictConnector", "kv_role": "both"}}, "kv_role"),
    ({"kv_transfer_config": {"kv_connector": "DictConnector", "kv_connector_module_path": "tests.kv_dict_connector",
                             "kv_connector_extra_config": {"bogus": 1}}}, "bogus"),
    ({"kv_transfer_config": {"kv_connector": "DictConnector", "kv_load_failure_policy": "retry"}},
     "kv_load_failure_policy"),
    ({"kv_transfer_config": {"kv_connector": "DictConnector", "kv_connector_module_path": "tests.kv_dict_connector"},
      "kv_offloading_size": 1}, "both given"),
    ({"kv_offloading_size": -1}, "positive"),
])
def test_bad_kv_transfer_configs_are_refused_clearly(kwargs, words):
    with pytest.raises(ValueError, match=words):
        EngineConfig(tiny_checkpoint("qwen2"), block_size=BLOCK, kv_cache_blocks=24, **kwargs)


def test_the_server_flags_reach_the_engine_config_and_both_at_once_are_refused():
    from atb_plugin.server.cli import parse_config

    model = str(tiny_checkpoint("qwen2"))
    config = parse_config(["--model", model, "--kv-transfer-config",
                           '{"kv_connector": "DictConnector", "kv_connector_module_path": "tests.kv_dict_connector", '
                           '"kv_load_failure_policy": "fail"}'])
    kv = config.engine.kv_transfer_config
    assert (kv.kv_connector, kv.kv_role, kv.kv_load_failure_policy) == ("DictConnector", "kv_both", "fail")
    with pytest.raises(ValueError, match="both given"):
        parse_config(["--model", model, "--kv-offloading-size", "1", "--kv-transfer-config",
                      '{"kv_connector": "DictConnector"}'])
    with pytest.raises(ValueError, match="generative"):
        EngineConfig(model, runner="pooling", convert="embed", kv_transfer_config=kv)


def test_tensor_parallel_ranks_outputs_merge_finishes_across_steps():
    from atb_plugin.engine.kv_transfer.base import KVConnectorOutput, KVOutputAggregator
    from atb_plugin.engine.messages import KVTransferStats

    aggregator = KVOutputAggregator(2)
    step1 = aggregator.aggregate([
        KVConnectorOutput({"a", "b"}, {"x"}, {3}, {b"h1", b"h2"}, stats=KVTransferStats(num_loads=1,
                                                                                     tier_bytes={"cpu": 10})),
        KVConnectorOutput({"a"}, set(), {4}, {b"h1"}, stats=KVTransferStats(num_loads=1, tier_bytes={"cpu": 12}))])
    assert step1.finished_sending == {"a"} and not step1.finished_recving and step1.invalid_block_ids == {3, 4}
    assert step1.stored_block_hashes == {b"h1"}
    assert step1.stats.num_loads == 2 and step1.stats.tier_bytes == {"cpu": 22}  # each rank's shard
    step2 = aggregator.aggregate([KVConnectorOutput(), KVConnectorOutput({"b"}, {"x"}, stored_block_hashes={b"h2"})])
    assert step2.finished_sending == {"b"} and step2.finished_recving == {"x"} and step2.stats is None
    assert step2.stored_block_hashes == {b"h2"}


def test_metrics_export_the_external_prefix_cache_and_transfer_series():
    from atb_plugin.engine.messages import KVTransferStats
    from atb_plugin.server.metrics import ServerMetrics

    metrics = ServerMetrics("m")
    metrics.add_kv_transfer(21, 20, KVTransferStats(num_loads=5, bytes_loaded=4096, num_failed_loads=1,
                                                    tier_bytes={"cpu": 8192}))
    text = metrics.render()[0].decode()
    assert 'vllm:external_prefix_cache_queries_total{model_name="m"} 21.0' in text
    assert 'vllm:external_prefix_cache_hits_total{model_name="m"} 20.0' in text
    assert 'atb_plugin:kv_bytes_loaded_total{engine="0",model_name="m"} 4096.0' in text
    assert 'atb_plugin:kv_failed_loads_total{engine="0",model_name="m"} 1.0' in text
    assert 'atb_plugin:kv_offload_tier_bytes{engine="0",model_name="m",tier="cpu"} 8192.0' in text


def test_an_asynchronous_load_waits_for_remote_kv_then_runs(reference):
    with _core(_config(extra={"store": "ref", "load_async_steps": 3})) as core:
        core.add_request(EngineCoreRequest("a", PROMPT, GREEDY))
        core.add_request(EngineCoreRequest("b", [3, 4, 5], GREEDY))
        tokens = {"a": [], "b": []}
        _collect(core.step(), tokens)
        a = core.scheduler.requests["a"]
        assert a.status is RequestStatus.WAITING_FOR_REMOTE_KVS and a.num_computed_tokens == 20
        assert [r.request_id for r in core.scheduler.running] == ["b"]  # the others go on meanwhile
        # Its blocks are held, but nobody may hit them before the KV arrived.
        assert all(_pool(core).get_cached_block(h) is None for h in _hashes(PROMPT))
        while core.has_unfinished_requests():
            _collect(core.step(), tokens)
        assert tokens["a"] == reference and len(tokens["b"]) == GREEDY.max_tokens
        assert core.make_stats().external_prefix_cache_hits == 20
        _assert_clean(core)


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_a_failed_asynchronous_load_is_recomputed_or_fails(reference, policy):
    with _core(_config(extra={"store": "ref", "load_async_steps": 2, "fail_loads": True},
                       kv_load_failure_policy=policy)) as core:
        tokens, finals = _run(core, {"a": PROMPT})
        assert core.make_stats().kv_transfer.num_failed_loads == 1
        if policy == "recompute":
            assert tokens["a"] == reference and finals["a"].num_cached_tokens == 0
        else:
            assert finals["a"].finish_reason == "error" and "KV load failed" in finals["a"].error
        _assert_clean(core)


def test_an_abort_while_receiving_keeps_the_blocks_until_the_load_ended(reference):
    with _core(_config(extra={"store": "ref", "load_async_steps": 3})) as core:
        core.add_request(EngineCoreRequest("a", PROMPT, GREEDY))
        core.step()
        core.abort(["a"])
        assert core.has_pending_kv_transfers() and core.kv_cache_manager.req_to_blocks  # still written into
        while core.has_pending_kv_transfers():
            assert core.step() == []
        _assert_clean(core)


def _collect(outputs, tokens: dict) -> None:
    for out in outputs:
        tokens[out.request_id] += out.new_token_ids


def _pool(core: EngineCore):
    return core.kv_cache_manager.block_pool


def _hashes(prompt: list[int]) -> list[bytes]:
    return request_block_hashes(Request("x", prompt, GREEDY), BLOCK, len(prompt) - 1)
