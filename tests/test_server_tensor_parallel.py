"""The service at tensor_parallel_size 2 (``-tp 2``): the same greedy answers as the offline ``LLM``
at TP = 1 for a text and an image chat (the image crosses shared memory once; both ranks read
the segment), and a rank killed mid-stream fails the in-flight request with an error event,
makes the service exit non-zero, and leaves no process and no segment behind.

Equality is of greedy tokens: the ranks' all-reduces only change the float32 summation order
(logits agree to ~1e-6 with TP = 1, tests/test_tensor_parallel.py), far below the gap between a
greedy token and the runner-up on these prompts."""

from __future__ import annotations

import json
import os
import signal

import pytest

from atb_plugin import LLM, SamplingParams
from atb_plugin.testing.tiny import tiny_checkpoint
from tests.server_helpers import data_url
from tests.test_server_lifecycle import StreamInThread, segments_of, wait_until_gone, wait_until_group_gone

pytestmark = pytest.mark.slow  # a real server with two rank processes

TEXT = [{"role": "user", "content": "Tell me a story about a fox."}]
IMAGE = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(seed=3)}},
                                      {"type": "text", "text": "What is in this picture?"}]}]


@pytest.fixture(scope="module")
def server(serve):
    # The module's last test kills a rank and checks the service's exit code (1) itself.
    with serve(tiny_checkpoint("qwen2_vl"), "--tensor-parallel-size", "2", check_exit=False) as server:
        yield server


def test_tp2_answers_as_tp1_offline(server):
    model = server.client().models.list().data[0].id
    answers = [server.client().chat.completions.create(model=model, messages=messages, max_tokens=8, temperature=0)
               for messages in (TEXT, IMAGE)]
    with LLM(tiny_checkpoint("qwen2_vl"), block_size=16) as llm:
        offline = [llm.chat(messages, SamplingParams(max_tokens=8, temperature=0))[0] for messages in (TEXT, IMAGE)]
    for answer, reference in zip(answers, offline):
        assert answer.choices[0].message.content == reference.outputs[0].text
        assert answer.usage.prompt_tokens == len(reference.prompt_token_ids)
    assert "tensor-parallel rank 1 pid" in server.log(tail=None)


def test_a_dead_rank_fails_the_stream_and_the_service_exits_nonzero(server):
    ranks = [server.pid_of(f"tensor-parallel rank {r}") for r in (0, 1)]
    stream = StreamInThread(server, {"model": server.client().models.list().data[0].id, "messages": IMAGE,
                                     "max_tokens": 400, "min_tokens": 400, "temperature": 0})
    assert stream.first_chunk.wait(60) and stream.status == 200
    os.kill(ranks[1], signal.SIGKILL)
    stream.thread.join(30)
    errors = [json.loads(e)["error"] for e in stream.events if e != "[DONE]" and "error" in json.loads(e)]
    assert errors and errors[0]["code"] == 500, stream.events[-3:]
    server.process.wait(30)
    assert server.process.returncode == 1, server.log()
    # The core named the rank and why (the one killed by a signal: rank 1, unless rank 0 saw the
    # broken collective and exited first), and stopped the other rank: none is orphaned.
    log = server.log(tail=None)
    assert "died during a step" in log and "tensor-parallel rank 1 died" in log, log[-3000:]

    wait_until_gone(ranks)
    wait_until_group_gone(server.process.pid)
    assert segments_of(server) == []
