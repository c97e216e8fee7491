"""Sampler: allowed_token_ids, bad words, logit_bias, penalties and min_p (vLLM v1's semantics
and order) against a plain per-row reference.

The reference (``reference_logits``) edits one row at a time in NumPy float32, token by token,
in vLLM's order: allowed ids, bad words, logit_bias, min_tokens, repetition / frequency /
presence penalties; min_p (``reference_min_p``) masks the tokens whose tempered probability is
below min_p x the row's top one. The plain sampler (no new field set, no min_tokens) on those
logits, with the same seeds, must then draw exactly the tokens the sampler draws from the raw
logits with the fields set: the exponential race consumes the same noise either way. All CPU,
fixed seeds."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from atb_plugin.engine.sampler import Sampler, make_generator
from atb_plugin.engine.sampling_params import SamplingParams

VOCAB = 50
EOS = 7


def fixed_logits(rows: int = 4, seed: int = 0, scale: float = 2.0) -> torch.Tensor:
    torch.manual_seed(seed)
    return torch.randn(rows, VOCAB) * scale


# -- the reference ---------------------------------------------------------------------------------


def reference_logits(row: torch.Tensor, p: SamplingParams, prompt, output, eos=(EOS,)) -> np.ndarray:
    """One row, token by token, in vLLM v1's order (before temperature)."""
    x = row.numpy().astype(np.float32).copy()
    vocab = len(x)
    neg_inf = np.float32(-np.inf)
    if p.allowed_token_ids is not None:
        for t in range(vocab):
            if t not in p.allowed_token_ids:
                x[t] = neg_inf
    for word in p.bad_words_token_ids:
        # Blocked when sampling its last token would complete the word at the end of the output.
        if word[-1] < vocab and (list(output) + [word[-1]])[-len(word):] == list(word):
            x[word[-1]] = neg_inf
    for t, bias in p.logit_bias.items():
        if t < vocab:
            x[t] = x[t] + np.float32(bias)
    if len(output) < p.min_tokens:
        for t in list(p.stop_token_ids) + ([] if p.ignore_eos else list(eos)):
            x[t] = neg_inf
    for t in range(vocab):
        count = list(output).count(t)
        if t in prompt or count > 0:
            rp = np.float32(p.repetition_penalty)
            x[t] = x[t] / rp if x[t] > 0 else x[t] * rp
        x[t] = x[t] - np.float32(p.frequency_penalty) * np.float32(count)
        x[t] = x[t] - np.float32(p.presence_penalty) * np.float32(count > 0)
    return x


def reference_min_p(x: np.ndarray, p: SamplingParams) -> np.ndarray:
    """-inf where prob / max prob = exp((x - max) / T) < min_p (random rows only)."""
    if p.temperature < 1e-5 or p.min_p == 0:
        return x
    x = x.copy()
    z = x.astype(np.float64) / p.temperature
    ratio = np.exp(z - z.max())
    x[ratio < p.min_p] = -np.inf
    return x


def plain(p: SamplingParams) -> SamplingParams:
    """The same request without the new fields (and without min_tokens)."""
    return SamplingParams(temperature=p.temperature, top_k=p.top_k, top_p=p.top_p, seed=p.seed)


def reference_sample(logits, params, prompts, outputs, generators, eos=(EOS,)) -> list[int]:
    rows = [reference_min_p(reference_logits(logits[i], p, prompts[i], outputs[i], eos), p)
            for i, p in enumerate(params)]
    processed = torch.from_numpy(np.stack(rows))
    return Sampler(eos).sample(processed, [plain(p) for p in params], generators, [0] * len(params)).token_ids


def sample(logits, params, prompts=None, outputs=None, generators=None, eos=(EOS,)):
    batch = logits.shape[0]
    params = params if isinstance(params, list) else [params] * batch
    generators = generators if generators is not None else [None] * batch
    num_output = [len(o) for o in outputs] if outputs is not None else [0] * batch
    return Sampler(eos).sample(logits, params, generators, num_output,
                               prompt_token_ids=prompts, output_token_ids=outputs)


