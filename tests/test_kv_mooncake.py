"""The Mooncake wrapper and the MooncakeConnector's two sides against a real Transfer Engine in
another process (tests/kv_mooncake_netns_checks.py, inside a network namespace: the engine's
listeners bind every interface), plus the config checks that need no transfer."""

from __future__ import annotations

import pytest

from atb_plugin.engine.kv_transfer.base import ConnectorContext, KVConnectorRole
from atb_plugin.engine.kv_transfer.config import KVTransferConfig
from atb_plugin.engine.kv_transfer.factory import connector_class
from atb_plugin.engine.kv_transfer.mooncake.connector import MooncakeConnector, _coalesce
from atb_plugin.engine.kv_transfer.mooncake.side_channel import KVLayout
from tests.helpers import checked_section, run_checks_in_netns


def _layout(**changes) -> KVLayout:
    fields = dict(engine_id="e", session="127.0.0.1:1", tp_rank=0, tp_size=1, dtype="torch.float32", block_size=4,
                  num_blocks=12, block_bytes=256, tensor_shapes=[[12, 4, 2, 8]] * 4, base_addresses=[0, 1, 2, 3])
    return KVLayout(**{**fields, **changes})


def test_registered_by_name():
    assert connector_class(KVTransferConfig("MooncakeConnector")) is MooncakeConnector


def test_extra_config_is_checked():
    context = ConnectorContext("m", 16, 8)
    with pytest.raises(ValueError, match="unknown kv_connector_extra_config keys"):
        MooncakeConnector(KVTransferConfig("MooncakeConnector", "kv_consumer", {"bogus": 1}),
                          KVConnectorRole.SCHEDULER, context)
    with pytest.raises(ValueError, match="transfer_timeout_s must be a number > 0"):
        MooncakeConnector(KVTransferConfig("MooncakeConnector", "kv_consumer", {"transfer_timeout_s": 0}),
                          KVConnectorRole.SCHEDULER, context)


def test_layout_mismatch_names_the_field():
    assert _layout().mismatch(_layout(num_blocks=99, base_addresses=[9, 9, 9, 9])) is None
    assert "tp_size" in _layout().mismatch(_layout(tp_size=2))
    assert "dtype" in _layout().mismatch(_layout(dtype="torch.bfloat16"))
    assert "shapes" in _layout().mismatch(_layout(tensor_shapes=[[12, 4, 2, 8]] * 2))


def test_runs_coalesce_consecutive_blocks():
    assert _coalesce([2, 3, 4, 9], [5, 6, 7, 8]) == [(2, 5, 3), (9, 8, 1)]


@pytest.fixture(scope="module")
def netns_run():
    pytest.importorskip("mooncake.engine", reason="pip install 'atb-plugin[kv]' (mooncake-transfer-engine-non-cuda)")
    return run_checks_in_netns("tests.kv_mooncake_netns_checks",
                               "the Mooncake Transfer Engine binds every interface and must not run on the host's network",
                               120)


_section = checked_section


def test_wrapper_reads_byte_exact_between_processes(netns_run):
    wrapper = _section(netns_run, "wrapper")
    assert wrapper["byte_exact"] and wrapper["many_ranges_exact"]


def test_wrapper_turns_every_sharp_edge_into_an_error(netns_run):
    wrapper = _section(netns_run, "wrapper")
    # Mooncake itself accepts an unregistered local buffer over TCP: the wrapper refuses it.
    assert "not in registered memory" in wrapper["unregistered_local"] and wrapper["stray_untouched"]
    assert "batch_transfer_sync_read" in wrapper["remote_out_of_range"]
    assert "batch_transfer_sync_read" in wrapper["dead_peer"] and wrapper["dead_peer_seconds"] < 5
    # Frozen (SIGSTOP): the progress timeout (2 s in the checks), not Mooncake's default 30 s.
    assert "batch_transfer_sync_read" in wrapper["frozen_peer"] and 1.5 < wrapper["frozen_peer_seconds"] < 10


def test_producer_hands_out_its_blocks_and_frees_them_on_ack(netns_run):
    connector = _section(netns_run, "connector")
    assert connector["delay_free"]
    params = connector["params"]
    assert params["do_remote_prefill"] and not params["do_remote_decode"]
    assert params["remote_block_ids"] == [5, 6, 9] and params["remote_engine_id"] == "producer-engine"
    assert params["remote_tp_size"] == 1 and params["num_prompt_tokens"] == 10
    assert connector["producer_finished"] == ["r1"]


