"""Claims (issue 36, data parallelism), SmolLM2-135M-Instruct fp32 on this 2-core box:

1. Throughput: ``--data-parallel-size 2 --num-threads 1`` (two engine cores, one core each)
   against ``--data-parallel-size 1 --num-threads 2`` (one engine, two threads), 32 streams x 128
   tokens through ``bench_serving.py``; goal >= 1.3x output tok/s.
2. Routing: on a multi-turn chat workload (16 conversations x 4 turns, each conversation's next
   turn sent when its answer is in, all conversations at once), ``--data-parallel-routing
   cache-aware`` against ``round-robin`` at DP = 2: prefix-cache hit rate (hits / queries from
   ``vllm:prefix_cache_*``, summed over the engines) and mean TTFT side by side; goal: hit rate
   >= 1.5x round-robin's.

Each side is a fresh server started by ``bench_serving.ManagedServer``; sides alternate for
``--rounds`` rounds (this box is shared and noisy); medians printed. Kernels as bench_tp.py
chooses them: the engine's default on an AVX-512 CPU, ``ATB_PLUGIN_CPU_KERNELS=torch`` elsewhere
(the native linear kernel is slow on AVX2-only CPUs; bench_tp.py's docstring). Last line: JSON.

    python benchmarks/bench_dp.py [--rounds 2] [--streams 32] [--tokens 128] [--conversations 16] [--turns 4]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_serving import REPO_ROOT, ManagedServer, free_port, our_server_env, sigterm_as_exit  # noqa: E402
from bench_tp import has_avx512  # noqa: E402

from atb_plugin.default_model import default_model_dir  # noqa: E402

WORDS = ("river mountain forest ocean desert valley meadow canyon glacier island harbor village castle "
         "garden library market bridge tower").split()


def server(flags: list[str]) -> ManagedServer:
    port = free_port()
    command = [sys.executable, "-m", "atb_plugin.server", "--model", str(default_model_dir()), "--port", str(port),
               "--block-size", "16", *flags]
    log = Path(tempfile.gettempdir()) / f"bench-dp-{port}.log"
    return ManagedServer(command, port, log, 600.0, 30.0, env=our_server_env())


def throughput(flags: list[str], streams: int, tokens: int) -> float:
    """Output tok/s of ``streams`` concurrent streams through bench_serving.py."""
    out = subprocess.run([sys.executable, str(REPO_ROOT / "benchmarks" / "bench_serving.py"), "--start-server",
                          "--server-args", f"--model {default_model_dir()} " + " ".join(flags),
                          "--num-prompts", str(streams), "--concurrency", str(streams), "--warmup", "2",
                          "--input-len", "64", "--output-len", str(tokens), "--ignore-eos", "--temperature", "0"],
                         capture_output=True, text=True, check=True, env=our_server_env())
    return json.loads(out.stdout.strip().splitlines()[-1])["output_throughput"]


def _summed(text: str, name: str) -> float:
    return sum(float(v) for v in re.findall(rf"^{re.escape(name)}{{[^}}]*}} (\S+)$", text, re.M))


def multiturn(routing: str, conversations: int, turns: int) -> dict:
    """Hit rate and mean TTFT of the multi-turn workload on a DP = 2 server routing by ``routing``."""
    with server(["--data-parallel-size", "2", "--num-threads", "1", "--data-parallel-routing", routing]) as srv:
        url = srv.base_url + "/v1/chat/completions"
        before = httpx.get(srv.base_url + "/metrics").text
        ttfts: list[float] = []
        lock = threading.Lock()

        def talk(seed: int) -> None:
            topic = " ".join(WORDS[(seed + i) % len(WORDS)] for i in range(12))
            messages = [{"role": "user", "content": f"Conversation {seed}: let us talk about {topic}. " * 4}]
            with httpx.Client(timeout=600) as client:
                for turn in range(turns):
                    start = time.perf_counter()
                    first, text = None, []
                    body = {"model": "SmolLM2-135M-Instruct", "messages": messages, "max_tokens": 24,
                            "temperature": 0, "stream": True}
                    with client.stream("POST", url, json=body) as response:
                        for line in response.iter_lines():
                            if not line.startswith("data: ") or line == "data: [DONE]":
                                continue
                            delta = json.loads(line[6:])["choices"]
                            if delta and delta[0]["delta"].get("content"):
                                first = first or time.perf_counter()
                                text.append(delta[0]["delta"]["content"])
                    with lock:
                        ttfts.append((first or time.perf_counter()) - start)
                    messages += [{"role": "assistant", "content": "".join(text)},
                                 {"role": "user", "content": f"Turn {turn + 1}: tell me more about it."}]

        threads = [threading.Thread(target=talk, args=(seed,)) for seed in range(conversations)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        time.sleep(0.5)  # the last steps' stats
        after = httpx.get(srv.base_url + "/metrics").text
    queries = _summed(after, "vllm:prefix_cache_queries_total") - _summed(before, "vllm:prefix_cache_queries_total")
    hits = _summed(after, "vllm:prefix_cache_hits_total") - _summed(before, "vllm:prefix_cache_hits_total")
    return {"hit_rate": hits / queries if queries else 0.0, "mean_ttft_ms": 1e3 * statistics.fmean(ttfts),
            "requests": len(ttfts)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--conversations", type=int, default=16)
    parser.add_argument("--turns", type=int, default=4)
    args = parser.parse_args()
    os.environ["ATB_PLUGIN_CPU_KERNELS"] = "auto" if has_avx512() else "torch"  # inherited by the servers
    print(f"kernels {os.environ['ATB_PLUGIN_CPU_KERNELS']}", flush=True)
    sides = {"DP=1 2 threads": ["--data-parallel-size", "1", "--num-threads", "2"],
             "DP=2 1 thread each": ["--data-parallel-size", "2", "--num-threads", "1"]}
    tok_s: dict[str, list[float]] = {side: [] for side in sides}
    routing: dict[str, list[dict]] = {"cache-aware": [], "round-robin": []}
    for round_ in range(args.rounds):
        order = list(sides) if round_ % 2 == 0 else list(reversed(sides))
        for side in order:
            tok_s[side].append(throughput(sides[side], args.streams, args.tokens))
            print(f"round {round_} {side:>20}: {tok_s[side][-1]:.1f} output tok/s", flush=True)
        for name in (list(routing) if round_ % 2 == 0 else list(reversed(routing))):
            routing[name].append(multiturn(name, args.conversations, args.turns))
            r = routing[name][-1]
            print(f"round {round_} {name:>20}: hit rate {r['hit_rate']:.3f}, mean TTFT {r['mean_ttft_ms']:.0f} ms "
                  f"({r['requests']} requests)", flush=True)
    med = {side: statistics.median(v) for side, v in tok_s.items()}
    ratio = med["DP=2 1 thread each"] / med["DP=1 2 threads"]
    summary = {name: {key: statistics.median(r[key] for r in runs) for key in ("hit_rate", "mean_ttft_ms")}
               for name, runs in routing.items()}
    hit_ratio = summary["cache-aware"]["hit_rate"] / max(summary["round-robin"]["hit_rate"], 1e-9)
    print(f"\n{args.streams} x {args.tokens}: DP=2 / DP=1 {ratio:.2f}x (goal >= 1.3x: {'met' if ratio >= 1.3 else 'MISSED'})")
    for name, s in summary.items():
        print(f"{name:>12}: hit rate {s['hit_rate']:.3f}, mean TTFT {s['mean_ttft_ms']:.0f} ms")
    print(f"hit rate cache-aware / round-robin {hit_ratio:.2f}x (goal >= 1.5x: {'met' if hit_ratio >= 1.5 else 'MISSED'})")
    print(json.dumps({"tok_s": tok_s, "throughput_ratio": ratio, "routing": routing, "routing_medians": summary,
                      "hit_rate_ratio": hit_ratio}))


if __name__ == "__main__":
    with sigterm_as_exit():  # a terminated benchmark still stops the server it started
        main()