def reference_probs(logits_row, p, prompt=(), output=()) -> torch.Tensor:
    """The distribution the random draw follows (no top-k/top-p in these tests)."""
    x = reference_min_p(reference_logits(logits_row, p, prompt, output), p)
    return torch.from_numpy(x.astype(np.float64) / p.temperature).softmax(-1)


def draw_seeded(logits_row, p, n, prompt=(), output=()) -> list[int]:
    """n draws of one row, one seeded generator per draw (seeds 0..n-1), in one batch."""
    batch = logits_row.expand(n, -1).contiguous()
    return sample(batch, [p] * n, [list(prompt)] * n, [list(output)] * n,
                  [make_generator(s) for s in range(n)]).token_ids


PROMPTS = [[1, 2, 3, 3, 40], [5, 6, -3, -3, 9], [11, 12], [0, 49, 20]]  # row 1: media handles (< 0)
OUTPUTS = [[3, 3, 3, 10, 11], [9, 9, 17], [], [20, 21, 22, 20]]

# One field per case (plus combinations), each case run greedy and random.
FIELD_CASES = {
    "allowed": dict(allowed_token_ids=[2, 5, 11, 30, 31, 49]),
    "allowed_beyond_vocab": dict(allowed_token_ids=[4, 8, 15, VOCAB + 3]),
    "bad_words": dict(bad_words_token_ids=[[4], [11, 12], [3, 10, 11, 17], [20, 21], [99, 5], [8, 8, 8, 8, 8, 8, 8]]),
    "logit_bias": dict(logit_bias={0: 3.5, 17: -2.25, 33: 1.0, VOCAB + 5: 100.0}),
    "repetition_up": dict(repetition_penalty=1.7),
    "repetition_down": dict(repetition_penalty=0.6),
    "frequency": dict(frequency_penalty=1.3),
    "frequency_negative": dict(frequency_penalty=-0.8),
    "presence": dict(presence_penalty=1.9),
    "presence_negative": dict(presence_penalty=-1.1),
    "min_p": dict(min_p=0.15),
    "everything": dict(allowed_token_ids=list(range(0, VOCAB, 2)), bad_words_token_ids=[[2], [20, 22]],
                       logit_bias={4: 2.0, 6: -1.0}, min_tokens=10, stop_token_ids=[8],
                       repetition_penalty=1.4, frequency_penalty=0.5, presence_penalty=0.3, min_p=0.05),
}


