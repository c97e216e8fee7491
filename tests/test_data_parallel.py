"""Data parallelism (``--data-parallel-size``, ``engine/dp_client.py``).

Routing, in process: a conversation's later turns go back to the engine that took its earlier
turns; new prompts spread to the least-loaded engine; an engine more than ``affinity_slack``
requests busier than the least-loaded loses its affinity; prompts shorter than a block carry no
affinity; the index forgets the oldest blocks past its capacity; round-robin ignores all that.
Config: each engine's devices and CPU cores.

Through the real service with two engine cores (one thread each): the same greedy answers as the
offline ``LLM`` with one engine; a 4-turn conversation stays on one engine (its prefix-cache hits
are all there, per the ``engine`` label of ``/metrics``) while independent conversations use
both; killing one engine core fails its in-flight stream, and the service exits non-zero with no
process or segment left."""

from __future__ import annotations

import json
import os
import signal

import pytest

from atb_plugin import LLM, SamplingParams
from atb_plugin.engine.config import EngineConfig
from atb_plugin.engine.dp_client import CacheAwareRouting, RoundRobinRouting
from atb_plugin.engine.messages import EngineCoreRequest
from atb_plugin.testing.tiny import tiny_checkpoint
from tests.test_server_lifecycle import StreamInThread, segments_of, wait_until, wait_until_group_gone

BLOCK = 16


def request(ids, request_id="r") -> EngineCoreRequest:
    return EngineCoreRequest(request_id=request_id, prompt_token_ids=list(ids), sampling_params=SamplingParams())


def conversation(seed: int, turns: int) -> list[list[int]]:
    """Each turn's prompt: the previous one plus new tokens (40 in the first turn, 12 after)."""
    prompt, prompts = [], []
    for turn in range(turns):
        prompt = prompt + [seed * 1000 + turn * 40 + i for i in range(40 if turn == 0 else 12)]
        prompts.append(prompt)
    return prompts


def test_a_conversation_returns_to_its_engine_and_new_ones_spread():
    routing = CacheAwareRouting(2, BLOCK)
    in_flight, kv = [0, 0], [0.0, 0.0]
    first = {}
    for seed in range(4):  # four conversations' first turns: alternate by load
        first[seed] = routing.choose(request(conversation(seed, 1)[0]), in_flight, kv)
        in_flight[first[seed]] += 1
    assert sorted(first.values()) == [0, 0, 1, 1]
    for turn in range(1, 4):
        for seed in range(4):
            assert routing.choose(request(conversation(seed, turn + 1)[turn]), in_flight, kv) == first[seed]


def test_an_overloaded_engine_loses_its_affinity():
    routing = CacheAwareRouting(2, BLOCK, affinity_slack=2)
    turns = conversation(7, 3)
    assert routing.choose(request(turns[0]), [0, 0], [0.0, 0.0]) == 0
    assert routing.choose(request(turns[1]), [2, 0], [0.0, 0.0]) == 0  # within the slack: stays
    assert routing.choose(request(turns[2]), [3, 0], [0.0, 0.0]) == 1  # beyond it: the least loaded
    # ... and the conversation now belongs to engine 1.
    assert routing.choose(request(turns[2] + [1] * 12), [0, 2], [0.0, 0.0]) == 1


def test_a_shared_system_prompt_alone_binds_nothing():
    routing = CacheAwareRouting(2, BLOCK)
    system = list(range(2 * BLOCK))
    assert routing.choose(request(system + list(range(500, 540))), [0, 0], [0.0, 0.0]) == 0
    # 32 of 72 tokens shared: not most of the prompt, so by load (engine 1 has taken none).
    assert routing.choose(request(system + list(range(600, 640))), [0, 0], [0.0, 0.0]) == 1
    # 32 of 40: most of it.
    assert routing.choose(request(system + list(range(700, 708))), [0, 0], [0.0, 0.0]) == 1


