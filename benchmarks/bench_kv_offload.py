"""Claim (issue 48, KV offload): multi-turn chats whose histories together exceed the device KV
budget get their next turn's first token sooner with a host-memory KV tier (the
OffloadingConnector) than without: the history's KV is loaded from the tier instead of being
recomputed. Goal: mean TTFT with the tier <= 0.5x without, same greedy tokens.

SmolLM2-135M-Instruct (``atb_plugin.default_model``), one engine core in this process,
``--threads`` torch threads, one request at a time. ``--chats`` conversations of ``--turns``
turns each, played round-robin (turn 1 of every chat, then turn 2 of every chat, ...), so each
chat's history has left the device cache (``--device-blocks`` KV blocks) before its next turn.
Each turn asks one question of about ``--question-tokens`` tokens and takes a ``--answer-tokens``
greedy answer, which joins the history. TTFT: from adding the turn's request to the core until
its first token comes out of a step (the engine's part of a server's TTFT).

Runs alternate between the engine without and with the tier (``--runs`` of each, a fresh engine
per run); per run the mean TTFT over the turns after the first (the first turn of a chat has no
history to reuse); reported: the median of the runs' means, their ratio, the tier's hits, and
whether every turn's tokens were the same (asserted). float32 by default: in bfloat16 the run
without the tier recomputes each history in one prefill, whose rounding differs from the
history's first computation (its answers were decoded token by token), so a few greedy tokens
differ from the tier's run, which reuses the first computation exactly (as an unbounded device
prefix cache does: same tokens).

The last line is one JSON object.

    python benchmarks/bench_kv_offload.py [--threads 1] [--runs 3] [--chats 6] [--turns 4]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere in the repo

from atb_plugin.default_model import default_model_dir  # noqa: E402
from atb_plugin.engine.config import EngineConfig  # noqa: E402
from atb_plugin.engine.core import EngineCore  # noqa: E402
from atb_plugin.engine.messages import EngineCoreRequest  # noqa: E402
from atb_plugin.engine.sampling_params import SamplingParams  # noqa: E402

TOPICS = ["lighthouses", "bread baking", "river deltas", "chess openings", "glaciers", "beekeeping",
          "violin making", "tide pools", "desert plants", "old maps"]
ASPECTS = ["history", "the tools people use", "a common mistake", "what beginners should know first",
           "how it changes with the seasons", "a surprising fact", "the vocabulary experts use",
           "how to explain it to a child"]


def question(chat: int, turn: int, words: int) -> str:
    topic, aspect = TOPICS[chat % len(TOPICS)], ASPECTS[turn % len(ASPECTS)]
    filler = (f" Please be specific about {topic} and keep in mind everything we said so far about it,"
              " including the details of your earlier answers and the examples you gave.") * max(1, words // 30)
    return f"Chat {chat}, turn {turn}: tell me about {aspect} of {topic}.{filler}"


def chat_ids(tokenizer, messages, generation_prompt: bool = True) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def play(model: Path, args, tier_gib: float | None) -> tuple[list[float], list[list[int]], dict]:
    """Every turn of every chat, round-robin; returns TTFTs (turns after the first), every turn's
    tokens and the tier's counters."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    core = EngineCore(EngineConfig(str(model), dtype=args.dtype, num_threads=args.threads, block_size=16,
                                   kv_cache_blocks=args.device_blocks + 1, max_model_len=args.max_model_len,
                                   max_num_seqs=1, kv_offloading_size=tier_gib))
    params = SamplingParams(temperature=0, max_tokens=args.answer_tokens, ignore_eos=True)
    histories = [[] for _ in range(args.chats)]
    ttfts, tokens = [], []
    hits = 0
    try:
        for turn in range(args.turns):
            for chat in range(args.chats):
                messages = histories[chat] + [{"role": "user", "content": question(chat, turn, args.question_tokens)}]
                ids = chat_ids(tokenizer, messages)
                request_id = f"{chat}-{turn}"
                began = time.perf_counter()
                core.add_request(EngineCoreRequest(request_id, ids, params))
                answer, first = [], None
                while core.has_unfinished_requests():
                    for out in core.step():
                        if out.new_token_ids and first is None:
                            first = time.perf_counter() - began
                        answer += out.new_token_ids
                if turn > 0:
                    ttfts.append(first)
                tokens.append(answer)
                histories[chat] = messages + [{"role": "assistant", "content": tokenizer.decode(answer)}]
            hits += core.make_stats().external_prefix_cache_hits
        longest = max(len(chat_ids(tokenizer, h, False)) for h in histories)
    finally:
        core.shutdown()
    return ttfts, tokens, {"external_hit_tokens": hits, "longest_history_tokens": longest}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--dtype", default="float32",
                        help="float32 (default): a recomputed history rounds as the first computation did, so "
                             "the runs without the tier give the same tokens too; in bfloat16 a history "
                             "recomputed by one prefill rounds differently from its decode-computed KV")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--chats", type=int, default=6)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--question-tokens", type=int, default=60)
    parser.add_argument("--answer-tokens", type=int, default=16)
    parser.add_argument("--device-blocks", type=int, default=40, help="device KV blocks of 16 tokens")
    parser.add_argument("--max-model-len", type=int, default=640)
    parser.add_argument("--tier-gib", type=float, default=0.25, help="the host tier (--kv-offloading-size)")
    args = parser.parse_args()
    model = default_model_dir()
    means = {"off": [], "on": []}
    reference, stats = None, {}
    for run in range(args.runs):
        for name, tier in (("off", None), ("on", args.tier_gib)):
            ttfts, tokens, counters = play(model, args, tier)
            if reference is None:
                reference = tokens
            assert tokens == reference, f"run {run} ({name}): the tokens differ from the first run's"
            means[name].append(statistics.fmean(ttfts))
            stats[name] = counters
            print(f"run {run} tier {name}: mean TTFT {means[name][-1] * 1e3:.1f} ms over {len(ttfts)} turns, "
                  f"{counters['external_hit_tokens']} prompt tokens loaded from the tier", flush=True)
    off, on = statistics.median(means["off"]), statistics.median(means["on"])
    print(f"median mean TTFT: without the tier {off * 1e3:.1f} ms, with it {on * 1e3:.1f} ms: {on / off:.2f}x")
    print(json.dumps({"ttft_off_ms": round(off * 1e3, 2), "ttft_on_ms": round(on * 1e3, 2),
                      "ratio": round(on / off, 3), "same_tokens": True, "runs": args.runs, "chats": args.chats,
                      "turns": args.turns, "device_blocks": args.device_blocks, "threads": args.threads, "dtype": args.dtype,
                      "tier_hit_tokens_per_run": stats["on"]["external_hit_tokens"],
                      "longest_history_tokens": stats["on"]["longest_history_tokens"]}))


if __name__ == "__main__":
    main()