def test_consumer_pulls_exactly_the_blocks_of_all_prompt_tokens_but_the_last(netns_run):
    connector = _section(netns_run, "connector")
    assert connector["matched"] == [9, False]
    assert connector["params_after_alloc"] is False  # pulled once: a recompute never reads again
    assert connector["load_errors"] == [] and connector["blocks_exact"]
    assert connector["stats"]["num_loads"] == 1 and connector["stats"]["bytes_loaded"] == 3 * 4 * 256


def test_consumer_reports_load_errors_never_garbage(netns_run):
    connector = _section(netns_run, "connector")
    assert connector["mismatch_errors"] == [1, 2, 3]
    assert connector["dead_producer_errors"] == [4, 5, 6] and connector["dead_producer_seconds"] < 5


@pytest.mark.parametrize("change, why", [
    ({"remote_block_ids": ["0", 1]}, "remote_block_ids"),
    ({"remote_block_ids": [-1]}, "remote_block_ids"),
    ({"remote_port": "5600"}, "remote_port"),
    ({"remote_request_id": None}, "remote_request_id"),
    ({"remote_tp_size": 0}, "remote_tp_size"),
    ({"num_prompt_tokens": 9}, None),  # another tokenization: not an error, computed here
])
def test_a_consumer_never_trusts_malformed_params(change, why, caplog):
    from atb_plugin.engine.request import Request
    from atb_plugin.engine.sampling_params import SamplingParams

    params = {"do_remote_prefill": True, "remote_request_id": "r", "remote_engine_id": "e", "remote_host": "h",
              "remote_port": 5600, "remote_block_ids": [1, 2], "remote_tp_size": 1, "num_prompt_tokens": 10}
    scheduler = MooncakeConnector(KVTransferConfig("MooncakeConnector", "kv_consumer"), KVConnectorRole.SCHEDULER,
                                  ConnectorContext("m", 16, 8))
    assert scheduler.get_num_new_matched_tokens(
        Request("ok", list(range(10)), SamplingParams(), kv_transfer_params=params), 0) == (9, False)
    request = Request("bad", list(range(10)), SamplingParams(), kv_transfer_params={**params, **change})
    assert scheduler.get_num_new_matched_tokens(request, 0) == (0, False)
    scheduler.update_state_after_alloc(request, [3], 0)
    recv = scheduler.build_connector_meta(None).recv
    if why is not None:
        assert recv == [] and why in caplog.text  # nothing to read for it, nobody to tell
    else:  # valid params for other tokens: nothing read, the producer told once to free its blocks
        assert [(spec.remote_request_id, spec.local_block_ids) for spec in recv] == [("r", [])]


def test_the_offline_llm_takes_and_returns_kv_transfer_params(netns_run):
    offline = _section(netns_run, "offline")
    assert offline["plain"] is None
    handed = offline["handed"]
    assert handed["do_remote_prefill"] and handed["num_prompt_tokens"] == offline["prompt_tokens"]
    assert len(handed["remote_block_ids"]) == -(-offline["prompt_tokens"] // 16)
    assert "kv_transfer_params with n > 1 is not supported" in offline["n2"]


def test_a_producer_frees_on_ack_or_after_abort_timeout():
    import time

    from atb_plugin.engine.kv_transfer.mooncake.connector import MooncakeConnectorMetadata

    class Acks:  # the side channel's end, without a socket
        acked: set = set()

        def take_acked(self):
            acked, self.acked = self.acked, set()
            return acked

    worker = MooncakeConnector(KVTransferConfig("MooncakeConnector", "kv_producer", {"abort_timeout_s": 0.05}),
                               KVConnectorRole.WORKER, ConnectorContext("m", 16, 8))
    worker._server = Acks()
    worker._server.acked = {"early"}  # acknowledged before this rank heard of the request
    assert worker.get_finished(set()) == (set(), set())
    worker.bind_connector_metadata(MooncakeConnectorMetadata(send=["a", "b", "early"]))
    worker.start_load_kv()
    worker._server.acked = {"b", "stray"}
    assert worker.get_finished(set()) == ({"b", "early"}, set())
    time.sleep(0.1)
    assert worker.get_finished(set()) == ({"a"}, set())  # nobody pulled it: freed after the timeout
    assert worker._early_acks == {} and worker._sending == {}  # the stray ack expired too


def test_a_pulled_image_prompt_runs_no_vision_encoder(netns_run):
    media = _section(netns_run, "media")
    assert media["producer_encoder_calls"] == 1 and media["plain_encoder_calls"] == 1
    assert media["consumer_encoder_calls"] == 0  # the KV carried the image
    cached, prompt = media["consumer_cached"]
    assert cached == prompt - 1 and media["same_tokens"]
