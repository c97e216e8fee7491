"""Image chat through the real service with the ``openai`` client, for each VL family: a data URL
image is preprocessed by a tokenizer worker into shared memory, read by the engine-core process,
and the answer equals the offline engine's; a 3-turn chat resending one image reuses one segment.
One more Qwen2-VL server runs with ``--mm-wire-dtype float32`` (MindIE's form): its answers equal
the offline engine's on the default uint8 wire, since the device-side normalisation is bit-exact
on CPU."""

from __future__ import annotations

import pytest

from atb_plugin import LLM, SamplingParams
from atb_plugin.testing.tiny import tiny_checkpoint
from shm.segment import list_segment_names, read_header
from tests.server_helpers import ServerProcess, data_url


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen_vl", "llava", "qwen2_vl/float32"])
def family_server(request, serve):
    family, _, wire = request.param.partition("/")
    with serve(tiny_checkpoint(family), *(["--mm-wire-dtype", wire] if wire else [])) as server:
        server.wire_dtype = wire or "uint8"
        yield family, server


def image_message(url: str, text: str = "What is in this picture?") -> dict:
    return {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": text}]}


def test_image_chat_matches_the_offline_engine(family_server):
    family, server = family_server
    url = data_url(seed=1)
    messages = [image_message(url)]
    response = server.client().chat.completions.create(model=server_model(server), messages=messages, max_tokens=6,
                                                       temperature=0, extra_body={"ignore_eos": True})
    with LLM(tiny_checkpoint(family), block_size=16) as llm:
        offline = llm.chat(messages, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))[0]
    assert response.choices[0].message.content == offline.outputs[0].text
    assert response.usage.prompt_tokens == len(offline.prompt_token_ids)


def test_mindie_style_parts_are_accepted(family_server):
    family, server = family_server
    messages = [{"role": "user", "content": [{"image": data_url(seed=2)}, {"text": "Describe it."}]}]
    response = server.post("/v1/chat/completions", {"messages": messages, "max_tokens": 3, "temperature": 0})
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] >= 1


def test_a_three_turn_chat_resending_the_image_reuses_one_segment(family_server):
    family, server = family_server
    client = server.client()
    url = data_url(seed=3)
    before = set(list_segment_names())
    history = [image_message(url, "Look at this.")]
    created = []
    for turn in range(3):
        reply = client.chat.completions.create(model=server_model(server), messages=history, max_tokens=3,
                                               temperature=0)
        created.append(sorted(set(list_segment_names()) - before))
        history += [{"role": "assistant", "content": reply.choices[0].message.content},
                    image_message(url, f"And now, turn {turn + 2}?")]
    # The first turn wrote one segment for the image; the later turns (the same image, twice in
    # the history) reused it: no new segment appeared.
    assert len(created[0]) == 1, created
    assert created[1] == created[0] and created[2] == created[0], created
    # The segment holds the image in the server's wire form, as its header says.
    assert str(read_header(created[0][0]).dtype) == server.wire_dtype


def server_model(server: ServerProcess) -> str:
    return server.client().models.list().data[0].id
