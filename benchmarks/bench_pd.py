"""Claims (issue 48, prefill/decode disaggregation), SmolLM2-135M-Instruct on this 2-core box:

1. Inter-token latency under long prompts: short streams (a ~40-token prompt, ``--tokens``
   greedy tokens each, all at once) decode while long prompts (~``--long-words`` words, 4 tokens
   each) arrive one every ``--long-every`` seconds. p99 of the short streams' inter-token gaps with
   PD (a producer and a consumer, ``--num-threads 1`` each, MooncakeConnector over TCP, ``atb-plugin
   proxy`` in front; both the short and the long requests go through the proxy) against one
   instance with ``--num-threads 2`` under the same load. Goal: PD p99 ITL <= 0.5x co-located.
2. Transfer bandwidth on loopback: ``MooncakeTransfer.read`` of ``--mib`` MiB from another
   process (one range; and the same bytes as 12 KiB ranges, one SmolLM2 layer's K or V block at
   block size 16, in one batch) against an in-process copy of the same bytes (``Tensor.copy_``).

The Transfer Engine binds every interface: the script re-runs itself inside a fresh network
namespace (``unshare -n``, loopback only; root, or a user namespace) unless ``--in-netns``.
Modes alternate for ``--rounds`` rounds (the box is shared and noisy); medians printed; the last
line is JSON.

    python benchmarks/bench_pd.py [--rounds 2] [--short 4] [--tokens 128] [--long 8] [--long-every 0.4]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_serving import ManagedServer, free_port, our_server_env, sigterm_as_exit  # noqa: E402

from atb_plugin.default_model import default_model_dir  # noqa: E402

WORDS = ("river mountain forest ocean desert valley meadow canyon glacier island harbor village castle "
         "garden library market bridge tower").split()
BLOCK_ENTRY_BYTES = 16 * 3 * 64 * 4  # SmolLM2-135M: block 16 x 3 KV heads x head_dim 64, fp32


def kv_flags(role: str) -> list[str]:
    config = {"kv_connector": "MooncakeConnector", "kv_role": role,
              "kv_connector_extra_config": {"side_channel_port": free_port()}}
    return ["--kv-transfer-config", json.dumps(config)]


def server(name: str, flags: list[str]) -> ManagedServer:
    port = free_port()
    command = [sys.executable, "-m", "atb_plugin.server", "--model", str(default_model_dir()), "--port", str(port),
               "--block-size", "16", "--max-model-len", "2048", *flags]
    log = Path(tempfile.gettempdir()) / f"bench-pd-{name}-{port}.log"
    return ManagedServer(command, port, log, 600.0, 30.0, env=our_server_env())


def proxy(prefill: str, decode: str) -> ManagedServer:
    port = free_port()
    command = [sys.executable, "-m", "atb_plugin.server", "proxy", "--prefill", prefill, "--decode", decode,
               "--port", str(port)]
    return ManagedServer(command, port, Path(tempfile.gettempdir()) / f"bench-pd-proxy-{port}.log", 60.0, 10.0,
                         env=our_server_env())


def stream_gaps(base_url: str, model: str, prompt: str, tokens: int) -> list[float]:
    """Seconds between consecutive streamed chunks of one completion (one token each)."""
    body = {"model": model, "prompt": prompt, "max_tokens": tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    times = []
    with httpx.stream("POST", base_url + "/v1/completions", json=body, timeout=600) as answer:
        answer.raise_for_status()
        for line in answer.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                times.append(time.perf_counter())
    return [b - a for a, b in zip(times, times[1:])]


def load(base_url: str, args, seed: int) -> list[float]:
    """The mixed load once: every short stream's inter-token gaps."""
    short = [f"Note {seed}-{i}. " + f"Describe the {WORDS[(seed + i) % len(WORDS)]} in a few sentences. " * 3
             for i in range(args.short)]
    # A distinct first word per prompt and load: no prefix-cache hit ever spares a prefill.
    long_prompts = [f"Note {seed}-{i}: " + " ".join(WORDS[(seed * 7 + i + j) % len(WORDS)]
                                                   for j in range(args.long_words)) for i in range(args.long)]
    gaps: list[float] = []
    lock = threading.Lock()
    model = httpx.get(base_url + "/v1/models", timeout=30).json()["data"][0]["id"]
    failures: list[BaseException] = []

    def run_short(prompt: str) -> None:
        try:
            found = stream_gaps(base_url, model, prompt, args.tokens)
        except BaseException as error:  # re-raised below, in the main thread
            failures.append(error)
            return
        with lock:
            gaps.extend(found)

    def run_long(prompt: str) -> None:
        try:
            httpx.post(base_url + "/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 4,
                                                           "temperature": 0}, timeout=600).raise_for_status()
        except BaseException as error:
            failures.append(error)

    threads = [threading.Thread(target=run_short, args=(p,)) for p in short]
    for thread in threads:
        thread.start()
    time.sleep(0.5)  # the short streams are decoding (and keep decoding while the long prompts arrive)
    longs = []
    for prompt in long_prompts:
        longs.append(threading.Thread(target=run_long, args=(prompt,)))
        longs[-1].start()
        time.sleep(args.long_every)
    for thread in threads + longs:
        thread.join()
    if failures:
        raise failures[0]
    return gaps


def p99(values: list[float]) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[98] if len(values) >= 2 else float("nan")


