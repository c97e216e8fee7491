"""Tensor-parallel ranks in the captured CPU decode step (models/native_decode.py; the all-reduce
inside the native step: atb_plugin/ops/csrc/tp_allreduce.c).

1. The native all-reduce on a real exchange segment, between spawned members: its rounds and the
   Python exchange's (``ShmExchange.exchange``) form one sequence, and its sum is
   ``distributed.all_reduce``'s bit for bit (slot 0 + slot 1, then each further slot, in rank
   order: checked at 3 members, where the order matters); a member that dies, one that marks its
   step as failed (the abort flag) and one that never comes are errors naming the rank, not a
   hang (the abort within a second, a death within the half-second liveness check).
2. Through ``LLM``: TP = 2 decodes captured, and its greedy tokens and logprobs equal TP = 2
   eager bit for bit on a dense model (the same kernels, the same reduction order) and TP = 1's
   within test_tensor_parallel.py's FP32_ATOL (the reduction order differs from one rank's sum:
   observed max |diff| ~2e-6); a Qwen3-MoE model decodes captured at TP = 2 as well (its
   experts' native GEMMs: within FP32_ATOL of eager, as at TP = 1), and under expert
   parallelism every rank stays eager and says why. A rank killed while the other waits in the
   captured step's all-reduce fails ``generate`` with the rank named, within seconds, and leaves
   no rank process behind.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import threading
import time

import numpy as np
import pytest

from shm import exchange as shm_exchange

pytestmark = pytest.mark.skipif(not shm_exchange.supported(), reason="the exchange needs x86-64's store order")

SLOT = 1 << 16
FP32_ATOL = 1e-4  # test_tensor_parallel.py's float32 tolerance (its docstring: why)


def _library():
    import torch

    from atb_plugin.ops import cpu_native

    return cpu_native.linear_library(torch.device("cpu"))


def _tp(ex: shm_exchange.ShmExchange, timeout_s: float):
    from atb_plugin.ops import cpu_native

    return cpu_native.DecodeTP(ex.address, ex.rank, ex.size, ex.slot_bytes, timeout_s)


def _payload(rank: int, k: int):
    import torch

    return torch.from_numpy(np.random.default_rng(1000 * k + rank).standard_normal(1 + (k * 53) % 4000)
                            .astype(np.float32))


def _rounds(ex: shm_exchange.ShmExchange, rounds: int) -> list[bool]:
    """Alternating native all-reduces and Python exchanges; each native sum checked against the
    Python all-reduce's arithmetic (distributed.all_reduce) on the same payloads."""
    import torch

    from atb_plugin.ops import cpu_native

    library, tp, ok = _library(), _tp(ex, 60), []
    for k in range(rounds):
        x = _payload(ex.rank, k)
        if k % 3 == 2:  # a Python round between native ones: the round numbers are shared
            views = ex.exchange(x.numpy().view(np.uint8), 60)
            ok.append(all((v.view(np.float32) == _payload(r, k).numpy()).all() for r, v in enumerate(views)))
            continue
        pieces = [_payload(r, k) for r in range(ex.size)]
        expected = torch.add(pieces[0], pieces[1])
        for piece in pieces[2:]:
            expected += piece
        cpu_native.tp_all_reduce(library, tp, x)
        ok.append(torch.equal(x, expected))
    return ok


def _member(rank: int, size: int, name: str, rounds: int, behaviour: str, queue) -> None:
    try:
        ex = shm_exchange.ShmExchange.attach(name, rank, size, SLOT)
        if behaviour == "exit":
            os._exit(0)
        if behaviour == "abort":  # what tp_abort writes: this member's abort flag
            ex._aborted[rank] = 1
        if behaviour in ("abort", "absent"):
            time.sleep(30)
            return
        queue.put((rank, all(_rounds(ex, rounds))))
    except BaseException as error:  # noqa: BLE001 - reported to the test
        queue.put((rank, repr(error)))


def _group(size: int, behaviour: str, rounds: int = 0):
    host = shm_exchange.ShmExchange.create(0, size, SLOT)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    members = [ctx.Process(target=_member, args=(rank, size, host.name, rounds, behaviour, queue), daemon=True)
               for rank in range(1, size)]
    for member in members:
        member.start()
    return host, queue, members


def _stop(host, members) -> None:
    for member in members:
        if member.is_alive():
            member.kill()
        member.join(10)
    host.unlink()
    host.close()


def test_native_all_reduce_shares_the_rounds_and_sums_as_the_python_all_reduce():
    size, rounds = 3, 300
    host, queue, members = _group(size, "sum", rounds)
    try:
        assert all(_rounds(host, rounds))
        assert sorted(queue.get(timeout=120) for _ in members) == [(1, True), (2, True)]
    finally:
        _stop(host, members)


