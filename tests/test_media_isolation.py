"""One slow media host must never stall the others (issue: a trickling host wedged the server).

- ``fetch``'s deadline is for the whole download: a host that trickles its body a byte at a
  time, one that trickles its status line, and one that accepts and never answers are all cut
  at ``http_timeout_s`` (their sockets are shut down), with an error naming the limit.
- A tokenizer worker fetches a job's media on its fetch threads while the jobs behind it run, and
  drops a job whose client left before it ran (``CancelJob``).
- Through the real service (one tokenizer worker): image requests to a dripping and to a silent
  host fail with their deadline's error, and a text chat sent meanwhile is answered while both
  downloads still hang.
- The images of one request share a pixel budget (``max_request_pixels``, 4 images at the
  per-image cap by default): the image that would pass it is refused from its header, before it
  is decoded, however it arrives (bytes, a resent data URL or a cached image, a PIL image).
"""

from __future__ import annotations

import base64
import io
import socketserver
import threading
import time
from concurrent.futures import Future
from contextlib import contextmanager

import numpy as np
import pytest
from PIL import Image

from atb_plugin.frontend.tokenizer_pool import (CancelJob, ChatJob, Envelope, PromptJob, Reply, _WorkerLoop,
                                                media_urls)
from atb_plugin.testing.tiny import tiny_checkpoint
from input_builders.image import load_image, load_images
from input_builders.media_config import MediaConfig
from input_builders.media_errors import MediaDecodeError, MediaFetchError, MediaTooLargeError
from routers import get_router
from tests.server_helpers import ServerProcess


class _Handler(socketserver.BaseRequestHandler):
    def handle(self):
        mode, deadline = self.server.mode, time.monotonic() + 60  # every loop here ends by itself
        try:
            if mode == "silent":
                while time.monotonic() < deadline and not self.server.stopping.wait(0.2):
                    pass
                return
            if mode == "drip-headers":
                for byte in b"HTTP/1.1 200 OK\r\nContent-Type: image/png\r\n\r\n":
                    if time.monotonic() > deadline or self.server.stopping.wait(0.2):
                        return
                    self.request.sendall(bytes([byte]))
                return
            self.request.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: image/png\r\n\r\n")
            while time.monotonic() < deadline and not self.server.stopping.wait(0.2):
                self.request.sendall(b"\x89")  # a byte every 0.2 s: each one would restart a socket timeout
        except OSError:
            return  # the client cut us off


class _Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True


@contextmanager
def media_host(mode: str):
    """A host on 127.0.0.1 that misbehaves as ``mode`` says; yields its image URL."""
    server = _Server(("127.0.0.1", 0), _Handler)
    server.mode, server.stopping = mode, threading.Event()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/cat.png"
    finally:
        server.stopping.set()
        server.shutdown()
        server.server_close()
        thread.join(5)


@pytest.mark.parametrize("mode", ["drip", "drip-headers", "silent"])
def test_the_deadline_is_for_the_whole_download(mode):
    config = MediaConfig(allowed_domains=("127.0.0.1",), http_timeout_s=1.0)
    with media_host(mode) as url:
        with pytest.raises(MediaFetchError, match=r"timed out after 1 s \(http_timeout_s\), the limit for the whole"):
            load_image(url, config)


# -- the pixel budget of one request -------------------------------------------------------------------

def _png(width: int, height: int, seed: int) -> bytes:
    """Random pixels: a file that is all pixel data after its header, and no two alike."""
    buffer = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)).save(buffer, "PNG")
    return buffer.getvalue()


# Two 100x100 images fit; a third passes the budget (30,000 pixels).
BUDGET = MediaConfig(max_image_pixels=10_000, max_request_pixels=25_000)
OVER = r"the request's images come to 30000 pixels with image 3 \(.*100x100 = 10000 pixels\); the limit for all " \
       r"images of one request is 25000 \(MediaConfig.max_request_pixels\); send fewer or smaller images"


def test_the_request_pixel_budget_defaults_to_four_images_at_the_per_image_cap():
    assert MediaConfig().max_request_pixels == 4 * MediaConfig().max_image_pixels == 144_000_000
    assert MediaConfig(max_image_pixels=100).max_request_pixels == 400
    assert MediaConfig(max_image_pixels=100, max_request_pixels=150).max_request_pixels == 150
    with pytest.raises(ValueError, match="max_request_pixels must be a positive integer"):
        MediaConfig(max_request_pixels=0)


def test_the_image_that_passes_the_request_budget_is_refused_before_it_is_decoded():
    first, second, third = _png(100, 100, 1), _png(100, 100, 2), _png(100, 100, 3)
    assert [loaded.image.size for loaded in load_images([first, second], BUDGET)] == [(100, 100)] * 2
    # The third's pixels are cut off after its header: decoding it would be a decode error, so
    # the budget's refusal shows that only the header was read.
    truncated = third[:third.index(b"IDAT") + 100]
    with pytest.raises(MediaDecodeError):
        load_image(truncated, BUDGET)
    for last in (third, truncated):
        with pytest.raises(MediaTooLargeError, match=OVER):
            load_images([first, second, last], BUDGET)
    # The budget is per request: the next one starts afresh.
    assert len(load_images([third, first], BUDGET)) == 2


