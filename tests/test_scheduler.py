"""The scheduler on its own: random workloads under tight budgets and a tiny KV cache, with a
stand-in for the model that "samples" a deterministic token, so every step's decisions can be
checked against the invariants stated at the top of Scheduler.schedule()."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from atb_plugin.engine.kv_cache_manager import KVCacheManager
from atb_plugin.engine.request import Request, RequestStatus
from atb_plugin.engine.sampling_params import SamplingParams
from atb_plugin.engine.scheduler import Scheduler, SchedulerConfig

BLOCK = 4


def drive(prompts: list[int], max_tokens: int, num_blocks: int, budget: int, max_seqs: int,
          max_model_len: int = 64, caching: bool = True):
    kv = KVCacheManager(num_blocks, BLOCK, enable_prefix_caching=caching)
    scheduler = Scheduler(SchedulerConfig(budget, max_seqs, max_model_len), kv)
    for index, length in enumerate(prompts):
        # Prompts share a prefix so the prefix cache has something to hit.
        scheduler.add_request(Request(f"r{index}", [7] * 8 + list(range(index, index + length)),
                                      SamplingParams(max_tokens=max_tokens)))
    finished, generated, steps = {}, {}, 0
    while scheduler.has_unfinished_requests():
        steps += 1
        assert steps < 2000, "no progress: starvation or a scheduling deadlock"
        output = scheduler.schedule()
        # Invariants: budget, at most max_seqs running, nobody scheduled past max_model_len.
        assert output.total_num_scheduled_tokens <= budget
        assert len(scheduler.running) <= max_seqs
        for request_id, count in output.num_scheduled_tokens.items():
            request = scheduler.requests[request_id]
            assert count > 0 and request.status is RequestStatus.RUNNING
            assert request.num_computed_tokens + count <= min(request.num_tokens, max_model_len)
            # It holds blocks for everything it will have computed after this step.
            held = len(kv.get_block_ids(request_id))
            assert held * BLOCK >= request.num_computed_tokens + count
        if not output.num_scheduled_tokens:
            assert not scheduler.running, "running requests left unscheduled with budget to spare"
            continue
        # The stand-in model: a request samples when its chunk reaches the end of its tokens.
        sampled = {r: 1000 + scheduler.requests[r].num_output_tokens
                   for r, count in output.num_scheduled_tokens.items()
                   if scheduler.requests[r].num_computed_tokens + count == scheduler.requests[r].num_tokens}
        for out in scheduler.update_from_output(output, sampled):
            # The scheduler itself ends a request at max_tokens / max_model_len and frees its blocks.
            generated.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished:
                assert out.finish_reason == RequestStatus.FINISHED_LENGTH.value
                assert out.request_id not in scheduler.requests
                finished[out.request_id] = generated[out.request_id]
    assert kv.num_free_blocks == num_blocks - 1  # everything returned, but the null block
    return finished, scheduler


@settings(max_examples=60, deadline=None)
@given(
    prompts=st.lists(st.integers(1, 20), min_size=1, max_size=6),
    max_tokens=st.integers(1, 8),
    num_blocks=st.integers(10, 40),
    budget=st.integers(1, 32),
    max_seqs=st.integers(1, 4),
    caching=st.booleans(),
)
def test_random_workloads_keep_the_invariants_and_finish(prompts, max_tokens, num_blocks, budget, max_seqs, caching):
    # A request needs at most (8 + 20 + 8) / 4 = 9 blocks; 10 keep every request runnable alone.
    finished, _ = drive(prompts, max_tokens, num_blocks, budget, max_seqs, caching=caching)
    assert set(finished) == {f"r{i}" for i in range(len(prompts))}
    for tokens in finished.values():
        assert tokens == [1000 + i for i in range(max_tokens)]  # nothing lost or repeated by preemption


def test_a_tiny_cache_preempts_the_youngest_and_it_resumes_first():
    finished, scheduler = drive([12, 12, 12], max_tokens=8, num_blocks=12, budget=64, max_seqs=3)
    assert scheduler.num_preemptions > 0
    assert len(finished) == 3


def test_waiting_requests_keep_arrival_order():
    kv = KVCacheManager(64, BLOCK)
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=6, max_num_seqs=8, max_model_len=64), kv)
    for index in range(3):
        scheduler.add_request(Request(f"r{index}", list(range(10 * index, 10 * index + 5)), SamplingParams()))
    first = scheduler.schedule()
    assert list(first.num_scheduled_tokens.items()) == [("r0", 5), ("r1", 1)]  # chunked to the budget


def test_prompts_that_cannot_fit_are_refused():
    scheduler = Scheduler(SchedulerConfig(max_model_len=8), KVCacheManager(16, BLOCK))
    try:
        scheduler.add_request(Request("r", list(range(8)), SamplingParams()))
    except ValueError as error:
        assert "max_model_len is 8" in str(error)
    else:
        raise AssertionError("an 8-token prompt with max_model_len 8 must be refused")


def test_a_request_that_can_never_fit_the_cache_is_refused():
    scheduler = Scheduler(SchedulerConfig(max_model_len=64), KVCacheManager(5, BLOCK))  # 4 usable blocks
    try:
        scheduler.add_request(Request("r", list(range(10)), SamplingParams(max_tokens=10)))
    except ValueError as error:
        assert "may grow to 20 tokens (5 KV blocks); the KV cache has 4" in str(error)
    else:
        raise AssertionError("a request needing 5 blocks must be refused by a 4-block cache")
