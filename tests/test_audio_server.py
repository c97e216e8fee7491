"""Audio chat through the real service with the ``openai`` client (``input_audio`` parts): a
media worker decodes the clip and writes its log-mel features into shared memory, the
engine-core process reads them, and the greedy answer equals the offline engine's. One server for
the module, started with ``--limit-mm-per-prompt audio=2``. Bad audio is a 400 naming the problem,
and leaves no segment behind; ``input_audio.data`` is base64 alone (OpenAI's definition); a chat
resending its clip reuses the clip's segment and the prefix cache."""

from __future__ import annotations

import base64

import pytest

from atb_plugin import LLM, SamplingParams
from atb_plugin.testing import audio_signals as sig
from atb_plugin.testing.tiny import tiny_checkpoint
from shm.segment import list_segment_names

pytestmark = pytest.mark.slow
pytest.importorskip("av")

FAMILY = "qwen2_audio"


@pytest.fixture(scope="module")
def server(serve):
    with serve(tiny_checkpoint(FAMILY), "--limit-mm-per-prompt", "audio=2") as server:
        yield server


def part(data: bytes, fmt: str) -> dict:
    return {"type": "input_audio", "input_audio": {"data": base64.b64encode(data).decode(), "format": fmt}}


def message(*parts, text="What do you hear?") -> dict:
    return {"role": "user", "content": [*parts, {"type": "text", "text": text}]}


def model_name(server) -> str:
    return server.client().models.list().data[0].id


def our_segments(server) -> set[str]:
    instances = tuple(f"psm_{i}" for i in server.shm_instances())
    return {name for name in list_segment_names() if name.startswith(instances)}


CLIP = sig.encode(sig.bursts(2.0, 44100, channels=2), 44100, "flac")


def test_audio_chat_matches_the_offline_engine(server):
    messages = [message(part(CLIP, "flac"), part(sig.encode(sig.sweep(1.0, 16000), 16000, "mp3"), "mp3"))]
    response = server.client().chat.completions.create(model=model_name(server), messages=messages, max_tokens=6,
                                                       temperature=0, extra_body={"ignore_eos": True})
    with LLM(tiny_checkpoint(FAMILY), block_size=16) as llm:
        offline = llm.chat(messages, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))[0]
    assert response.choices[0].message.content == offline.outputs[0].text
    assert response.usage.prompt_tokens == len(offline.prompt_token_ids)


def test_a_chat_resending_its_clip_reuses_the_segment_and_the_prefix_cache(server):
    client = server.client()
    clip = sig.encode(sig.noise(3.0, 16000, seed=7), 16000, "wav16")
    before = our_segments(server)
    history = [message(part(clip, "wav"), text="Listen.")]
    created, cached = [], []
    for turn in range(3):
        reply = client.chat.completions.create(model=model_name(server), messages=history, max_tokens=3, temperature=0)
        created.append(sorted(our_segments(server) - before))
        details = reply.usage.prompt_tokens_details
        cached.append(details.cached_tokens if details is not None else 0)
        history += [{"role": "assistant", "content": reply.choices[0].message.content},
                    message(text=f"And turn {turn + 2}?")]  # the clip stays in the resent history
    assert len(created[0]) == 1 and created[1] == created[0] == created[2], created
    assert cached[1] and cached[2], cached  # the first turn's audio block came from the prefix cache


@pytest.mark.parametrize("case, content, says", [
    ("undecodable", lambda: part(b"\x00\x01garbage" * 64, "wav"), "could not be decoded"),
    ("video", lambda: part(sig.encode_video(), "mp3"), "is a video file"),
    ("zero-length", lambda: part(sig.empty_wav(), "wav"), "audio"),
    ("over-long", lambda: part(sig.encode(sig.tones(241.0, 8000, amplitude=0.01), 8000, "flac"), "flac"),
     "--max-audio-seconds"),
    ("wrong format", lambda: part(CLIP, "mp3"), "format 'mp3' but is a flac file"),
    ("unknown format", lambda: part(CLIP, "aiff"), "not supported"),
    ("too many clips", lambda: [part(CLIP, "flac")] * 3, "at most 2"),
])
def test_bad_audio_is_a_400_and_leaks_nothing(server, case, content, says):
    before = our_segments(server)
    parts = content()
    parts = parts if isinstance(parts, list) else [parts]
    response = server.post("/v1/chat/completions", {"messages": [message(*parts)], "max_tokens": 2})
    assert response.status_code == 400, response.text
    assert says in response.json()["error"]["message"], response.json()
    assert our_segments(server) <= before  # nothing new stays behind (leases released, nothing written)


@pytest.mark.parametrize("data", ["!!!not base64$$$", "file:///etc/passwd", "data:audio/wav;base64,UklGRg==",
                                  "/etc/passwd"])
def test_input_audio_data_is_base64_only(server, data):
    content = {"type": "input_audio", "input_audio": {"data": data, "format": "wav"}}
    response = server.post("/v1/chat/completions", {"messages": [message(content)], "max_tokens": 2})
    assert response.status_code == 400, response.text
    says = response.json()["error"]["message"]
    assert "outside the allowed media directories" not in says
    assert "base64" in says, says  # "/etc/passwd" is valid base64 (of bytes that are no audio), never a path