@pytest.mark.parametrize("temperature", [0.0, 0.8])
@pytest.mark.parametrize("case", list(FIELD_CASES))
def test_each_field_matches_the_reference(case, temperature):
    params = SamplingParams(temperature=temperature, max_tokens=100, **FIELD_CASES[case])
    for step in range(20):
        logits = fixed_logits(seed=step)
        seeds = [100 * step + i for i in range(4)]
        got = sample(logits, params, PROMPTS, OUTPUTS, [make_generator(s) for s in seeds]).token_ids
        want = reference_sample(logits, [params] * 4, PROMPTS, OUTPUTS, [make_generator(s) for s in seeds])
        assert got == want, (case, step)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_mixed_batch_decoding_matches_the_reference(temperature):
    """Eight rows, each its own mix (two use nothing), decoded for 40 steps with their outputs
    growing, so penalties and bad-word prefixes change from step to step."""
    cases = [{}, FIELD_CASES["allowed"], FIELD_CASES["bad_words"],
             dict(logit_bias={9: 1.5}, frequency_penalty=0.7, top_k=10),
             dict(repetition_penalty=1.5, presence_penalty=0.4, min_p=0.1, top_p=0.9), {},
             dict(bad_words_token_ids=[[1, 2], [2, 1]], allowed_token_ids=[1, 2, 3], min_tokens=5,
                  stop_token_ids=[3]),
             FIELD_CASES["everything"]]
    params = [SamplingParams(temperature=temperature if i != 3 else 0.5, max_tokens=100, seed=i, **case)
              for i, case in enumerate(cases)]
    prompts = [PROMPTS[i % 4] for i in range(8)]
    outputs = [[] for _ in range(8)]
    ours = [make_generator(p.seed) for p in params]
    ref = [make_generator(p.seed) for p in params]
    for step in range(40):
        logits = fixed_logits(rows=8, seed=1000 + step)
        before = logits.clone()
        got = Sampler((EOS,)).sample(logits, params, ours, [len(o) for o in outputs],
                                     prompt_token_ids=prompts, output_token_ids=outputs).token_ids
        assert torch.equal(logits, before)
        assert got == reference_sample(logits, params, prompts, outputs, ref), step
        for output, token in zip(outputs, got):
            output.append(token)
    # The rows that set nothing drew what the plain sampler draws from the raw logits.
    plain_outputs = [[], []]
    gens = [make_generator(0), make_generator(5)]
    for step in range(40):
        logits = fixed_logits(rows=8, seed=1000 + step)[[0, 5]]
        tokens = Sampler((EOS,)).sample(logits, [params[0], params[5]], gens, [0, 0]).token_ids
        for output, token in zip(plain_outputs, tokens):
            output.append(token)
    assert plain_outputs == [outputs[0], outputs[5]]
    # Rows the fields constrain stay inside their constraints.
    assert set(outputs[1]) <= set(FIELD_CASES["allowed"]["allowed_token_ids"])
    assert set(outputs[6]) <= {1, 2, 3} and 3 not in outputs[6][:5]
    assert all(pair not in ([1, 2], [2, 1]) for pair in zip(outputs[6], outputs[6][1:]))


def test_unset_fields_leave_sampling_unchanged():
    """With prompt/output ids passed but no field set: greedy is argmax, and random draws are
    the ones made without those arguments."""
    logits = fixed_logits(rows=6)
    params = SamplingParams(temperature=0)
    assert sample(logits, params, PROMPTS + PROMPTS[:2], OUTPUTS + OUTPUTS[:2]).token_ids == logits.argmax(-1).tolist()
    assert sample(logits, params).token_ids == logits.argmax(-1).tolist()
    random = SamplingParams(temperature=0.9, top_p=0.8, seed=3)
    with_ids = sample(logits, random, PROMPTS + PROMPTS[:2], OUTPUTS + OUTPUTS[:2],
                      [make_generator(s) for s in range(6)]).token_ids
    without = sample(logits, random, generators=[make_generator(s) for s in range(6)]).token_ids
    assert with_ids == without


# -- support of many draws -------------------------------------------------------------------------

DRAWS = 5000


def check_support(drawn: list[int], probs: torch.Tensor) -> None:
    """Tokens of zero reference probability never appear; every other one does (the test's
    distributions give each at least 40 / DRAWS, so missing one has odds below e^-40)."""
    support = set(torch.nonzero(probs > 0).flatten().tolist())
    assert min(probs[list(support)]) * DRAWS > 40
    assert set(drawn) == support


@pytest.mark.parametrize("min_p", [0.1, 0.3])
@pytest.mark.parametrize("temperature", [0.7, 1.5])
def test_min_p_support(min_p, temperature):
    logits = fixed_logits(rows=1, seed=5, scale=1.0)[0]
    p = SamplingParams(temperature=temperature, min_p=min_p)
    probs = reference_probs(logits, p)
    # min_p really cuts something here, and what it keeps depends on the temperature.
    assert 1 < int((probs > 0).sum()) < VOCAB
    check_support(draw_seeded(logits, p, DRAWS), probs)


def test_min_p_follows_temperature():
    """min_p is applied to the tempered distribution (vLLM): a higher temperature keeps more."""
    logits = fixed_logits(rows=1, seed=5, scale=1.0)[0]
    kept = [int((reference_probs(logits, SamplingParams(temperature=t, min_p=0.3)) > 0).sum()) for t in (0.7, 1.5)]
    assert kept[0] < kept[1]
    for t, n in zip((0.7, 1.5), kept):
        assert len(set(draw_seeded(logits, SamplingParams(temperature=t, min_p=0.3), DRAWS))) == n


