"""Claim (issue 34, "Low precision"): a CPU decode step, which streams every weight from DRAM
once, runs faster when the weights sit in transparent huge pages (``atb_plugin/ops/huge_pages.py``)
than in the 4 KiB pages torch's allocator gives them.

The same model is loaded twice in one process, once with ``ATB_PLUGIN_HUGE_PAGES=off`` (the
baseline) and once with the default; --runs rounds alternate them (order swapped each round), one
torch thread, single-stream greedy decode (bench_engine's ``ours_single``), medians and the
ratio. The process's AnonHugePages (``/proc/self/smaps_rollup``) shows the huge pages were given.

    python benchmarks/bench_huge_pages.py [--precision w8a8+head] [--runs 5] [--tokens 64]

--precision as bench_precision.py spells it (fp32, bf16, w8a8, w8a8+head, ...).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_engine import chats, ours_single  # noqa: E402
from bench_precision import load  # noqa: E402

from atb_plugin.default_model import default_model_dir  # noqa: E402
from atb_plugin.ops.huge_pages import HUGE_PAGES_ENV, thp_mode  # noqa: E402


def anon_huge_mib() -> float:
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
        if line.startswith("AnonHugePages:"):
            return int(line.split()[1]) / 1024
    return 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--precision", default="w8a8+head")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()
    args.batch = 0
    torch.set_num_threads(1)
    llms = {}
    for side, choice in (("4 KiB pages", "off"), ("huge pages", "auto")):
        os.environ[HUGE_PAGES_ENV] = choice
        llms[side] = load(default_model_dir(), args.precision, args)
        print(f"{side}: loaded; the process's AnonHugePages now {anon_huge_mib():.0f} MiB", flush=True)
    os.environ.pop(HUGE_PAGES_ENV)
    try:
        prompt = next(iter(llms.values())).router.input_builder.make_context(0, chats(1)[0])
        rates = {side: [] for side in llms}
        for llm in llms.values():
            ours_single(llm, prompt, 4)  # warm-up
        for run in range(args.runs):
            for side in (list(llms) if run % 2 == 0 else list(llms)[::-1]):
                rates[side].append(ours_single(llms[side], prompt, args.tokens)[1])
    finally:
        for llm in llms.values():
            llm.close()
    medians = {side: statistics.median(r) for side, r in rates.items()}
    for side, r in rates.items():
        print(f"{side}: {medians[side]:.1f} tok/s (runs {[round(x, 1) for x in r]})", flush=True)
    ratio = medians["huge pages"] / medians["4 KiB pages"]
    print(f"SmolLM2 {args.precision}, single stream: huge pages / 4 KiB pages = {ratio:.2f}x (THP {thp_mode()})")
    print(json.dumps({"precision": args.precision, "runs": args.runs, "tokens": args.tokens, "thp": thp_mode(),
                      "tok_s": medians, "ratio": round(ratio, 3)}))


if __name__ == "__main__":
    main()
