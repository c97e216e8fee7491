"""``SamplingParams.prompt_logprobs`` (vLLM semantics): every prompt token's logprob given the
tokens before it, with the top k, None for the first token, equal to a plain full forward of the
same checkpoint through transformers; across prefill chunks, with prefix caching on, through
preemption and over msgpack. Also: token ids the params name must be in the vocabulary."""

from __future__ import annotations

import pytest
import torch

from atb_plugin import LLM, SamplingParams
from atb_plugin.engine.config import EngineConfig
from atb_plugin.engine.core import EngineCore
from atb_plugin.engine.messages import (EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest, LogprobsEntry,
                                        decode_outputs, encode)
from atb_plugin.engine.scheduler import Scheduler
from atb_plugin.testing.tiny import tiny_checkpoint

PROMPT = "one two three four five six seven eight nine ten eleven twelve thirteen fourteen"
TOP_K = 3
# Both sides compute in float32; they differ only in summation order (paged attention over
# chunks vs one dense attention, oneDNN-packed vs MKL GEMMs), which moves a logprob by ~1e-6.
# 1e-4 leaves that a wide margin while anything semantically wrong (a target shifted by one
# position, temperature or penalties applied, a chunk's rows mixed up) is off by far more than 1e-2.
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def reference():
    """``ids -> (T, vocab)`` log_softmax of a full transformers forward: row p predicts token p + 1."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_checkpoint("qwen2")).eval()

    def logprobs(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)

    return logprobs


def assert_matches_reference(entries, ids: list[int], reference_logprobs: torch.Tensor, k: int = TOP_K) -> None:
    assert len(entries) == len(ids)
    assert entries[0] is None  # nothing precedes the first token
    for position, entry in enumerate(entries[1:], start=1):
        row = reference_logprobs[position - 1]
        expected = row[ids[position]].item()
        assert entry.token_id == ids[position]
        assert entry.logprob == pytest.approx(expected, abs=TOLERANCE), position
        assert entry.rank == int((row > expected).sum()) + 1
        top = row.topk(k)
        assert entry.top_token_ids == top.indices.tolist()
        assert entry.top_logprobs == pytest.approx(top.values.tolist(), abs=TOLERANCE)


def prompt_logprobs_params(k: int = TOP_K) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, prompt_logprobs=k)


def test_prompt_logprobs_over_several_prefill_chunks_equal_a_full_forward(reference):
    with LLM(tiny_checkpoint("qwen2"), block_size=4, max_num_batched_tokens=8) as llm:
        ids = llm.router.tokenize(PROMPT)
        assert len(ids) > 2 * 8  # three chunks at least, the last one ending mid-chunk or not
        output = llm.generate(PROMPT, prompt_logprobs_params())[0]
        plain = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))[0]
    assert_matches_reference(output.prompt_logprobs, ids, reference(ids))
    assert plain.prompt_logprobs is None  # not asked for
    assert output.outputs[0].token_ids == plain.outputs[0].token_ids  # asking changes no sampling


def test_logits_are_made_in_slices_of_a_long_chunk(reference, monkeypatch):
    """One chunk longer than a slice: its rows are computed in several slices, stitched in order."""
    from atb_plugin.engine import model_runner

    monkeypatch.setattr(model_runner, "_PROMPT_LOGITS_ROWS", 5)
    with LLM(tiny_checkpoint("qwen2"), block_size=4) as llm:
        ids = llm.router.tokenize(PROMPT)
        output = llm.generate(PROMPT, prompt_logprobs_params(k=0))[0]
    assert all(entry.top_token_ids == [] for entry in output.prompt_logprobs[1:])  # k = 0: no top entries
    assert_matches_reference(output.prompt_logprobs, ids, reference(ids), k=0)


def test_a_request_owing_prompt_logprobs_takes_no_prefix_cache_hit(reference):
    with LLM(tiny_checkpoint("qwen2"), block_size=4, max_num_batched_tokens=8, enable_prefix_caching=True) as llm:
        ids = llm.router.tokenize(PROMPT)
        plain = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
        llm.generate(PROMPT, plain)  # caches the prompt's blocks
        output = llm.generate(PROMPT, prompt_logprobs_params())[0]
        after = llm.generate(PROMPT, plain)[0]
    assert output.num_cached_tokens == 0
    assert after.num_cached_tokens >= 4  # the prefix was cached all along
    assert_matches_reference(output.prompt_logprobs, ids, reference(ids))


def test_preemption_neither_repeats_nor_loses_an_entry(reference, monkeypatch):
    """Requests preempted mid-prompt restart their list at position 0 (the scheduler checks the
    positions line up); preempted after their first token they send nothing again."""
    mid_prompt = []
    preempt = Scheduler._preempt

    def spy(self, request):
        mid_prompt.append(request.num_output_tokens == 0 and request.num_computed_tokens > 0)
        preempt(self, request)

    monkeypatch.setattr(Scheduler, "_preempt", spy)
    prompts = ["one two three four five six", "the cat sat on the mat and then it ran", "seven eight nine ten eleven"]
    # 11 usable blocks of 4 tokens, 8-token chunks: three ~15-token prompts growing by 12 cannot all fit.
    with LLM(tiny_checkpoint("qwen2"), block_size=4, kv_cache_blocks=12, max_num_batched_tokens=8) as llm:
        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, prompt_logprobs=TOP_K)
        outputs = llm.generate(prompts, params)
        all_ids = [llm.router.tokenize(p) for p in prompts]
        assert llm.engine.scheduler.num_preemptions > 0
    assert any(mid_prompt)
    for output, ids in zip(outputs, all_ids):
        assert_matches_reference(output.prompt_logprobs, ids, reference(ids))


def test_prompt_logprobs_ride_only_on_the_first_output_and_survive_msgpack():
    core = EngineCore(EngineConfig(tiny_checkpoint("qwen2"), block_size=4, kv_cache_blocks=64,
                                   max_num_batched_tokens=4))
    ids = [5, 9, 14, 3, 77, 21, 8, 40, 2, 11]
    core.add_request(EngineCoreRequest("r", ids, prompt_logprobs_params()))
    outputs = []
    while core.has_unfinished_requests():
        outputs += core.step()
    assert [len(o.prompt_logprobs) if o.prompt_logprobs else None for o in outputs] == [len(ids), None, None]
    message = EngineCoreOutputs(outputs)
    assert decode_outputs(encode(message)) == message
    handmade = EngineCoreOutputs([EngineCoreOutput("x", [1], prompt_logprobs=[
        None, LogprobsEntry(3, -0.5, 1, [3, 4], [-0.5, -1.5])])])
    assert decode_outputs(encode(handmade)) == handmade


def test_media_prompts_score_the_expanded_prompt_whatever_the_chunking():
    """For an image prompt the targets are the runner's expanded ids (placeholders, not the
    negative handle slots), and chunking the prompt (through the image) changes no value."""
    from tests.server_helpers import data_url

    chat = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(seed=4)}},
                                         {"type": "text", "text": "What is this?"}]}]
    results = {}
    for chunk in (2048, 16):
        with LLM(tiny_checkpoint("qwen2_vl"), block_size=16, max_num_batched_tokens=chunk) as llm:
            results[chunk] = llm.chat(chat, prompt_logprobs_params())[0]
    whole, chunked = results[2048].prompt_logprobs, results[16].prompt_logprobs
    assert len(whole) == len(results[2048].prompt_token_ids) > 16 and whole[0] is None
    assert min(results[2048].prompt_token_ids) < 0  # the prompt does hold handle slots
    assert all(entry.token_id >= 0 for entry in whole[1:])
    assert [e.token_id for e in whole[1:]] == [e.token_id for e in chunked[1:]]
    assert [e.logprob for e in chunked[1:]] == pytest.approx([e.logprob for e in whole[1:]], abs=TOLERANCE)


@pytest.mark.parametrize("field, value", [
    ("logit_bias", {10**6: 1.0}),
    ("allowed_token_ids", [3, 10**6]),
    ("bad_words", [[3, 10**6]]),
    ("stop_token_ids", [10**6]),
])
def test_token_ids_outside_the_vocabulary_are_refused_naming_the_field(field, value):
    keyword = "bad_words_token_ids" if field == "bad_words" else field
    params = SamplingParams(max_tokens=2, **{keyword: value})
    core = EngineCore(EngineConfig(tiny_checkpoint("qwen2"), block_size=4, kv_cache_blocks=64))
    vocab = core.config.vocab_size
    with pytest.raises(ValueError, match=rf"{field}.*\b{vocab}\b"):
        core.add_request(EngineCoreRequest("r", [1, 2, 3], params))
    assert not core.has_unfinished_requests()
    core.add_request(EngineCoreRequest("ok", [1, 2, 3], SamplingParams(max_tokens=2, logit_bias={vocab - 1: 1.0})))


def test_the_offline_llm_refuses_an_out_of_vocabulary_logit_bias_and_stays_usable():
    with LLM(tiny_checkpoint("qwen2"), block_size=4) as llm:
        vocab = llm.engine.config.vocab_size
        with pytest.raises(ValueError, match="logit_bias"):
            llm.generate(["hello", "world"], SamplingParams(max_tokens=2, logit_bias={vocab: 5.0}))
        with pytest.raises(ValueError, match="logit_bias"):
            llm.generate("hello", SamplingParams(max_tokens=2, n=2, logit_bias={vocab: 5.0}))
        assert not llm.engine.has_unfinished_requests()
        assert not llm.engine.output_processor.has_unfinished_requests()
        assert len(llm.generate("hello", SamplingParams(max_tokens=2))[0].outputs[0].token_ids) == 2