def test_min_p_ignored_by_greedy_rows():
    logits = fixed_logits()
    assert sample(logits, SamplingParams(temperature=0, min_p=0.9)).token_ids == logits.argmax(-1).tolist()


def test_allowed_token_ids_support():
    logits = fixed_logits(rows=1, seed=6, scale=1.0)[0]
    allowed = [0, 3, 17, 18, 41, 49]
    p = SamplingParams(temperature=1.0, allowed_token_ids=allowed)
    probs = reference_probs(logits, p)
    assert set(torch.nonzero(probs > 0).flatten().tolist()) == set(allowed)
    check_support(draw_seeded(logits, p, DRAWS), probs)


def test_allowed_token_ids_greedy():
    logits = fixed_logits()
    allowed = [1, 2, 3]
    got = sample(logits, SamplingParams(temperature=0, allowed_token_ids=allowed)).token_ids
    assert got == [allowed[i] for i in logits[:, allowed].argmax(-1).tolist()]


def test_min_p_with_allowed_ids_and_bad_words_support():
    logits = fixed_logits(rows=1, seed=7, scale=1.0)[0]
    p = SamplingParams(temperature=1.2, min_p=0.2, allowed_token_ids=list(range(10, 40)),
                       bad_words_token_ids=[[5, 22], [23]])
    probs = reference_probs(logits, p, output=[1, 5])
    assert probs[22] == 0 and probs[23] == 0
    check_support(draw_seeded(logits, p, DRAWS, output=[1, 5]), probs)


# -- bad words -------------------------------------------------------------------------------------


def one_hot_ranking(order: list[int]) -> torch.Tensor:
    """A (1, VOCAB) row whose argmax is order[0], then order[1], ..."""
    row = torch.zeros(1, VOCAB)
    for rank, token in enumerate(order):
        row[0, token] = 10.0 - rank
    return row


@pytest.mark.parametrize("word, output, blocked", [
    ([30], [], True),  # one token: always
    ([30], [1, 2, 3], True),
    ([5, 30], [], False),  # the prefix needs an output
    ([5, 30], [5], True),
    ([5, 30], [1, 5], True),
    ([5, 30], [5, 1], False),  # the prefix must end the output
    ([4, 5, 30], [4, 5], True),  # prefix = the whole output
    ([4, 5, 30], [9, 4, 5], True),
    ([4, 5, 30], [5], False),  # only part of the prefix
    ([4, 5, 30], [4, 9, 5], False),
    ([4, 5, 30], [5, 4], False),  # the prefix's order matters
    ([30, 30], [30], True),
    ([30, 30, 30], [30], False),
])
def test_bad_words_multi_token(word, output, blocked):
    logits = one_hot_ranking([30, 12])
    params = SamplingParams(temperature=0, bad_words_token_ids=[word])
    got = sample(logits, params, [[1]], [output]).token_ids
    assert got == ([12] if blocked else [30])


def test_bad_words_several_words_and_rows():
    logits = torch.cat([one_hot_ranking([30, 31, 32, 33])] * 3)
    params = SamplingParams(temperature=0, bad_words_token_ids=[[30], [7, 31], [8, 9, 32]])
    outputs = [[], [7], [8, 9]]
    assert sample(logits, params, None, outputs).token_ids == [31, 32, 31]
    outputs = [[8, 9, 7], [1, 7], [7, 9]]  # row 0: 8, 9 no longer end the output
    assert sample(logits, params, None, outputs).token_ids == [32, 32, 31]
    outputs = [[7, 8, 9], [9, 8], [8, 9, 8]]
    assert sample(logits, params, None, outputs).token_ids == [31, 31, 31]


