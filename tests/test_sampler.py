"""Sampler: greedy, temperature, top-k / top-p, per-request seeds, min_tokens, logprobs, and
``check_stop``'s finish reasons. All CPU, fixed seeds; the distribution checks are chi-square
tests against thresholds at p = 0.001, so a correct sampler fails them once in a thousand seeds
(the seeds here are fixed, so never) and a wrong one (off by a temperature, a mask) by far."""

from __future__ import annotations

import math

import pytest
import torch

from atb_plugin.engine.request import Request, RequestStatus
from atb_plugin.engine.sampler import LogprobsEntry, Sampler, SamplerOutput, make_generator
from atb_plugin.engine.scheduler import check_stop
from atb_plugin.engine.sampling_params import SamplingParams

VOCAB = 64
EOS = 7

# chi-square critical values at p = 0.001 by degrees of freedom
CHI2_CRITICAL = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32}


def random_logits(rows: int, vocab: int = VOCAB, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def sample(logits, params, generators=None, num_output_tokens=None, eos=(EOS,)) -> SamplerOutput:
    batch = logits.shape[0]
    params = params if isinstance(params, list) else [params] * batch
    generators = generators if generators is not None else [None] * batch
    num_output_tokens = num_output_tokens if num_output_tokens is not None else [0] * batch
    return Sampler(eos).sample(logits, params, generators, num_output_tokens)


def chi_square(samples: list[int], expected_probs: torch.Tensor) -> tuple[float, int]:
    """Statistic and degrees of freedom over the tokens with non-zero expected probability;
    asserts that no token outside them was drawn."""
    counts = torch.bincount(torch.tensor(samples), minlength=len(expected_probs)).double()
    support = expected_probs > 0
    assert counts[~support].sum() == 0, f"drew excluded tokens {torch.nonzero(counts * ~support).flatten().tolist()}"
    expected = expected_probs[support].double() * len(samples)
    return float(((counts[support] - expected) ** 2 / expected).sum()), int(support.sum()) - 1


def draw_unseeded(logits_row: torch.Tensor, params: SamplingParams, n: int, seed: int = 0) -> list[int]:
    """n independent draws in one batch of n identical rows (the global generator, forked)."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return sample(logits_row.expand(n, -1).contiguous(), params).token_ids


# -- greedy and its equivalents --------------------------------------------------------------------


def test_greedy_is_argmax():
    logits = random_logits(9)
    out = sample(logits, SamplingParams(temperature=0))
    assert out.token_ids == logits.argmax(-1).tolist()
    assert out.logprobs == [None] * 9


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0, top_k=1),
    SamplingParams(temperature=1.5, top_p=1e-6),
    SamplingParams(temperature=1e-7),  # below vLLM's epsilon: greedy
], ids=["top_k=1", "top_p tiny", "temperature tiny"])
def test_degenerate_sampling_is_greedy(params):
    logits = random_logits(32, seed=1)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        assert sample(logits, params).token_ids == logits.argmax(-1).tolist()


def test_logits_are_not_modified_and_half_precision_works():
    logits = random_logits(4)
    before = logits.clone()
    sample(logits, SamplingParams(temperature=0.7, top_k=5, top_p=0.8, min_tokens=2, logprobs=3))
    assert torch.equal(logits, before)
    half = sample(logits.half(), SamplingParams(temperature=0)).token_ids
    assert half == logits.half().float().argmax(-1).tolist()


# -- seeds -----------------------------------------------------------------------------------------


def test_seeded_sampling_is_reproducible_and_independent_of_the_batch():
    steps = [random_logits(1, seed=100 + t)[0] for t in range(12)]
    params = SamplingParams(temperature=1.3, top_k=40, top_p=0.95, seed=1234)

    def run_alone() -> list[int]:
        generator = make_generator(params.seed)
        return [sample(step[None], [params], [generator]).token_ids[0] for step in steps]

    def run_in_batch(position: int, neighbours: int) -> list[int]:
        """The same request at ``position`` among other seeded, unseeded and greedy requests
        whose logits and params differ from step to step."""
        generator = make_generator(params.seed)
        other_generators = [make_generator(999 + j) if j % 3 == 0 else None for j in range(neighbours)]
        others = [SamplingParams(temperature=[0.0, 0.5, 2.0][j % 3], top_p=0.5 + 0.1 * (j % 4),
                                 seed=999 + j if j % 3 == 0 else None) for j in range(neighbours)]
        tokens = []
        for t, step in enumerate(steps):
            logits = random_logits(neighbours + 1, seed=500 + t)
            logits[position] = step
            batch_params = others[:position] + [params] + others[position:]
            batch_generators = other_generators[:position] + [generator] + other_generators[position:]
            tokens.append(sample(logits, batch_params, batch_generators).token_ids[position])
        return tokens

    alone = run_alone()
    assert alone == run_alone()
    assert alone == run_in_batch(0, 3) == run_in_batch(2, 5) == run_in_batch(7, 7)
    # and the seed matters (12 draws over ~40 tokens: equal by chance essentially never)
    other_seed = make_generator(4321)
    assert alone != [sample(step[None], [params], [other_seed]).token_ids[0] for step in steps]


def test_a_generator_is_advanced_by_sampling():
    logits = torch.zeros(1, VOCAB)  # uniform: every draw is fresh randomness
    generator = make_generator(5)
    draws = [sample(logits, [SamplingParams(seed=5)], [generator]).token_ids[0] for _ in range(20)]
    assert len(set(draws)) > 5
    assert make_generator(None) is None


# -- distributions -----------------------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_temperature_samples_softmax_of_logits_over_t(temperature):
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    draws = draw_unseeded(logits, SamplingParams(temperature=temperature), n=20000)
    statistic, dof = chi_square(draws, torch.softmax(logits / temperature, -1))
    assert statistic < CHI2_CRITICAL[dof], (statistic, dof)
    # the same test rejects the wrong temperature
    wrong, _ = chi_square(draws, torch.softmax(logits / (temperature * 1.5), -1))
    assert wrong > CHI2_CRITICAL[dof]


def test_seeded_generator_samples_the_same_distribution():
    logits = torch.tensor([[1.0, 0.0, -0.5, 0.5]])
    generator = make_generator(7)
    params = SamplingParams(temperature=0.8, seed=7)
    draws = [sample(logits, [params], [generator]).token_ids[0] for _ in range(3000)]
    statistic, dof = chi_square(draws, torch.softmax(logits[0] / 0.8, -1))
    assert statistic < CHI2_CRITICAL[dof], statistic


def test_a_seeded_top_k_row_races_only_its_candidates_with_the_right_distribution():
    # top_k <= 1024 draws k values per step from the row's own generator (not V): the draws must
    # still follow the softmax over the k most likely tokens.
    logits = torch.tensor([[1.0, 0.0, -0.5, 0.5, 2.0, -3.0]])
    generator = make_generator(11)
    params = SamplingParams(temperature=0.9, top_k=3, seed=11)
    draws = [sample(logits, [params], [generator]).token_ids[0] for _ in range(3000)]
    expected = torch.zeros(6)
    expected[[4, 0, 3]] = torch.softmax(logits[0, [4, 0, 3]] / 0.9, -1)
    assert set(draws) == {0, 3, 4}
    statistic, dof = chi_square(draws, expected)
    assert statistic < CHI2_CRITICAL[dof], statistic


PROBS = torch.tensor([0.40, 0.30, 0.15, 0.10, 0.05])


@pytest.mark.parametrize("top_k, top_p, kept", [
    (2, 1.0, [0, 1]),
    (4, 1.0, [0, 1, 2, 3]),
    (0, 0.65, [0, 1]),  # mass before token 2 is 0.70 >= 0.65
    (-1, 0.75, [0, 1, 2]),  # before token 3: 0.85
    (3, 0.5, [0, 1]),  # both: top-k first, then top-p over what is left
    (1, 1.0, [0]),
], ids=lambda v: str(v))
def test_top_k_and_top_p_keep_exactly_the_right_tokens(top_k, top_p, kept):
    logits = PROBS.log()[torch.tensor([3, 0, 4, 1, 2])]  # shuffled: masks must follow the sort
    probs_in_vocab_order = PROBS[torch.tensor([3, 0, 4, 1, 2])]
    kept_ids = torch.tensor([0, 1, 2, 3, 4])[torch.tensor([1, 3, 4, 0, 2])][kept]  # the ranks' vocab ids
    expected = torch.zeros(5)
    expected[kept_ids] = probs_in_vocab_order[kept_ids] / probs_in_vocab_order[kept_ids].sum()
    draws = draw_unseeded(logits, SamplingParams(temperature=1.0, top_k=top_k, top_p=top_p), n=8000, seed=3)
    assert set(draws) == set(kept_ids.tolist())
    if len(kept) > 1:
        statistic, dof = chi_square(draws, expected)
        assert statistic < CHI2_CRITICAL[dof], statistic


def test_per_row_top_k_and_top_p_in_one_batch():
    logits = PROBS.log().expand(4, -1).contiguous()
    params = [SamplingParams(top_k=1), SamplingParams(top_k=2), SamplingParams(top_p=0.75), SamplingParams()]
    seen = [set() for _ in params]
    with torch.random.fork_rng():
        torch.manual_seed(0)
        for _ in range(400):
            for row, token in enumerate(sample(logits, params).token_ids):
                seen[row].add(token)
    assert seen == [{0}, {0, 1}, {0, 1, 2}, {0, 1, 2, 3, 4}]


# -- min_tokens --------------------------------------------------------------------------------------


def eos_favoured_logits(rows: int = 1) -> torch.Tensor:
    logits = torch.zeros(rows, VOCAB)
    logits[:, EOS] = 50.0
    logits[:, 11] = 40.0  # a stop token id, next most likely
    logits[:, 3] = 30.0
    return logits


def test_min_tokens_blocks_eos_and_stop_ids_until_reached():
    params = SamplingParams(temperature=0, min_tokens=3, stop_token_ids=[11])
    assert sample(eos_favoured_logits(), params, num_output_tokens=[0]).token_ids == [3]
    assert sample(eos_favoured_logits(), params, num_output_tokens=[2]).token_ids == [3]
    assert sample(eos_favoured_logits(), params, num_output_tokens=[3]).token_ids == [EOS]
    # random sampling too (EOS would win ~always otherwise)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        out = sample(eos_favoured_logits(64), SamplingParams(temperature=1.0, min_tokens=1, stop_token_ids=[11]))
    assert set(out.token_ids) == {3}


def test_min_tokens_leaves_eos_alone_with_ignore_eos():
    params = SamplingParams(temperature=0, min_tokens=3, stop_token_ids=[11], ignore_eos=True)
    assert sample(eos_favoured_logits(), params, num_output_tokens=[0]).token_ids == [EOS]


def test_min_tokens_per_row():
    params = [SamplingParams(temperature=0, min_tokens=2), SamplingParams(temperature=0)]
    assert sample(eos_favoured_logits(2), params, num_output_tokens=[1, 1]).token_ids == [11, EOS]


# -- logprobs ----------------------------------------------------------------------------------------


def test_logprobs_are_log_softmax_of_the_raw_logits():
    logits = random_logits(3, seed=4)
    params = [SamplingParams(temperature=0.3, top_k=3, logprobs=5, min_tokens=1),
              SamplingParams(temperature=0, logprobs=0),
              SamplingParams(temperature=0)]
    with torch.random.fork_rng():
        torch.manual_seed(0)
        out = sample(logits, params)
    reference = torch.log_softmax(logits, -1)
    first, second, third = out.logprobs
    assert isinstance(first, LogprobsEntry) and third is None
    for row, entry in enumerate((first, second)):
        token = out.token_ids[row]
        assert entry.token_id == token
        assert entry.logprob == pytest.approx(reference[row, token].item(), abs=1e-6)
        assert entry.rank == int((reference[row] > reference[row, token]).sum()) + 1
    values, ids = reference[0].topk(5)
    assert first.top_token_ids == ids.tolist()
    assert first.top_logprobs == pytest.approx(values.tolist(), abs=1e-6)
    assert second.rank == 1 and second.top_token_ids == [] and second.top_logprobs == []
    assert math.isclose(sum(math.exp(v) for v in reference[0].tolist()), 1.0, rel_tol=1e-5)


def test_logprobs_count_is_clamped_to_the_vocabulary():
    out = sample(random_logits(1, vocab=4), SamplingParams(temperature=0, logprobs=10))
    assert len(out.logprobs[0].top_token_ids) == 4


# -- validation --------------------------------------------------------------------------------------


def test_mismatched_inputs_are_rejected():
    with pytest.raises(RuntimeError, match="one entry per row"):
        Sampler().sample(random_logits(2), [SamplingParams()], [None, None], [0, 0])
    with pytest.raises(RuntimeError, match="num_requests, vocab_size"):
        Sampler().sample(torch.zeros(VOCAB), [SamplingParams()], [None], [0])
    assert Sampler().sample(torch.zeros(0, VOCAB), [], [], []) == SamplerOutput([], [])


# -- check_stop --------------------------------------------------------------------------------------


def finished_after(tokens: list[int], params: SamplingParams, max_model_len: int | None = None,
                   prompt_len: int = 4) -> tuple[int, RequestStatus]:
    """Append ``tokens`` one at a time, calling check_stop after each: (how many, final status)."""
    request = Request("r", list(range(100, 100 + prompt_len)), params)
    status = request.status
    for token in tokens:
        request.append_output_token(token)
        status = check_stop(request, {EOS, 8}, max_model_len) or status
        if status.is_finished:
            break
    return request.num_output_tokens, status


def test_max_tokens_finishes_with_length():
    assert finished_after([1] * 10, SamplingParams(max_tokens=3)) == (3, RequestStatus.FINISHED_LENGTH)


def test_context_window_finishes_with_length():
    assert finished_after([1] * 10, SamplingParams(max_tokens=None), max_model_len=6) == (2, RequestStatus.FINISHED_LENGTH)


def test_eos_and_stop_ids_finish_with_stop():
    assert finished_after([1, 2, EOS, 4], SamplingParams()) == (3, RequestStatus.FINISHED_STOPPED)
    assert finished_after([1, 8, 4], SamplingParams()) == (2, RequestStatus.FINISHED_STOPPED)  # any EOS id
    assert finished_after([1, 2, 42, 4], SamplingParams(stop_token_ids=[42])) == (3, RequestStatus.FINISHED_STOPPED)
    # the max_tokens-th token being EOS is a stop, not a length finish
    assert finished_after([1, EOS], SamplingParams(max_tokens=2)) == (2, RequestStatus.FINISHED_STOPPED)


def test_ignore_eos_runs_to_max_tokens_but_stop_ids_still_stop():
    assert finished_after([EOS] * 6, SamplingParams(max_tokens=5, ignore_eos=True)) == (5, RequestStatus.FINISHED_LENGTH)
    assert finished_after([EOS, 42], SamplingParams(ignore_eos=True, stop_token_ids=[42])) == (2, RequestStatus.FINISHED_STOPPED)


def test_min_tokens_defers_stopping():
    assert finished_after([EOS, EOS, EOS], SamplingParams(min_tokens=2)) == (2, RequestStatus.FINISHED_STOPPED)
    assert finished_after([EOS, 1, 1], SamplingParams(min_tokens=2, max_tokens=3)) == (3, RequestStatus.FINISHED_LENGTH)


def test_a_running_request_is_left_alone():
    request = Request("r", [1, 2], SamplingParams(max_tokens=5), status=RequestStatus.RUNNING)
    request.append_output_token(3)
    assert check_stop(request, {EOS}) is None and request.status is RequestStatus.RUNNING