def test_ties_go_by_kv_usage_then_fewest_taken_and_short_prompts_carry_no_affinity():
    routing = CacheAwareRouting(3, BLOCK)
    assert routing.choose(request(range(40)), [1, 1, 1], [0.5, 0.2, 0.2]) == 1
    short = list(range(BLOCK - 1))
    idle = ([0, 0, 0], [0.0, 0.0, 0.0])
    assert [routing.choose(request(short), *idle) for _ in range(3)] == [0, 2, 0]  # spread, no affinity


def test_the_index_forgets_the_oldest_blocks_past_its_capacity():
    routing = CacheAwareRouting(2, BLOCK, capacity=4)
    old = list(range(4 * BLOCK))
    assert routing.choose(request(old), [0, 0], [0.0, 0.0]) == 0
    routing.choose(request(list(range(1000, 1000 + 4 * BLOCK))), [5, 0], [0.0, 0.0])  # to 1, evicts `old`
    assert routing.choose(request(old), [1, 0], [0.0, 0.0]) == 1  # no affinity left: least loaded
    with pytest.raises(ValueError, match="affinity_slack"):
        CacheAwareRouting(2, BLOCK, affinity_slack=-1)


def test_round_robin_ignores_load_and_prefixes():
    routing = RoundRobinRouting(2, BLOCK)
    same = request(range(64))
    assert [routing.choose(same, [9, 0], [0.0, 0.0]) for _ in range(4)] == [0, 1, 0, 1]


def test_each_engine_takes_its_own_devices_and_cores():
    config = EngineConfig(tiny_checkpoint("qwen2"), data_parallel_size=2, num_threads=1)
    engines = [config.for_data_parallel_rank(i) for i in range(2)]
    assert [e.data_parallel_rank for e in engines] == [0, 1]
    assert [e.engine_cores([4, 5, 6]) for e in engines] == [[4], [5]]
    assert config.engine_cores([0]) is None  # too few cores: no pinning
    assert EngineConfig(tiny_checkpoint("qwen2")).engine_cores([0, 1]) is None  # one engine: no pinning
    tp2 = EngineConfig(tiny_checkpoint("qwen2"), data_parallel_size=2, tensor_parallel_size=2)
    assert [[tp2.for_data_parallel_rank(i).rank_device(r) for r in range(2)] for i in range(2)] == [[0, 1], [2, 3]]
    with pytest.raises(ValueError, match="ASCEND_RT_VISIBLE_DEVICES"):
        EngineConfig(tiny_checkpoint("qwen2"), data_parallel_size=2, device_ids=(0,))
    with pytest.raises(ValueError, match="data_parallel_rank"):
        EngineConfig(tiny_checkpoint("qwen2"), data_parallel_size=2, data_parallel_rank=2)


# -- through the service -----------------------------------------------------------------------------

def engine_metric(server, name: str) -> dict[str, float]:
    """``name``'s value per engine label."""
    import re

    text = server.get("/metrics").text
    return {m.group(1): float(m.group(2))
            for m in re.finditer(rf'^{re.escape(name)}{{engine="(\d+)",model_name="[^"]*"}} (\S+)$', text, re.M)}


@pytest.fixture(scope="module")
def server(serve):
    # The module's last test kills an engine core and checks the service's exit code (1) itself.
    with serve(tiny_checkpoint("qwen2"), "--data-parallel-size", "2", "--num-threads", "1",
               "--block-size", str(BLOCK), check_exit=False) as server:
        yield server


