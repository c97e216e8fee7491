"""Speculative decoding (n-gram drafts, exact rejection sampler; docs/speculative.md): greedy output
is token-identical to plain decoding (prompts that repeat and that do not, prefix caching,
preemption, chunked budgets, n > 1, stop strings, EOS and max_tokens inside an accepted run);
the rejection sampler emits exactly the target distribution; seeded runs reproduce; acceptance
is real; configuration errors name what is supported."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from atb_plugin import LLM, SamplingParams
from atb_plugin.engine.config import EngineConfig
from atb_plugin.engine.messages import SpecDecodingStats
from atb_plugin.engine.sampler import Sampler
from atb_plugin.engine.scheduler import computed_advance
from atb_plugin.engine.spec_decode.config import SpeculativeConfig
from atb_plugin.engine.spec_decode.ngram import NgramProposer
from atb_plugin.engine.spec_decode.rejection_sampler import RejectionSampler, VerifyRequest
from atb_plugin.testing.tiny import tiny_checkpoint

PARAGRAPH = "the quick brown fox jumps over the lazy dog while the cat sleeps on the warm mat. "
PROMPTS = [PARAGRAPH * 3 + "the quick brown", "hello world", "numbers: 1 2 3 4 5 6 7 8 9 10 11 12", "a"]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


def generate(prompts=PROMPTS, params=GREEDY, **kwargs):
    kwargs.setdefault("block_size", 4)
    with LLM(tiny_checkpoint("qwen2"), **kwargs) as llm:
        outputs = llm.generate(prompts, params)
        return outputs, llm.engine.scheduler


def token_ids(outputs):
    return [[c.token_ids for c in o.outputs] for o in outputs]


@pytest.fixture(scope="module")
def plain():
    return token_ids(generate()[0])


# -- lossless ---------------------------------------------------------------------------------------


def test_greedy_ngram_equals_plain_decoding_and_accepts_drafts(plain):
    outputs, scheduler = generate(speculative_config=NGRAM)
    assert token_ids(outputs) == plain
    stats = scheduler.spec_decoding
    assert stats.num_drafts > 0 and stats.num_accepted_tokens > 0
    assert len(stats.num_accepted_tokens_per_pos) == 4
    # Position i counts the steps that accepted more than i drafts: never increasing.
    assert stats.num_accepted_tokens_per_pos == sorted(stats.num_accepted_tokens_per_pos, reverse=True)
    assert sum(stats.num_accepted_tokens_per_pos) == stats.num_accepted_tokens


class _CountingStep:
    """A captured decode step that notes each call's rows."""

    def __init__(self, step):
        self.step, self.rows = step, []

    def applies(self, kv_caches, metadata):
        return self.step.applies(kv_caches, metadata)

    def __call__(self, embeds, cos, sin, metadata):
        self.rows.append(metadata.num_reqs)
        return self.step(embeds, cos, sin, metadata)


def test_verify_steps_run_the_captured_decode_step_one_row_per_query(plain):
    """Each query token of a verify step is a row of the captured CPU decode step (its sequence's
    cache up to itself): more rows than requests, the same tokens."""
    with LLM(tiny_checkpoint("qwen2"), block_size=4, speculative_config=NGRAM) as llm:
        runner = llm.engine.runner
        if runner.decode_capture != "captured":
            pytest.skip(f"no captured decode step here: {runner.decode_capture}")
        model = runner.model.get_language_model().model
        model.captured_decode = counting = _CountingStep(model.captured_decode)
        assert token_ids(llm.generate(PROMPTS, GREEDY)) == plain
    assert max(counting.rows) > len(PROMPTS)


def test_lossless_under_preemption_chunked_budgets_and_without_prefix_cache(plain):
    outputs, scheduler = generate(speculative_config=NGRAM, kv_cache_blocks=40)
    assert scheduler.num_preemptions > 0
    assert token_ids(outputs) == plain
    assert token_ids(generate(speculative_config=NGRAM, max_num_batched_tokens=6)[0]) == plain
    assert token_ids(generate(speculative_config=NGRAM, enable_prefix_caching=False)[0]) == plain


