"""Claim: the native CPU kernels (atb_plugin/ops/cpu_native.py: C decode attention over the paged
cache, RMSNorm, rotary, SiLU-and-mul) make the engine faster than the same engine on torch ops,
with the same greedy tokens. SmolLM2-135M-Instruct fp32, one torch thread.

Both sides are the same ``LLM`` in one process: ``ATB_PLUGIN_CPU_KERNELS`` is read every step, so
runs alternate native / torch (order swapped every run), and the ratio of medians is printed.
The linear layers are laid out when the model loads: since the native linear kernel exists they
are ``PanelLinear`` here, so the torch side runs their torch fallback (one batched matmul over
the panels), not oneDNN; the linear kernel against oneDNN is bench_linear.py's claim.

  single     one prompt, --tokens new tokens through ``LLMEngine.step`` (decode tok/s after the
             first token), as bench_engine.py measures it;
  batch      --batch prompts x --tokens tokens through ``LLM.generate``;
  attention  decode attention alone: --batch requests with contexts of 100-255 tokens, 30 layers'
             caches (as many as SmolLM2 has: each layer's K/V comes from memory, not cache),
             ``torch_kernels.paged_attention`` on each path.

Last line: JSON with single / batch / attention for both paths and the ratios.

    python benchmarks/bench_cpu_kernels.py [--runs 5] [--tokens 128] [--batch 32]
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_engine as a sibling module
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_engine import ab_arguments, ab_summary, chats, ours_batch, ours_single  # noqa: E402

from atb_plugin import LLM, SamplingParams  # noqa: E402
from atb_plugin.default_model import default_model_dir  # noqa: E402
from atb_plugin.ops import AttentionMetadata, cpu_native, torch_kernels  # noqa: E402

PATHS = ("native", "torch")


def attention_case(batch: int, layers: int = 30, heads: int = 9, kv_heads: int = 3, head_dim: int = 64,
                   block_size: int = 16):
    """SmolLM2's attention shapes: ``batch`` decodes over shuffled blocks, one cache per layer."""
    gen = torch.Generator().manual_seed(0)
    lens = torch.randint(100, 256, (batch,), generator=gen, dtype=torch.int32)
    blocks = ((lens + block_size - 1) // block_size).tolist()
    num_blocks = 1 + sum(blocks)
    order = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    tables = []
    for count in blocks:
        tables.append(order[:count] + [0] * (max(blocks) - count))
        order = order[count:]
    caches = [(torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen),
               torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen)) for _ in range(layers)]
    query = torch.randn(batch, heads, head_dim, generator=gen)
    metadata = AttentionMetadata(
        query_start_loc=torch.arange(batch + 1, dtype=torch.int32), seq_lens=lens,
        block_tables=torch.tensor(tables, dtype=torch.int32), slot_mapping=torch.zeros(batch, dtype=torch.int64),
        max_query_len=1, max_seq_len=int(lens.max()))
    return query, caches, metadata, head_dim ** -0.5


def attention_ms(case) -> float:
    query, caches, metadata, scale = case
    metadata.step_cache.clear()  # a new step: the path is chosen again
    start = time.perf_counter()
    for key_cache, value_cache in caches:
        torch_kernels.paged_attention(query, key_cache, value_cache, metadata, scale)
    return (time.perf_counter() - start) * 1e3


def main() -> None:
    args = ab_arguments(__doc__)
    if cpu_native.library_for(torch.float32, torch.device("cpu")) is None:
        sys.exit("the native CPU kernels did not build here (see the warning above): nothing to compare")

    llm = LLM(default_model_dir(), max_num_seqs=args.batch, max_num_batched_tokens=2048, num_threads=1)
    prompts = [llm.router.input_builder.make_context(0, chat) for chat in chats(args.batch)]
    llm.generate([prompts[0]], SamplingParams(temperature=0, max_tokens=4))  # warm-up
    case = attention_case(args.batch)
    results = {path: {"single_tok_s": [], "batch_tok_s": [], "attention_ms": []} for path in PATHS}
    tokens = {}
    for run in range(args.runs):
        for path in PATHS if run % 2 == 0 else PATHS[::-1]:
            os.environ[cpu_native.KERNELS_ENV] = path
            _, single, single_tokens = ours_single(llm, prompts[0], args.tokens)
            batch, batch_tokens = ours_batch(llm, prompts, args.tokens)
            results[path]["single_tok_s"].append(single)
            results[path]["batch_tok_s"].append(batch)
            results[path]["attention_ms"].append(statistics.median(attention_ms(case) for _ in range(3)))
            tokens[path] = (single_tokens, batch_tokens)
            print(f"run {run} {path:>6}: single {single:.1f} tok/s, {args.batch} x {args.tokens} {batch:.1f} tok/s, "
                  f"attention {results[path]['attention_ms'][-1]:.1f} ms", flush=True)
    llm.close()

    med = {path: {k: statistics.median(v) for k, v in r.items()} for path, r in results.items()}
    ratios = {"single": med["native"]["single_tok_s"] / med["torch"]["single_tok_s"],
              "batch": med["native"]["batch_tok_s"] / med["torch"]["batch_tok_s"],
              "attention": med["torch"]["attention_ms"] / med["native"]["attention_ms"]}
    print(f"SmolLM2-135M-Instruct fp32, 1 torch thread, medians of {args.runs} interleaved runs")
    print(f"single stream: native {med['native']['single_tok_s']:.1f} vs torch ops {med['torch']['single_tok_s']:.1f} "
          f"tok/s ({ratios['single']:.2f}x)")
    print(f"{args.batch} x {args.tokens}: native {med['native']['batch_tok_s']:.1f} vs torch ops "
          f"{med['torch']['batch_tok_s']:.1f} tok/s ({ratios['batch']:.2f}x)")
    print(f"decode attention, {args.batch} requests x 30 layers: native {med['native']['attention_ms']:.1f} vs "
          f"torch (gather + SDPA) {med['torch']['attention_ms']:.1f} ms ({ratios['attention']:.2f}x faster)")
    ab_summary(args.runs, med, ratios, tokens["native"], tokens["torch"], args.batch)


if __name__ == "__main__":
    main()
