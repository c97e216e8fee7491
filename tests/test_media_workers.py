"""Issue #45: one video must not freeze the server.

- A decode budget per video / audio item (``MediaLimits.max_video_decode_frames``,
  ``media_decode_timeout``): the many-frames video (16x16 frames at 5,000 fps, one keyframe) is
  refused from its header before a packet is read; frames are counted while demuxing and
  decoding too; the wall clock is checked as they go by. Each refusal is a 400 naming its knob.
- Video and audio jobs run on media workers (the tokenizer pool's, in processes of their own):
  a text chat is answered while a video is still decoding, a media worker killed mid-decode fails
  only its own request, one past its job's budget is killed and that job alone gets a 504, and
  /health stays 200 throughout.
- ``input_audio.data`` is base64 alone; an unknown content part's error lists every accepted
  type; refusals say what the model takes, not which class refused; an over-long video is refused
  with the context-length 400 before it is decoded or written to shared memory.
"""

from __future__ import annotations

import asyncio
import base64
import io
import os
import signal
import threading
import time
import wave

import numpy as np
import pytest

from atb_plugin.engine.config import EngineConfig
from atb_plugin.frontend.errors import InvalidRequestError, RequestError
from atb_plugin.frontend.tokenizer_pool import ChatJob, PoolJob, PromptJob, TokenizerPool, WorkerSettings, media_items
from atb_plugin.multimodal.parts import PART_TYPES
from atb_plugin.testing.tiny import tiny_checkpoint
from atb_plugin.testing.videos import many_frames_video_bytes, video_bytes
from input_builders.audio import AudioRef, load_audio
from input_builders.conversation import ConversationError, parse_part
from input_builders.decode_budget import DecodeBudget
from input_builders.media_config import MediaConfig
from input_builders.media_errors import MediaDecodeError, MediaTooLargeError
from input_builders.video import decode_frames, load_video, probe_video


