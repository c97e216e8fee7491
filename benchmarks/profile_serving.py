"""Where a served decode step's time goes: every process of our service sampled under P6's load.

The engine-speed benchmark (bench_engine.py --profile) times the phases of ``EngineCore.step``
inside one process. A served step has more around it: the requests and outputs cross to and from
the engine-core process (msgpack over ZeroMQ), and the API process detokenises every output and
writes one SSE event per stream per token. This script measures all of it from the outside, with
no change to the code it measures:

1. starts our service on SmolLM2-135M-Instruct (fp32, one engine thread, one tokenizer worker,
   ``--max-num-seqs`` = ``--streams``), as bench_serving_overhead.py (P6) does;
2. sends ``--streams`` streaming chats at once, ``--tokens`` tokens each (greedy, ignore_eos), with
   bench_serving's client;
3. once every stream is decoding (``--record-after`` seconds), samples every process of the
   service for ``--duration`` seconds with py-spy (``--idle --threads --nonblocking``: wall-clock
   samples of every thread, idle ones included, without pausing the processes);
4. sorts each main-thread sample into a phase by the frames on its stack (``PHASES``, first match
   wins) and prints each process's shares of the wall time, and for the engine core the phases in
   milliseconds per decode step (share x the median TPOT, which at a steady batch is the step time).

The engine core and the API process run on different cores, so the API process's phases are not
part of the engine's step unless the engine waits for them (its ``idle`` share says how long it
waits for work). py-spy's sampling rate and its own cost (it reads the processes' memory from a
third process on this 2-core box) limit the resolution to a few per cent.

Needs py-spy (``pip install -e '.[bench]'`` or ``pip install py-spy==0.4.3``) and ptrace rights over
the service (root, or kernel.yama.ptrace_scope = 0).

    flock /tmp/atb-bench.lock python benchmarks/profile_serving.py [--streams 32] [--tokens 256]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

import bench_serving as serving  # sibling scripts: `python benchmarks/X.py` puts benchmarks/ on sys.path
from bench_serving_overhead import make_chats  # P6's prompts: the load this profile explains


@dataclass(frozen=True)
class Phase:
    """A phase of one process: a sample belongs to it when any frame on its stack contains one of
    ``markers`` (``function (file``, as py-spy prints a frame)."""

    role: str
    name: str
    markers: tuple[str, ...]


# Checked in this order; the first phase with a marker on the stack takes the sample.
PHASES = (
    Phase("engine", "sampler", ("engine/sampler.py",)),
    Phase("engine", "structured output (grammar mask)", ("engine/structured_output.py",)),
    Phase("engine", "prepare_inputs", ("engine/prepare_inputs.py", "engine/input_batch.py")),
    Phase("engine", "model forward + LM head", ("atb_plugin/models/", "atb_plugin/ops/")),
    Phase("engine", "runner bookkeeping", ("ModelRunner.execute (",)),
    Phase("engine", "scheduler (schedule + update)", ("engine/scheduler.py", "engine/kv_cache_manager.py",
                                                      "engine/block_pool.py")),
    Phase("engine", "IPC out: encode + send outputs", ("send_multipart (", "make_stats (",
                                                       "encode (atb_plugin/engine/messages.py")),
    Phase("engine", "IPC in: receive + decode requests", ("recv_multipart (", "decode_request (",
                                                          "EngineCore.add_request (", "EngineCore.abort (")),
    Phase("engine", "idle: waiting for work", ("Poller.poll (",)),
    Phase("api", "detokenise + output processing", ("AsyncLLM.on_outputs (", "frontend/output_processor.py",
                                                    "frontend/detokenizer.py")),
    Phase("api", "IPC in: receive + decode outputs", ("MPClient._read_outputs (",)),
    Phase("api", "request parse + admission", ("parse (atb_plugin/server/http.py", "admit (atb_plugin/server/http.py",
                                               "TokenizerPool.call (")),
    Phase("api", "response stream: chunks + SSE + HTTP writes", ("server/dialects.py", "sse (atb_plugin",
                                                                 "StreamingResponse", "h11_impl.py",
                                                                 "selector_events.py")),
    Phase("api", "idle: event loop waiting", ("EpollSelector.select (",)),
    Phase("worker", "render + tokenise + images", ("run_job (",)),
    Phase("worker", "idle: waiting for jobs", ("Poller.poll (", "Socket.poll (")),
)
ROLE_MARKERS = (("engine", "run_engine_core ("), ("worker", "run_tokenizer_worker ("),
                ("tracker", "resource_tracker"))
_PROCESS = re.compile(r"process (\d+):")


@dataclass(frozen=True)
class Sample:
    pid: int
    thread: str
    frames: tuple[str, ...]
    count: int


def parse_raw(text: str) -> list[Sample]:
    """py-spy's ``--format raw --threads --subprocesses`` lines: ``process A:"cmd";process B:"cmd";
    thread (TID): NAME;frame;frame COUNT``. A command line may hold ``;`` itself, so the process
    part is read up to the thread frame and the pid is the last ``process N:`` before it."""
    samples = []
    for line in text.splitlines():
        stack, _, count = line.rstrip().rpartition(" ")
        head, marker, rest = stack.partition(";thread (")
        if not marker or not count.isdigit():
            continue
        pids = _PROCESS.findall(head)
        thread_frame, _, frames = rest.partition(";")
        thread = thread_frame.partition("): ")[2]
        samples.append(Sample(int(pids[-1]), thread, tuple(frames.split(";")) if frames else (), int(count)))
    return samples


def role_of(samples_of_process: list[Sample]) -> str:
    """engine / worker / tracker / api: what the process's main thread ever ran."""
    for role, marker in ROLE_MARKERS:
        if any(marker in frame for sample in samples_of_process for frame in sample.frames):
            return role
    return "api"


def phase_of(role: str, frames: tuple[str, ...]) -> str:
    for phase in PHASES:
        if phase.role == role and any(marker in frame for frame in frames for marker in phase.markers):
            return phase.name
    return "other"


def breakdown(samples: list[Sample]) -> dict[str, dict]:
    """Per process (keyed ``role`` or ``role pid`` when a role repeats): main-thread samples and
    the share of each phase."""
    by_pid: dict[int, list[Sample]] = collections.defaultdict(list)
    for sample in samples:
        if sample.thread == "MainThread":
            by_pid[sample.pid].append(sample)
    roles = {pid: role_of(group) for pid, group in by_pid.items()}
    result = {}
    for pid, group in sorted(by_pid.items()):
        role = roles[pid]
        if role == "tracker":
            continue
        key = role if list(roles.values()).count(role) == 1 else f"{role} {pid}"
        counts: collections.Counter = collections.Counter()
        for sample in group:
            counts[phase_of(role, sample.frames)] += sample.count
        total = sum(counts.values())
        result[key] = {"pid": pid, "samples": total,
                       "shares": {name: n / total for name, n in counts.most_common()}}
    return result


def step_breakdown_ms(engine: dict, step_ms: float) -> dict[str, float]:
    """The engine core's phases in ms per step: shares of the wall time x the step time."""
    return {name: share * step_ms for name, share in engine["shares"].items()}


def non_forward_share(engine: dict) -> float:
    """Of the engine's busy time (idle left out), the share that is not the model's forward."""
    shares = engine["shares"]
    busy = 1.0 - shares.get("idle: waiting for work", 0.0)
    return (busy - shares.get("model forward + LM head", 0.0)) / busy if busy > 0 else 0.0


# -- the run ----------------------------------------------------------------------------------------


def py_spy() -> str:
    found = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(found).is_file():
        raise SystemExit("profile_serving: py-spy not found; pip install py-spy==0.4.3 (or pip install -e '.[bench]')")
    return found


def record(pid: int, seconds: float, rate: int, out: Path) -> subprocess.CompletedProcess:
    return subprocess.run([py_spy(), "record", "--pid", str(pid), "--subprocesses", "--idle", "--threads",
                           "--nonblocking", "--rate", str(rate), "--duration", str(int(seconds)),
                           "--format", "raw", "--output", str(out)], capture_output=True, text=True)


async def load(base_url: str, streams: int, tokens: int) -> dict:
    bodies = [{"model": "m", "messages": chat, "max_tokens": tokens, "temperature": 0, "ignore_eos": True,
               "stream": True, "stream_options": {"include_usage": True}} for chat in make_chats(streams)]
    limits = httpx.Limits(max_connections=streams + 4, max_keepalive_connections=streams + 4)
    async with httpx.AsyncClient(base_url=base_url, timeout=900, limits=limits) as client:
        start = serving.clock()
        records = await asyncio.gather(*(serving.send_request(client, "/v1/chat/completions", body, 900, 0)
                                         for body in bodies))
        return serving.aggregate(records, serving.clock() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--record-after", type=float, default=8.0, help="seconds into the load")
    parser.add_argument("--duration", type=float, default=25.0, help="seconds sampled")
    parser.add_argument("--rate", type=int, default=100, help="py-spy samples per second")
    parser.add_argument("--model", help="checkpoint directory (default: SmolLM2-135M-Instruct)")
    args = parser.parse_args()
    py_spy()
    if args.model is None:
        from atb_plugin.default_model import default_model_dir
        args.model = str(default_model_dir())
    port = serving.free_port()
    command = [sys.executable, "-m", "atb_plugin.server", "--model", args.model, "--port", str(port),
               "--served-model-name", "m", "--num-threads", "1", "--tokenizer-workers", "1",
               "--max-num-seqs", str(args.streams)]
    out = Path(tempfile.mkdtemp(prefix="profile-serving-")) / "py-spy.raw"
    with serving.ManagedServer(command, port, out.with_name("server.log"), ready_timeout=600, stop_timeout=30,
                               env=serving.our_server_env()) as server:
        asyncio.run(load(server.base_url, 2, 4))  # warm-up
        spy: dict = {}

        def sample_later():
            time.sleep(args.record_after)
            spy["done"] = record(server.process.pid, args.duration, args.rate, out)

        sampler = threading.Thread(target=sample_later)
        sampler.start()
        result = asyncio.run(load(server.base_url, args.streams, args.tokens))
        sampler.join()
    done = spy["done"]
    if done.returncode != 0 or not out.is_file():
        raise SystemExit(f"py-spy failed ({done.returncode}): {done.stderr[-2000:]}")
    processes = breakdown(parse_raw(out.read_text()))
    step_ms = result["tpot_ms"]["median"]
    print(f"{args.streams} streams x {args.tokens} tokens: {result['output_throughput']:.1f} tok/s, "
          f"TPOT p50 {step_ms:.1f} ms (= the step), {result['failed']} failed; "
          f"sampled {args.duration:.0f} s at {args.rate} Hz from {args.record_after:.0f} s in; raw: {out}")
    for key, info in processes.items():
        print(f"\n{key} (pid {info['pid']}, {info['samples']} main-thread samples): share of wall time"
              + (", ms per step" if key == "engine" else ""))
        for name, share in info["shares"].items():
            ms = f"  {share * step_ms:7.1f} ms" if key == "engine" else ""
            print(f"  {name:<46} {share:6.1%}{ms}")
    engine = processes.get("engine")
    summary = {"streams": args.streams, "tokens": args.tokens, "output_tok_s": result["output_throughput"],
               "tpot_p50_ms": step_ms, "failed": result["failed"], "processes": processes, "raw": str(out)}
    if engine:
        summary["engine_step_ms"] = step_breakdown_ms(engine, step_ms)
        summary["engine_non_forward_share_of_busy"] = non_forward_share(engine)
        print(f"\nengine core: {summary['engine_non_forward_share_of_busy']:.1%} of its busy time is outside "
              "the model's forward (the issue's threshold for a fix: 15 %)")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
