"""Claim (issue 33; issue 49: >= 1.5x with MoE in the captured decode step): on a Qwen3-MoE-shaped
model our engine decodes 32 batched streams x 128 tokens faster than transformers' padded-batch
``generate``, same greedy tokens, one torch thread each; single-stream decode is reported too.

The model: a random Qwen3-MoE checkpoint written by ``atb_plugin.testing.tiny.build_qwen3_moe``
(the tiny tokenizer) with the expert layout of Qwen3-30B-A3B scaled down: --experts 64, top
--top-k 8, renormalised, --layers 8 sparse layers, hidden 256, 4 query / 2 KV heads of 64,
experts of 128 intermediate features. Prompts: chat prompts of ~25-35 tokens.

Sides, interleaved run by run (medians of --runs):

  ours    ``LLM.generate`` (continuous batching; decode steps in the captured decode step, its
          MoE layers through the native grouped experts of csrc/moe_kernels.c) and the engine's
          step API for one stream (decode tok/s after the first token).
  ours_eager  the same with ``enforce_eager=True``: every step eager, the MoE layers through
          ``ops.fused_moe`` (tokens sorted by expert, one ``torch._grouped_mm`` per projection).
  hf      transformers' Qwen3MoeForCausalLM ``generate``: the prompts left-padded into one batch
          with an attention mask; one prompt alone for the single stream. Twice per run, with
          each of its experts implementations: its default here ("grouped_mm": the tokens
          sorted by expert, ``torch.nn.functional.grouped_mm``, the same idea as ours) and
          "eager" (a Python loop over the experts hit, what older transformers always ran).

Same tokens: the greedy tokens of both sides are compared (single: all; batch: the first 16 of
each prompt, as bench_engine.py does: batched float32 sums may reorder and diverge late).

    python benchmarks/bench_moe.py [--runs 3] [--tokens 128] [--batch 32]

Before the runs, the MoE block alone (router logits given; one layer's experts, 1 and --batch
rows, medians of 21 interleaved timings): the native grouped experts (``cpu_native.moe_experts``)
against the eager op (``ops.fused_moe``'s CPU kernels).

The last line is one JSON object with the tok/s of all sides and the ratios.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_engine as a sibling module
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_engine import chats, hf_batch, hf_single, ours_batch, ours_single  # noqa: E402

from atb_plugin import LLM  # noqa: E402
from atb_plugin.ops import cpu_native, torch_kernels  # noqa: E402
from atb_plugin.testing.tiny import build_qwen3_moe  # noqa: E402


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--layers", type=int, default=8)
    return parser.parse_args()


def build(out: Path, args) -> None:
    build_qwen3_moe(out, seed=0, num_hidden_layers=args.layers, num_experts=args.experts,
                    num_experts_per_tok=args.top_k, moe_intermediate_size=128, intermediate_size=512,
                    hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64, mlp_only_layers=[],
                    norm_topk_prob=True)


def experts_alone(args, rows_list: tuple[int, ...]) -> dict[str, float]:
    """ms per MoE block (experts of the benchmark's shape, router logits given) for each row
    count: the native grouped experts and the eager op, interleaved, medians."""
    library = cpu_native.linear_library(torch.device("cpu"))
    generator = torch.Generator().manual_seed(0)
    hidden, inter = 256, 128
    w13 = torch.randn(args.experts, hidden, 2 * inter, generator=generator) / hidden**0.5
    w2 = torch.randn(args.experts, inter, hidden, generator=generator) / inter**0.5
    result = {}
    for rows in rows_list:
        x, logits = torch.randn(rows, hidden, generator=generator), torch.randn(rows, args.experts, generator=generator)

        def native():
            return cpu_native.moe_experts(library, x, logits, w13, w2, args.top_k, True)

        def eager():
            weights, ids = torch_kernels.moe_select_experts(logits, args.top_k, True)
            return torch_kernels.moe_experts(x, weights, ids, w13, w2, 0)

        times = {"native": [], "grouped_mm": []}
        for _ in range(21):
            for name, run in (("native", native), ("grouped_mm", eager)):
                start = time.perf_counter()
                for _ in range(10):
                    run()
                times[name].append((time.perf_counter() - start) / 10 * 1e3)
        for name, values in times.items():
            result[f"{name}_{rows}_rows_ms"] = round(statistics.median(values), 4)
    return result


def main() -> None:
    args = arguments()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    import transformers

    with tempfile.TemporaryDirectory(prefix="bench-moe-") as scratch:
        path = Path(scratch)
        build(path, args)
        reference = transformers.Qwen3MoeForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        default_impl = reference.config._experts_implementation
        impls = {"hf": default_impl, "hf_eager": "eager"}
        alone = experts_alone(args, (1, max(args.batch, 1)))
        print("MoE block alone, ms: " + ", ".join(f"{k} {v}" for k, v in alone.items()), flush=True)
        llm = LLM(path, max_num_seqs=max(args.batch, 1), num_threads=1, block_size=16)
        eager_llm = LLM(path, max_num_seqs=max(args.batch, 1), num_threads=1, block_size=16, enforce_eager=True)
        print(f"ours: decode {llm.engine.core.runner.decode_capture}", flush=True)
        try:
            tokenizer = llm.router.tokenizer
            prompts = [llm.router.input_builder.make_context(0, chat) for chat in chats(max(args.batch, 1))]
            single = prompts[0]
            ours = {"ours": llm, "ours_eager": eager_llm}
            sides = (*ours, *impls)
            samples = {f"{side}_{mode}": [] for side in sides for mode in ("single", "batch")}
            tokens = {}
            for run in range(args.runs):
                for side, engine in ours.items():
                    _, rate, tokens[f"{side}_single"] = ours_single(engine, single, args.tokens)
                    samples[f"{side}_single"].append(rate)
                    rate, tokens[f"{side}_batch"] = ours_batch(engine, prompts, args.tokens)
                    samples[f"{side}_batch"].append(rate)
                for side, impl in impls.items():
                    reference.set_experts_implementation(impl)
                    _, rate, tokens[f"{side}_single"] = hf_single(reference, single, args.tokens)
                    samples[f"{side}_single"].append(rate)
                    rate, tokens[f"{side}_batch"] = hf_batch(reference, prompts, args.tokens, tokenizer.pad_token_id)
                    samples[f"{side}_batch"].append(rate)
                print(f"run {run + 1}: " + ", ".join(f"{k} {v[-1]:.1f} tok/s" for k, v in samples.items()), flush=True)
        finally:
            llm.close()
            eager_llm.close()
    med = {k: statistics.median(v) for k, v in samples.items()}
    same = {side: {"single": tokens["ours_single"] == tokens[f"{side}_single"],
                   "batch": sum(a[:16] == b[:16] for a, b in zip(tokens["ours_batch"], tokens[f"{side}_batch"]))}
            for side in impls}
    ratios = {f"{mode}_vs_{side}": med[f"ours_{mode}"] / med[f"{side}_{mode}"]
              for side in ("ours_eager", *impls) for mode in ("single", "batch")}
    print(f"model: {args.layers} layers, {args.experts} experts, top-{args.top_k}, hidden 256, experts of 128")
    for side, impl in impls.items():
        print(f"vs transformers ({impl} experts): single stream ours {med['ours_single']:.1f} tok/s, theirs "
              f"{med[side + '_single']:.1f}, {ratios['single_vs_' + side]:.2f}x (same tokens: {same[side]['single']}); "
              f"{args.batch} x {args.tokens} ours {med['ours_batch']:.1f} tok/s, padded batch "
              f"{med[side + '_batch']:.1f}, {ratios['batch_vs_' + side]:.2f}x (same first 16 tokens: "
              f"{same[side]['batch']} of {args.batch})")
    print(f"captured vs eager (ours): single stream {ratios['single_vs_ours_eager']:.2f}x, batch "
          f"{ratios['batch_vs_ours_eager']:.2f}x")
    print(json.dumps({"runs": args.runs, "hf_default_experts": default_impl, "experts_alone_ms": alone,
                      "medians_tok_s": {k: round(v, 2) for k, v in med.items()},
                      "ratios": {k: round(v, 3) for k, v in ratios.items()}, "same": same}))


if __name__ == "__main__":
    main()