@pytest.mark.slow  # a real server with two engine-core processes
def test_dp2_answers_as_one_engine_offline_and_keeps_a_conversation_on_one_engine(server):
    client = server.client()
    model = client.models.list().data[0].id
    # Each longer than the chat template's shared start, so that no two bind to one engine.
    questions = [f"Tell me everything about {topic}. " * 6 for topic in ("foxes", "France", "numbers", "the sea")]
    answers = [client.chat.completions.create(model=model, messages=[{"role": "user", "content": q}],
                                              max_tokens=8, temperature=0).choices[0].message.content
               for q in questions]
    with LLM(tiny_checkpoint("qwen2"), block_size=BLOCK) as llm:
        offline = [llm.chat([{"role": "user", "content": q}], SamplingParams(max_tokens=8, temperature=0))[0]
                   for q in questions]
    assert answers == [o.outputs[0].text for o in offline]
    log = server.log(tail=None)
    assert "engine core 0 pid" in log and "engine core 1 pid" in log
    queries_before = engine_metric(server, "vllm:prefix_cache_queries_total")
    assert set(queries_before) == {"0", "1"} and all(queries_before.values())  # both engines took requests
    hits_before = engine_metric(server, "vllm:prefix_cache_hits_total")
    messages = [{"role": "user", "content": "Let us talk about foxes and their dens in the forest. " * 3}]
    for _ in range(4):
        reply = client.chat.completions.create(model=model, messages=messages, max_tokens=6, temperature=0)
        messages += [{"role": "assistant", "content": reply.choices[0].message.content},
                     {"role": "user", "content": "Go on, tell me more about that please."}]
    hits = engine_metric(server, "vllm:prefix_cache_hits_total")
    gained = {engine: hits[engine] - hits_before[engine] for engine in hits}
    assert sorted(gained.values())[0] == 0 and sorted(gained.values())[1] >= 3 * BLOCK, gained


def successes_by_engine(server) -> dict[tuple[str, str], float]:
    """``vllm:request_success_total`` per (engine, finished_reason); every sample must have both."""
    from prometheus_client.parser import text_string_to_metric_families

    return {(sample.labels["engine"], sample.labels["finished_reason"]): sample.value
            for family in text_string_to_metric_families(server.get("/metrics").text)
            for sample in family.samples if sample.name == "vllm:request_success_total"}


@pytest.mark.slow
def test_request_success_is_counted_per_engine(server):
    """vLLM labels it with the engine core (issue 45, item 5): each request counts under the
    engine that ran it, the one whose prefix-cache lookups grew."""
    client = server.client()
    model = client.models.list().data[0].id
    before, queries_before = successes_by_engine(server), engine_metric(server, "vllm:prefix_cache_queries_total")
    assert {engine for engine, _ in before} == {"0", "1"}
    assert {reason for _, reason in before} == {"stop", "length", "abort", "error"}  # there from the start
    for topic in ("owls", "Peru", "primes", "rivers"):
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": f"All about {topic}. " * 6}],
                                       max_tokens=4, temperature=0)
    after, queries = successes_by_engine(server), engine_metric(server, "vllm:prefix_cache_queries_total")
    gained = {engine: sum(after[engine, r] - before[engine, r] for r in ("stop", "length")) for engine in ("0", "1")}
    assert sum(gained.values()) == 4
    assert {e for e, n in gained.items() if n} == {e for e in queries if queries[e] > queries_before[e]}


@pytest.mark.slow
def test_a_dead_engine_core_fails_its_stream_and_the_service_exits_nonzero(server):
    engines = [server.pid_of(f"engine core {i}") for i in (0, 1)]
    stream = StreamInThread(server, {"model": server.client().models.list().data[0].id,
                                     "messages": [{"role": "user", "content": "Write a long poem."}],
                                     "max_tokens": 400, "min_tokens": 400, "temperature": 0})
    assert stream.first_chunk.wait(60) and stream.status == 200
    holder = {}
    wait_until(lambda: holder.update(engine_metric(server, "vllm:num_requests_running")) or 1.0 in holder.values(),
               what="an engine to report the stream running")
    os.kill(engines[int(next(e for e, running in holder.items() if running == 1.0))], signal.SIGKILL)
    stream.thread.join(30)
    server.process.wait(30)
    assert server.process.returncode == 1, server.log()
    assert "engine-core process died" in server.log(tail=None)
    errors = [json.loads(e)["error"] for e in stream.events if e != "[DONE]" and "error" in json.loads(e)]
    assert errors and errors[0]["code"] == 500, stream.events[-3:]

    wait_until_group_gone(server.process.pid)
    assert segments_of(server) == []
