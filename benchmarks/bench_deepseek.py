"""Claims (issue 50): on a DeepSeek-V3-shaped model our engine decodes 32 batched streams x 128
tokens at least 1.5x faster than transformers' padded-batch ``generate``, same greedy tokens,
one torch thread each; single-stream decode and a long-context decode (an 8k-token prompt, where
the latent cache should pay) are reported too.

The model: a random checkpoint written by ``atb_plugin.testing.tiny.build_deepseek_v3`` (the tiny
tokenizer) with DeepSeek-V3's layout scaled down to this machine: --layers layers, the first
dense, hidden 512, 8 heads, q LoRA 256, latent 128 + rope 16, q/k nope 32, v 32 (V3: 7168, 128,
1536, 512 + 64, 128, 128), 64 routed experts of 128 features in 8 groups (4 kept, top-8, sigmoid
with the correction bias, scaling 2.5), one shared expert; YaRN factor 32 over 512 positions.

Sides, interleaved run by run (medians of --runs):

  ours    ``LLM.generate`` (continuous batching; prefill in MLA's expanded form, decode absorbed
          over the latent cache) and the engine's step API for one stream (decode tok/s after
          the first token, TTFT).
  hf      transformers' DeepseekV3ForCausalLM ``generate`` (its DynamicCache keeps the latents
          too and expands them every step): the prompts left-padded into one batch with an
          attention mask; one prompt alone for the single stream and the long context.

Same tokens: greedy tokens compared (single and long: all; batch: the first 16 of each prompt,
as bench_engine.py does: batched float32 sums may reorder and diverge late).

    python benchmarks/bench_deepseek.py [--runs 1] [--tokens 128] [--batch 32] [--long 8192]

The last line is one JSON object with the tok/s of both sides and the ratios.
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
from atb_plugin.testing.tiny import build_deepseek_v3  # noqa: E402


# --flag: (default, help); every flag an int
FLAGS = {
    "runs": (1, "interleaved runs (medians)"),
    "tokens": (128, "tokens per request, single stream and batch"),
    "batch": (32, "batched requests"),
    "layers": (4, "decoder layers (the first dense)"),
    "long": (8192, "prompt tokens of the long-context decode (0: skip)"),
    "long-tokens": (32, "tokens decoded after the long prompt"),
}


def arguments() -> argparse.Namespace:
    """The flags, parsed; torch set to one thread and seeded, as every engine-speed claim here is
    measured."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for flag, (default, text) in FLAGS.items():
        parser.add_argument(f"--{flag}", type=int, default=default, help=f"{text} (default {default})")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    return args


def reference_model(path: Path):
    """transformers' model of the checkpoint, float32. Our side's ignore_eos decodes through EOS;
    generate's min_new_tokens would instead ban EOS (another token where the model picks EOS), so
    its generation config loses the EOS and the two agree."""
    import transformers

    model = transformers.DeepseekV3ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    return model


@torch.inference_mode()
def hf_long(model, ids: list[int], tokens: int, pad_id: int) -> tuple[float, float, list[int], list[float]]:
    """(TTFT s, decode tok/s, token ids, top-2 logit margin at each step) of transformers' generate
    after a long prompt: one generate of 1 token (TTFT: the prefill) and one of ``tokens``, the
    decode rate from their difference (a separate forward for the TTFT, as ``hf_single`` measures
    it, can take longer than the whole generate at 8k tokens: allocator warm-up)."""
    inputs = torch.tensor([ids])
    start = time.perf_counter()
    model.generate(inputs, max_new_tokens=1, do_sample=False, pad_token_id=pad_id)
    ttft = time.perf_counter() - start
    start = time.perf_counter()
    out = model.generate(inputs, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False, pad_token_id=pad_id,
                         output_scores=True, return_dict_in_generate=True)
    elapsed = time.perf_counter() - start
    margins = [float(top[0, 0] - top[0, 1]) for top in (score.topk(2, dim=-1).values for score in out.scores)]
    return ttft, (tokens - 1) / (elapsed - ttft), out.sequences[0, len(ids):].tolist(), margins


def build(out: Path, args) -> None:
    build_deepseek_v3(out, seed=0, num_hidden_layers=args.layers, first_k_dense_replace=1, hidden_size=512,
                      intermediate_size=1024, num_attention_heads=8, num_key_value_heads=8, q_lora_rank=256,
                      kv_lora_rank=128, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, n_routed_experts=64,
                      moe_intermediate_size=128, num_experts_per_tok=8, n_group=8, topk_group=4, n_shared_experts=1,
                      num_nextn_predict_layers=0, max_position_embeddings=16384,
                      rope_scaling={"beta_fast": 32, "beta_slow": 1, "factor": 32, "mscale": 1.0,
                                    "mscale_all_dim": 1.0, "original_max_position_embeddings": 512, "type": "yarn"})


