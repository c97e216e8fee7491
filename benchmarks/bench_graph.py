"""Claim: decode graphs (docs/graph-mode.md) decode faster than the eager forward, with the same
greedy tokens: goal at least 2x at batch 1 on a real GPU or NPU.

For each model (SmolLM2-135M-Instruct, the default model; a Qwen2.5-0.5B-shaped random
checkpoint: 24 layers, hidden 896, 14 / 2 heads, intermediate 4864, SmolLM2's tokenizer and
vocabulary) two ``LLM``s in one process, one with ``enforce_eager=True``, runs alternating
between them. Decode tokens/s at batch 1, 8 and 32: ``batch x (tokens - 1)`` over the time of a
``tokens``-token greedy generation minus the time of a 1-token one (the prefill and the first
token), medians over ``--runs``. Last line: JSON with both sides' medians, the ratios, and whether
the tokens are equal.

Needs CUDA or an Ascend NPU (``--device``; auto picks what is there); on the CPU it exits with a
message, since the CPU's captured step is measured by bench_decode_capture.py. What ran on a
GPU so far: benchmarks/RESULTS.md.

    python benchmarks/bench_graph.py [--runs 3] [--tokens 64] [--batches 1 8 32] [--device auto]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parent))  # random_checkpoint as a sibling module
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from atb_plugin import LLM, SamplingParams  # noqa: E402
from atb_plugin.default_model import default_model_dir  # noqa: E402
from atb_plugin.platform import platform_for  # noqa: E402
from random_checkpoint import random_checkpoint  # noqa: E402

QWEN2_5_0_5B = {"hidden_size": 896, "intermediate_size": 4864, "num_attention_heads": 14, "num_key_value_heads": 2,
                "num_hidden_layers": 24, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "tie_word_embeddings": True,
                "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "max_position_embeddings": 4096}
SIDES = ("graphs", "eager")


def qwen2_5_shaped_checkpoint() -> Path:
    """The Qwen2.5-0.5B-shaped random checkpoint (q/k/v biases, a tied head), SmolLM2's tokenizer;
    written once into the cache."""
    return random_checkpoint("qwen2.5-0.5b-shape-random-smollm2-vocab", QWEN2_5_0_5B, qkv_bias=True)


def decode_rate(llm: LLM, prompts: list[str], tokens: int) -> tuple[float, list[list[int]]]:
    """Decode tokens/s of ``prompts`` (greedy, ``tokens`` new tokens each) and the tokens."""
    def timed(max_tokens: int):
        started = time.perf_counter()
        outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
        return time.perf_counter() - started, [list(o.outputs[0].token_ids) for o in outputs]

    first, _ = timed(1)
    total, out = timed(tokens)
    return len(prompts) * (tokens - 1) / max(total - first, 1e-9), out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--device", default="auto", choices=("auto", "cuda", "npu"))
    args = parser.parse_args()
    platform = platform_for(args.device)
    if platform.device_graphs() is None:
        sys.exit(f"no device graphs on {platform.name}: this benchmark needs CUDA or an Ascend NPU "
                 "(the CPU's captured step: bench_decode_capture.py)")
    prompts_all = [f"Write a short story about the number {i}." for i in range(max(args.batches))]
    report = {"device": platform.name, "runs": args.runs, "tokens": args.tokens, "models": {}}
    for name, path in (("SmolLM2-135M-Instruct", default_model_dir()),
                       ("Qwen2.5-0.5B-shaped random", qwen2_5_shaped_checkpoint())):
        # An explicit KV cache size per side: the profile's peak is the process's, so a second LLM
        # at the default gpu_memory_utilization would find the first one's cache counted against it.
        llms = {side: LLM(str(path), device=args.device, max_num_seqs=max(args.batches), enforce_eager=side == "eager",
                          kv_cache_bytes=2 << 30,
                          compilation_config=None if side == "eager" else {"cudagraph_mode": "FULL_DECODE_ONLY"})
                for side in SIDES}
        print(f"{name}: decode step {llms['graphs'].engine.client.core.runner.decode_capture}", flush=True)
        model = report["models"][name] = {}
        for batch in args.batches:
            prompts = prompts_all[:batch]
            rates = {side: [] for side in SIDES}
            tokens = {}
            for run in range(args.runs):
                for side in SIDES if run % 2 == 0 else SIDES[::-1]:
                    rate, tokens[side] = decode_rate(llms[side], prompts, args.tokens)
                    rates[side].append(rate)
            medians = {side: statistics.median(r) for side, r in rates.items()}
            model[f"batch_{batch}"] = {**{f"{s}_tok_s": round(m, 1) for s, m in medians.items()},
                                       "ratio": round(medians["graphs"] / medians["eager"], 2),
                                       "same_tokens": tokens["graphs"] == tokens["eager"]}
            print(f"  batch {batch:>3}: graphs {medians['graphs']:.1f} tok/s, eager {medians['eager']:.1f} tok/s, "
                  f"{medians['graphs'] / medians['eager']:.2f}x", flush=True)
        for llm in llms.values():
            llm.close()
    print(json.dumps(report))


if __name__ == "__main__":
    main()
