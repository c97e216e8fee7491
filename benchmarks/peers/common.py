"""Helpers shared by the peer benchmark scripts.

Standard library only: this module is imported by the orchestrator (our venv) and by each peer's
runner inside that peer's own venv, where neither torch nor atb_plugin is installed.

The contract between the orchestrator and a runner:

* the orchestrator writes a prompts file (``write_prompts``): the token ids of bench_engine's
  ``chats()`` rendered by OUR tokenizer and chat template, so every engine prefills the very same
  ids;
* a runner measures one single stream and one batch, then prints ONE JSON object as its last
  stdout line (``emit``); everything else it prints is diagnostics;
* a runner that cannot run its engine (not installed, refuses this CPU, ...) still prints that
  line, with ``available: false`` and the reason (``unavailable``), and exits with
  ``EXIT_UNAVAILABLE`` so that nothing is mistaken for a measurement.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Callable

BENCHMARKS_DIR = Path(__file__).resolve().parents[1]
BENCH_ENGINE = BENCHMARKS_DIR / "bench_engine.py"

EXIT_UNAVAILABLE = 3  # the runner ran, but its engine cannot: not a crash, not a result

clock = time.perf_counter  # one clock for every engine: monotonic, highest resolution


F32_GGUF_NAME = "SmolLM2-135M-Instruct-F32.gguf"  # setup.sh converts it into peers_dir()/models
TCMALLOC = Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4")  # Debian's libtcmalloc-minimal4


def vllm_preloads(venv_prefix: Path) -> list[Path]:
    """What vLLM's CPU guide asks to LD_PRELOAD, of what is installed: tcmalloc and the Intel
    OpenMP runtime that the vLLM venv carries (the intel-openmp wheel)."""
    return [path for path in (TCMALLOC, venv_prefix / "lib" / "libiomp5.so") if path.is_file()]


def peers_dir() -> Path:
    """Where setup.sh puts the peers' venvs, sources and converted models (outside the repo)."""
    default = Path.home() / ".cache" / "atb-plugin" / "peers"
    return Path(os.environ.get("ATB_PEERS_DIR") or default)


# -- prompts ------------------------------------------------------------------------------------------


def bench_chats(count: int) -> list[list[dict]]:
    """bench_engine.py's ``chats(count)``, taken from that file rather than copied.

    bench_engine imports torch and atb_plugin at module level, which the peers' venvs lack, so it
    cannot be imported there. Instead the ``TOPICS`` assignment and the ``chats`` function are cut
    out of its syntax tree and executed alone: if someone changes the prompts there, every engine
    here follows, and no second copy of the list can drift."""
    tree = ast.parse(BENCH_ENGINE.read_text(), filename=str(BENCH_ENGINE))
    wanted = [node for node in tree.body
              if (isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "TOPICS" for t in node.targets))
              or (isinstance(node, ast.FunctionDef) and node.name == "chats")]
    if len(wanted) != 2:
        raise RuntimeError(f"{BENCH_ENGINE} no longer defines TOPICS and chats() at module level")
    namespace: dict = {}
    exec(compile(ast.Module(body=wanted, type_ignores=[]), str(BENCH_ENGINE), "exec"), namespace)
    return namespace["chats"](count)


def write_prompts(path: Path, single: list[int], batch: list[list[int]], source: str) -> None:
    path.write_text(json.dumps({"source": source, "single": single, "batch": batch}))


def load_prompts(path: str | os.PathLike[str], batch: int) -> tuple[list[int], list[list[int]], str]:
    """(single-stream ids, ``batch`` prompts' ids, where they came from) from a prompts file."""
    data = json.loads(Path(path).read_text())
    if len(data["batch"]) < batch:
        raise ValueError(f"{path} holds {len(data['batch'])} batch prompts, --batch asks for {batch}")
    return list(data["single"]), [list(p) for p in data["batch"][:batch]], data.get("source", str(path))


# -- runner plumbing ----------------------------------------------------------------------------------


def runner_parser(description: str) -> argparse.ArgumentParser:
    """The options every runner takes, with bench_engine's defaults."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--tokens", type=int, default=128, help="new tokens per stream (EOS ignored)")
    parser.add_argument("--batch", type=int, default=32, help="prompts in the batch mode")
    parser.add_argument("--threads", type=int, default=1, help="compute threads for the engine")
    parser.add_argument("--prompts", default=None,
                        help="JSON file of prompt token ids (run_peers.py writes it with our tokenizer); "
                             "without it the engine renders bench_engine's chats with its own chat template")
    parser.add_argument("--warmup-tokens", type=int, default=4,
                        help="tokens of the untimed warm-up generation (bench_engine uses 4)")
    return parser


def decode_rate(tokens: int, first_at: float, end: float) -> float:
    """Decode tok/s as bench_engine counts it: the tokens after the first over the time after it."""
    return (tokens - 1) / max(end - first_at, 1e-9)


def measurement(*, version: str, model: str, config: str, prompt_source: str, ttft_s: float,
                single_tok_s: float, batch_tok_s: float, single_tokens: list[int],
                batch_tokens: list[list[int]], **extra) -> dict:
    """One runner's result, in the fields run_peers reads (``extra``: engine-specific facts)."""
    return {"version": version, "model": model, "config": config, **extra, "prompt_source": prompt_source,
            "single_ttft_ms": ttft_s * 1e3, "single_tok_s": single_tok_s, "batch_tok_s": batch_tok_s,
            "single_tokens": single_tokens, "batch_tokens": batch_tokens}


def emit(result: dict) -> None:
    """Print the result as the last stdout line (the orchestrator reads only that line)."""
    sys.stdout.flush()
    print(json.dumps(result), flush=True)


def unavailable(engine: str, reason: str, **extra) -> None:
    """Report that the engine cannot run here, with the exact reason, and exit without a result."""
    emit({"engine": engine, "available": False, "reason": reason, **extra})
    sys.exit(EXIT_UNAVAILABLE)


def run_guarded(engine: str, main: Callable[[], dict]) -> None:
    """Run a runner's ``main`` and emit its result; a failure becomes an ``error`` result line (with
    the traceback on stderr) so the orchestrator always has one JSON line to read."""
    try:
        result = main()
    except SystemExit:
        raise
    except BaseException as error:  # noqa: BLE001 - reported, not swallowed
        traceback.print_exc()
        emit({"engine": engine, "available": True, "error": f"{type(error).__name__}: {error}"})
        sys.exit(1)
    emit({"engine": engine, "available": True, **result})


def last_json_line(text: str) -> dict | None:
    """The last line of ``text`` that parses as a JSON object (a runner's result), else None."""
    for line in reversed(text.strip().splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                value = json.loads(line)
            except ValueError:
                continue
            if isinstance(value, dict):
                return value
    return None