def main() -> None:
    args = arguments()
    with tempfile.TemporaryDirectory(prefix="bench-deepseek-") as scratch:
        path = Path(scratch)
        build(path, args)
        reference = reference_model(path)
        max_len = max(args.long + args.long_tokens, 512)
        llm = LLM(path, max_num_seqs=max(args.batch, 1), num_threads=1, block_size=16, max_model_len=max_len)
        try:
            tokenizer = llm.router.tokenizer
            prompts = [llm.router.input_builder.make_context(0, chat) for chat in chats(max(args.batch, 1))]
            single = prompts[0]
            long_prompt = torch.randint(3, len(tokenizer), (args.long,), generator=torch.Generator().manual_seed(1))
            long_prompt = long_prompt.tolist()
            samples = {f"{side}_{mode}": [] for side in ("ours", "hf") for mode in ("single", "batch", "long")}
            ttft = {"ours_long": [], "hf_long": []}
            tokens = {}
            for run in range(args.runs):
                _, rate, tokens["ours_single"] = ours_single(llm, single, args.tokens)
                samples["ours_single"].append(rate)
                # DeepSeek's BOS is id 0, bench_engine's default pad: pass the tokenizer's pad instead
                _, rate, tokens["hf_single"] = hf_single(reference, single, args.tokens, tokenizer.pad_token_id)
                samples["hf_single"].append(rate)
                rate, tokens["ours_batch"] = ours_batch(llm, prompts, args.tokens)
                samples["ours_batch"].append(rate)
                rate, tokens["hf_batch"] = hf_batch(reference, prompts, args.tokens, tokenizer.pad_token_id)
                samples["hf_batch"].append(rate)
                if args.long:
                    first, rate, tokens["ours_long"] = ours_single(llm, long_prompt, args.long_tokens)
                    samples["ours_long"].append(rate)
                    ttft["ours_long"].append(first)
                    first, rate, tokens["hf_long"], margins = hf_long(reference, long_prompt, args.long_tokens,
                                                                      tokenizer.pad_token_id)
                    samples["hf_long"].append(rate)
                    ttft["hf_long"].append(first)
                print(f"run {run + 1}: " + ", ".join(f"{k} {v[-1]:.1f} tok/s" for k, v in samples.items() if v),
                      flush=True)
        finally:
            llm.close()
    med = {k: statistics.median(v) for k, v in samples.items() if v}
    modes = [m for m in ("single", "batch", "long") if f"ours_{m}" in med]
    ratios = {mode: med[f"ours_{mode}"] / med[f"hf_{mode}"] for mode in modes}
    same = {"single": tokens["ours_single"] == tokens["hf_single"],
            "batch": sum(a[:16] == b[:16] for a, b in zip(tokens["ours_batch"], tokens["hf_batch"]))}
    if args.long:
        same["long"] = tokens["ours_long"] == tokens["hf_long"]
        diverge = next((i for i, (a, b) in enumerate(zip(tokens["ours_long"], tokens["hf_long"])) if a != b), None)
        if diverge is not None:  # a near tie in transformers' own scores, or an error: say which
            same["long_first_difference"] = {"step": diverge, "hf_top2_margin": round(margins[diverge], 5)}
    print(f"model: {args.layers} layers (1 dense), hidden 512, 8 heads, latent 128 + 16, 64 experts of 128, top-8")
    print(f"single stream: ours {med['ours_single']:.1f} tok/s, transformers {med['hf_single']:.1f}, "
          f"{ratios['single']:.2f}x (same tokens: {same['single']})")
    print(f"{args.batch} x {args.tokens}: ours {med['ours_batch']:.1f} tok/s, transformers (padded batch) "
          f"{med['hf_batch']:.1f}, {ratios['batch']:.2f}x (same first 16 tokens: {same['batch']} of {args.batch})")
    if args.long:
        print(f"long context ({args.long} prompt tokens, {args.long_tokens} decoded): decode ours "
              f"{med['ours_long']:.1f} tok/s, transformers {med['hf_long']:.1f}, {ratios['long']:.2f}x; TTFT ours "
              f"{statistics.median(ttft['ours_long']):.1f} s, transformers {statistics.median(ttft['hf_long']):.1f} s "
              f"(same tokens: {same['long']})")
    print(json.dumps({"runs": args.runs, "medians_tok_s": {k: round(v, 2) for k, v in med.items()},
                      "ttft_long_s": {k: round(statistics.median(v), 2) for k, v in ttft.items() if v},
                      "ratios": {k: round(v, 3) for k, v in ratios.items()}, "same": same}))


if __name__ == "__main__":
    main()
