"""Prefill/decode disaggregation end to end: producer + consumer (MooncakeConnector over the real
Mooncake Transfer Engine) + ``atb-plugin proxy``, on loopback inside a network namespace
(tests/pd_netns_checks.py starts everything there and reports; the Transfer Engine binds every
interface). The proxy's request shaping is checked here without servers."""

from __future__ import annotations

import pytest

from atb_plugin.server.proxy import Proxy, parse_args
from tests.helpers import checked_section, run_checks_in_netns

CHECKS_TIMEOUT_S = 400


def test_proxy_needs_both_roles():
    with pytest.raises(ValueError, match="at least one --prefill and one --decode"):
        Proxy(["http://p:1"], [], 10)
    args = parse_args(["--prefill", "http://p:1", "http://p:2/", "--decode", "http://d:1"])
    proxy = Proxy(args.prefill, args.decode, args.timeout)
    assert proxy.prefill_urls == ["http://p:1", "http://p:2"] and args.port == 8000
    assert [next(proxy._prefill) for _ in range(3)] == ["http://p:1", "http://p:2", "http://p:1"]


@pytest.fixture(scope="module")
def pd_run():
    pytest.importorskip("mooncake.engine", reason="pip install 'atb-plugin[kv]' (mooncake-transfer-engine-non-cuda)")
    return run_checks_in_netns("tests.pd_netns_checks",
                               "the Mooncake Transfer Engine binds every interface and must not run on the host's network",
                               CHECKS_TIMEOUT_S)


_section = checked_section


@pytest.mark.slow
def test_everything_ran_on_loopback_only(pd_run):
    assert pd_run["interfaces"] == ["lo"]


@pytest.mark.slow
def test_pd_gives_one_instances_greedy_tokens_text_and_image_streamed_and_not(pd_run):
    tp1 = _section(pd_run, "tp1")
    assert tp1["health"] == 200 and tp1["models"]
    for name, reference in tp1["reference"].items():
        assert tp1["pd"][name]["text"] == reference["text"], name


@pytest.mark.slow
def test_the_consumer_computed_only_the_last_prompt_token(pd_run):
    tp1 = _section(pd_run, "tp1")
    for name in ("completion", "chat"):  # the chat's image: its KV came from the producer
        answer = tp1["pd"][name]
        assert answer["cached_tokens"] == answer["prompt_tokens"] - 1, name
    # Each prompt ran twice (streamed and not): the second time the consumer's own prefix cache
    # holds the full blocks the first pull filled (block size 16), the rest comes from the producer.
    expected = sum(2 * (p - 1) - (p // 16) * 16 for p in (tp1["pd"]["completion"]["prompt_tokens"],
                                                           tp1["pd"]["chat"]["prompt_tokens"]))
    assert tp1["consumer_external_hits"] == expected
    assert tp1["consumer_bytes_loaded"] > 0
    assert tp1["producer_kv_usage"] == 0  # every block handed out was freed on the consumer's ack


@pytest.mark.slow
def test_producer_hands_out_where_its_blocks_lie(pd_run):
    params = _section(pd_run, "tp1")["handed_params"]
    assert params["do_remote_prefill"] and not params["do_remote_decode"]
    assert params["remote_block_ids"] and params["remote_tp_size"] == 1 and params["num_prompt_tokens"] > 1


@pytest.mark.slow
def test_a_dead_producer_is_recomputed_by_the_consumer_and_refused_by_the_proxy(pd_run):
    tp1 = _section(pd_run, "tp1")
    assert tp1["recompute_status"] == 200
    assert tp1["recompute_text"] == tp1["reference"]["completion"]["text"]
    assert tp1["consumer_failed_loads"] == 1 and tp1["recompute_seconds"] < 10
    proxied = tp1["dead_producer_proxy"]
    assert proxied["status"] in (502, 503) and proxied["seconds"] < 10
    assert "prefill instance" in proxied["body"]["error"]["message"]
    assert tp1["health_after_kill"] == 503


@pytest.mark.slow
def test_tensor_parallel_two_on_both_sides_equals_one(pd_run):
    tp1, tp2 = _section(pd_run, "tp1"), _section(pd_run, "tp2")
    assert tp2["handed_params"]["remote_tp_size"] == 2
    assert tp2["pd"]["completion"]["text"] == tp1["reference"]["completion"]["text"]
    assert tp2["pd"]["completion"]["cached_tokens"] == tp2["pd"]["completion"]["prompt_tokens"] - 1
    assert tp2["pd"]["chat_stream"]["text"] == tp1["reference"]["chat_stream"]["text"]


@pytest.mark.slow
def test_policy_fail_answers_a_clear_5xx_and_the_consumer_lives_on(pd_run):
    tp2 = _section(pd_run, "tp2")
    assert tp2["fail_status"] == 500
    assert "KV load failed" in tp2["fail_body"] and "MooncakeConnector" in tp2["fail_body"]
    assert tp2["consumer_healthy_after"] == 200


# -- deploy/k8s/pd.yaml ------------------------------------------------------------------------------

def test_the_pd_manifests_run_a_producer_a_consumer_and_the_proxy_in_front():
    from atb_plugin.engine.kv_transfer.config import KVTransferConfig
    from atb_plugin.engine.kv_transfer.mooncake.connector import MooncakeConnector
    from tests.test_deploy import documents, parsed

    docs = {(doc["kind"], doc["metadata"]["name"]): doc for doc in documents()}
    roles = {}
    for name in ("atb-plugin-prefill", "atb-plugin-decode"):
        (container,) = docs["Deployment", name]["spec"]["template"]["spec"]["containers"]
        config = KVTransferConfig.from_value(parsed(container["args"]).engine.kv_transfer_config)
        MooncakeConnector.check_config(config)
        assert config.kv_connector == "MooncakeConnector"
        # The address the consumers read from is the pod's own (Kubernetes expands $(POD_IP)).
        assert config.kv_connector_extra_config["host"] == "$(POD_IP)"
        assert any(env["name"] == "POD_IP" for env in container["env"])
        roles[name] = config.kv_role
        service = docs["Service", name]
        assert service["spec"]["selector"].items() <= docs["Deployment", name]["spec"]["template"]["metadata"][
            "labels"].items()
    assert roles == {"atb-plugin-prefill": "kv_producer", "atb-plugin-decode": "kv_consumer"}
    (proxy,) = docs["Deployment", "atb-plugin-pd-proxy"]["spec"]["template"]["spec"]["containers"]
    assert proxy["command"] == ["python", "-m", "atb_plugin.server", "proxy"]
    args = parse_args(proxy["args"])
    assert args.prefill == ["http://atb-plugin-prefill:8000"] and args.decode == ["http://atb-plugin-decode:8000"]
    assert args.host == "0.0.0.0" and docs["Service", "atb-plugin-pd"]["spec"]["selector"] == {
        "app": "atb-plugin-pd-proxy"}
