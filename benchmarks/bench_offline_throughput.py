"""Claim: our LLM.generate is >= 4x the output throughput of transformers' generate run one prompt
at a time, on SmolLM2-135M-Instruct fp32 on CPU, 32 prompts x 128 output tokens (ignore_eos).

Both sides decode greedily the same prompts (checked: the first prompts' tokens are compared).
Also reported: the share of engine step time spent outside the model (scheduler +
prepare_inputs + sampling), measured by timing ModelRunner.execute's model call separately.

    python benchmarks/bench_offline_throughput.py [--prompts 32] [--tokens 128] [--reference-prompts 8]

The reference's tok/s is measured on --reference-prompts of the prompts (one at a time, so its
rate does not depend on how many are run); ours runs all of them in one batch.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from atb_plugin import LLM, SamplingParams
from atb_plugin.default_model import default_model_dir

TOPICS = ["the ocean", "a red bicycle", "mountains in winter", "how bread is made", "the history of maps",
          "a quiet library", "bees and flowers", "the moon landing"]


def make_prompts(count: int) -> list[list[dict]]:
    return [[{"role": "user", "content": f"Write a short story about {TOPICS[i % len(TOPICS)]} (number {i})."}]
            for i in range(count)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--reference-prompts", type=int, default=8)
    args = parser.parse_args()
    torch.manual_seed(0)
    model_dir = default_model_dir()
    chats = make_prompts(args.prompts)
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)

    # float32, as the reference (dtype "auto" may be bfloat16 on the CPU)
    with LLM(model_dir, max_num_seqs=args.prompts, max_num_batched_tokens=4096, dtype="float32") as llm:
        prompt_ids = [llm.router.input_builder.make_context(0, chat) for chat in chats]
        llm.generate([prompt_ids[0]], SamplingParams(temperature=0, max_tokens=4))  # warm-up
        runner = llm.engine.runner
        model_time = [0.0]
        model_call = runner.model.forward

        def timed_forward(*a, **k):
            start = time.perf_counter()
            out = model_call(*a, **k)
            model_time[0] += time.perf_counter() - start
            return out

        runner.model.forward = timed_forward  # instance attribute: only this runner's calls
        start = time.perf_counter()
        outputs = llm.generate(prompt_ids, params)
        ours_s = time.perf_counter() - start
        runner.model.forward = model_call
        ours_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    # Everything but the forward: scheduler, prepare_inputs, embedding gather, logits, sampling, detokenise.
    overhead_share = 1 - model_time[0] / ours_s

    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ref_tokens, ref_s = 0, 0.0
    mismatches = 0
    for index in range(args.reference_prompts):
        ids = torch.tensor([prompt_ids[index]])
        start = time.perf_counter()
        with torch.no_grad():
            generated = reference.generate(ids, max_new_tokens=args.tokens, min_new_tokens=args.tokens,
                                           do_sample=False, repetition_penalty=1.0, pad_token_id=0)
        ref_s += time.perf_counter() - start
        new = generated[0, ids.shape[1]:].tolist()
        ref_tokens += len(new)
        # fp32 on both sides; batched matmuls may reorder sums, so a late divergence is possible.
        mismatches += new[:16] != outputs[index].outputs[0].token_ids[:16]

    ours_tps, ref_tps = ours_tokens / ours_s, ref_tokens / ref_s
    print(f"SmolLM2-135M-Instruct fp32 CPU, {args.prompts} prompts x {args.tokens} tokens (greedy, ignore_eos)")
    print(f"  ours (LLM.generate, batched):       {ours_tokens} tokens in {ours_s:7.2f} s = {ours_tps:8.1f} tok/s")
    print(f"  transformers generate, one at a time: {ref_tokens} tokens in {ref_s:7.2f} s = {ref_tps:8.1f} tok/s "
          f"({args.reference_prompts} prompts)")
    print(f"  speedup {ours_tps / ref_tps:.2f}x; engine overhead outside the model forward: {overhead_share:.1%}")
    print(f"  first-16-token mismatches vs transformers: {mismatches} of {args.reference_prompts}")
    print(json.dumps({
        "ours_tok_s": round(ours_tps, 1),
        "transformers_tok_s": round(ref_tps, 1),
        "speedup": round(ours_tps / ref_tps, 2),
        "engine_overhead_share": round(overhead_share, 3),
        "prompts": args.prompts,
        "tokens": args.tokens,
        "first16_mismatches": mismatches,
    }))


if __name__ == "__main__":
    main()
