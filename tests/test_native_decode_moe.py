"""Qwen3 and mixture-of-experts layers in the captured decode step (atb_plugin/models/native_decode.py,
csrc/moe_kernels.c).

Tolerances:
- Qwen3 (dense): none. Its per-head q / k norms run the eager path's native RMSNorm kernel on the
  same rows, so a dense Qwen3 step is bit-identical to eager, like the other dense families
  (tests/test_native_decode.py).
- Sparse layers (Qwen3-MoE, Qwen2-MoE's shared expert): the router (the same panels kernel as
  eager) and the top-k rule are the same, but the experts' products are summed by the native
  grouped kernel where eager calls torch._grouped_mm (MKL), in another order, and the router's
  softmax uses another exp; float32 rounding over sums of a few hundred terms. So tokens must be
  equal and logprobs within 1e-4 (seen: ~2e-6); a chosen expert flipping on a near-tie would show as
  a token difference, not hide inside the bound.
- The grouped kernel alone: against tests/test_moe.py's float64 definition, within 1e-5 on values
  of order 1 (float32 sums of at most 80 terms of order 1 err ~1e-6).
"""

from __future__ import annotations

import pytest
import torch

from atb_plugin import LLM, SamplingParams
from atb_plugin.models import native_decode
from atb_plugin.models.moe import MoeConfig, SparseMoeBlock
from atb_plugin.ops import cpu_native
from atb_plugin.testing.tiny import tiny_checkpoint
from tests.test_moe import assert_greedy_equals_transformers, random_moe, reference_moe
from tests import test_native_decode
from tests.test_native_decode import PROMPTS, _assert_same, _generate

# test_native_decode's fixtures: the count of captured steps, and the native kernels required.
captured_calls, native_kernels = test_native_decode.captured_calls, test_native_decode.native_kernels

MOE_LOGPROB_ATOL = 1e-4


@pytest.fixture
def library(native_kernels):
    return cpu_native.linear_library(torch.device("cpu"))


# -- the grouped expert kernel ------------------------------------------------------------------


@pytest.mark.parametrize("tokens, hidden, experts, intermediate, top_k, renormalize", [
    (1, 64, 8, 32, 2, True),     # one decode row, whole 64-column tiles
    (5, 80, 6, 40, 3, False),    # a partial column tile (80 = 64 + 16) and a 5-row expert
    (33, 64, 4, 32, 4, True),    # every token to every expert: row tiles of 4 and a tail of 1
    (13, 16, 6, 8, 1, False),    # narrower than one tile: the plain C columns only
])
def test_grouped_experts_equal_float64(library, tokens, hidden, experts, intermediate, top_k, renormalize):
    x, logits, w13, w2 = random_moe(tokens, hidden, experts, intermediate, seed=tokens)
    got = cpu_native.moe_experts(library, x, logits, w13, w2, top_k, renormalize)
    exact = reference_moe(x, logits, w13, w2, top_k, renormalize)
    assert (got.double() - exact).abs().max().item() <= 1e-5


def test_grouped_experts_break_ties_by_the_lower_index_and_ignore_the_thread_count(library):
    x, logits, w13, w2 = random_moe(9, 64, 8, 32, seed=3)
    logits[:4] = 0.5  # every expert ties: experts 0 and 1 win
    exact = reference_moe(x, logits, w13, w2, 2, True)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu_native.moe_experts(library, x, logits, w13, w2, 2, True)
        torch.set_num_threads(2)
        two = cpu_native.moe_experts(library, x, logits, w13, w2, 2, True)
    finally:
        torch.set_num_threads(threads)
    assert (one.double() - exact).abs().max().item() <= 1e-5
    # Each expert's rows are computed by one thread, the tokens' sums taken in expert order after.
    assert torch.equal(one, two)


def test_grouped_experts_refuse_mismatched_shapes(library):
    x, logits, w13, w2 = random_moe(3, 16, 4, 8)
    with pytest.raises(ValueError, match="moe_experts"):
        cpu_native.moe_experts(library, x, logits[:, :3], w13, w2, 2, True)
    with pytest.raises(ValueError, match="moe_experts"):
        cpu_native.moe_experts(library, x.double(), logits, w13, w2, 2, True)


# -- the captured step --------------------------------------------------------------------------


def test_captured_qwen3_equals_eager_exactly(captured_calls):
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=2)
    outcome, captured = _generate("qwen3", False, params)
    assert outcome == "captured" and captured_calls and max(captured_calls) == len(PROMPTS)
    _, eager = _generate("qwen3", True, params)
    _assert_same(captured, eager)


def _assert_close(captured, eager):
    for a, b in zip(captured, eager, strict=True):
        assert a.token_ids == b.token_ids
        for x, y in zip(a.logprobs, b.logprobs, strict=True):
            assert abs(x.logprob - y.logprob) <= MOE_LOGPROB_ATOL
            assert x.top_token_ids == y.top_token_ids
            assert all(abs(p - q) <= MOE_LOGPROB_ATOL for p, q in zip(x.top_logprobs, y.top_logprobs, strict=True))


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe"])
def test_captured_sparse_layers_equal_eager_within_float32_rounding(family, captured_calls):
    # qwen3_moe: 8 experts, top-2, renormalised, layer 1 dense; qwen2_moe: a shared expert behind
    # its sigmoid gate, no renormalisation.
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=2)
    outcome, captured = _generate(family, False, params)
    assert outcome == "captured" and captured_calls and max(captured_calls) == len(PROMPTS)
    _, eager = _generate(family, True, params)
    _assert_close(captured, eager)


def test_captured_qwen3_moe_greedy_equals_transformers(captured_calls):
    import transformers

    path = tiny_checkpoint("qwen3_moe")
    with LLM(path, block_size=4) as llm:
        assert llm.engine.core.runner.decode_capture == "captured"
        outputs = llm.generate(PROMPTS[:2], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
        prompt_ids = [llm.router.tokenize(p) for p in PROMPTS[:2]]
    assert captured_calls
    assert_greedy_equals_transformers(transformers.Qwen3MoeForCausalLM.from_pretrained(path).eval(), prompt_ids,
                                      outputs, 10)


def test_sparse_layers_the_plan_cannot_hold_say_why():
    block = SparseMoeBlock(MoeConfig(num_experts=4, top_k=2, intermediate_size=8, norm_topk_prob=True,
                                     sparse_layers=frozenset({0})), hidden_size=16)
    assert native_decode._sparse_reason(block) is None
    block.experts.first_expert = 2  # expert parallelism: another rank holds experts 0 and 1
    assert native_decode._sparse_reason(block) == "expert parallelism: this rank holds only some experts"
    block.experts.first_expert = 0
    block.experts.w13.data = block.experts.w13.data.to(torch.bfloat16)
    assert "bfloat16 experts" in native_decode._sparse_reason(block)