def test_cached_resent_and_pil_images_count_against_the_request_budget():
    # The same image three times: the second and third come from the decoded-image cache.
    again = _png(100, 100, 4)
    with pytest.raises(MediaTooLargeError, match=OVER):
        load_images([again, again, again], BUDGET)
    # A resent data URL: the second and third skip even the base64 decode (the inline cache).
    url = "data:image/png;base64," + base64.b64encode(_png(100, 100, 5)).decode()
    with pytest.raises(MediaTooLargeError, match=OVER):
        load_images([url, url, url], BUDGET)
    with pytest.raises(MediaTooLargeError, match=OVER):
        load_images([Image.new("RGB", (100, 100))] * 3, BUDGET)
    # One image over a request budget below the per-image cap; the server's error names its flag.
    with pytest.raises(MediaTooLargeError, match=r"is 100x100 = 10000 pixels; the limit for all images of one request "
                                                 r"is 5000 \(--max-request-pixels\); send a smaller image"):
        load_images([again], MediaConfig(max_request_pixels=5_000, api="server"))


def test_an_input_builder_loads_a_requests_images_under_one_budget():
    builder = get_router(tiny_checkpoint("qwen2_vl"), media_config=MediaConfig(max_image_pixels=10_000,
                                                                               max_request_pixels=15_000)).input_builder
    image = "data:image/png;base64," + base64.b64encode(_png(100, 100, 6)).decode()
    two = [{"role": "user", "content": [{"image": image}, {"image": image}, {"text": "Compare them."}]}]
    with pytest.raises(MediaTooLargeError, match="come to 20000 pixels with image 2"):
        builder.make_context(0, two, request_id="r")
    with pytest.raises(MediaTooLargeError, match="come to 20000 pixels with image 2"):
        builder.tokenize([{"image": image}, {"image": image}, {"text": "Compare them."}], request_id="r")


# -- the worker's loop ---------------------------------------------------------------------------------

class _Sink:
    def __init__(self):
        self.sent = []

    def send(self, data):
        from atb_plugin.frontend.tokenizer_pool import _reply_decoder

        self.sent.append(_reply_decoder.decode(data))


def _loop() -> _WorkerLoop:
    settings = type("Settings", (), {"media_config": MediaConfig(allowed_domains=("127.0.0.1",))})
    return _WorkerLoop(settings, processor=None, store=None, jobs=None, results=_Sink(), parent=0)


def test_media_urls_are_found_in_both_spellings():
    chat = ChatJob("r", [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": " https://a.example/x.png "}},
        {"image": "http://b.example/y.png"}, {"image": "file:///data/z.png"},
        {"type": "text", "text": "http://not.media/ is text"}]}])
    assert media_urls(chat) == ["https://a.example/x.png", "http://b.example/y.png"]
    assert media_urls(PromptJob("r", [{"image": "http://c.example/q.png"}, {"text": "hi"}])) == ["http://c.example/q.png"]
    assert media_urls(PromptJob("r", "just text")) == []


def test_a_job_fetching_media_lets_the_jobs_behind_it_run_and_a_departed_job_is_dropped():
    loop = _loop()
    blocked = Future()
    loop.fetcher.submit = lambda *args: blocked  # the fetch is still running
    with_media = Envelope(1, ChatJob("a", [{"role": "user", "content": [{"image": "http://127.0.0.1:9/x.png"}]}]))
    text, departed = Envelope(2, ChatJob("b", [{"role": "user", "content": "hi"}])), Envelope(3, PromptJob("c", "x"))
    for envelope in (with_media, text, departed, Envelope(-1, CancelJob(3))):
        loop.receive(envelope)
    assert [entry[0].id for entry in loop.ready] == [2]  # job 1 waits for its media, job 3 is gone
    assert loop.results.sent == [Reply(3, error="cancelled: the client left", kind="cancelled")]
    loop.receive(Envelope(-1, CancelJob(1)))  # its client left too: the fetch is dropped with it
    assert not loop.fetching and blocked.cancelled()
    loop.receive(Envelope(-1, CancelJob(2)))
    loop.receive(Envelope(-1, CancelJob(99)))  # ran (or never was) already: nothing to do
    assert [reply.id for reply in loop.results.sent] == [3, 1, 2] and not loop.ready
    loop.fetcher.shutdown(wait=False)


# -- through the service -------------------------------------------------------------------------------

@pytest.mark.server  # and two 10 s deadlines
def test_slow_media_hosts_delay_only_their_own_requests():
    server = ServerProcess(tiny_checkpoint("qwen2_vl"), "--allowed-media-domains", "127.0.0.1", workers=1)
    chat = {"messages": [{"role": "user", "content": "Say something."}], "max_tokens": 4, "temperature": 0}

    def text_chat() -> None:
        assert server.post("/v1/chat/completions", chat).status_code == 200

    try:
        text_chat()  # warm-up
        with media_host("drip") as drip, media_host("silent") as silent:
            outcomes = {}

            def image_request(name, url):
                body = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                                 {"type": "text", "text": "What is it?"}]}],
                        "max_tokens": 4}
                response = server.post("/v1/chat/completions", body)
                outcomes[name] = response

            threads = [threading.Thread(target=image_request, args=item) for item in
                       (("drip", drip), ("silent", silent))]
            for thread in threads:
                thread.start()
            time.sleep(1.0)  # both downloads are hanging now
            text_chat()
            # Answered while both downloads still hang: the text did not queue behind them (they
            # end at their 10 s deadline). An order of events, not a clock reading.
            hanging = [thread.is_alive() for thread in threads]
            for thread in threads:
                thread.join(30)
        assert hanging == [True, True]
        for name, response in outcomes.items():
            assert response.status_code == 400, (name, response.text)
            assert "timed out after 10 s (http_timeout_s" in response.json()["error"]["message"], name
    finally:
        assert server.stop() == 0, server.log()