def test_prefix_cache_hits_after_speculative_requests_give_the_same_tokens():
    """Blocks are hashed only over accepted tokens: a second request sharing the first's prompt
    and output hits the cache and still continues exactly as plain decoding does."""
    with LLM(tiny_checkpoint("qwen2"), block_size=4, speculative_config=NGRAM) as llm:
        first = llm.generate(PROMPTS[0], GREEDY)[0]
        again = llm.generate(first.prompt_token_ids + first.outputs[0].token_ids, GREEDY)[0]
    with LLM(tiny_checkpoint("qwen2"), block_size=4) as llm:
        reference = llm.generate(first.prompt_token_ids + first.outputs[0].token_ids, GREEDY)[0]
    assert again.num_cached_tokens > 0
    assert again.outputs[0].token_ids == reference.outputs[0].token_ids


def test_n_choices_stop_strings_logprobs_eos_and_max_tokens_inside_a_run(plain):
    first_text = generate(PROMPTS[:1])[0][0].outputs[0].text
    stop = first_text.split()[2] if len(first_text.split()) > 2 else first_text[-3:]
    cases = [
        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, n=2),
        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop]),
        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2),
        SamplingParams(temperature=0, max_tokens=7, ignore_eos=True),  # fewer than k + 1 left at the end
        SamplingParams(temperature=0, max_tokens=24, repetition_penalty=1.3, frequency_penalty=0.5),
    ]
    for params in cases:
        base = generate(params=params)[0]
        spec = generate(params=params, speculative_config=NGRAM)[0]
        assert token_ids(spec) == token_ids(base), params
        assert [c.text for o in spec for c in o.outputs] == [c.text for o in base for c in o.outputs]
        assert [c.finish_reason for o in spec for c in o.outputs] == [c.finish_reason for o in base for c in o.outputs]
        if params.logprobs:
            for s, b in zip(spec, base):
                assert [e.token_id for e in s.outputs[0].logprobs] == s.outputs[0].token_ids
                assert [e.top_token_ids for e in s.outputs[0].logprobs] == [e.top_token_ids for e in b.outputs[0].logprobs]
                np.testing.assert_allclose([e.logprob for e in s.outputs[0].logprobs],
                                           [e.logprob for e in b.outputs[0].logprobs], atol=1e-4)
        assert all(len(c.token_ids) <= params.max_tokens for o in spec for c in o.outputs)


def test_eos_inside_an_accepted_run_ends_the_request_there(plain):
    # A token that the plain greedy output reaches late, as EOS: the request ends at its first
    # occurrence, whatever drafts follow it in the run.
    repeating = plain[0][0]
    eos = repeating[len(repeating) // 2]
    params = SamplingParams(temperature=0, max_tokens=24)
    results = []
    for spec in (None, NGRAM):
        with LLM(tiny_checkpoint("qwen2"), block_size=4, speculative_config=spec) as llm:
            llm.engine.eos_token_ids = (eos,)
            results.append(llm.generate(PROMPTS[:1], params)[0].outputs[0])
    assert results[0].token_ids == results[1].token_ids
    assert results[1].token_ids[-1] == eos and results[1].finish_reason == "stop"


def test_stop_token_ids_and_min_tokens_inside_an_accepted_run(plain):
    """min_tokens masks the stop ids at each verified position by its own output count."""
    repeating = plain[0][0]
    stop = repeating[2]
    for params in (SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[stop], ignore_eos=True),
                   SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[stop], min_tokens=6,
                                  ignore_eos=True)):
        base = generate(PROMPTS[:1], params)[0][0].outputs[0]
        spec = generate(PROMPTS[:1], params, speculative_config=NGRAM)[0][0].outputs[0]
        assert spec.token_ids == base.token_ids and spec.finish_reason == base.finish_reason
        assert len(spec.token_ids) >= params.min_tokens


