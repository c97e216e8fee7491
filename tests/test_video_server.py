"""Video chat through the real service with the ``openai`` client (tiny Qwen2.5-VL, one server for
the module): a ``video_url`` data URL and a ``file://`` URL give the offline engine's greedy
tokens; ``mm_processor_kwargs`` reaches the sampler; each bad video is a 400 naming the problem
or the limit (nothing leaked: the suite's shm check); a resent video reuses its segment and the
prefix cache."""

from __future__ import annotations

import base64
import re

import pytest

from atb_plugin import LLM, SamplingParams
from atb_plugin.testing.tiny import tiny_checkpoint
from atb_plugin.testing.videos import video_bytes, write_video
from input_builders.media_config import MediaConfig
from shm.segment import list_segment_names

pytestmark = pytest.mark.slow
pytest.importorskip("av")

OPTIONS = {"max_pixels": 28 * 28 * 6, "min_pixels": 28 * 28 * 2}
MAX_SECONDS, MAX_FRAME_PIXELS = 60, 200 * 200


def data_url(data: bytes, mime: str = "video/mp4") -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


@pytest.fixture(scope="module")
def video_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("videos")
    write_video(directory / "clip.mp4", 30, 7, (64, 96), gop=6, seed=11)
    return directory


@pytest.fixture(scope="module")
def server(serve, video_dir):
    with serve(tiny_checkpoint("qwen2_5_vl"), "--allowed-local-media-path", str(video_dir),
               "--max-video-seconds", str(MAX_SECONDS), "--max-video-frame-pixels", str(MAX_FRAME_PIXELS),
               "--limit-mm-per-prompt", "image=4,video=1") as server:
        yield server


def message(url: str, text: str = "What happens in this clip?") -> dict:
    return {"role": "user",
            "content": [{"type": "video_url", "video_url": {"url": url}}, {"type": "text", "text": text}]}


def test_video_chat_matches_the_offline_engine(server, video_dir):
    path = video_dir / "clip.mp4"
    client = server.client()
    model = client.models.list().data[0].id
    answers = []
    for url in (data_url(path.read_bytes()), f"file://{path}"):
        response = client.chat.completions.create(model=model, messages=[message(url)], max_tokens=6, temperature=0,
                                                  extra_body={"ignore_eos": True, "mm_processor_kwargs": OPTIONS})
        answers.append((response.choices[0].message.content, response.usage.prompt_tokens))
    config = MediaConfig(allowed_local_media_paths=(str(video_dir),))
    with LLM(tiny_checkpoint("qwen2_5_vl"), block_size=16, media_config=config) as llm:
        offline = llm.chat([message(f"file://{path}")], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                           mm_processor_kwargs=OPTIONS)[0]
    expected = (offline.outputs[0].text, len(offline.prompt_token_ids))
    assert answers == [expected, expected]


def test_bad_videos_are_refused_with_400(server):
    good = video_bytes(30, 10, seed=5)
    cases = [
        (data_url(b"\x00\x00\x00\x18ftypmp42" + bytes(range(256)) * 8), "video|FFmpeg|corrupt"),
        (data_url(good[: len(good) // 3]), "truncated|corrupt|not a video"),
        (data_url(video_bytes(0, 10, audio=True)), "has no video stream"),
        (data_url(video_bytes(1, 10, seed=6)), "has 1 frame"),
        (data_url(video_bytes(10, 5, codec="libx264").replace(b"avc1", b"zzzz")), "codec cannot be decoded"),
        (data_url(video_bytes(12, 0.1, seed=7)), f"the limit is {MAX_SECONDS} s \\(--max-video-seconds\\)"),
        (data_url(video_bytes(4, 2, (256, 320), seed=8)), "--max-video-frame-pixels"),
        (data_url(good, "image/png"), "send a video: data:video/mp4"),
        ("file:///etc/passwd", "outside the allowed media directories"),
    ]
    for url, pattern in cases:
        response = server.post("/v1/chat/completions", {"messages": [message(url)], "max_tokens": 2})
        assert response.status_code == 400, (pattern, response.text)
        assert response.json()["error"]["message"], response.text
        assert re.search(pattern, response.json()["error"]["message"]), (pattern, response.json())
    two = {"role": "user", "content": [{"type": "video_url", "video_url": {"url": data_url(good)}}] * 2}
    response = server.post("/v1/chat/completions", {"messages": [two], "max_tokens": 2})
    assert response.status_code == 400 and "at most 1" in response.json()["error"]["message"], response.text
    for kwargs, pattern in (({"fps": 1000}, "fps"), ({"colour": 1}, "unknown video option"), ([1], "object")):
        response = server.post("/v1/chat/completions", {"messages": [message(data_url(good))], "max_tokens": 2,
                                                        "mm_processor_kwargs": kwargs})
        assert response.status_code == 400 and pattern in response.text, response.text
    assert server.get("/health").status_code == 200


def test_a_resent_video_reuses_its_segment_and_the_prefix_cache(server):
    client = server.client()
    model = client.models.list().data[0].id
    url = data_url(video_bytes(40, 8, (64, 96), seed=21))
    before = set(list_segment_names())
    history = [message(url, "Look at this.")]
    created, cached = [], []
    for turn in range(2):
        reply = client.chat.completions.create(model=model, messages=history, max_tokens=3, temperature=0,
                                               extra_body={"mm_processor_kwargs": OPTIONS})
        created.append(sorted(set(list_segment_names()) - before))
        details = reply.usage.prompt_tokens_details
        cached.append(details.cached_tokens if details else 0)
        history += [{"role": "assistant", "content": reply.choices[0].message.content},
                    {"role": "user", "content": "And then?"}]
    assert len(created[0]) == 1 and created[1] == created[0], created
    assert cached[1] and cached[1] >= 16, cached  # turn 1's blocks, its video block among them
