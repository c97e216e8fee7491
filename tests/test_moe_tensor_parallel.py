"""Qwen3, Qwen3-MoE and Qwen2-MoE (its shared expert sharded like a dense MLP) under tensor
parallelism through ``LLM`` (rank processes, gloo on
loopback / the shared-memory exchange): TP = 2, and for the MoE model TP = 2 with expert
parallelism (``enable_expert_parallel``: each rank holds 4 of the 8 experts whole instead of half
of every expert), give TP = 1's greedy tokens and logprobs under preemption, and each rank holds
fewer weight bytes than TP = 1. The expert-parallel run uses experts of 33 intermediate features,
which do not split over 2 ranks: it can only start if the ranks really split whole experts.

Tolerance: 1e-4 on logprobs (float32; only the all-reduce's summation order differs from TP = 1,
as in tests/test_tensor_parallel.py). Greedy tokens must be equal.
"""

from __future__ import annotations

import pytest

from atb_plugin.testing.tiny import build_qwen3_moe, tiny_checkpoint
from tests.test_tensor_parallel import PROMPTS, Memo, assert_same_answers

pytestmark = pytest.mark.slow

GREEDY = dict(temperature=0, max_tokens=24, ignore_eos=True, logprobs=5)
KV_BLOCKS = 10  # 9 usable blocks of 16 tokens for 8 requests of ~10-20 + 24 tokens: preemption


def generate(path, tp: int, expert_parallel: bool) -> dict:
    from atb_plugin import LLM, SamplingParams

    with LLM(path, tensor_parallel_size=tp, enable_expert_parallel=expert_parallel,
             block_size=16, kv_cache_blocks=KV_BLOCKS) as llm:
        return {"outputs": llm.generate(PROMPTS, SamplingParams(**GREEDY)),
                "preemptions": llm.engine.core.scheduler.num_preemptions,
                "weight_bytes": list(llm.engine.core.executor.weight_bytes)}


@pytest.fixture(scope="module")
def generated():
    return Memo(generate)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    odd = tmp_path_factory.mktemp("qwen3_moe_i33")
    build_qwen3_moe(odd, seed=2, moe_intermediate_size=33)
    return {"qwen3": tiny_checkpoint("qwen3"), "qwen3_moe": tiny_checkpoint("qwen3_moe"), "qwen3_moe_i33": odd,
            "qwen2_moe": tiny_checkpoint("qwen2_moe")}


@pytest.mark.parametrize("family, expert_parallel", [("qwen3", False), ("qwen3_moe", False), ("qwen3_moe_i33", True),
                                                     ("qwen2_moe", True)],
                         ids=["qwen3-tp2", "qwen3_moe-tp2", "qwen3_moe-tp2-ep", "qwen2_moe-tp2-ep"])
def test_tp2_generates_as_tp1(family, expert_parallel, generated, checkpoints):
    path = checkpoints[family]
    tp1, tp2 = generated(path, 1, False), generated(path, 2, expert_parallel)
    assert tp2["preemptions"] > 0 and tp2["preemptions"] == tp1["preemptions"]
    for got, expected in zip(tp2["outputs"], tp1["outputs"]):
        assert_same_answers(got, expected, f"{family} tp2 ep={expert_parallel}: {expected.prompt}")
    assert len(tp2["weight_bytes"]) == 2 and max(tp2["weight_bytes"]) < tp1["weight_bytes"][0]


def test_experts_that_do_not_split_need_expert_parallelism(checkpoints):
    from atb_plugin.engine.config import EngineConfig

    with pytest.raises(ValueError, match=r"moe_intermediate_size \(33\) is not divisible.*--enable-expert-parallel"):
        EngineConfig(model=str(checkpoints["qwen3_moe_i33"]), tensor_parallel_size=2)


def test_expert_parallel_ranks_hold_whole_experts():
    """Built as rank 1 of 2 with expert parallelism: experts 4..7 whole; without it, all 8
    experts with half their intermediate features each."""
    from atb_plugin import distributed
    from atb_plugin.models.moe import FusedExperts, MoeConfig

    config = MoeConfig(num_experts=8, top_k=2, intermediate_size=32, norm_topk_prob=True,
                       sparse_layers=frozenset({0}))
    saved = distributed._group
    try:
        for expert_parallel, shape, first in ((True, (4, 64, 64), 4), (False, (8, 64, 32), 0)):
            distributed._group = distributed._Group(1, 2, expert_parallel=expert_parallel)
            experts = FusedExperts(config, 64)
            assert (tuple(experts.w13.shape), experts.first_expert) == (shape, first)
            assert experts.owns(5) and experts.owns(3) is not expert_parallel
    finally:
        distributed._group = saved
