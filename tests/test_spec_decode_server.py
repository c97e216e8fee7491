"""Speculative decoding through the server with a head (EAGLE-3 on the tiny Llama, ``-sc``), with
the official ``openai`` client: completions (whole and streamed) and a json_schema chat give
plain decoding's greedy text, the JSON parses, and /metrics counts the drafts. One server."""

from __future__ import annotations

import json

import pytest

from atb_plugin import LLM, SamplingParams
from atb_plugin.testing.spec_heads import tiny_eagle_head
from atb_plugin.testing.tiny import tiny_checkpoint

PROMPT = "the quick brown fox jumps over the lazy dog. " * 3 + "the quick"
SCHEMA = {"type": "object", "properties": {"colors": {"type": "array", "items": {"enum": ["red", "green"]},
                                                      "minItems": 3, "maxItems": 3}},
          "required": ["colors"]}


@pytest.fixture(scope="module")
def server(serve):
    spec = {"method": "eagle3", "model": str(tiny_eagle_head("llama", eagle3=True)), "num_speculative_tokens": 3}
    with serve(tiny_checkpoint("llama"), "-sc", json.dumps(spec)) as server:
        yield server


def test_completions_and_json_schema_chat_equal_plain_decoding(server):
    with LLM(tiny_checkpoint("llama"), block_size=16) as llm:
        expected = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0].outputs[0]
    client = server.client()
    model = client.models.list().data[0].id
    completion = client.completions.create(model=model, prompt=PROMPT, max_tokens=24, temperature=0,
                                           extra_body={"ignore_eos": True})
    assert completion.choices[0].text == expected.text
    stream = client.completions.create(model=model, prompt=PROMPT, max_tokens=24, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    assert "".join(chunk.choices[0].text for chunk in stream) == expected.text
    chat = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Three colors as JSON."}], max_tokens=200, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "colors", "schema": SCHEMA}})
    assert len(json.loads(chat.choices[0].message.content)["colors"]) == 3
    metrics = server.get("/metrics").text
    drafts = [line for line in metrics.splitlines() if line.startswith("vllm:spec_decode_num_draft_tokens_total")]
    assert drafts and float(drafts[0].rsplit(" ", 1)[1]) > 0