def test_the_counters_agree_with_the_tokens_emitted():
    """Each step samples one token per request and a verify step adds its accepted drafts: one
    request's output length is its sampling steps plus the accepted drafts."""
    with LLM(tiny_checkpoint("qwen2"), block_size=4, speculative_config=NGRAM) as llm:
        engine = llm.engine
        engine.add_request("r", engine.tokenizer.encode(PROMPTS[0]),
                           SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
        steps, tokens = 0, []
        while engine.has_unfinished_requests():
            for output in engine.step():
                tokens = output.outputs[0].token_ids
            steps += 1
        stats = engine.scheduler.spec_decoding
    assert len(tokens) == 40
    assert len(tokens) == steps + stats.num_accepted_tokens  # the prompt fits one step: every step samples
    assert stats.num_drafts <= steps - 1  # the first step (the prompt) verifies nothing


def test_only_accepted_tokens_are_hashed_for_the_prefix_cache():
    """After every step, the request's hashed blocks lie within its accepted tokens (its
    all_token_ids), whatever slots the drafts it verified took."""
    with LLM(tiny_checkpoint("qwen2"), block_size=4, speculative_config=NGRAM) as llm:
        engine = llm.engine
        engine.add_request("r", engine.tokenizer.encode(PROMPTS[0]),
                           SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
        kv = engine.kv_cache_manager
        while engine.has_unfinished_requests():
            engine.step()
            request = engine.scheduler.requests.get("r")
            if request is None:
                break
            assert kv.num_cached_blocks["r"] * 4 <= request.num_tokens
        assert engine.scheduler.spec_decoding.num_drafts > 0


def test_abort_mid_run_frees_every_block():
    with LLM(tiny_checkpoint("qwen2"), block_size=4, speculative_config=NGRAM) as llm:
        engine = llm.engine
        ids = engine.tokenizer.encode(PROMPTS[0])
        engine.add_request("r", ids, SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
        while engine.scheduler.spec_decoding.num_drafts == 0:
            engine.step()
        engine.abort_request("r")
        assert not engine.has_unfinished_requests()
        assert engine.kv_cache_manager.usage == 0.0


def test_acceptance_on_a_repeated_paragraph_is_above_half():
    _, scheduler = generate(prompts=[PARAGRAPH * 4], params=SamplingParams(temperature=0, max_tokens=48,
                                                                           ignore_eos=True),
                            speculative_config=NGRAM)
    stats = scheduler.spec_decoding
    assert stats.num_accepted_tokens / stats.num_draft_tokens > 0.5


def test_seeded_random_sampling_with_drafts_is_reproducible():
    params = SamplingParams(temperature=0.8, top_k=20, max_tokens=24, seed=1234, ignore_eos=True)
    first = token_ids(generate(params=params, speculative_config=NGRAM)[0])
    second = token_ids(generate(params=params, speculative_config=NGRAM)[0])
    assert first == second


def test_structured_output_with_drafts_is_lossless_and_parses():
    """Drafts cut to what the grammar accepts, a mask per verified position: greedy JSON equals
    plain decoding's and parses; seeded random JSON parses too."""
    from atb_plugin.engine.sampling_params import StructuredOutputsParams

    schema = {"type": "object", "properties": {"colors": {"type": "array", "items": {"enum": ["red", "green"]},
                                                          "minItems": 4, "maxItems": 4}},
              "required": ["colors"]}
    structured = StructuredOutputsParams(json=schema)
    greedy = SamplingParams(temperature=0, max_tokens=300, structured_outputs=structured)
    seeded = SamplingParams(temperature=1.0, seed=7, max_tokens=300, structured_outputs=structured)
    prompts = PROMPTS[:2]
    base = generate(prompts, greedy, block_size=16)[0]
    spec, scheduler = generate(prompts, greedy, block_size=16, speculative_config=NGRAM)
    assert token_ids(spec) == token_ids(base)
    assert scheduler.spec_decoding.num_accepted_tokens > 0
    for outputs in (spec, generate(prompts, seeded, block_size=16, speculative_config=NGRAM)[0]):
        for output in outputs:
            value = json.loads(output.outputs[0].text)
            assert len(value["colors"]) == 4 and set(value["colors"]) <= {"red", "green"}


@pytest.mark.parametrize("family", ["qwen2_vl", "llava"])
def test_image_chat_with_drafts_equals_plain_decoding(family, tmp_path):
    """N-gram over a prompt holding media blocks (their handles are never proposed), M-RoPE
    positions for the verified rows (Qwen2-VL): the same greedy tokens as plain decoding."""
    from input_builders.media_config import MediaConfig
    from tests.helpers import write_test_images

    images = write_test_images(tmp_path, sizes=((60, 90),))
    chat = [{"role": "user", "content": [{"image": str(images[0])}, {"text": PARAGRAPH * 2 + "the quick"}]}]
    media = MediaConfig(allowed_local_media_paths=(str(tmp_path),))
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    results = []
    for spec in (None, NGRAM):
        with LLM(tiny_checkpoint(family), block_size=16, media_config=media, speculative_config=spec) as llm:
            results.append(llm.chat([chat], params)[0].outputs[0].token_ids)
            drafts = llm.engine.scheduler.spec_decoding.num_drafts
    assert results[0] == results[1]
    assert drafts > 0


# -- draft model ------------------------------------------------------------------------------------


def test_draft_model_equal_to_the_target_accepts_every_greedy_draft(plain):
    spec = {"model": str(tiny_checkpoint("qwen2")), "num_speculative_tokens": 3}
    outputs, scheduler = generate(speculative_config=spec)
    assert token_ids(outputs) == plain
    stats = scheduler.spec_decoding
    assert stats.num_drafts > 0 and stats.num_accepted_tokens == stats.num_draft_tokens


def test_a_different_draft_model_is_lossless_under_preemption_and_sampling(plain):
    spec = {"method": "draft_model", "model": str(tiny_checkpoint("qwen2", seed=1)), "num_speculative_tokens": 3}
    outputs, scheduler = generate(speculative_config=spec)
    assert token_ids(outputs) == plain
    assert scheduler.spec_decoding.num_accepted_tokens < scheduler.spec_decoding.num_draft_tokens
    outputs, scheduler = generate(speculative_config=spec, kv_cache_blocks=40)
    assert scheduler.num_preemptions > 0 and token_ids(outputs) == plain
    seeded = SamplingParams(temperature=0.8, max_tokens=24, seed=5, ignore_eos=True)
    assert token_ids(generate(params=seeded, speculative_config=spec)[0]) == \
        token_ids(generate(params=seeded, speculative_config=spec)[0])


# -- the rejection sampler ---------------------------------------------------------------------------


def _chi_square(counts: np.ndarray, probs: np.ndarray) -> float:
    expected = probs * counts.sum()
    kept = expected > 0
    assert counts[~kept].sum() == 0, "a token of probability 0 was emitted"
    return float((((counts - expected) ** 2)[kept] / expected[kept]).sum())


def test_rejection_sampler_emits_the_target_distribution():
    """Fixed target logits and a fixed one-hot draft: over 120k draws, each emitted position is
    distributed as the target p (after temperature and top-k, the sampler's own processing):
    chi-square far below the 0.1 % critical value (df <= 7: 24.3)."""
    vocab, draws = 8, 120_000
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(3, vocab, generator=generator) * 1.5
    params = SamplingParams(temperature=0.9, top_k=6)
    probs = Sampler.probabilities(logits, [params] * 3)
    assert int((probs[0] > 0).sum()) == 6
    drafts = [int(probs[0].argsort()[-2]), int(probs[1].argmax())]  # a likely and the likeliest token
    first, second = np.zeros(vocab), np.zeros(vocab)
    for _ in range(draws):
        tokens = RejectionSampler.accept_or_recover(probs, drafts, generator)
        first[tokens[0]] += 1
        if tokens[0] == drafts[0]:  # then position 1 was sampled from the target given d1
            second[tokens[1]] += 1
    assert _chi_square(first, probs[0].numpy()) < 24.3
    assert _chi_square(second, probs[1].numpy()) < 24.3
    assert abs(second.sum() / draws - float(probs[0, drafts[0]])) < 0.01  # P(accept d1) = p(d1)


def test_rejection_sampler_greedy_accepts_while_equal_and_applies_processing_per_position():
    vocab = 10
    logits = torch.full((3, vocab), -5.0)
    logits[0, 3] = logits[1, 4] = logits[2, 5] = 5.0
    sampler = RejectionSampler(Sampler())

    def verify(drafts, **overrides):
        params = SamplingParams(temperature=0, logprobs=1, **overrides)
        request = VerifyRequest(drafts, params, None, 0, (), [1, 2], [])
        return sampler.verify(logits[:len(drafts) + 1], [request])[0]

    all_accepted = verify([3, 4])
    assert all_accepted.token_ids == [3, 4, 5] and all_accepted.num_accepted == 2
    assert [e.token_id for e in all_accepted.logprobs] == [3, 4, 5]
    assert verify([3, 9]).token_ids == [3, 4]
    assert verify([7, 4]).token_ids == [3]
    # The sampler's processing runs at every position: logit_bias takes 4 off position 1 (its
    # other logits tie: the first, 0, wins as in plain greedy decoding).
    assert verify([3, 4], logit_bias={4: -100.0}).token_ids == [3, 0]
    # ... and sees the drafts before each position: the bad word "3 4" blocks 4 at position 1
    # because position 0's draft 3 precedes it.
    assert verify([3, 4], bad_words_token_ids=[[3, 4]]).token_ids == [3, 0]


def test_computed_tokens_roll_back_past_rejected_drafts():
    assert computed_advance(5, 0, 1) == 5  # a prefill chunk or a plain decode
    assert computed_advance(5, 4, 1) == 1  # every draft rejected: the last token only
    assert computed_advance(5, 4, 3) == 3
    assert computed_advance(5, 4, 5) == 5  # all accepted: the bonus token is not computed yet


# -- the n-gram proposer -----------------------------------------------------------------------------


def test_ngram_proposes_the_continuation_of_the_earliest_match_and_never_a_media_handle():
    def propose(tokens, k, proposer=NgramProposer(1, 3)):
        return proposer.propose(["r"], [tokens], [k])[0]

    assert propose([1, 2, 3, 4, 5, 1, 2, 3], 3) == [4, 5, 1]
    assert propose([1, 2, 3, 4, 5, 1, 2, 3], 0) == []
    assert propose([1, 2, 3], 4) == []  # nothing repeats
    assert propose([7, 8, -5, -5, 9, 7, 8], 4) == []  # the continuation starts with media
    assert propose([7, 8, 1, -5, 9, 7, 8], 4) == [1]  # cut before the media handle
    assert propose([9, 4, 1, 2, 3, 4], 2, NgramProposer(2, 2)) == []  # only n = 2 tried: "3 4" is new


def test_spec_stats_count_per_position():
    stats = SpecDecodingStats()
    stats.observe(4, 2)
    stats.observe(4, 0)
    stats.observe(3, 3)
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (3, 11, 5)
    assert stats.num_accepted_tokens_per_pos == [2, 2, 1, 0]


# -- configuration -----------------------------------------------------------------------------------


def test_speculative_config_defaults_and_errors():
    config = SpeculativeConfig.from_value({"method": "ngram", "num_speculative_tokens": 3})
    assert (config.prompt_lookup_min, config.prompt_lookup_max) == (5, 5)
    assert SpeculativeConfig.from_value({"num_speculative_tokens": 2, "prompt_lookup_max": 4}).prompt_lookup_min == 4
    assert SpeculativeConfig.from_value({"model": "[ngram]", "num_speculative_tokens": 2}).method == "ngram"
    assert SpeculativeConfig.from_value({"model": "d", "num_speculative_tokens": 2}).method == "draft_model"
    errors = [
        ({"method": "suffix", "num_speculative_tokens": 2}, "not supported yet; this engine supports ngram, draft_model"),
        ({"method": "draft_model", "num_speculative_tokens": 2}, "needs the draft checkpoint's directory"),
        ({"model": "d", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 2}, "runs whole"),
        ({"model": "d", "num_speculative_tokens": 2, "prompt_lookup_max": 2}, "belongs to method 'ngram'"),
        ({"method": "lookahead", "num_speculative_tokens": 2}, "unknown; this engine supports ngram, draft_model"),
        ({"method": "ngram"}, "num_speculative_tokens is required"),
        ({"method": "ngram", "num_speculative_tokens": 16}, "must be in [1, 15]"),
        ({"method": "ngram", "num_speculative_tokens": 2.0}, "must be an int"),
        ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
         "exceeds prompt_lookup_max"),
        ({"method": "ngram", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 1}, "belongs to method 'draft_model'"),
        ({"method": "ngram", "num_speculative_tokens": 2, "acceptance_method": "x"}, "unknown key(s) acceptance_method"),
    ]
    for value, message in errors:
        with pytest.raises(ValueError, match=None) as error:
            SpeculativeConfig.from_value(value)
        assert message in str(error.value), (value, str(error.value))
    with pytest.raises(ValueError, match="must be a dict"):
        SpeculativeConfig.from_value("ngram")


def test_engine_config_llm_kwarg_and_cli_flag_take_the_same_config(tmp_path):
    from atb_plugin.server.cli import parse_config

    model = str(tiny_checkpoint("qwen2"))
    engine = EngineConfig(model, speculative_config=NGRAM)
    assert engine.speculative_config == SpeculativeConfig(**NGRAM)
    assert engine.replace(max_num_seqs=4).speculative_config == engine.speculative_config
    with pytest.raises(ValueError, match="supports ngram"):
        LLM(model, speculative_config={"method": "medusa", "num_speculative_tokens": 1})
    with pytest.raises(ValueError, match="speculative_config.model = '/nowhere'.*does not exist"):
        EngineConfig(model, speculative_config={"model": "/nowhere", "num_speculative_tokens": 2})
    # Under TP the draft runs whole (draft_tensor_parallel_size 1, or unset); nothing else.
    for draft_tp in (None, 1):
        spec = {"model": model, "num_speculative_tokens": 2, "draft_tensor_parallel_size": draft_tp}
        assert EngineConfig(model, tensor_parallel_size=2, speculative_config=spec).speculative_config.model == model
    with pytest.raises(ValueError, match="draft_tensor_parallel_size = 2: not supported; method 'draft_model' "
                                         "supports 1"):
        EngineConfig(model, tensor_parallel_size=2, speculative_config={**spec, "draft_tensor_parallel_size": 2})
    for flag in ("-sc", "--speculative-config"):
        served = parse_config(["--model", model, flag, json.dumps(NGRAM)])
        assert served.engine.speculative_config == engine.speculative_config
    with pytest.raises(SystemExit):
        parse_config(["--model", model, "-sc", "{ngram"])


def test_metrics_render_vllm_spec_decode_counters():
    from atb_plugin.server.metrics import ServerMetrics

    metrics = ServerMetrics("tiny")
    metrics.add_spec_decoding(None)
    assert b"spec_decode" not in metrics.render()[0]
    stats = SpecDecodingStats()
    stats.observe(4, 3)
    metrics.add_spec_decoding(stats)
    text = metrics.render()[0].decode()
    for name, value in (("num_drafts", 1), ("num_draft_tokens", 4), ("num_accepted_tokens", 3)):
        assert f'vllm:spec_decode_{name}_total{{engine="0",model_name="tiny"}} {float(value)}' in text
    assert 'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="tiny",position="2"} 1.0' in text


# -- tensor parallelism and the server (slow) ----------------------------------------------------------


@pytest.mark.slow
def test_tensor_parallel_ranks_verify_the_drafts_the_core_proposed(plain):
    """The proposer runs in the core; the drafts travel with the step to every rank, whose
    mirrors roll back as the core does: TP = 2 with drafts gives plain TP = 1's tokens."""
    outputs, scheduler = generate(speculative_config=NGRAM, tensor_parallel_size=2)
    assert scheduler.spec_decoding.num_accepted_tokens > 0
    assert token_ids(outputs) == plain


@pytest.mark.slow
def test_tensor_parallel_draft_model_runs_whole_in_the_core(plain):
    """Under TP = 2 the ranks hold the target's shards and the draft runs whole in the core's
    process (draft_tensor_parallel_size 1): greedy output is plain TP = 1's, with a different
    draft and a prefix-cache hit."""
    different = {"model": str(tiny_checkpoint("qwen2", seed=1)), "num_speculative_tokens": 3,
                 "draft_tensor_parallel_size": 1}
    with LLM(tiny_checkpoint("qwen2"), block_size=4, tensor_parallel_size=2, speculative_config=different) as llm:
        core = llm.engine.core
        assert core.executor.runner is None and core.proposer.runner.model is not None
        assert token_ids(llm.generate(PROMPTS, GREEDY)) == plain
        again = llm.generate(PROMPTS[:1], GREEDY)[0]
        assert again.num_cached_tokens > 0 and [again.outputs[0].token_ids] == plain[0]
        stats = llm.engine.scheduler.spec_decoding
        assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens


@pytest.mark.slow
def test_server_streams_the_same_greedy_text_with_drafts(serve):
    model = tiny_checkpoint("qwen2")
    texts = {}
    for flags in ((), ("-sc", json.dumps(NGRAM))):
        with serve(model, *flags) as server:
            client = server.client()
            completion = client.completions.create(model=client.models.list().data[0].id, prompt=PROMPTS[0],
                                                   max_tokens=24, temperature=0, extra_body={"ignore_eos": True})
            stream = client.completions.create(model=client.models.list().data[0].id, prompt=PROMPTS[0],
                                               max_tokens=24, temperature=0, stream=True,
                                               extra_body={"ignore_eos": True})
            streamed = "".join(chunk.choices[0].text for chunk in stream)
            assert streamed == completion.choices[0].text
            texts[flags] = completion.choices[0].text
            metrics = server.get("/metrics").text
            assert ("vllm:spec_decode_num_accepted_tokens_total" in metrics) == bool(flags)
    assert len(set(texts.values())) == 1
