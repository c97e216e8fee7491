"""Claim (issue 46, speculative decoding): n-gram drafts (k = 4) speed up a single stream on
prompts whose answer repeats their content (code editing, restating a given text), give the same
greedy tokens, and cost little on open-ended prompts (goal: >= 0.95x plain there).

One run, SmolLM2-135M-Instruct fp32, ``--threads`` torch threads, one request at a time: each
prompt set is generated plain and with ``{"method": "ngram", "num_speculative_tokens": k}``
(engines interleaved run by run, medians of ``--runs``); per set: tokens/s of each, the ratio,
the acceptance rate (accepted / draft tokens) and the mean acceptance length (1 + accepted /
verify steps), and whether the tokens are the same. ``--draft-self`` adds the upper bound on the
repetitive set: method draft_model with SmolLM2 as its own draft (every greedy draft accepted;
the draft's k forwards cost as much as the target's, so it is no speedup, only the bound on
acceptance).

The last line is one JSON object with repetitive_speedup, open_speedup, acceptance rates and
same_tokens.

    python benchmarks/bench_spec_decode.py [--threads 1] [--runs 3] [--tokens 128] [-k 4]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere in the repo

from atb_plugin import LLM, SamplingParams  # noqa: E402
from atb_plugin.default_model import default_model_dir  # noqa: E402

CODE = '''def total_price(items, tax_rate):
    subtotal = 0
    for item in items:
        subtotal += item.price * item.quantity
    tax = subtotal * tax_rate
    return subtotal + tax


def cheapest(items):
    best = None
    for item in items:
        if best is None or item.price < best.price:
            best = item
    return best
'''
TEXT = ("The lighthouse stood on the northern cliff for two hundred years. Every night its keeper climbed "
        "the spiral stairs, trimmed the wick and wound the clockwork that turned the lens. Ships passing in "
        "the fog counted its flashes to know where they were, and the fishermen of the village said that "
        "as long as the light turned, no boat of theirs would be lost on the rocks below.")
REPETITIVE = [
    f"Rename the variable `items` to `products` in this code and return the whole code:\n\n{CODE}",
    f"Add a docstring to each function of this code and return the whole code:\n\n{CODE}",
    f"Repeat the following text exactly, word for word:\n\n{TEXT}",
    f"Correct any mistakes in this text and return it in full:\n\n{TEXT}",
]
OPEN = ["Write a short story about a red bicycle.", "Explain how bread is made.",
        "What do bees do in winter?", "Describe a quiet library at night."]


def run_set(llm: LLM, prompts: list[str], params: SamplingParams) -> tuple[float, list[list[int]]]:
    """Tokens/s over the set, one request at a time, and the tokens."""
    tokens, seconds, outputs = 0, 0.0, []
    for prompt in prompts:
        start = time.perf_counter()
        output = llm.chat([[{"role": "user", "content": prompt}]], params)[0].outputs[0]
        seconds += time.perf_counter() - start
        tokens += len(output.token_ids)
        outputs.append(output.token_ids)
    return tokens / seconds, outputs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("-k", type=int, default=4)
    parser.add_argument("--draft-self", action="store_true", help="also draft_model with the model as its own draft")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = str(default_model_dir())
    params = SamplingParams(temperature=0, max_tokens=args.tokens)
    spec = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_min": 2, "prompt_lookup_max": 5}
    engines = {"plain": LLM(model, num_threads=args.threads),
               "ngram": LLM(model, num_threads=args.threads, speculative_config=spec)}
    if args.draft_self:
        engines["draft_self"] = LLM(model, num_threads=args.threads, speculative_config={
            "method": "draft_model", "model": model, "num_speculative_tokens": args.k})
    result = {"threads": args.threads, "k": args.k, "tokens": args.tokens}
    try:
        for name, prompts in (("repetitive", REPETITIVE), ("open", OPEN)):
            rates = {engine: [] for engine in engines}
            tokens = {}
            stats_before = engines["ngram"].engine.scheduler.spec_decoding
            before = (stats_before.num_drafts, stats_before.num_draft_tokens, stats_before.num_accepted_tokens)
            for _ in range(args.runs):
                for engine, llm in engines.items():
                    if engine == "draft_self" and name != "repetitive":
                        continue
                    rate, tokens[engine] = run_set(llm, prompts, params)
                    rates[engine].append(rate)
            if rates.get("draft_self"):
                draft_stats = engines["draft_self"].engine.scheduler.spec_decoding
                result["draft_self_tok_s"] = round(statistics.median(rates["draft_self"]), 2)
                result["draft_self_acceptance_rate"] = round(
                    draft_stats.num_accepted_tokens / max(1, draft_stats.num_draft_tokens), 3)
                result["draft_self_same_tokens"] = tokens["draft_self"] == tokens["plain"]
                print(f"{'draft_self':>10}: {result['draft_self_tok_s']:6.2f} tok/s, acceptance "
                      f"{result['draft_self_acceptance_rate']:.0%}, same tokens: {result['draft_self_same_tokens']}")
            stats = engines["ngram"].engine.scheduler.spec_decoding
            drafts, draft_tokens, accepted = (stats.num_drafts - before[0], stats.num_draft_tokens - before[1],
                                              stats.num_accepted_tokens - before[2])
            plain, ngram = statistics.median(rates["plain"]), statistics.median(rates["ngram"])
            result[f"{name}_plain_tok_s"] = round(plain, 2)
            result[f"{name}_ngram_tok_s"] = round(ngram, 2)
            result[f"{name}_speedup"] = round(ngram / plain, 3)
            result[f"{name}_acceptance_rate"] = round(accepted / draft_tokens, 3) if draft_tokens else 0.0
            result[f"{name}_acceptance_length"] = round(1 + accepted / drafts, 2) if drafts else 1.0
            result[f"{name}_same_tokens"] = tokens["plain"] == tokens["ngram"]
            print(f"{name:>10}: plain {plain:6.2f} tok/s, ngram k={args.k} {ngram:6.2f} tok/s "
                  f"({ngram / plain:.2f}x), acceptance {result[f'{name}_acceptance_rate']:.0%}, "
                  f"length {result[f'{name}_acceptance_length']:.2f}, same tokens: {result[f'{name}_same_tokens']}")
    finally:
        for llm in engines.values():
            llm.close()
    result["same_tokens"] = result["repetitive_same_tokens"] and result["open_same_tokens"]
    print(json.dumps(result))


if __name__ == "__main__":
    main()
