"""Claim: structured output costs little: output tok/s with a ``json_schema`` on all 32 requests is
>= 0.8x the tok/s of the same 32 requests without it (SmolLM2-135M-Instruct fp32, CPU, offline
``LLM.generate``: the engine step the server runs).

Both sides run the same chat prompts, greedy, up to --tokens output tokens each; the runs are
interleaved (off, on, off, on...) and the ratio is of the medians. Output lengths differ (a JSON
answer ends when its grammar does), so the measure is tokens per second, not time per request.
Also reported: how many structured outputs parse and match the schema, and the mask's own share
of the step (``StructuredOutputManager.apply_bitmask`` timed separately).

    python benchmarks/bench_structured.py [--prompts 32] [--tokens 128] [--runs 3] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from atb_plugin import LLM, SamplingParams
from atb_plugin.default_model import default_model_dir
from atb_plugin.engine.sampling_params import StructuredOutputsParams

TOPICS = ["the ocean", "a red bicycle", "mountains in winter", "how bread is made", "the history of maps",
          "a quiet library", "bees and flowers", "the moon landing"]
SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string"},
        "mood": {"enum": ["happy", "sad", "calm", "tense"]},
        "characters": {"type": "array", "items": {"type": "string"}},
        "summary": {"type": "string"},
    },
    "required": ["title", "mood", "characters", "summary"],
    "additionalProperties": False,
}


def make_chats(count: int) -> list[list[dict]]:
    return [[{"role": "user", "content": f"Describe a short story about {TOPICS[i % len(TOPICS)]} (number {i}) "
                                         "as JSON with a title, a mood, the characters and a summary."}]
            for i in range(count)]


def matches_schema(text: str) -> bool:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return False
    return (isinstance(value, dict) and set(value) == set(SCHEMA["required"]) and isinstance(value["title"], str)
            and value["mood"] in SCHEMA["properties"]["mood"]["enum"] and isinstance(value["summary"], str)
            and isinstance(value["characters"], list) and all(isinstance(c, str) for c in value["characters"]))


def run_once(llm, prompt_ids, params) -> tuple[float, list]:
    start = time.perf_counter()
    outputs = llm.generate(prompt_ids, params)
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return tokens / elapsed, outputs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.manual_seed(0)
    chats = make_chats(args.prompts)
    plain = SamplingParams(temperature=0, max_tokens=args.tokens)
    structured = SamplingParams(temperature=0, max_tokens=args.tokens,
                                structured_outputs=StructuredOutputsParams(json=SCHEMA))

    with LLM(default_model_dir(), max_num_seqs=args.prompts, max_num_batched_tokens=4096,
             num_threads=args.threads) as llm:
        prompt_ids = [llm.router.input_builder.make_context(0, chat) for chat in chats]
        llm.generate(prompt_ids[:2], SamplingParams(temperature=0, max_tokens=4,
                                                    structured_outputs=StructuredOutputsParams(json=SCHEMA)))  # warm-up: tokenizer, compile
        manager = llm.engine.core.structured_output
        mask_time = [0.0]
        apply_bitmask = manager.apply_bitmask

        def timed_apply(*a, **k):
            start = time.perf_counter()
            result = apply_bitmask(*a, **k)
            mask_time[0] += time.perf_counter() - start
            return result

        manager.apply_bitmask = timed_apply  # instance attribute: only this manager's calls
        off, on, mask_shares, valid = [], [], [], []
        for run in range(args.runs):
            rate, _ = run_once(llm, prompt_ids, plain)
            off.append(rate)
            mask_time[0] = 0.0
            start = time.perf_counter()
            rate, outputs = run_once(llm, prompt_ids, structured)
            mask_shares.append(mask_time[0] / (time.perf_counter() - start))
            on.append(rate)
            finished = [o.outputs[0] for o in outputs if o.outputs[0].finish_reason == "stop"]
            valid.append((sum(matches_schema(c.text) for c in finished), len(finished), len(outputs)))
            print(f"run {run + 1}: off {off[-1]:.1f} tok/s, json_schema {on[-1]:.1f} tok/s "
                  f"(ratio {on[-1] / off[-1]:.2f}), mask {100 * mask_shares[-1]:.1f}% of the time; "
                  f"{valid[-1][0]}/{valid[-1][1]} finished outputs match the schema ({valid[-1][2]} requests)")

    ratio = statistics.median(on) / statistics.median(off)
    print(f"median: off {statistics.median(off):.1f} tok/s, json_schema {statistics.median(on):.1f} tok/s, "
          f"ratio {ratio:.2f} (goal >= 0.8)")
    print(json.dumps({"off_tok_s": round(statistics.median(off), 2), "json_schema_tok_s": round(statistics.median(on), 2),
                      "ratio": round(ratio, 3), "mask_share": round(statistics.median(mask_shares), 4),
                      "valid": valid[-1][0], "finished": valid[-1][1], "requests": valid[-1][2],
                      "prompts": args.prompts, "tokens": args.tokens, "runs": args.runs, "threads": args.threads}))


if __name__ == "__main__":
    main()