def test_bad_words_only_look_at_the_output():
    logits = one_hot_ranking([30, 12])
    params = SamplingParams(temperature=0, bad_words_token_ids=[[5, 30]])
    assert sample(logits, params, [[1, 5]], [[]]).token_ids == [30]


# -- logit_bias ------------------------------------------------------------------------------------


def test_logit_bias_forces_a_token_under_greedy():
    logits = fixed_logits()
    lowest = logits.argmin(-1).tolist()
    params = [SamplingParams(temperature=0, logit_bias={t: 100.0}) for t in lowest]
    assert sample(logits, params).token_ids == lowest


def test_logit_bias_negative_removes_the_argmax():
    logits = fixed_logits()
    top2 = logits.topk(2, dim=-1).indices
    params = [SamplingParams(temperature=0, logit_bias={int(t): -100.0}) for t in top2[:, 0]]
    assert sample(logits, params).token_ids == top2[:, 1].tolist()


def test_logit_bias_forces_a_token_under_random_sampling():
    logits = fixed_logits(rows=1)
    params = SamplingParams(temperature=1.0, logit_bias={13: 100.0})
    assert set(draw_seeded(logits[0], params, 200)) == {13}


def test_logit_bias_ignores_ids_beyond_the_vocabulary():
    logits = fixed_logits()
    params = SamplingParams(temperature=0, logit_bias={VOCAB: 100.0, VOCAB + 1000: -100.0})
    assert sample(logits, params).token_ids == logits.argmax(-1).tolist()


# -- penalties -------------------------------------------------------------------------------------


def test_repetition_penalty_by_hand():
    # 0: in the prompt, positive; 1: in the output, negative; 2: in neither; 3: in the prompt, negative
    logits = torch.tensor([[3.0, -1.0, 2.0, -0.5] + [-20.0] * (VOCAB - 4)])
    p = SamplingParams(temperature=0, repetition_penalty=2.0)
    # 3 / 2 = 1.5 < 2: token 2 wins; with the penalty off, token 0 does.
    assert sample(logits, p, [[0, 3]], [[1]]).token_ids == [2]
    assert sample(logits, SamplingParams(temperature=0), [[0, 3]], [[1]]).token_ids == [0]
    x = reference_logits(logits[0], p, [0, 3], [1])
    assert x[:4].tolist() == [1.5, -2.0, 2.0, -1.0]


def test_repetition_penalty_ignores_media_handles():
    logits = one_hot_ranking([0, 1])
    p = SamplingParams(temperature=0, repetition_penalty=2.0)
    # -1 must not count as token VOCAB - 1 (or anything else): only 0 is penalised
    # (10 / 2 = 5 < 9), and a prompt of handles only penalises nothing.
    assert sample(logits, p, [[-1, 0, -1]], [[]]).token_ids == [1]
    assert sample(logits, p, [[-1, -2, -3]], [[]]).token_ids == [0]


def test_frequency_penalty_counts_the_output_only():
    logits = torch.tensor([[5.0, 4.0] + [-20.0] * (VOCAB - 2)])
    p = SamplingParams(temperature=0, frequency_penalty=0.6)
    assert sample(logits, p, [[0, 0, 0, 0]], [[]]).token_ids == [0]  # the prompt does not count
    assert sample(logits, p, [[1]], [[0]]).token_ids == [0]  # 5 - 0.6 > 4
    assert sample(logits, p, [[1]], [[0, 0]]).token_ids == [1]  # 5 - 1.2 < 4


def test_presence_penalty_once():
    logits = torch.tensor([[5.0, 3.5] + [-20.0] * (VOCAB - 2)])
    p = SamplingParams(temperature=0, presence_penalty=1.0)
    assert sample(logits, p, [[0]], [[]]).token_ids == [0]
    assert sample(logits, p, [[1]], [[0] * 10]).token_ids == [0]  # 5 - 1 > 3.5, whatever the count
    p = SamplingParams(temperature=0, presence_penalty=2.0)
    assert sample(logits, p, [[1]], [[0]]).token_ids == [1]


