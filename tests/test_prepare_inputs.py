"""InputBatch and prepare_inputs.

1. The worked example of vllm-ascend's prepare_inputs design guide ("Prepare inputs for model
   forwarding", "the guide" below: max 10 tokens per step, block size 2, prompts 3 / 2 / 8, max
   model len 12), both steps, every table it prints typed here as a literal and compared with our
   arrays.
2. Random batches (hypothesis; requests added and removed so rows are reused) against a per-token
   Python reference that reads a plain-Python model of the batch, not the batch's tables.
3. Row reuse, null-block padding, bounds checks.
4. The metadata drives the real attention: a tiny Qwen2 run through the guide's steps (plus decodes)
   gives, token for token, the logits ``SequenceRunner`` gives for each request alone.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from atb_plugin.engine.input_batch import InputBatch, cdiv
from atb_plugin.engine.prepare_inputs import PreparedInputs, attention_mask, prepare_inputs

# --------------------------------------------------------------------------------------------------
# 1. The guide's example
# --------------------------------------------------------------------------------------------------

MAX_NUM_REQS, MAX_MODEL_LEN, BLOCK_SIZE = 4, 12, 2  # the guide draws 4 rows ("......" beyond)
PROMPT_LENS = {"0": 3, "1": 2, "2": 8}


def T(request: int, index: int) -> int:
    """The guide's token ``T_<request>_<index>`` as an int (distinct for every token of the example).
    (The guide's token tables write request 2's tokens T_2_0, T_2_1, T_3_2 ... T_3_7: a typo for T_2_*,
    as its input ids of step 2, "T_3_5, T_3_6, T_3_7" = token indices 29, 30, 31 = row 2, show.)"""
    return 100 * (request + 1) + index


Q = -1  # "?" in the guide's token tables: a cell that holds nothing yet


def token_table_matches(batch: InputBatch, expected: list[list[int]]) -> bool:
    """Compare the cells the guide fills (not its ``?``) and check that nothing else is live."""
    expected = np.array(expected)
    live = expected != Q
    table = batch.token_ids_cpu[: len(expected)]
    return bool((table[live] == expected[live]).all() and (live.sum(axis=1) == batch.num_tokens_cpu[:4]).all())


@pytest.fixture
def seed_batch():
    batch = InputBatch(MAX_NUM_REQS, MAX_MODEL_LEN, BLOCK_SIZE)
    # Step 1's block table: request 0 -> blocks 1, 2; request 1 -> 3; request 2 -> 4, 5, 6.
    for request, block_ids in (("0", [1, 2]), ("1", [3]), ("2", [4, 5, 6])):
        r = int(request)
        row = batch.add_request(request, [T(r, j) for j in range(PROMPT_LENS[request])], 0, block_ids)
        assert row == r
    return batch


def check_step_1(batch: InputBatch) -> PreparedInputs:
    """Step 1: all requests prefill; {'0': 3, '1': 2, '2': 5} (request 2 chunked, 3 tokens left)."""
    assert token_table_matches(batch, [
        [T(0, 0), T(0, 1), T(0, 2), Q, Q, Q, Q, Q, Q, Q, Q, Q],
        [T(1, 0), T(1, 1), Q, Q, Q, Q, Q, Q, Q, Q, Q, Q],
        [T(2, 0), T(2, 1), T(2, 2), T(2, 3), T(2, 4), T(2, 5), T(2, 6), T(2, 7), Q, Q, Q, Q],
        [Q, Q, Q, Q, Q, Q, Q, Q, Q, Q, Q, Q],
    ])
    assert batch.block_table_cpu.tolist() == [
        [1, 2, 0, 0, 0, 0],
        [3, 0, 0, 0, 0, 0],
        [4, 5, 6, 0, 0, 0],
        [0, 0, 0, 0, 0, 0],
    ]
    p = prepare_inputs(batch, ["0", "1", "2"], [3, 2, 5])
    assert p.num_tokens == 10  # the step's token budget, used up
    assert p.req_indices.tolist() == [0, 0, 0, 1, 1, 2, 2, 2, 2, 2]
    assert p.positions_cpu.tolist() == [0, 1, 2, 0, 1, 0, 1, 2, 3, 4]
    assert p.token_indices.tolist() == [0, 1, 2, 12, 13, 24, 25, 26, 27, 28]
    assert p.input_ids_cpu.tolist() == [T(0, 0), T(0, 1), T(0, 2), T(1, 0), T(1, 1),
                                        T(2, 0), T(2, 1), T(2, 2), T(2, 3), T(2, 4)]
    assert p.block_table_indices.tolist() == [0, 0, 1, 6, 6, 12, 12, 13, 13, 14]
    assert p.block_numbers.tolist() == [1, 1, 2, 3, 3, 4, 4, 5, 5, 6]
    assert p.block_offsets.tolist() == [0, 1, 0, 0, 1, 0, 1, 0, 1, 0]
    assert p.slot_mapping_cpu.tolist() == [2, 3, 4, 6, 7, 8, 9, 10, 11, 12]
    assert p.query_start_loc_cpu.tolist() == [0, 3, 5, 10]
    assert p.seq_lens_cpu.tolist() == [3, 2, 5]
    assert p.num_computed_tokens_cpu.tolist() == [0, 0, 0]
    assert p.num_reqs == 3
    assert p.num_scheduled_tokens.tolist() == [3, 2, 5]
    assert p.max_query_len == 5
    # One 5 x 5 causal matrix, reused by every request (all start their prefill).
    assert attention_mask(p).astype(int).tolist() == [
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [1, 1, 1, 0, 0],
        [1, 1, 1, 1, 0],
        [1, 1, 1, 1, 1],
    ]
    # Not printed by the guide, implied by it: requests 0 and 1 finish their prompt and sample;
    # request 2's chunk stops 3 tokens short and does not.
    assert p.logits_indices_cpu.tolist() == [2, 4, 9]
    assert p.samples.tolist() == [True, True, False]
    return p


def advance_to_step_2(batch: InputBatch, sampled: dict[str, int]) -> None:
    for request, n in (("0", 3), ("1", 2), ("2", 5)):
        batch.set_num_computed_tokens(request, n)
    batch.append_token("0", sampled["0"])  # T_0_3 and T_1_2: sampled from step 1's output
    batch.append_token("1", sampled["1"])
    batch.append_block_ids("1", [7])  # "we assign blocks 7 and 8 to request_1 and request_2"
    batch.append_block_ids("2", [8])


def check_step_2(batch: InputBatch, ids: dict[str, int]) -> PreparedInputs:
    """Step 2: chunked prefill; {'0': 1, '1': 1, '2': 3}."""
    assert token_table_matches(batch, [
        [T(0, 0), T(0, 1), T(0, 2), ids["T_0_3"], Q, Q, Q, Q, Q, Q, Q, Q],
        [T(1, 0), T(1, 1), ids["T_1_2"], Q, Q, Q, Q, Q, Q, Q, Q, Q],
        [T(2, 0), T(2, 1), T(2, 2), T(2, 3), T(2, 4), T(2, 5), T(2, 6), T(2, 7), Q, Q, Q, Q],
        [Q, Q, Q, Q, Q, Q, Q, Q, Q, Q, Q, Q],
    ])
    assert batch.block_table_cpu.tolist() == [
        [1, 2, 0, 0, 0, 0],
        [3, 7, 0, 0, 0, 0],
        [4, 5, 6, 8, 0, 0],
        [0, 0, 0, 0, 0, 0],
    ]
    p = prepare_inputs(batch, ["0", "1", "2"], [1, 1, 3])
    assert p.req_indices.tolist() == [0, 1, 2, 2, 2]
    assert p.positions_cpu.tolist() == [3, 2, 5, 6, 7]
    assert p.token_indices.tolist() == [3, 14, 29, 30, 31]
    assert p.input_ids_cpu.tolist() == [ids["T_0_3"], ids["T_1_2"], T(2, 5), T(2, 6), T(2, 7)]
    assert p.block_table_indices.tolist() == [1, 7, 14, 15, 15]
    assert p.block_numbers.tolist() == [2, 7, 6, 8, 8]
    assert p.block_offsets.tolist() == [1, 0, 1, 0, 1]
    assert p.slot_mapping_cpu.tolist() == [5, 14, 13, 16, 17]
    assert p.num_scheduled_tokens.tolist() == [1, 1, 3]
    assert p.query_start_loc_cpu.tolist() == [0, 1, 2, 5]
    assert p.seq_lens_cpu.tolist() == [4, 3, 8]
    assert p.num_computed_tokens_cpu.tolist() == [3, 2, 5]
    assert p.num_reqs == 3
    assert p.max_query_len == 3
    # 5 x 8: each of the 5 scheduled tokens has a 1 x 8 row (keys up to its own position).
    assert attention_mask(p).astype(int).tolist() == [
        [1, 1, 1, 1, 0, 0, 0, 0],  # request 0, position 3
        [1, 1, 1, 0, 0, 0, 0, 0],  # request 1, position 2
        [1, 1, 1, 1, 1, 1, 0, 0],  # request 2, position 5
        [1, 1, 1, 1, 1, 1, 1, 0],  # request 2, position 6
        [1, 1, 1, 1, 1, 1, 1, 1],  # request 2, position 7
    ]
    assert p.logits_indices_cpu.tolist() == [0, 1, 4]
    assert p.samples.tolist() == [True, True, True]  # request 2 finishes its prompt this time
    return p


def test_seed_example_both_steps(seed_batch):
    check_step_1(seed_batch)
    advance_to_step_2(seed_batch, {"0": T(0, 3), "1": T(1, 2)})
    check_step_2(seed_batch, {"T_0_3": T(0, 3), "T_1_2": T(1, 2)})


def test_seed_example_metadata_tensors(seed_batch):
    p = check_step_1(seed_batch)
    m = p.attn_metadata
    assert m.query_start_loc.tolist() == [0, 3, 5, 10] and m.query_start_loc.dtype == torch.int32
    assert m.seq_lens.tolist() == [3, 2, 5] and m.seq_lens.dtype == torch.int32
    assert m.slot_mapping.tolist() == [2, 3, 4, 6, 7, 8, 9, 10, 11, 12] and m.slot_mapping.dtype == torch.int64
    assert m.block_tables.tolist() == [[1, 2, 0], [3, 0, 0], [4, 5, 6]]  # rows to cdiv(max_seq_len, 2) = 3
    assert m.block_tables.dtype == torch.int32
    assert (m.max_query_len, m.max_seq_len, m.num_reqs) == (5, 5, 3)
    assert m.query_start_loc_cpu.tolist() == [0, 3, 5, 10] and m.seq_lens_cpu.tolist() == [3, 2, 5]
    assert m.is_prefill_only and not m.is_decode_only
    assert p.input_ids.dtype == p.positions.dtype == p.logits_indices.dtype == torch.long
    assert p.positions.tolist() == [0, 1, 2, 0, 1, 0, 1, 2, 3, 4]
    assert p.logits_indices.tolist() == [2, 4, 9]

    advance_to_step_2(seed_batch, {"0": T(0, 3), "1": T(1, 2)})
    m = check_step_2(seed_batch, {"T_0_3": T(0, 3), "T_1_2": T(1, 2)}).attn_metadata
    assert m.block_tables.tolist() == [[1, 2, 0, 0], [3, 7, 0, 0], [4, 5, 6, 8]]
    assert m.num_computed_tokens_cpu.tolist() == [3, 2, 5]
    assert not m.is_prefill_only and not m.is_decode_only and m.max_seq_len == 8


def test_prepared_arrays_do_not_alias_the_batch(seed_batch):
    p = prepare_inputs(seed_batch, ["0", "1", "2"], [3, 2, 5])
    seed_batch.block_table_cpu[:] = 99
    seed_batch.token_ids_cpu[:] = 99
    assert p.attn_metadata.block_tables.tolist() == [[1, 2, 0], [3, 0, 0], [4, 5, 6]]
    assert p.input_ids.tolist()[:3] == [T(0, 0), T(0, 1), T(0, 2)]


def test_attention_mask_is_what_the_npu_kernels_apply(seed_batch):
    """Our debug mask is the complement of the masks the NPU path builds (there 0 = visible)."""
    from atb_plugin.ops.npu_kernels import _prefill_mask, _splitfuse_mask

    p = prepare_inputs(seed_batch, ["0", "1", "2"], [3, 2, 5])
    kernel = _prefill_mask(p.attn_metadata.max_seq_len, torch.float32, "cpu")
    assert np.array_equal(attention_mask(p), (kernel == 0).numpy())
    advance_to_step_2(seed_batch, {"0": 7, "1": 8})
    p = prepare_inputs(seed_batch, ["0", "1", "2"], [1, 1, 3])
    kernel = _splitfuse_mask(p.positions, p.attn_metadata.max_seq_len, torch.float32)
    assert np.array_equal(attention_mask(p), (kernel == 0).numpy())


# --------------------------------------------------------------------------------------------------
# 2. Random batches against a per-token reference
# --------------------------------------------------------------------------------------------------


def reference_prepare(requests: dict, rows: dict, max_model_len: int, block_size: int,
                      request_ids: list[str], num_scheduled: list[int]) -> dict:
    """The guide's recipe, one token at a time, from plain lists: ``requests[id] = (token_ids,
    num_computed, block_ids)``, ``rows[id]`` = the row the batch should have given it."""
    max_blocks = cdiv(max_model_len, block_size)
    out = {k: [] for k in ("req_indices", "positions", "token_indices", "input_ids", "block_table_indices",
                           "block_numbers", "block_offsets", "slot_mapping", "seq_lens", "num_computed",
                           "logits_indices", "samples")}
    query_start_loc = [0]
    for i, (request_id, n) in enumerate(zip(request_ids, num_scheduled)):
        token_ids, computed, block_ids = requests[request_id]
        row = rows[request_id]
        for j in range(n):
            position = computed + j
            out["req_indices"].append(i)
            out["positions"].append(position)
            out["token_indices"].append(row * max_model_len + position)
            out["input_ids"].append(token_ids[position])
            out["block_table_indices"].append(row * max_blocks + position // block_size)
            out["block_numbers"].append(block_ids[position // block_size])
            out["block_offsets"].append(position % block_size)
            out["slot_mapping"].append(block_ids[position // block_size] * block_size + position % block_size)
        query_start_loc.append(query_start_loc[-1] + n)
        out["seq_lens"].append(computed + n)
        out["num_computed"].append(computed)
        out["logits_indices"].append(query_start_loc[-1] - 1)
        out["samples"].append(computed + n == len(token_ids))
    out["query_start_loc"] = query_start_loc
    out["max_query_len"] = max(num_scheduled)
    max_seq_len = max(out["seq_lens"])
    out["block_tables"] = [[(requests[r][2] + [0] * max_blocks)[b] for b in range(cdiv(max_seq_len, block_size))]
                           for r in request_ids]
    if all(c == 0 for c in out["num_computed"]):
        size = out["max_query_len"]
        out["mask"] = [[k <= q for k in range(size)] for q in range(size)]
    else:
        out["mask"] = [[k <= position for k in range(max_seq_len)] for position in out["positions"]]
    return out


def assert_matches_reference(p: PreparedInputs, ref: dict) -> None:
    pairs = {
        "req_indices": p.req_indices, "positions": p.positions_cpu, "token_indices": p.token_indices,
        "input_ids": p.input_ids_cpu, "block_table_indices": p.block_table_indices,
        "block_numbers": p.block_numbers, "block_offsets": p.block_offsets, "slot_mapping": p.slot_mapping_cpu,
        "seq_lens": p.seq_lens_cpu, "num_computed": p.num_computed_tokens_cpu,
        "logits_indices": p.logits_indices_cpu, "samples": p.samples, "query_start_loc": p.query_start_loc_cpu,
        "block_tables": p.block_tables_cpu, "mask": attention_mask(p),
    }
    for name, ours in pairs.items():
        assert ours.tolist() == ref[name], name
    assert p.max_query_len == ref["max_query_len"]
    m = p.attn_metadata
    assert m.query_start_loc.tolist() == ref["query_start_loc"] and m.seq_lens.tolist() == ref["seq_lens"]
    assert m.slot_mapping.tolist() == ref["slot_mapping"] and m.block_tables.tolist() == ref["block_tables"]
    assert p.input_ids.tolist() == ref["input_ids"] and p.positions.tolist() == ref["positions"]
    assert p.logits_indices.tolist() == ref["logits_indices"]
    assert m.max_seq_len == max(ref["seq_lens"]) and m.max_query_len == ref["max_query_len"]


@settings(max_examples=150, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), max_num_reqs=st.integers(1, 8), max_model_len=st.integers(1, 40),
       block_size=st.sampled_from([1, 2, 3, 4, 16]), num_ops=st.integers(1, 24))
def test_random_batches_match_the_per_token_reference(seed, max_num_reqs, max_model_len, block_size, num_ops):
    rng = np.random.default_rng(seed)
    batch = InputBatch(max_num_reqs, max_model_len, block_size)
    max_blocks = cdiv(max_model_len, block_size)
    requests, rows, free_rows, next_id = {}, {}, set(range(max_num_reqs)), 0
    unused_blocks = list(rng.permutation(np.arange(1, 1000)))

    def add():
        nonlocal next_id
        num_tokens = int(rng.integers(1, max_model_len + 1))
        token_ids = rng.integers(-50, 50_000, num_tokens).tolist()  # negatives: media handle slots
        computed = int(rng.integers(0, num_tokens))
        block_ids = [int(unused_blocks.pop()) for _ in range(int(rng.integers(cdiv(num_tokens, block_size),
                                                                                max_blocks + 1)))]
        request_id = f"req-{next_id}"
        next_id += 1
        row = batch.add_request(request_id, token_ids, computed, block_ids)
        assert row == min(free_rows)  # the lowest free row is reused
        free_rows.discard(row)
        requests[request_id], rows[request_id] = (token_ids, computed, block_ids), row

    for _ in range(num_ops):
        if free_rows and (not requests or rng.random() < 0.65):
            add()
        else:
            victim = list(requests)[int(rng.integers(len(requests)))]
            batch.remove_request(victim)
            free_rows.add(rows.pop(victim))
            del requests[victim]
    if not requests:
        add()
    # A decode-like update on some requests: one more token (and a block when it needs one).
    for request_id, (token_ids, computed, block_ids) in list(requests.items()):
        if len(token_ids) < max_model_len and rng.random() < 0.3:
            token_ids.append(int(rng.integers(0, 50_000)))
            batch.append_token(request_id, token_ids[-1])
            if cdiv(len(token_ids), block_size) > len(block_ids):
                block_ids.append(int(unused_blocks.pop()))
                batch.append_block_ids(request_id, block_ids[-1:])
        if rng.random() < 0.2:
            computed = int(rng.integers(0, len(token_ids)))
            batch.set_num_computed_tokens(request_id, computed)
        requests[request_id] = (token_ids, computed, block_ids)
    # Free rows hold nothing in the block table (the null-block padding contract).
    assert not batch.block_table_cpu[sorted(free_rows)].any()
    for request_id, (token_ids, _, block_ids) in requests.items():
        assert batch.token_ids(request_id).tolist() == token_ids
        assert batch.block_table_cpu[rows[request_id]].tolist() == block_ids + [0] * (max_blocks - len(block_ids))

    scheduled = [r for r in rng.permutation(list(requests)).tolist() if rng.random() < 0.8] or [next(iter(requests))]
    num_scheduled = [int(rng.integers(1, len(requests[r][0]) - requests[r][1] + 1)) for r in scheduled]
    p = prepare_inputs(batch, scheduled, np.array(num_scheduled))
    assert_matches_reference(p, reference_prepare(requests, rows, max_model_len, block_size, scheduled, num_scheduled))


# --------------------------------------------------------------------------------------------------
# 3. Rows, padding, bounds
# --------------------------------------------------------------------------------------------------


def test_rows_are_reused_and_padded_with_the_null_block():
    batch = InputBatch(3, 16, 4)
    assert [batch.add_request(r, list(range(10)), 0, [5 + i, 8 + i, 11 + i]) for i, r in enumerate("abc")] == [0, 1, 2]
    with pytest.raises(RuntimeError, match="full"):
        batch.add_request("d", [1], 0, [20])
    batch.remove_request("b")
    assert "b" not in batch and batch.num_reqs == 2 and batch.request_ids == ["a", "c"]
    assert batch.block_table_cpu[1].tolist() == [0, 0, 0, 0]
    # The new request gets row 1, with fewer tokens and blocks than "b" had: nothing of "b" shows.
    assert batch.add_request("d", [42, 43], 1, [30]) == 1
    assert batch.block_table_cpu[1].tolist() == [30, 0, 0, 0]
    assert batch.request_ids == ["a", "d", "c"] and batch.request_id_of_row(1) == "d"
    p = prepare_inputs(batch, ["c", "d", "a"], [3, 1, 10])
    assert p.rows.tolist() == [2, 1, 0]
    assert p.input_ids_cpu.tolist() == [0, 1, 2, 43] + list(range(10))
    assert p.positions_cpu.tolist() == [0, 1, 2, 1] + list(range(10))
    assert p.block_tables_cpu.tolist() == [[7, 10, 13], [30, 0, 0], [5, 8, 11]]  # 0-padded to cdiv(10, 4)
    assert p.slot_mapping_cpu.tolist()[:4] == [28, 29, 30, 121]
    assert p.samples.tolist() == [False, True, True]
    batch.remove_request("a")
    batch.remove_request("c")
    assert batch.add_request("e", [1], 0, [2]) == 0  # lowest free row first
    assert batch.block_table_cpu[2].tolist() == [0, 0, 0, 0]


def test_block_table_width_rounds_up():
    batch = InputBatch(2, 10, 4)  # a 10-token request needs 3 blocks of 4
    assert batch.block_table_cpu.shape == (2, 3)
    batch.add_request("a", list(range(10)), 0, [1, 2, 3])
    assert prepare_inputs(batch, ["a"], [10]).slot_mapping_cpu.tolist()[-2:] == [12, 13]


BAD_CALLS = [
    (lambda b: b.add_request("x", [1, 2], 0, [1]), "already in the input batch"),
    (lambda b: b.add_request("y", [1] * 9, 0, [1]), "exceed max_model_len"),
    (lambda b: b.add_request("y", [1, 2], 3, [1]), "num_computed_tokens=3"),
    (lambda b: b.add_request("y", [1, 2], 0, [1, 2, 3, 4, 5]), "blocks exceed"),
    (lambda b: b.add_request("y", [1, 2], 0, [0]), "null block"),
    (lambda b: b.add_request("y", [2**31], 0, [1]), "int32"),
    (lambda b: b.append_block_ids("x", [2, 3, 4, 5]), "5 blocks exceed"),
    (lambda b: [b.append_token("x", 7) for _ in range(7)], "already holds max_model_len=8"),
    (lambda b: b.set_num_computed_tokens("x", 3), r"not in \[0, 2\]"),
    (lambda b: b.remove_request("nope"), "not in the input batch"),
    (lambda b: prepare_inputs(b, ["x"], [3]), "exceed the 2 tokens"),
    (lambda b: prepare_inputs(b, ["x"], [0]), ">= 1 token"),
    (lambda b: prepare_inputs(b, ["x", "x"], [1, 1]), "scheduled twice"),
    (lambda b: prepare_inputs(b, ["x"], [1, 1]), "one entry per request"),
    (lambda b: prepare_inputs(b, ["x"], [[1]]), "one entry per request"),
    (lambda b: prepare_inputs(b, [], []), "at least one"),
    (lambda b: prepare_inputs(b, ["nope"], [1]), "not in the input batch"),
]


@pytest.mark.parametrize("action, message", BAD_CALLS, ids=[f"{i}-{m}" for i, (_, m) in enumerate(BAD_CALLS)])
def test_bad_calls_are_refused_with_a_reason(action, message):
    batch = InputBatch(2, 8, 2)
    batch.add_request("x", [1, 2], 0, [1])
    with pytest.raises((RuntimeError, KeyError), match=message):  # our invariants, not input errors
        action(batch)


def test_blocks_must_cover_the_scheduled_tokens():
    batch = InputBatch(2, 8, 2)
    batch.add_request("x", [1, 2, 3], 0, [1])  # 3 tokens, one block of 2: the scheduler owes a block
    assert prepare_inputs(batch, ["x"], [2]).slot_mapping_cpu.tolist() == [2, 3]
    with pytest.raises(RuntimeError, match="need 2 blocks, the batch has 1"):
        prepare_inputs(batch, ["x"], [3])
    batch.append_token("x", 4)
    batch.append_block_ids("x", [6])
    assert prepare_inputs(batch, ["x"], [4]).slot_mapping_cpu.tolist() == [2, 3, 12, 13]


# --------------------------------------------------------------------------------------------------
# 4. End to end: the metadata drives the model's paged attention like SequenceRunner's does
# --------------------------------------------------------------------------------------------------


def test_tiny_model_batched_steps_match_sequence_runner_per_request():
    from atb_plugin.testing.sequence import SequenceRunner
    from atb_plugin.testing.tiny import tiny_checkpoint
    from routers import get_router

    path = tiny_checkpoint("qwen2")
    model = get_router(path).model_cls.from_pretrained(path)
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    prompts = {r: torch.randint(0, vocab, (n,), generator=gen).tolist() for r, n in PROMPT_LENS.items()}

    # The guide's example, then decode steps (block ids as the guide hands them out, then 9, 10, ...).
    batch = InputBatch(MAX_NUM_REQS, MAX_MODEL_LEN, BLOCK_SIZE)
    for r, block_ids in (("0", [1, 2]), ("1", [3]), ("2", [4, 5, 6])):
        batch.add_request(r, prompts[r], 0, block_ids)
    kv_caches = model.make_kv_caches(16, BLOCK_SIZE)
    schedules = [{"0": 3, "1": 2, "2": 5}, {"0": 1, "1": 1, "2": 3}, {"0": 1, "1": 1, "2": 1}, {"0": 1, "2": 1}]
    blocks_after_step = [{"1": [7], "2": [8]}, {"0": [9], "2": [10]}, {"1": [11]}, {}]
    ours = {r: {} for r in PROMPT_LENS}  # request -> position -> logits
    for step, schedule in enumerate(schedules):
        p = prepare_inputs(batch, list(schedule), list(schedule.values()))
        with torch.no_grad():
            logits = model.compute_logits(model(p.input_ids, p.positions, kv_caches, p.attn_metadata))
        for i, r in enumerate(p.request_ids):
            start = int(p.query_start_loc_cpu[i])
            for j, position in enumerate(p.positions_cpu[p.req_indices == i].tolist()):
                ours[r][position] = logits[start + j]
            batch.set_num_computed_tokens(r, int(p.seq_lens_cpu[i]))
            if p.samples[i]:  # greedy: the next token comes from the last scheduled token's logits
                batch.append_token(r, int(logits[p.logits_indices[i]].argmax()))
        for r, block_ids in blocks_after_step[step].items():
            batch.append_block_ids(r, block_ids)
    assert batch.block_ids("2").tolist() == [4, 5, 6, 8, 10]

    for r in PROMPT_LENS:
        token_ids = torch.tensor(batch.token_ids(r).tolist()[: int(batch.num_computed_tokens_cpu[batch.row(r)])])
        expected = SequenceRunner(model, max_len=MAX_MODEL_LEN, block_size=BLOCK_SIZE).step(token_ids)
        got = torch.stack([ours[r][position] for position in range(len(token_ids))])
        assert (got - expected).abs().max() <= 1e-4, r