def run_mode(mode: str, args, seed: int) -> dict:
    if mode == "colocated":
        with server("colocated", ["--num-threads", "2"]) as one:
            load(one.base_url, args, seed + 1000)  # warm-up
            gaps = load(one.base_url, args, seed)
    else:
        with server("prefill", ["--num-threads", "1", *kv_flags("kv_producer")]) as prefill, \
                server("decode", ["--num-threads", "1", *kv_flags("kv_consumer")]) as decode, \
                proxy(prefill.base_url, decode.base_url) as front:
            load(front.base_url, args, seed + 1000)
            gaps = load(front.base_url, args, seed)
    return {"p99_itl_ms": 1000 * p99(gaps), "p50_itl_ms": 1000 * statistics.median(gaps),
            "max_itl_ms": 1000 * max(gaps), "gaps": len(gaps)}


# -- transfer bandwidth --------------------------------------------------------------------------

def _producer(nbytes: int, pipe) -> None:
    import torch

    from atb_plugin.engine.kv_transfer.mooncake.transfer import MooncakeTransfer

    transfer = MooncakeTransfer()
    buffer = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
    transfer.register_tensor(buffer)
    pipe.send((transfer.session, buffer.data_ptr()))
    pipe.recv()


def bandwidth(mib: int, reps: int) -> dict:
    import torch

    from atb_plugin.engine.kv_transfer.mooncake.transfer import MooncakeTransfer

    nbytes = mib << 20
    context = multiprocessing.get_context("spawn")
    ours, theirs = context.Pipe()
    child = context.Process(target=_producer, args=(nbytes, theirs), daemon=True)
    child.start()
    session, remote = ours.recv()
    transfer = MooncakeTransfer()
    local = torch.zeros(nbytes, dtype=torch.uint8)
    transfer.register_tensor(local)
    source = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
    entries = nbytes // BLOCK_ENTRY_BYTES
    offsets = [i * BLOCK_ENTRY_BYTES for i in range(entries)]
    timings = {"one_range": [], "block_ranges": [], "memcpy": []}
    for _ in range(reps + 1):  # the first round warms up
        started = time.perf_counter()
        transfer.read(session, [local.data_ptr()], [remote], [nbytes])
        timings["one_range"].append(time.perf_counter() - started)
        started = time.perf_counter()
        transfer.read(session, [local.data_ptr() + o for o in offsets], [remote + o for o in offsets],
                      [BLOCK_ENTRY_BYTES] * entries)
        timings["block_ranges"].append(time.perf_counter() - started)
        started = time.perf_counter()
        local.copy_(source)
        timings["memcpy"].append(time.perf_counter() - started)
    ours.send("done")
    child.join(10)
    transfer.close()
    result = {"mib": mib, "block_entry_bytes": BLOCK_ENTRY_BYTES}
    for name, values in timings.items():
        seconds = statistics.median(values[1:])
        result[f"{name}_ms"] = 1000 * seconds
        result[f"{name}_gb_s"] = nbytes / seconds / 1e9
    return result


def in_netns(argv: list[str]) -> int:
    if shutil.which("unshare") is None or shutil.which("ip") is None:
        sys.exit("bench_pd.py needs unshare and ip (a network namespace: the Transfer Engine binds every interface)")
    prefix = ["unshare", "-n"] if os.geteuid() == 0 else ["unshare", "-rn"]
    command = [*prefix, "sh", "-c", 'ip link set lo up && exec "$0" "$@"', sys.executable,
               str(Path(__file__).resolve()), "--in-netns", *argv]
    return subprocess.call(command)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--short", type=int, default=4, help="short streams")
    parser.add_argument("--tokens", type=int, default=128, help="tokens per short stream")
    parser.add_argument("--long", type=int, default=8, help="long prompts per load")
    parser.add_argument("--long-words", type=int, default=900)
    parser.add_argument("--long-every", type=float, default=0.4, help="seconds between long prompts")
    parser.add_argument("--mib", type=int, default=64)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--in-netns", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if not args.in_netns:
        sys.exit(in_netns(sys.argv[1:]))
    default_model_dir()  # fetched once, before any server starts
    report: dict = {"bandwidth": bandwidth(args.mib, args.reps)}
    bw = report["bandwidth"]
    print(f"transfer {args.mib} MiB: one range {bw['one_range_gb_s']:.2f} GB/s, "
          f"{BLOCK_ENTRY_BYTES // 1024} KiB ranges {bw['block_ranges_gb_s']:.2f} GB/s, "
          f"memcpy {bw['memcpy_gb_s']:.2f} GB/s", flush=True)
    rounds = {"colocated": [], "pd": []}
    with sigterm_as_exit():
        for index in range(args.rounds):
            for mode in (("colocated", "pd") if index % 2 == 0 else ("pd", "colocated")):
                result = run_mode(mode, args, seed=index)
                rounds[mode].append(result)
                print(f"round {index + 1} {mode}: p99 ITL {result['p99_itl_ms']:.1f} ms, p50 "
                      f"{result['p50_itl_ms']:.1f} ms, max {result['max_itl_ms']:.1f} ms ({result['gaps']} gaps)",
                      flush=True)
    report["rounds"] = rounds
    medians = {mode: statistics.median(r["p99_itl_ms"] for r in results) for mode, results in rounds.items()}
    report["median_p99_itl_ms"] = medians
    report["pd_over_colocated"] = medians["pd"] / medians["colocated"]
    print(f"median p99 ITL: co-located {medians['colocated']:.1f} ms, PD {medians['pd']:.1f} ms, "
          f"PD / co-located {report['pd_over_colocated']:.2f} (goal <= 0.5)")
    print(json.dumps(report))


if __name__ == "__main__":
    main()