@pytest.mark.parametrize("behaviour, error, message, within_s", [
    ("exit", RuntimeError, r"rank 1 exited while rank 0 waited for it in a collective", 5),
    ("abort", RuntimeError, r"rank 1 failed its step while rank 0 waited", 1),
    ("absent", TimeoutError, r"rank 1 did not reach the collective within 2 s", 5),
], ids=["exited", "aborted", "timed-out"])
def test_a_native_all_reduce_never_hangs_on_a_missing_rank(behaviour, error, message, within_s):
    import torch

    from atb_plugin.ops import cpu_native

    host, _, members = _group(2, behaviour)
    try:
        deadline = time.monotonic() + 60
        while int(host._pids[1]) == 0 and time.monotonic() < deadline:  # the member has mapped the segment
            time.sleep(0.05)
        if behaviour == "exit":
            members[0].join(30)
        elif behaviour == "abort":
            while not host._aborted[1] and time.monotonic() < deadline:
                time.sleep(0.05)
        start = time.monotonic()
        with pytest.raises(error, match=message):
            cpu_native.tp_all_reduce(_library(), _tp(host, 2), torch.ones(64))
        assert time.monotonic() - start < within_s
        # The waiting rank marked its own step failed too: a third rank waiting for it stops in turn.
        assert host._aborted[0] == 1
    finally:
        _stop(host, members)


# ------------------------------------------------------------------------------------------------
# Through LLM: tiny checkpoints, TP = 2 captured against TP = 2 eager and TP = 1.

PROMPTS = ["The quick brown fox", "Hello, my name is", "In 1492, a sailor", "def fibonacci(n):"]


def _generate(family: str, **arguments):
    from atb_plugin import LLM, SamplingParams
    from atb_plugin.testing.tiny import tiny_checkpoint

    with LLM(str(tiny_checkpoint(family)), **arguments) as llm:
        capture = llm.engine.core.executor.decode_capture
        outputs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=16, logprobs=1))
    return capture, [(o.outputs[0].token_ids, [p.logprob for p in o.outputs[0].logprobs]) for o in outputs]


def _max_logprob_diff(a, b) -> float:
    assert [tokens for tokens, _ in a] == [tokens for tokens, _ in b]
    return max(abs(x - y) for (_, la), (_, lb) in zip(a, b) for x, y in zip(la, lb))


@pytest.fixture(scope="module")
def native():
    if _library() is None:
        pytest.skip("the native CPU kernels are not in use here: nothing is captured")


@pytest.mark.slow
def test_tp2_decodes_captured_as_tp2_eager_bit_for_bit_and_as_tp1(native):
    capture, tp2 = _generate("qwen2", tensor_parallel_size=2)
    assert capture == "captured"
    eager_capture, tp2_eager = _generate("qwen2", tensor_parallel_size=2, enforce_eager=True)
    assert eager_capture == "off (enforce_eager)"
    assert _max_logprob_diff(tp2, tp2_eager) == 0.0  # the same kernels, the same reduction order
    assert _max_logprob_diff(tp2, _generate("qwen2")[1]) <= FP32_ATOL


@pytest.mark.slow
def test_tp2_moe_decodes_captured_and_expert_parallel_ranks_stay_eager(native):
    capture, tp2 = _generate("qwen3_moe", tensor_parallel_size=2)
    assert capture == "captured"
    assert _max_logprob_diff(tp2, _generate("qwen3_moe", tensor_parallel_size=2, enforce_eager=True)[1]) <= FP32_ATOL
    capture, expert_parallel = _generate("qwen3_moe", tensor_parallel_size=2, enable_expert_parallel=True)
    assert capture == "expert parallelism: this rank holds only some experts"
    assert _max_logprob_diff(tp2, expert_parallel) <= FP32_ATOL


@pytest.mark.slow
def test_a_rank_killed_during_captured_decode_fails_generate_naming_it(native):
    from atb_plugin import LLM, SamplingParams
    from atb_plugin.testing.tiny import tiny_checkpoint
    from tests.test_tensor_parallel import rank_pids, worker_processes

    with LLM(str(tiny_checkpoint("qwen2")), tensor_parallel_size=2) as llm:
        assert llm.engine.core.executor.decode_capture == "captured"
        victim = rank_pids(llm)[1]
        # Many long decodes: rank 0 spends most of its time in the captured step's all-reduces.
        params = SamplingParams(temperature=0, max_tokens=4000, min_tokens=4000, ignore_eos=True)
        killer = threading.Timer(3.0, os.kill, (victim, signal.SIGKILL))
        killer.start()
        start = time.monotonic()
        try:
            with pytest.raises(Exception, match="rank 1") as caught:
                llm.generate(PROMPTS * 4, params)
        finally:
            killer.cancel()
        assert time.monotonic() - start < 60, caught.value
    assert worker_processes() == []
