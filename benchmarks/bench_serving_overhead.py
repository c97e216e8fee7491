"""Claim P6 (serving overhead): 32 concurrent streaming chat requests x 128 tokens over HTTP reach
>= 0.85x the output tok/s of the offline ``LLM.chat`` on the same prompts, measured in the same
run (SmolLM2-135M-Instruct fp32, CPU, one engine thread on both sides, ignore_eos, greedy).

The server is ours, started here (``--num-threads 1 --tokenizer-workers 1 --max-num-seqs 32``):
what HTTP costs on top of the engine step is the API process (parsing, detokenising, one SSE
event per token per stream), the IPC to the engine-core process and the client reading 4096
events; the offline side runs the same engine in this process with no frontend. Rounds
alternate offline / served; the ratio is of the medians. The client is bench_serving.py's
(httpx, SSE parsed by hand), so the served side's tok/s is bench_serving's output throughput.

    python benchmarks/bench_serving_overhead.py [--prompts 32] [--tokens 128] [--runs 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

import httpx

from atb_plugin import LLM, SamplingParams
from atb_plugin.default_model import default_model_dir

import bench_serving as serving  # a sibling script: `python benchmarks/X.py` puts benchmarks/ on sys.path

TOPICS = ["the ocean", "a red bicycle", "mountains in winter", "how bread is made", "the history of maps",
          "a quiet library", "bees and flowers", "the moon landing"]


def make_chats(count: int) -> list[list[dict]]:
    return [[{"role": "user", "content": f"Write a short story about {TOPICS[i % len(TOPICS)]} (number {i})."}]
            for i in range(count)]


async def served_round(base_url: str, chats, tokens: int) -> dict:
    """Every chat at once (32 streams), bench_serving's client and arithmetic."""
    bodies = [{"model": "m", "messages": chat, "max_tokens": tokens, "temperature": 0, "ignore_eos": True,
               "stream": True, "stream_options": {"include_usage": True}} for chat in chats]
    limits = httpx.Limits(max_connections=len(bodies) + 4, max_keepalive_connections=len(bodies) + 4)
    async with httpx.AsyncClient(base_url=base_url, timeout=600, limits=limits) as client:
        start = serving.clock()
        records = await asyncio.gather(*(serving.send_request(client, "/v1/chat/completions", body, 600, 0)
                                         for body in bodies))
        duration = serving.clock() - start
    return serving.aggregate(records, duration)


def offline_round(llm: LLM, chats, tokens: int) -> float:
    start = time.perf_counter()
    outputs = llm.chat(chats, SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True))
    return sum(len(o.outputs[0].token_ids) for o in outputs) / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    chats = make_chats(args.prompts)
    model = str(default_model_dir())
    port = serving.free_port()
    command = [sys.executable, "-m", "atb_plugin.server", "--model", model, "--port", str(port),
               "--served-model-name", "m", "--num-threads", "1", "--tokenizer-workers", "1",
               "--max-num-seqs", str(args.prompts)]
    log = Path(f"/tmp/bench-serving-overhead-{port}.log")
    offline, served, results = [], [], []
    with serving.ManagedServer(command, port, log, ready_timeout=600, stop_timeout=30,
                               env=serving.our_server_env()) as server, \
            LLM(model, max_num_seqs=args.prompts, max_num_batched_tokens=2048, num_threads=1) as llm:
        asyncio.run(served_round(server.base_url, chats[:2], 4))  # warm-up both sides
        llm.chat(chats[:2], SamplingParams(temperature=0, max_tokens=4))
        for run in range(args.runs):
            offline.append(offline_round(llm, chats, args.tokens))
            result = asyncio.run(served_round(server.base_url, chats, args.tokens))
            results.append(result)
            served.append(result["output_throughput"])
            print(f"run {run + 1}: offline {offline[-1]:.1f} tok/s, served {served[-1]:.1f} tok/s "
                  f"(ratio {served[-1] / offline[-1]:.2f}); TTFT p50 {result['ttft_ms']['median']:.0f} ms, "
                  f"TPOT p50 {result['tpot_ms']['median']:.1f} ms, failed {result['failed']}", flush=True)
        description = server.describe()
    ratio = statistics.median(served) / statistics.median(offline)
    print(f"median: offline {statistics.median(offline):.1f} tok/s, served {statistics.median(served):.1f} tok/s, "
          f"ratio {ratio:.2f} (goal >= 0.85)")
    print(json.dumps({"offline_tok_s": round(statistics.median(offline), 2),
                      "served_tok_s": round(statistics.median(served), 2), "ratio": round(ratio, 3),
                      "ttft_p50_ms": results[-1]["ttft_ms"]["median"], "tpot_p50_ms": results[-1]["tpot_ms"]["median"],
                      "failed": sum(r["failed"] for r in results), "prompts": args.prompts, "tokens": args.tokens,
                      "runs": args.runs, "server_command": description["command"]}))


if __name__ == "__main__":
    main()
