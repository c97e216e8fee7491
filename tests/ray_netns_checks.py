"""The Ray checks of tests/test_ray_executor.py, run inside a network namespace that has only a
loopback interface (the test starts ``unshare -n`` and raises ``lo``): Ray advertises the host's
own address by default, and no test may send traffic outside 127.0.0.0/8; in the namespace
every Ray component can only bind and reach 127.0.0.1.

    python -m tests.ray_netns_checks OUT.json

A local Ray cluster of two logical nodes (``ray.cluster_utils.Cluster``: a head and one worker
node, one CPU each, so the two ranks' bundles land on different nodes), then:

1. ``LLM(tensor_parallel_size=2, distributed_executor_backend="ray")`` on the tiny qwen2 and
   qwen2_vl checkpoints against ``LLM(tensor_parallel_size=1)``: greedy tokens of text prompts
   and of an image chat sent twice (the second from the prefix cache). Rank 1 sits on the worker
   node: its collectives cross nodes over gloo and it gets the image through the step (the
   "remote" media path), not from shared memory.
2. The service with ``--distributed-executor-backend ray``: while streams are in flight, the
   rank actor on the worker node is SIGKILLed; the streams must fail and the service exit
   non-zero, leaving no rank actor behind.

Everything observed goes to OUT.json (tracebacks included), for the test to assert on.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import sys
import threading
import time
import traceback
from pathlib import Path

PROMPTS = ["The capital of France is", "Count: one, two, three,", "Write a haiku about rain."]
GREEDY = dict(temperature=0.0, max_tokens=12, ignore_eos=True)


def image_chat() -> list[dict]:
    from tests.server_helpers import data_url

    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(seed=3)}},
                                         {"type": "text", "text": "What is in this picture?"}]}]


def rank_actor_pids() -> list[int]:
    """Live processes of rank actors (Ray titles an actor's process ``ray::RankActor...``)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if command.startswith("ray::RankActor") and state != "Z":
            found.append(int(entry.name))
    return found


def answers(family: str, **arguments) -> dict:
    from atb_plugin import LLM, SamplingParams
    from atb_plugin.testing.tiny import tiny_checkpoint

    params = SamplingParams(**GREEDY)
    with LLM(tiny_checkpoint(family), block_size=16, kv_cache_blocks=48, **arguments) as llm:
        executor = llm.engine.client.core.executor
        result = {"text": [output.outputs[0].token_ids for output in llm.generate(PROMPTS, params)]}
        if family == "qwen2_vl":
            result["image"] = [llm.chat(image_chat(), params)[0].outputs[0].token_ids for _ in range(2)]
        result["remote_ranks"] = list(getattr(executor, "remote_ranks", []))
        result["actors_while_open"] = len(rank_actor_pids())
    result["actors_after_close"] = len(rank_actor_pids())
    return result


def llm_checks() -> dict:
    out = {}
    for family in ("qwen2", "qwen2_vl"):
        out[family] = {"tp1": answers(family),
                       "ray": answers(family, tensor_parallel_size=2, distributed_executor_backend="ray")}
    return out


def kill_check() -> dict:
    from atb_plugin.testing.tiny import tiny_checkpoint
    from tests.server_helpers import ServerProcess

    out: dict = {}
    server = ServerProcess(tiny_checkpoint("qwen2"), "-tp", "2", "--distributed-executor-backend", "ray",
                           start_timeout=300)
    try:
        pids = {int(rank): int(pid) for rank, pid in re.findall(r"ray rank (\d+): pid (\d+)", server.log(tail=None))}
        out["rank_pids"] = pids
        client = server.client()
        first_chunk = threading.Event()
        errors: list[str] = []

        def stream(index: int) -> None:
            try:
                chunks = client.chat.completions.create(
                    model=client.models.list().data[0].id, stream=True, max_tokens=400,
                    messages=[{"role": "user", "content": f"story {index}"}], extra_body={"ignore_eos": True})
                for chunk in chunks:
                    first_chunk.set()
                    if chunk.choices and chunk.choices[0].finish_reason is not None:
                        errors.append(f"finished: {chunk.choices[0].finish_reason}")
                        return
                errors.append("the stream ended without a finish reason")
            except Exception as error:  # noqa: BLE001 - recorded: the test expects the streams to fail
                errors.append(f"raised {type(error).__name__}: {error}")
            finally:
                first_chunk.set()

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(2)]
        for thread in threads:
            thread.start()
        out["in_flight"] = first_chunk.wait(120)
        os.kill(pids[1], signal.SIGKILL)
        out["killed"] = pids[1]
        for thread in threads:
            thread.join(120)
        out["streams"] = errors
        try:
            out["exit_code"] = server.process.wait(120)
        except Exception:  # noqa: BLE001
            out["exit_code"] = None
        deadline = time.monotonic() + 30
        while rank_actor_pids() and time.monotonic() < deadline:
            time.sleep(0.5)
        out["actors_left"] = rank_actor_pids()
        out["log_tail"] = server.log(tail=3000)
        out["rank_failed"] = re.findall(r"tensor-parallel rank \d+ \(a Ray actor\)[^\n]{0,200}", server.log(tail=None))
    finally:
        server.stop()
    return out


def main(out_path: str) -> None:
    from ray.cluster_utils import Cluster

    results: dict = {"interfaces": sorted(name for _, name in socket.if_nameindex())}  # this namespace's
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    try:
        cluster.add_node(num_cpus=1)
        cluster.wait_for_nodes()
        os.environ["RAY_ADDRESS"] = cluster.address
        results["ray_address"] = cluster.address
        for name, check in (("llm", llm_checks), ("kill", kill_check)):
            try:
                results[name] = check()
            except Exception:  # noqa: BLE001 - the test shows it
                results[name] = {"error": traceback.format_exc()}
    finally:
        cluster.shutdown()
    Path(out_path).write_text(json.dumps(results))


if __name__ == "__main__":
    main(sys.argv[1])
