"""The service with a host-memory KV tier (``--kv-offloading-size``): with a device KV cache that
holds one prompt's prefix at most, a second round of the same prompts is served from the tier
(usage's cached_tokens, /metrics' vllm:external_prefix_cache_* and atb_plugin:kv_* series) with
the first round's greedy tokens."""

from __future__ import annotations

import re

import pytest

from atb_plugin.testing.tiny import tiny_checkpoint

# Four prompts of 96 distinct tokens (6 blocks of 16) each, over a device cache of 12 blocks.
PROMPTS = [list(range(10 + 100 * i, 10 + 100 * i + 96)) for i in range(4)]


@pytest.fixture(scope="module")
def server(serve):
    with serve(tiny_checkpoint("qwen2"), "--max-model-len", "128", "--max-num-seqs", "1",
               "--kv-cache-memory", str(12 * 8192), "--kv-offloading-size", "0.001") as server:
        yield server


def _complete(server, prompt):
    response = server.post("/v1/completions", json={"model": server.get("/v1/models").json()["data"][0]["id"],
                                                    "prompt": prompt, "max_tokens": 4, "temperature": 0})
    assert response.status_code == 200, response.text
    body = response.json()
    details = body["usage"].get("prompt_tokens_details") or {}
    return body["choices"][0]["text"], details.get("cached_tokens") or 0


def _metric(text: str, name: str) -> float:
    return sum(float(v) for v in re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.MULTILINE))


def test_a_second_round_is_served_from_the_host_tier(server):
    first = [_complete(server, prompt) for prompt in PROMPTS]
    second = [_complete(server, prompt) for prompt in PROMPTS]
    assert [text for text, _ in second] == [text for text, _ in first]
    assert [cached for _, cached in first] == [0] * 4
    assert [cached for _, cached in second] == [80] * 4  # 5 whole blocks; the last token is computed
    metrics = server.get("/metrics").text
    assert _metric(metrics, "vllm:external_prefix_cache_hits_total") == 4 * 80
    assert _metric(metrics, "vllm:external_prefix_cache_queries_total") == 8 * 96
    assert _metric(metrics, "atb_plugin:kv_loads_total") == 4 * 5
    assert _metric(metrics, "atb_plugin:kv_offload_tier_bytes") > 0
