"""A text far too long for the model is refused before it is tokenized (``frontend/input_bounds``),
through both doors: a 60 MB text to chat and to /v1/embeddings is refused without the builder ever
tokenizing it, a small request sent meanwhile is answered, and the tokenizer worker's memory stays
where it was (tokenizing the text would grow it by far more). No assertion reads a clock.
Texts that fit are never refused by the estimate (it is a lower bound on their tokens)."""

from __future__ import annotations

import threading
import time

import pytest

from atb_plugin import LLM, SamplingParams
from atb_plugin.frontend.input_bounds import check_text_fits, max_chars_per_token, text_chars
from atb_plugin.testing.tiny import tiny_checkpoint
from routers import get_router
from tests.server_helpers import ServerProcess

HUGE = "lorem ipsum " * (5 << 20)  # 60 MiB of text


def test_text_is_counted_without_media():
    chat = [{"role": "user", "content": [{"type": "text", "text": "abcd"},
                                         {"type": "image_url", "image_url": {"url": "data:image/png;base64," + "A" * 99}},
                                         {"image": "/x.png"}, {"text": "ef"}]},
            {"role": "assistant", "content": "ghi"}]
    assert text_chars(chat) == 9
    assert text_chars("hello") == 5 and text_chars([{"text": "ab"}, {"image": "zzz"}]) == 2


def test_the_estimate_never_refuses_a_text_that_fits():
    tokenizer = get_router(tiny_checkpoint("qwen2")).tokenizer
    per_token = max_chars_per_token(tokenizer)
    for text in ("a" * 5000, "hello world " * 400, "".join(chr(c) for c in range(32, 3000))):
        tokens = len(tokenizer(text)["input_ids"])
        check_text_fits(len(text), tokenizer, tokens)  # exactly its length in tokens: accepted
        assert len(text) / per_token <= tokens
    check_text_fits(100 * per_token + 1, tokenizer, 100)  # short: left to the exact check
    with pytest.raises(ValueError, match="at least .* tokens; this model's maximum context length is 100"):
        check_text_fits(1 << 20, tokenizer, 100)


def test_the_offline_door_refuses_it_before_tokenizing(monkeypatch):
    with LLM(tiny_checkpoint("qwen2"), block_size=16) as llm:
        builder = llm.router.input_builder

        def never(*args, **kwargs):
            raise AssertionError("the builder was asked to tokenize a text the bound should refuse")

        monkeypatch.setattr(builder, "tokenize", never)
        monkeypatch.setattr(builder, "make_context", never)
        with pytest.raises(ValueError, match="maximum context length"):
            llm.generate(HUGE, SamplingParams(max_tokens=2))
        with pytest.raises(ValueError, match="maximum context length"):
            llm.chat([{"role": "user", "content": HUGE}], SamplingParams(max_tokens=2))


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS")) / 1024


@pytest.mark.server
@pytest.mark.parametrize("family, route, body", [
    ("qwen2", "/v1/chat/completions", lambda text: {"messages": [{"role": "user", "content": text}], "max_tokens": 2}),
    ("bert", "/v1/embeddings", lambda text: {"input": text}),
])
def test_a_huge_text_is_refused_fast_and_leaves_the_others_and_the_worker_alone(family, route, body):
    server = ServerProcess(tiny_checkpoint(family), workers=1)
    try:
        small = body("a short question")
        assert server.post(route, small).status_code == 200
        worker = server.pid_of("tokenizer worker 0")
        before = _rss_mb(worker)
        meanwhile = {}

        def send_small():
            time.sleep(0.3)
            meanwhile["status"] = server.post(route, small).status_code

        thread = threading.Thread(target=send_small)
        thread.start()
        response = server.post(route, body(HUGE))
        thread.join(30)
        assert response.status_code == 400, response.text[:300]
        assert "maximum context length" in response.json()["error"]["message"]
        assert meanwhile == {"status": 200}
        assert _rss_mb(worker) < before + 100, (before, _rss_mb(worker))
    finally:
        assert server.stop() == 0, server.log()