def data_url(data: bytes, mime: str = "video/mp4") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def video_chat(url: str, text: str = "What happens?") -> list:
    return [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": url}}, {"type": "text", "text": text}]}]


@pytest.fixture(scope="module")
def many_frames():
    return many_frames_video_bytes(20_000)  # 4 s at 5,000 fps: the bomb's shape, small


# -- the decode budget ---------------------------------------------------------------------------


def test_the_many_frames_video_is_refused_from_its_header_before_a_packet_is_read(many_frames):
    config = MediaConfig(max_video_decode_frames=10_000, api="server")
    budget = DecodeBudget(config, "video", "video.mp4")
    with pytest.raises(MediaTooLargeError, match=r"has 20000 frames \(4\.0 s at 5000 fps\); the server demuxes and "
                                                 r"decodes at most 10000 frames per video.*--max-video-decode-frames"):
        probe_video(many_frames, "video.mp4", config, budget)
    assert budget.frames == 0  # refused before demuxing
    assert load_video(many_frames, MediaConfig()).stream.total_frames == 20_000  # the default budget admits it


class _NoHeaderCheck(DecodeBudget):
    def check_header(self, *args) -> None:  # a header that understates
        pass


def test_frames_are_counted_while_demuxing_and_while_decoding(many_frames):
    config = MediaConfig(max_video_decode_frames=1_000)
    with pytest.raises(MediaTooLargeError, match=r"has more than 1000 frames.*MediaConfig\.max_video_decode_frames"):
        probe_video(many_frames, "video", config, _NoHeaderCheck(config, "video", "video"))
    stream = probe_video(many_frames, "video", MediaConfig())
    # The last frame costs every frame since the one keyframe: 20,000 decoded for 1 kept.
    with pytest.raises(MediaTooLargeError, match="has more than 1000 frames"):
        decode_frames(many_frames, stream, [stream.total_frames - 1], budget=DecodeBudget(config, "video", "video"))
    assert decode_frames(many_frames, stream, [stream.total_frames - 1]).decoded == 20_000  # without a budget


def _wav(seconds: float) -> bytes:
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(16000)
        out.writeframes((np.sin(np.arange(int(seconds * 16000)) / 8) * 8000).astype("<i2").tobytes())
    return buffer.getvalue()


def test_the_wall_clock_budget_refuses_a_video_or_audio_item_that_decodes_too_long(many_frames):
    config = MediaConfig(media_decode_timeout=1e-6, api="server")
    with pytest.raises(MediaTooLargeError, match=r"video \(.*\) takes longer than 1e-06 s to decode, the limit per "
                                                 r"video \(--media-decode-timeout\)"):
        load_video(many_frames, config)
    with pytest.raises(MediaTooLargeError, match=r"audio \(.*\) takes longer than 1e-06 s to decode.*"
                                                 r"--media-decode-timeout"):
        load_audio(_wav(60.0), config)
    assert load_audio(_wav(60.0), MediaConfig()).seconds == pytest.approx(60.0)


# -- input_audio, part types, messages -----------------------------------------------------------


@pytest.mark.parametrize("data", ["!!!not base64$$$", "file:///etc/passwd", "data:audio/wav;base64,UklGRg==",
                                  "https://example.com/a.wav"])
def test_input_audio_data_is_base64_only(tmp_path, data):
    config = MediaConfig(allowed_local_media_paths=(str(tmp_path),))
    with pytest.raises(MediaDecodeError) as refused:
        load_audio(AudioRef(data, "wav"), config)
    message = str(refused.value)
    assert "base64" in message and "outside the allowed" not in message and "audio_url" in message


def test_input_audio_never_reads_a_server_path(tmp_path):
    clip = tmp_path / "clip.wav"
    clip.write_bytes(_wav(1.0))
    config = MediaConfig(allowed_local_media_paths=(str(tmp_path),))
    assert load_audio(AudioRef(str(clip)), config).seconds == pytest.approx(1.0)  # audio_url / MindIE: a path
    with pytest.raises(MediaDecodeError):  # input_audio: the same text is (bad) base64, never opened
        load_audio(AudioRef(str(clip), "wav"), config)
    assert load_audio(AudioRef(base64.b64encode(_wav(1.0)).decode(), "wav"), config).seconds == pytest.approx(1.0)


def test_an_unknown_content_part_lists_every_accepted_type():
    from atb_plugin.server.protocol import _check_part

    for refuse in (lambda item: parse_part(item, "message 0"), lambda item: _check_part(item, "part 0")):
        for item in ({"type": "sticker"}, {"colour": "red"}):
            with pytest.raises((ConversationError, ValueError)) as refused:
                refuse(item)
            assert all(repr(kind) in str(refused.value) for kind in PART_TYPES), str(refused.value)
    assert {"text", "image_url", "video_url", "input_audio", "audio_url"} <= set(PART_TYPES)


def test_refusals_say_what_the_model_takes_not_which_class_refused():
    from routers import get_router

    router = get_router(tiny_checkpoint("qwen2"))
    for content in ([{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}],
                    [{"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}}]):
        with pytest.raises(Exception) as refused:
            router.input_builder.make_context(0, [{"role": "user", "content": content}], request_id="r")
        message = str(refused.value)
        assert "InputBuilder" not in message and "this server serves a" in message, message


def test_an_over_long_video_is_refused_with_the_context_length_400_before_it_is_decoded(monkeypatch, tmp_path):
    import shm
    import input_builders.video as video_module
    from atb_plugin.frontend.input_processor import InputProcessor, load_router

    def no_decoding(*args, **kwargs):
        raise AssertionError("decoded a video its length refuses")

    monkeypatch.setattr(video_module, "decode_frames", no_decoding)
    config = EngineConfig(model=str(tiny_checkpoint("qwen2_vl")), max_model_len=512)
    store = shm.ShmStore()
    try:
        processor = InputProcessor(config, load_router(config, store), shm_store=store)
        long = video_bytes(64, 2, (224, 224), seed=3)  # 32 s: 64 frames of 224x224, thousands of tokens
        with pytest.raises(InvalidRequestError, match=r"This model's maximum context length is 512 tokens\. However, "
                                                      r"your request has \d+ input tokens"):
            processor.chat_ids(video_chat(data_url(long)), "r1")
        assert store.stats()["segments"] == 0  # nothing written to shared memory
    finally:
        store.close()


# -- the media workers ---------------------------------------------------------------------------


def test_the_flags():
    from atb_plugin.server.cli import parse_config

    config = parse_config(["--model", str(tiny_checkpoint("qwen2_vl")), "--max-video-decode-frames", "1000",
                           "--media-decode-timeout", "2.5", "--media-workers", "2"])
    assert (config.media.max_video_decode_frames, config.media.media_decode_timeout) == (1000, 2.5)
    assert config.media_config().limits.max_video_decode_frames == 1000 and config.media_workers == 2
    # One media worker by default for a model that takes video or audio, none for one that takes neither.
    assert [parse_config(["--model", str(tiny_checkpoint(family))]).media_workers
            for family in ("qwen2_vl", "qwen2_audio", "qwen2", "llava")] == [1, 1, 0, 0]


def test_media_items_count_the_video_and_audio_parts_of_a_job():
    audio = {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}
    assert media_items(ChatJob("r", video_chat("x.mp4"))) == 1
    assert media_items(ChatJob("r", [{"role": "user", "content": [audio, audio, {"type": "text", "text": "hi"}]}])) == 2
    assert media_items(ChatJob("r", [{"role": "user", "content": [{"video": "x.mp4"}, {"audio": "a.wav"}]}])) == 2
    assert media_items(ChatJob("r", [{"role": "user", "content": "hi"}])) == 0
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    assert media_items(ChatJob("r", [{"role": "user", "content": [image]}])) == 0  # images stay with the text workers
    assert media_items(PromptJob("r", [{"video": "x.mp4"}, {"text": "hi"}])) == 1
    assert media_items(PoolJob("r", ["hi"])) == 0


def _pool(config: MediaConfig, **kwargs) -> TokenizerPool:
    settings = WorkerSettings(EngineConfig(model=str(tiny_checkpoint("qwen2_vl"))), config)
    return TokenizerPool(settings, 1, None, on_worker_death=lambda index, instance: None, num_media_workers=1,
                         **kwargs)


def test_a_media_worker_past_its_jobs_budget_fails_that_job_alone_with_a_504(many_frames):
    async def run():
        pool = _pool(MediaConfig(media_decode_timeout=0.5, http_timeout_s=0.1), stuck_after_s=1.0)
        await pool.start()
        try:
            media = pool._workers[1]
            os.kill(media.process.pid, signal.SIGSTOP)  # a decoder that never returns
            video = asyncio.ensure_future(pool.call(ChatJob("v", video_chat(data_url(many_frames)))))
            await asyncio.sleep(0.2)
            worker, _, text_ids = await pool.call(ChatJob("t", [{"role": "user", "content": "hi"}]))
            pending_when_text_answered = not video.done()
            health = [pool.health_problem()]
            with pytest.raises(RequestError) as refused:
                await video
            health.append(pool.health_problem())
            while not pool._live(media=True):  # the replacement starts
                await asyncio.sleep(0.1)
            index, _, ids = await pool.call(ChatJob("v2", video_chat(data_url(video_bytes(8, 2, seed=1)))))
            pool.release(index, "v2")
            return worker, text_ids, pending_when_text_answered, health, refused.value, media.process.exitcode, index
        finally:
            await pool.shutdown()

    worker, text_ids, pending, health, error, exitcode, index = asyncio.run(run())
    assert worker == 0 and text_ids and pending  # the text job ran on the text worker meanwhile
    assert health == [None, None]
    assert error.status == 504 and "--media-decode-timeout 0.5 s per item" in str(error)
    assert exitcode == -signal.SIGKILL
    assert index == 1  # the next video ran on the replacement media worker


# -- through the service ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(serve):
    with serve(tiny_checkpoint("qwen2_vl"), "--media-workers", "1", "--max-video-decode-frames", "600000") as server:
        yield server


def _chat(server, messages, max_tokens: int = 4):
    return server.post("/v1/chat/completions", {"messages": messages, "max_tokens": max_tokens, "temperature": 0})


class _HealthWatch:
    """/health polled in a thread for the length of a ``with`` block."""

    def __init__(self, server):
        self.server, self.codes, self.stop = server, [], threading.Event()

    def __enter__(self):
        def poll():
            while not self.stop.wait(0.1):
                self.codes.append(self.server.get("/health").status_code)

        self.thread = threading.Thread(target=poll, daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join(10)


def _in_background(function, *args) -> tuple[threading.Thread, dict]:
    out = {}
    thread = threading.Thread(target=lambda: out.setdefault("response", function(*args)), daemon=True)
    thread.start()
    return thread, out


def test_the_many_frames_video_never_delays_a_text_chat(server):
    text = [{"role": "user", "content": "Say something."}]
    assert _chat(server, text).status_code == 200  # warm-up
    bomb = data_url(many_frames_video_bytes(1_000_000))  # 200 s at 5,000 fps: over the 600,000-frame budget
    with _HealthWatch(server) as health:
        video, outcome = _in_background(_chat, server, video_chat(bomb))
        answer = _chat(server, text)
        pending_or_refused = video.is_alive() or outcome["response"].status_code == 400
        video.join(60)
    assert answer.status_code == 200 and pending_or_refused
    refused = outcome["response"]
    assert refused.status_code == 400, refused.text
    assert "(--max-video-decode-frames)" in refused.json()["error"]["message"]
    assert health.codes and set(health.codes) == {200}


def test_a_media_worker_killed_mid_decode_fails_only_its_request(server):
    text = [{"role": "user", "content": "Say something."}]
    # Under the budget (600,000 frames) and as close to it as is safe: seconds of decoding, so the
    # kill lands mid-decode even when the text chat is slow to answer (a decode that finished first
    # gets the context-length 400 instead).
    slow = data_url(many_frames_video_bytes(590_000))
    with _HealthWatch(server) as health:
        video, outcome = _in_background(_chat, server, video_chat(slow))
        answer = _chat(server, text)
        pending = video.is_alive()  # the text was answered while the video decodes
        os.kill(server.pid_of("media worker 1"), signal.SIGKILL)
        video.join(60)
        after = _chat(server, text)
        deadline = time.monotonic() + 60
        while server.log(tail=None).count("media worker 1 ready") < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        small = _chat(server, video_chat(data_url(video_bytes(8, 2, seed=2))))
    assert answer.status_code == 200 and pending
    failed = outcome["response"]
    assert failed.status_code == 500 and "media worker" in failed.json()["error"]["message"], failed.text
    assert after.status_code == 200
    assert small.status_code == 200, small.text  # on the replacement
    assert health.codes and set(health.codes) == {200}
