"""Head proposers (EAGLE, EAGLE-3, MTP; docs/speculative.md): tiny random heads in the layouts vLLM
loads are lossless (greedy token-identical to plain decoding, with prefix-cache hits, under a
forced preemption, with a json_schema request, under TP = 2 with the head on every rank); their incremental drafts equal a fresh head's over
each whole sequence (the KV bookkeeping); their weights and KV are inside the KV budget; the
configuration errors name what a method needs."""

from __future__ import annotations

import json

import pytest
import torch

from atb_plugin import LLM, SamplingParams
from atb_plugin.engine.config import EngineConfig
from atb_plugin.engine.spec_decode.head_proposer import HeadProposer
from atb_plugin.engine.spec_decode.hidden_states import TargetHiddenStates
from atb_plugin.testing.spec_heads import tiny_eagle_head, tiny_mtp_checkpoint
from atb_plugin.testing.tiny import tiny_checkpoint

PARAGRAPH = "the quick brown fox jumps over the lazy dog while the cat sleeps on the warm mat. "
PROMPTS = [PARAGRAPH * 3 + "the quick brown", "hello world", "numbers: 1 2 3 4 5 6 7 8 9 10 11 12", "a"]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
METHODS = ("eagle", "eagle3", "mtp")


def target_and_spec(method: str, k: int = 3):
    """(target checkpoint, speculative_config) of a head method on its tiny target."""
    if method == "mtp":
        return tiny_mtp_checkpoint("qwen2"), {"method": "mtp", "num_speculative_tokens": k}
    head = tiny_eagle_head("llama", eagle3=method == "eagle3")
    return tiny_checkpoint("llama"), {"method": method, "model": str(head), "num_speculative_tokens": k}


def token_ids(outputs):
    return [o.outputs[0].token_ids for o in outputs]


_plain: dict = {}


def plain(model, prompts=tuple(PROMPTS), params=GREEDY, **kwargs):
    """Plain decoding's tokens (cached per model and arguments)."""
    key = (str(model), prompts, repr(params), tuple(sorted(kwargs.items())))
    if key not in _plain:
        with LLM(model, block_size=kwargs.pop("block_size", 4), **kwargs) as llm:
            _plain[key] = token_ids(llm.generate(list(prompts), params))
    return _plain[key]


@pytest.mark.parametrize("method", METHODS)
def test_greedy_output_equals_plain_decoding_with_prefix_hits_and_preemption(method):
    model, spec = target_and_spec(method)
    reference = plain(model)
    with LLM(model, block_size=4, speculative_config=spec) as llm:
        assert token_ids(llm.generate(PROMPTS, GREEDY)) == reference
        stats = llm.engine.scheduler.spec_decoding
        drafts = stats.num_drafts
        assert drafts > 0 and stats.num_draft_tokens >= drafts
        # The same prompt again: its prefix comes from the cache (no target states there, the
        # head starts after it) and the tokens are still plain decoding's.
        again = llm.generate(PROMPTS[:1], GREEDY)[0]
        assert again.num_cached_tokens > 0 and again.outputs[0].token_ids == reference[0]
        assert stats.num_drafts > drafts
    with LLM(model, block_size=4, speculative_config=spec, kv_cache_blocks=40) as llm:
        assert token_ids(llm.generate(PROMPTS, GREEDY)) == reference
        assert llm.engine.scheduler.num_preemptions > 0


@pytest.mark.parametrize("method", ["eagle3", "mtp"])
def test_a_bfloat16_head_drafts_in_the_targets_dtype(method):
    """The head keeps the target's dtype (its int64 d2t and packed layers aside). Token identity
    is not asserted: bfloat16 rounding of a 1 + k row verify step may differ from a one-row step's
    at a near-tie (docs/speculative.md)."""
    model, spec = target_and_spec(method)
    with LLM(model, block_size=4, dtype="bfloat16", speculative_config=spec) as llm:
        outputs = llm.generate(PROMPTS, GREEDY)
        head = llm.engine.core.proposer.head
        assert llm.engine.scheduler.spec_decoding.num_drafts > 0
    assert all(len(ids) == GREEDY.max_tokens for ids in token_ids(outputs))
    assert head.dtype == torch.bfloat16 and head.make_kv_caches(1, 4)[0][0].dtype == torch.bfloat16


@pytest.mark.parametrize("method", METHODS)
def test_incremental_drafts_equal_a_fresh_head_over_the_whole_sequence(method):
    """Catch-up chunks, the roll-back past the head's own drafts, several requests per forward:
    at every call, each request's drafts are those of a fresh head given the target's states of
    its whole sequence at once."""
    model, spec = target_and_spec(method, k=4)
    checks = []
    with LLM(model, block_size=4, speculative_config=spec, enable_prefix_caching=False) as llm:
        core = llm.engine.core
        proposer = core.proposer
        store, history = proposer.hidden_states, {}
        record, propose = store.record, proposer.propose

        def logged_record(request_id, start, rows):
            for i, row in enumerate(rows):
                history.setdefault(request_id, {})[start + i] = row.clone()
            record(request_id, start, rows)

        def checked_propose(request_ids, token_ids_, max_drafts):
            drafts = propose(request_ids, token_ids_, max_drafts)
            for request_id, ids, k, got in zip(request_ids, token_ids_, max_drafts, drafts):
                fresh = HeadProposer(proposer.head, TargetHiddenStates(), core.config, 64)
                fresh.hidden_states.record(request_id, 0, torch.stack([history[request_id][p]
                                                                       for p in range(len(ids) - 1)]))
                checks.append((got, fresh.propose([request_id], [ids], [k])[0]))
            return drafts

        store.record, proposer.propose = logged_record, checked_propose
        llm.generate(PROMPTS, GREEDY)
    assert len(checks) > 20 and all(len(got) == 4 for got, _ in checks[:4])
    assert [got for got, _ in checks] == [expected for _, expected in checks]