def test_negative_penalties_favour_repeats():
    logits = torch.tensor([[4.0, 5.0] + [-20.0] * (VOCAB - 2)])
    assert sample(logits, SamplingParams(temperature=0, frequency_penalty=-0.6), [[1]], [[0, 0]]).token_ids == [0]
    assert sample(logits, SamplingParams(temperature=0, presence_penalty=-1.5), [[1]], [[0]]).token_ids == [0]


def test_logit_bias_comes_before_the_repetition_penalty():
    """vLLM's order: (1 - 2) x 2 = -2 < -1.7 picks token 1; penalty first would give
    1 / 2 - 2 = -1.5 and pick token 0."""
    logits = torch.tensor([[1.0, -1.7] + [-20.0] * (VOCAB - 2)])
    p = SamplingParams(temperature=0, logit_bias={0: -2.0}, repetition_penalty=2.0)
    assert sample(logits, p, [[0]], [[]]).token_ids == [1]


def test_penalties_apply_to_greedy_and_random_rows_alike():
    logits = torch.tensor([[5.0, 4.0] + [-30.0] * (VOCAB - 2)])
    greedy = SamplingParams(temperature=0, frequency_penalty=2.0)
    assert sample(logits, greedy, [[9]], [[0]]).token_ids == [1]
    random = SamplingParams(temperature=0.05, frequency_penalty=2.0)  # nearly greedy
    assert set(draw_seeded(logits[0], random, 100, prompt=[9], output=[0])) == {1}


# -- contract --------------------------------------------------------------------------------------


def test_missing_token_ids_raise_only_when_needed():
    logits = fixed_logits(rows=2)
    sampler = Sampler((EOS,))
    gens, counts = [None, None], [0, 0]
    for params in (SamplingParams(frequency_penalty=1.0), SamplingParams(presence_penalty=1.0),
                   SamplingParams(repetition_penalty=1.2), SamplingParams(bad_words_token_ids=[[3]])):
        with pytest.raises(RuntimeError, match="output_token_ids"):
            sampler.sample(logits, [SamplingParams(), params], gens, counts, prompt_token_ids=[[1], [1]])
    with pytest.raises(RuntimeError, match="prompt_token_ids"):
        sampler.sample(logits, [SamplingParams(), SamplingParams(repetition_penalty=1.2)], gens, counts,
                       output_token_ids=[[], []])
    # Frequency / presence need no prompt; the other fields need neither.
    sampler.sample(logits, [SamplingParams(frequency_penalty=1.0, presence_penalty=1.0)] * 2, gens, counts,
                   output_token_ids=[[], [1]])
    sampler.sample(logits, [SamplingParams(allowed_token_ids=[1], logit_bias={2: 1.0}, min_p=0.1)] * 2, gens, counts)
    with pytest.raises(RuntimeError, match="one entry per row"):
        sampler.sample(logits, [SamplingParams()] * 2, gens, counts, output_token_ids=[[]])


def test_logits_are_not_modified_and_logprobs_stay_raw():
    logits = fixed_logits()
    before = logits.clone()
    params = SamplingParams(temperature=0.7, max_tokens=50, logprobs=3, **{
        k: v for k, v in FIELD_CASES["everything"].items()})
    out = sample(logits, params, PROMPTS, OUTPUTS, [make_generator(s) for s in range(4)])
    assert torch.equal(logits, before)
    raw = torch.log_softmax(logits, dim=-1)
    for i, entry in enumerate(out.logprobs):
        assert math.isclose(entry.logprob, raw[i, entry.token_id].item(), rel_tol=1e-6)
        assert entry.top_token_ids == raw[i].topk(3).indices.tolist()


def test_half_precision_with_fields():
    logits = fixed_logits()
    params = SamplingParams(temperature=0, allowed_token_ids=[1, 2, 3, 4], repetition_penalty=1.3,
                            logit_bias={2: 0.5})
    half = logits.half()
    before = half.clone()
    got = sample(half, params, PROMPTS, OUTPUTS).token_ids
    assert torch.equal(half, before)
    assert got == reference_sample(half.float(), [params] * 4, PROMPTS, OUTPUTS, [None] * 4)


