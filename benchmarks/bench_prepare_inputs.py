"""Claim (goal): ``prepare_inputs`` (vectorised numpy) is >= 30x faster than a straightforward
per-token Python loop computing the same arrays, for 256 running requests under an 8192-token
step budget.

Cases (max_model_len 4096, block size 128 as on Ascend, 256 rows in the batch, a third of them
removed and re-added so rows are not the scheduling order, which is shuffled too):

  mixed    240 decodes (context 64 .. 4000 tokens) + 16 prefill chunks of 497 tokens (first,
           middle and last chunks of prompts up to 4000 tokens) filling the 8192-token budget:
           the headline case
  decode   256 decodes, 256 tokens: where the fixed per-call cost of the vectorised path shows most

*ours* is the full ``prepare_inputs`` call (numpy arrays, torch tensors, ``AttentionMetadata``);
*loop* computes only the numpy arrays (request indices, positions, token indices, input ids,
block-table indices, block numbers, offsets, slot mapping, query start loc, seq lens, num
computed, block tables, logits indices, samples), one token at a time. Before timing, the script
asserts that every array of both is equal (values and dtypes).

Each round: one *loop* call; then one call of ours right after it (*cold*: what a call finds after
other work ran, as an engine step's call does after the model forward); then --burst calls of ours
back to back (*steady*, the time per call). Medians over --reps rounds after 3 warm-up rounds.
``speedup`` = loop / steady, ``speedup_cold`` = loop / cold. The last line is one JSON object (the
mixed case at top level).

    python benchmarks/bench_prepare_inputs.py [--reps 200] [--burst 10]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import numpy as np
import torch

from atb_plugin.engine.input_batch import InputBatch, cdiv
from atb_plugin.engine.prepare_inputs import prepare_inputs

MAX_NUM_REQS, MAX_MODEL_LEN, BLOCK_SIZE, TOKEN_BUDGET = 256, 4096, 128, 8192


def build_case(case: str, seed: int = 0):
    """A batch of 256 running requests and the step's schedule."""
    rng = np.random.default_rng(seed)
    batch = InputBatch(MAX_NUM_REQS, MAX_MODEL_LEN, BLOCK_SIZE)
    # Fill, then remove and re-add a third of the requests so rows are reused out of order.
    free_blocks = list(rng.permutation(np.arange(1, 256 * cdiv(MAX_MODEL_LEN, BLOCK_SIZE) + 1)))
    num_prefills = 16 if case == "mixed" else 0
    num_decodes = MAX_NUM_REQS - num_prefills
    budget_left = TOKEN_BUDGET - num_decodes
    chunk = budget_left // max(num_prefills, 1)
    specs = []
    for i in range(MAX_NUM_REQS):
        if i < num_decodes:
            context = int(rng.integers(64, 4000))  # tokens in the cache; the last sampled token is new
            specs.append((context + 1, context, 1))
        else:
            prompt = int(rng.integers(chunk + 1, 4000))
            # First, middle or last chunk of the prompt (only the last one samples).
            computed = (0, int(rng.integers(1, prompt - chunk)), prompt - chunk)[i % 3]
            specs.append((prompt, computed, chunk))

    def add(request_id, spec):
        num_tokens, computed, scheduled = spec
        token_ids = rng.integers(0, 150_000, num_tokens)
        blocks = [int(free_blocks.pop()) for _ in range(cdiv(computed + scheduled, BLOCK_SIZE))]
        batch.add_request(request_id, token_ids, computed, blocks)

    for i, spec in enumerate(specs):
        add(f"req-{i}", spec)
    for i in rng.permutation(MAX_NUM_REQS)[: MAX_NUM_REQS // 3]:
        free_blocks += batch.block_ids(f"req-{i}").tolist()
        batch.remove_request(f"req-{i}")
        add(f"req-{i}-again", specs[i])
    request_ids = [f"req-{i}" if f"req-{i}" in batch else f"req-{i}-again" for i in range(MAX_NUM_REQS)]
    order = rng.permutation(MAX_NUM_REQS)  # the scheduler's order is neither row nor arrival order
    request_ids = [request_ids[i] for i in order]
    num_scheduled = [specs[i][2] for i in order]
    return batch, request_ids, num_scheduled


def prepare_by_loop(batch: InputBatch, request_ids, num_scheduled) -> dict[str, np.ndarray]:
    """vllm-ascend's prepare_inputs recipe, one token at a time (the baseline)."""
    M, K, bs = batch.max_model_len, batch.max_blocks_per_req, batch.block_size
    token_table, block_table = batch.token_ids_cpu, batch.block_table_cpu
    req_indices, positions, token_indices, input_ids = [], [], [], []
    block_table_indices, block_numbers, block_offsets, slot_mapping = [], [], [], []
    query_start_loc, seq_lens, num_computed_tokens, logits_indices, samples, rows = [0], [], [], [], [], []
    for i, request_id in enumerate(request_ids):
        row = batch.row(request_id)
        computed = int(batch.num_computed_tokens_cpu[row])
        n = int(num_scheduled[i])
        for j in range(n):
            position = computed + j
            req_indices.append(i)
            positions.append(position)
            token_indices.append(row * M + position)
            input_ids.append(int(token_table[row, position]))
            block_table_indices.append(row * K + position // bs)
            block = int(block_table[row, position // bs])
            block_numbers.append(block)
            block_offsets.append(position % bs)
            slot_mapping.append(block * bs + position % bs)
        rows.append(row)
        query_start_loc.append(query_start_loc[-1] + n)
        seq_lens.append(computed + n)
        num_computed_tokens.append(computed)
        logits_indices.append(query_start_loc[-1] - 1)
        samples.append(computed + n == int(batch.num_tokens_cpu[row]))
    width = cdiv(max(seq_lens), bs)
    block_tables = [[int(block_table[row, b]) for b in range(width)] for row in rows]
    return {
        "req_indices": np.array(req_indices, dtype=np.int32), "positions_cpu": np.array(positions, dtype=np.int64),
        "token_indices": np.array(token_indices, dtype=np.int32), "input_ids_cpu": np.array(input_ids, dtype=np.int64),
        "block_table_indices": np.array(block_table_indices, dtype=np.int32),
        "block_numbers": np.array(block_numbers, dtype=np.int32),
        "block_offsets": np.array(block_offsets, dtype=np.int32),
        "slot_mapping_cpu": np.array(slot_mapping, dtype=np.int64),
        "query_start_loc_cpu": np.array(query_start_loc, dtype=np.int32),
        "seq_lens_cpu": np.array(seq_lens, dtype=np.int32),
        "num_computed_tokens_cpu": np.array(num_computed_tokens, dtype=np.int32),
        "block_tables_cpu": np.array(block_tables, dtype=np.int32),
        "logits_indices_cpu": np.array(logits_indices, dtype=np.int64), "samples": np.array(samples, dtype=bool),
    }


def check_equal(batch, request_ids, num_scheduled) -> int:
    ours = prepare_inputs(batch, request_ids, num_scheduled)
    reference = prepare_by_loop(batch, request_ids, num_scheduled)
    for name, expected in reference.items():
        got = getattr(ours, name)
        assert got.dtype == expected.dtype and np.array_equal(got, expected), name
    assert ours.input_ids.tolist() == reference["input_ids_cpu"].tolist()
    assert ours.attn_metadata.slot_mapping.tolist() == reference["slot_mapping_cpu"].tolist()
    return ours.num_tokens


def run_case(case: str, reps: int, burst: int) -> dict:
    batch, request_ids, num_scheduled = build_case(case)
    num_tokens = check_equal(batch, request_ids, num_scheduled)
    times = {"loop": [], "cold": [], "steady": []}
    for rep in range(reps + 3):
        start = time.perf_counter()
        prepare_by_loop(batch, request_ids, num_scheduled)
        loop = time.perf_counter() - start
        start = time.perf_counter()
        prepare_inputs(batch, request_ids, num_scheduled)  # right after the loop: caches cold
        cold = time.perf_counter() - start
        start = time.perf_counter()
        for _ in range(burst):  # back to back: caches warm
            prepare_inputs(batch, request_ids, num_scheduled)
        steady = (time.perf_counter() - start) / burst
        if rep >= 3:  # warm-up rounds
            for mode, value in (("loop", loop), ("cold", cold), ("steady", steady)):
                times[mode].append(value)
    loop, cold, steady = (statistics.median(times[m]) for m in ("loop", "cold", "steady"))
    return {"case": case, "num_reqs": len(request_ids), "num_tokens": num_tokens, "loop_ms": round(loop * 1e3, 3),
            "ours_ms": round(steady * 1e3, 4), "ours_cold_ms": round(cold * 1e3, 4),
            "speedup": round(loop / steady, 1), "speedup_cold": round(loop / cold, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=200)
    parser.add_argument("--burst", type=int, default=10, help="back-to-back calls of ours per round (steady)")
    args = parser.parse_args()
    print(f"python {platform.python_version()}, numpy {np.__version__}, torch {torch.__version__}, "
          f"{platform.machine()}, {os.cpu_count()} CPUs")
    results = [run_case(case, args.reps, args.burst) for case in ("mixed", "decode")]
    print(f"{'case':<7} {'reqs':>5} {'tokens':>7} {'loop ms':>8} {'ours ms':>8} {'cold ms':>8} "
          f"{'speedup':>8} {'cold speedup':>13}")
    for r in results:
        print(f"{r['case']:<7} {r['num_reqs']:>5} {r['num_tokens']:>7} {r['loop_ms']:>8.2f} {r['ours_ms']:>8.3f} "
              f"{r['ours_cold_ms']:>8.3f} {r['speedup']:>7.1f}x {r['speedup_cold']:>12.1f}x")
    mixed, decode = results
    print(json.dumps({**{k: v for k, v in mixed.items() if k != "case"}, "reps": args.reps, "burst": args.burst,
                      "decode": decode}))


if __name__ == "__main__":
    main()