def test_seeded_random_sampling_with_a_head_is_reproducible():
    model, spec = target_and_spec("eagle3")
    params = SamplingParams(temperature=0.8, top_k=20, max_tokens=24, seed=99, ignore_eos=True)
    runs = []
    for _ in range(2):
        with LLM(model, block_size=4, speculative_config=spec) as llm:
            runs.append(token_ids(llm.generate(PROMPTS, params)))
    assert runs[0] == runs[1]


def test_json_schema_with_a_head_parses_and_equals_plain_decoding():
    from atb_plugin.engine.sampling_params import StructuredOutputsParams

    schema = {"type": "object", "properties": {"colors": {"type": "array", "items": {"enum": ["red", "green"]},
                                                          "minItems": 3, "maxItems": 3}},
              "required": ["colors"]}
    params = SamplingParams(temperature=0, max_tokens=200, structured_outputs=StructuredOutputsParams(json=schema))
    model, spec = target_and_spec("mtp")
    reference = plain(model, tuple(PROMPTS[:2]), params, block_size=16)
    with LLM(model, block_size=16, speculative_config=spec) as llm:
        outputs = llm.generate(PROMPTS[:2], params)
        assert llm.engine.scheduler.spec_decoding.num_drafts > 0
    assert token_ids(outputs) == reference
    for output in outputs:
        assert len(json.loads(output.outputs[0].text)["colors"]) == 3


@pytest.mark.parametrize("method", ["eagle", "mtp", "draft_model"])
def test_the_draft_weights_and_kv_are_inside_the_kv_budget(method):
    """A draft or head keeps as many KV blocks as the target: a block costs both caches' bytes,
    and the worker reports its weights with the target's."""
    if method == "draft_model":
        model, spec = tiny_checkpoint("llama"), {"model": str(tiny_checkpoint("llama", seed=1)),
                                                 "num_speculative_tokens": 2}
    else:
        model, spec = target_and_spec(method)
    budget = 64 << 10
    sizes = {}
    for config in (None, spec):
        with LLM(model, block_size=4, max_model_len=64, kv_cache_bytes=budget, speculative_config=config) as llm:
            core = llm.engine.core
            draft = core.runner.spec_model.module if config else None
            sizes[bool(config)] = (core.kv_cache_blocks, core.executor.weight_bytes[0], draft)
    (plain_blocks, plain_weights, _), (spec_blocks, spec_weights, draft) = sizes[False], sizes[True]
    target_block = budget // (plain_blocks - 1)
    draft_block = sum(k.numel() * k.element_size() * 2 for k, _ in draft.make_kv_caches(1, 4))
    assert spec_blocks - 1 == budget // (target_block + draft_block) < plain_blocks - 1
    draft_weights = sum(t.numel() * t.element_size() for t in (*draft.parameters(), *draft.buffers()))
    assert spec_weights == plain_weights + draft_weights > plain_weights


def test_head_configuration_errors_name_what_the_method_needs():
    llama, eagle = target_and_spec("eagle")
    with pytest.raises(ValueError, match="draft_tensor_parallel_size = 1: not supported; method 'eagle' runs its "
                                         "head on every rank, sharded as the target: unset or 2"):
        EngineConfig(str(llama), tensor_parallel_size=2, speculative_config={**eagle, "draft_tensor_parallel_size": 1})
    with pytest.raises(ValueError, match="num_nextn_predict_layers > 0"):
        EngineConfig(str(llama), speculative_config={"method": "mtp", "num_speculative_tokens": 1})
    with pytest.raises(ValueError, match="no config.json there"):
        EngineConfig(str(llama), speculative_config={**eagle, "model": str(llama / "nowhere")})
    with pytest.raises(ValueError, match="needs the head checkpoint's directory"):
        EngineConfig(str(llama), speculative_config={"method": "eagle3", "num_speculative_tokens": 1})
    with pytest.raises(ValueError, match="give no model"):
        EngineConfig(str(llama), speculative_config={"method": "mtp", "model": str(llama), "num_speculative_tokens": 1})


@pytest.mark.slow
@pytest.mark.parametrize("method", METHODS)
def test_tensor_parallel_heads_draft_on_every_rank(method):
    """Under TP = 2 the head runs on every rank, sharded as the target, over the hidden states
    each rank's runner recorded; rank 0's drafts come back (``Propose`` / ``Proposed``): greedy
    output is plain TP = 1's, a prefix-cache hit included."""
    model, spec = target_and_spec(method)
    reference = plain(model)
    with LLM(model, block_size=4, tensor_parallel_size=2, speculative_config=spec) as llm:
        assert llm.engine.core.executor.runner is None  # the target and the head live in the ranks
        assert token_ids(llm.generate(PROMPTS, GREEDY)) == reference
        again = llm.generate(PROMPTS[:1], GREEDY)[0]
        assert again.num_cached_tokens > 0 and again.outputs[0].token_ids == reference[0]
        assert llm.engine.scheduler.spec_decoding.num_drafts > 0