def test_a_seeded_row_ignores_its_neighbours_fields():
    """A seeded row draws the same tokens alone and next to rows that use top-k, top-p, min_p
    or any new field (each row's noise value i races token i, sorted or not)."""
    logits = fixed_logits(rows=5, seed=11)
    mine = SamplingParams(temperature=0.9, seed=42)
    neighbours = [SamplingParams(temperature=1.0, top_k=3), SamplingParams(temperature=1.0, top_p=0.5),
                  SamplingParams(temperature=1.0, min_p=0.2, repetition_penalty=1.5),
                  SamplingParams(temperature=0, bad_words_token_ids=[[1]], allowed_token_ids=[1, 2])]
    alone_gen, batched_gen = make_generator(42), make_generator(42)
    for _ in range(20):
        alone = sample(logits[:1], [mine], generators=[alone_gen]).token_ids[0]
        batched = sample(logits, [mine] + neighbours, [[1]] * 5, [[]] * 5,
                         [batched_gen, None, None, None, None]).token_ids[0]
        assert alone == batched


# -- through the engine ----------------------------------------------------------------------------


def test_the_runner_passes_each_requests_prompt_and_output():
    from atb_plugin import LLM
    from atb_plugin.testing.tiny import tiny_checkpoint

    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    with LLM(tiny_checkpoint("qwen2"), block_size=4) as llm:
        sampler = llm.engine.runner.sampler
        original, calls = sampler.sample, []

        def spy(*args, **kwargs):
            calls.append(([list(p) for p in kwargs["prompt_token_ids"]], [list(o) for o in kwargs["output_token_ids"]]))
            return original(*args, **kwargs)

        sampler.sample = spy
        outputs = llm.generate(["hello world", "the cat sat"], greedy)
    assert len(calls) == 6
    by_prompt = {tuple(o.prompt_token_ids): o.outputs[0].token_ids for o in outputs}
    for step, (prompts, produced) in enumerate(calls):
        assert sorted(map(tuple, prompts)) == sorted(by_prompt)
        for prompt, output in zip(prompts, produced):
            assert output == by_prompt[tuple(prompt)][:step]


def test_engine_penalties_and_bad_words_end_to_end():
    """Greedy with frequency and presence penalties picks, at every step, the argmax of the raw
    logprobs (the whole vocabulary, returned as top logprobs) less the penalties of the tokens it
    produced so far; a two-token bad word taken from the unpenalised output changes it exactly
    where the word would have completed."""
    from atb_plugin import LLM
    from atb_plugin.testing.tiny import tiny_checkpoint

    with LLM(tiny_checkpoint("qwen2"), block_size=4) as llm:
        vocab = llm.engine.config.vocab_size
        base = dict(temperature=0, max_tokens=12, ignore_eos=True)
        baseline = llm.generate("numbers: 1 2 3", SamplingParams(**base))[0].outputs[0].token_ids
        penalised = llm.generate("numbers: 1 2 3", SamplingParams(
            **base, frequency_penalty=1.0, presence_penalty=0.5, logprobs=vocab))[0].outputs[0]
        produced = []
        for token, entry in zip(penalised.token_ids, penalised.logprobs):
            raw = dict(zip(entry.top_token_ids, entry.top_logprobs))
            assert len(raw) == vocab
            scores = {t: lp - 1.0 * produced.count(t) - 0.5 * (t in produced) for t, lp in raw.items()}
            assert token == max(scores, key=scores.get)
            produced.append(token)
        word = baseline[2:4]
        blocked = llm.generate("numbers: 1 2 3", SamplingParams(**base, bad_words_token_ids=[word]))[0]
        tokens = blocked.outputs[0].token_ids
        assert tokens[:3] == baseline[:3] and tokens[3] != baseline[3]
        assert all(list(pair) != word for pair in zip(tokens, tokens[1:]))
