"""A tensor-parallel rank lives exactly as long as its engine core: an offline ``LLM`` built in
a thread that then exits keeps its ranks (the parent-death signal used before fired on the
creating *thread*'s exit and killed them), and a core killed outright takes its ranks with it
(each notices being re-parented), leaving no process and no exchange segment."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from atb_plugin import LLM, SamplingParams
from atb_plugin.testing.tiny import tiny_checkpoint
from shm.reaper import reap_orphans
from tests.test_server_lifecycle import wait_until_gone

pytestmark = pytest.mark.slow  # rank processes

PARAMS = SamplingParams(max_tokens=6, temperature=0)
PROMPT = "Tell me a story about a fox."


def test_an_llm_built_in_a_thread_that_ends_keeps_its_ranks():
    built = {}
    thread = threading.Thread(target=lambda: built.setdefault("llm", LLM(tiny_checkpoint("qwen2"), block_size=16,
                                                                          tensor_parallel_size=2)))
    thread.start()
    thread.join(300)
    with built["llm"] as llm:
        ranks = [rank.process for rank in llm.engine.client.core.executor.ranks]
        assert all(process.poll() is None for process in ranks)
        answer = llm.generate(PROMPT, PARAMS)[0].outputs[0].text
    with LLM(tiny_checkpoint("qwen2"), block_size=16) as reference:
        assert answer == reference.generate(PROMPT, PARAMS)[0].outputs[0].text


SCRIPT = """
import sys, time
from atb_plugin import LLM
llm = LLM(sys.argv[1], block_size=16, tensor_parallel_size=2)
print(" ".join(str(rank.process.pid) for rank in llm.engine.client.core.executor.ranks), flush=True)
time.sleep(600)
"""


def test_ranks_exit_when_their_core_is_killed():
    core = subprocess.Popen([sys.executable, "-c", SCRIPT, str(tiny_checkpoint("qwen2"))], stdout=subprocess.PIPE,
                            text=True, cwd=Path(__file__).resolve().parents[1])
    try:
        ranks = [int(pid) for pid in core.stdout.readline().split()]
        assert len(ranks) == 2
        core.send_signal(signal.SIGKILL)
        core.wait(30)
        wait_until_gone(ranks)
    finally:
        if core.poll() is None:
            core.kill()
            core.wait(30)
        reap_orphans()  # the killed process's shm instance marker (its store never got to unlink it)
    assert not [name for name in os.listdir("/dev/shm") if name.startswith("atbx_")]
