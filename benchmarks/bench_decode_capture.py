"""Claim: the captured decode step (atb_plugin/models/native_decode.py: every layer of a
decode-only step in one native call) decodes faster than the eager forward it replays, with the
same greedy tokens. SmolLM2-135M-Instruct fp32, one torch thread.

Two ``LLM``s in one process, one with ``enforce_eager=True``; runs alternate between them (order
swapped every run) and the ratio of medians is printed:

  single     one prompt, --tokens new tokens through ``LLMEngine.step`` (decode tok/s after the
             first token), as bench_engine.py measures it;
  batch      --batch prompts x --tokens tokens through ``LLM.generate``.

Last line: JSON with both sides' medians, the ratios and whether the tokens are equal.

    python benchmarks/bench_decode_capture.py [--runs 5] [--tokens 128] [--batch 32]
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_engine as a sibling module
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_engine import ab_arguments, ab_summary, chats, ours_batch, ours_single  # noqa: E402

from atb_plugin import LLM, SamplingParams  # noqa: E402
from atb_plugin.default_model import default_model_dir  # noqa: E402

SIDES = ("captured", "eager")


def main() -> None:
    args = ab_arguments(__doc__)
    llms = {side: LLM(default_model_dir(), max_num_seqs=args.batch, max_num_batched_tokens=2048, num_threads=1,
                      enforce_eager=side == "eager") for side in SIDES}
    outcome = llms["captured"].engine.core.runner.decode_capture
    if outcome != "captured":
        sys.exit(f"no captured decode step here ({outcome}): nothing to compare")
    prompts = [llms["eager"].router.input_builder.make_context(0, chat) for chat in chats(args.batch)]
    for llm in llms.values():
        llm.generate([prompts[0]], SamplingParams(temperature=0, max_tokens=4))  # warm-up
    results = {side: {"single_tok_s": [], "batch_tok_s": []} for side in SIDES}
    tokens = {}
    for run in range(args.runs):
        for side in SIDES if run % 2 == 0 else SIDES[::-1]:
            _, single, single_tokens = ours_single(llms[side], prompts[0], args.tokens)
            batch, batch_tokens = ours_batch(llms[side], prompts, args.tokens)
            results[side]["single_tok_s"].append(single)
            results[side]["batch_tok_s"].append(batch)
            tokens[side] = (single_tokens, batch_tokens)
            print(f"run {run} {side:>8}: single {single:.1f} tok/s, {args.batch} x {args.tokens} {batch:.1f} tok/s",
                  flush=True)
    for llm in llms.values():
        llm.close()

    med = {side: {k: statistics.median(v) for k, v in r.items()} for side, r in results.items()}
    ratios = {k: med["captured"][f"{k}_tok_s"] / med["eager"][f"{k}_tok_s"] for k in ("single", "batch")}
    print(f"SmolLM2-135M-Instruct fp32, 1 torch thread, medians of {args.runs} interleaved runs")
    for key, label in (("single", "single stream"), ("batch", f"{args.batch} x {args.tokens}")):
        print(f"{label}: captured {med['captured'][f'{key}_tok_s']:.1f} vs eager {med['eager'][f'{key}_tok_s']:.1f} "
              f"tok/s ({ratios[key]:.2f}x)")
    ab_summary(args.runs, med, ratios, tokens["captured"], tokens["eager"], args.batch)


if __name__ == "__main__":
    main()
