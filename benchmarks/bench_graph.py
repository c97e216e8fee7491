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
message, since the CPU's captured step is measured by bench_decode_capture.py. Not run yet: no
GPU or NPU was lent while graph mode was built (benchmarks/RESULTS.md says so).

    python benchmarks/bench_graph.py [--runs 3] [--tokens 64] [--batches 1 8 32] [--device auto]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from atb_plugin import LLM, SamplingParams  # noqa: E402
from atb_plugin.default_model import default_model_dir  # noqa: E402
from atb_plugin.platform import platform_for  # noqa: E402

QWEN2_5_0_5B = {"hidden_size": 896, "intermediate_size": 4864, "num_attention_heads": 14, "num_key_value_heads": 2,
                "num_hidden_layers": 24, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "tie_word_embeddings": True,
                "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "max_position_embeddings": 4096}
SIDES = ("graphs", "eager")


def qwen2_5_shaped_checkpoint() -> Path:
    """The Qwen2.5-0.5B-shaped random checkpoint (std 0.02 weights, unit norms, q/k/v biases, a tied
    head), SmolLM2's tokenizer; written once into the cache."""
    from safetensors.torch import save_file

    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "atb-plugin" / "models"
    out = base / "qwen2.5-0.5b-shape-random-smollm2-vocab"
    if (out / ".complete").exists():
        return out
    base.mkdir(parents=True, exist_ok=True)
    source = default_model_dir()
    config = {**json.loads((source / "config.json").read_text()), **QWEN2_5_0_5B, "torch_dtype": "float32"}
    config.pop("rope_scaling", None)
    scratch = Path(tempfile.mkdtemp(dir=base, prefix=".qwen2.5-shape-"))
    for name in os.listdir(source):
        if name not in ("config.json", "model.safetensors") and (source / name).is_file():
            (scratch / name).write_bytes((source / name).read_bytes())
    (scratch / "config.json").write_text(json.dumps(config, indent=2))
    gen = torch.Generator().manual_seed(0)
    hidden, inter, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    head_dim = hidden // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim

    def w(*shape):
        return torch.randn(*shape, generator=gen) * 0.02

    state = {"model.embed_tokens.weight": w(vocab, hidden), "model.norm.weight": torch.ones(hidden)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        state.update({p + "input_layernorm.weight": torch.ones(hidden),
                      p + "post_attention_layernorm.weight": torch.ones(hidden),
                      p + "self_attn.q_proj.weight": w(q, hidden), p + "self_attn.q_proj.bias": w(q),
                      p + "self_attn.k_proj.weight": w(kv, hidden), p + "self_attn.k_proj.bias": w(kv),
                      p + "self_attn.v_proj.weight": w(kv, hidden), p + "self_attn.v_proj.bias": w(kv),
                      p + "self_attn.o_proj.weight": w(hidden, q), p + "mlp.gate_proj.weight": w(inter, hidden),
                      p + "mlp.up_proj.weight": w(inter, hidden), p + "mlp.down_proj.weight": w(hidden, inter)})
    save_file(state, str(scratch / "model.safetensors"), metadata={"format": "pt"})
    (scratch / ".complete").write_text("random Qwen2.5-0.5B-shaped weights, seed 0\n")
    try:
        scratch.rename(out)
    except OSError:  # another process finished first
        pass
    return out


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
        llms = {side: LLM(str(path), device=args.device, max_num_seqs=max(args.batches), enforce_eager=side == "eager",
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
