"""Qwen3-MoE (and Qwen2-MoE) and the fused MoE op (``ops.fused_moe``): the op against a per-token float64
reference (routing edge cases included), on the CPU kernels and on the simulated NPU's MoE ops;
the model's logits against transformers' Qwen3MoeForCausalLM on tiny checkpoints with several
expert counts, top-k, ``norm_topk_prob`` both ways and dense layers mixed in; per-expert weight
loading; greedy tokens of the offline LLM against transformers' ``generate``.

Tolerances. float32 op / logits: 1e-4 absolute (logits ~4 at most here): the same products summed
in another order (the grouped GEMM over sorted tokens, the fused QKV matmul, SDPA), observed
~3e-6. The op against its float64 reference: 1e-5 (outputs O(1), one layer). Simulated NPU in
bfloat16 vs the CPU path in float32: the model-level bound of tests/test_models_text.py (5e-2 of
the largest logit: 8-bit mantissas over every weight and activation); the op alone: 3e-2
relative to its largest output (one bf16 rounding of inputs, weights, the intermediate and the
output, ~4e-3 each). Greedy tokens: compared exactly where the float32 top-2 margin exceeds
twice the bound.
"""

from __future__ import annotations


import pytest
import torch

from atb_plugin import ops
from atb_plugin.ops import torch_kernels
from atb_plugin.testing.sequence import SequenceRunner, check_simulated_npu
from atb_plugin.testing.tiny import build_qwen3_moe, tiny_checkpoint
from routers import get_router
from tests.helpers import model_pair as load_pair

FP32_ATOL = 1e-4
OP_ATOL = 1e-5
NPU_MODEL_TOL = 5e-2
NPU_OP_TOL = 3e-2


# The simulated A2 chip defaults to the FIA attention set; the MoE ops are the same in both sets
# (``npu_fia_kernels`` delegates them), and the ATB set's attention takes block size 16.
pytestmark = pytest.mark.usefixtures("atb_kernel_set")


# ------------------------------------------------------------------------------------------------
# The op


def reference_moe(hidden, router_logits, w13, w2, top_k, renormalize, first_expert=0):
    """Token by token, expert by expert, in float64: the definition the kernels must meet
    (softmax -> the k largest, ties to the lower index -> optional renormalisation -> SwiGLU
    experts, only those in [first_expert, first_expert + E_local))."""
    probs = torch.softmax(router_logits.double(), dim=-1)
    out = torch.zeros(hidden.shape, dtype=torch.float64)
    intermediate = w2.shape[1]
    for t in range(hidden.shape[0]):
        order = sorted(range(probs.shape[1]), key=lambda e: (-probs[t, e].item(), e))[:top_k]
        weights = probs[t, order]
        if renormalize:
            weights = weights / weights.sum()
        for expert, weight in zip(order, weights):
            local = expert - first_expert
            if not 0 <= local < w13.shape[0]:
                continue
            gate_up = hidden[t].double() @ w13[local].double()
            act = torch.nn.functional.silu(gate_up[:intermediate]) * gate_up[intermediate:]
            out[t] += weight * (act @ w2[local].double())
    return out


def random_moe(tokens=13, hidden=16, experts=6, intermediate=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(tokens, hidden, generator=g), torch.randn(tokens, experts, generator=g),
            torch.randn(experts, hidden, 2 * intermediate, generator=g) / hidden ** 0.5,
            torch.randn(experts, intermediate, hidden, generator=g) / intermediate ** 0.5)


@pytest.mark.parametrize("top_k, renormalize, intermediate", [(1, False, 8), (2, True, 8), (3, False, 8), (6, True, 8),
                                                             (2, True, 7)])
def test_fused_moe_equals_the_reference(top_k, renormalize, intermediate):
    """Intermediate size 7: rows of 28 bytes, which torch's grouped GEMM refuses (it needs
    multiples of 16 bytes): the kernel runs one GEMM per active expert instead."""
    hidden, logits, w13, w2 = random_moe(intermediate=intermediate)
    got = ops.fused_moe(hidden, logits, w13, w2, top_k=top_k, renormalize=renormalize)
    expected = reference_moe(hidden, logits, w13, w2, top_k, renormalize)
    assert (got.double() - expected).abs().max() <= OP_ATOL


def test_router_ties_go_to_the_lower_expert_index():
    """Experts 1, 2 and 4 score alike for every token, above the rest: top-2 must take 1 and 2,
    never 4; top-3 all three (and the op's output is the reference's with that rule)."""
    hidden, logits, w13, w2 = random_moe(tokens=9)
    logits[:, [1, 2, 4]] = logits.abs().max() + 1.0  # the same value in the three columns
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    assert torch.equal(probs[:, 1], probs[:, 2]) and torch.equal(probs[:, 1], probs[:, 4])  # a real tie
    weights, ids = torch_kernels.moe_select_experts(logits, 2, False)
    assert ids.tolist() == [[1, 2]] * 9 and torch.equal(weights[:, 0], weights[:, 1])
    assert torch_kernels.moe_select_experts(logits, 3, False)[1].tolist() == [[1, 2, 4]] * 9
    for top_k in (2, 3):
        got = ops.fused_moe(hidden, logits, w13, w2, top_k=top_k, renormalize=True)
        assert (got.double() - reference_moe(hidden, logits, w13, w2, top_k, True)).abs().max() <= OP_ATOL


def test_every_token_to_one_expert_and_experts_with_no_token():
    """One expert dominates every row (top-1): all tokens in one group, five empty groups; then
    top-2 over logits that never pick experts 0 and 5."""
    hidden, logits, w13, w2 = random_moe()
    one = logits.clone()
    one[:, 3] += 100.0
    got = ops.fused_moe(hidden, one, w13, w2, top_k=1, renormalize=False)
    assert (got.double() - reference_moe(hidden, one, w13, w2, 1, False)).abs().max() <= OP_ATOL
    # top-1 weight is ~1: the output is expert 3's MLP of each token
    solo = torch.nn.functional.silu(hidden @ w13[3][:, :8]) * (hidden @ w13[3][:, 8:]) @ w2[3]
    assert (got - solo).abs().max() <= 1e-4
    never = logits.clone()
    never[:, [0, 5]] -= 100.0
    _, ids = torch_kernels.moe_select_experts(never, 2, True)
    assert not {0, 5} & set(ids.flatten().tolist())
    got = ops.fused_moe(hidden, never, w13, w2, top_k=2, renormalize=True)
    assert (got.double() - reference_moe(hidden, never, w13, w2, 2, True)).abs().max() <= OP_ATOL


def test_expert_shards_sum_to_the_whole():
    """Expert parallelism's contract: each rank's experts give a partial sum; the ranks' partial
    sums add up to the whole layer (what the all-reduce does). A shard no token reaches returns
    zeros."""
    hidden, logits, w13, w2 = random_moe(experts=8)
    whole = ops.fused_moe(hidden, logits, w13, w2, top_k=2, renormalize=True)
    parts = [ops.fused_moe(hidden, logits, w13[i:i + 4], w2[i:i + 4], top_k=2, renormalize=True, first_expert=i)
             for i in (0, 4)]
    assert (parts[0] + parts[1] - whole).abs().max() <= OP_ATOL
    assert (parts[0].double() - reference_moe(hidden, logits, w13[:4], w2[:4], 2, True, 0)).abs().max() <= OP_ATOL
    away = logits.clone()
    away[:, 4:] += 100.0  # every token's top-2 lies in experts 4..7
    assert torch.equal(ops.fused_moe(hidden, away, w13[:4], w2[:4], top_k=2, renormalize=True),
                       torch.zeros_like(hidden))


def test_an_empty_step_and_bad_shapes():
    hidden, logits, w13, w2 = random_moe()
    assert ops.fused_moe(hidden[:0], logits[:0], w13, w2, top_k=2, renormalize=True).shape == (0, 16)
    with pytest.raises(ValueError, match="top_k 7 must be in"):
        ops.fused_moe(hidden, logits, w13, w2, top_k=7, renormalize=True)
    with pytest.raises(ValueError, match=r"w2 \(6, 8, 15\) must be"):
        ops.fused_moe(hidden, logits, w13, w2[..., :15], top_k=2, renormalize=True)
    with pytest.raises(ValueError, match="outside the 6 experts"):
        ops.fused_moe(hidden, logits, w13, w2, top_k=2, renormalize=True, first_expert=1)


def test_the_cpu_kernel_runs_one_grouped_gemm_per_projection(monkeypatch):
    """Never a loop over experts per token: the CPU kernel makes exactly two grouped GEMM calls
    per layer call, whatever the number of tokens and experts."""
    calls = []
    original = torch._grouped_mm

    def counting(*args, **kwargs):
        calls.append(args[1].shape[0])
        return original(*args, **kwargs)

    monkeypatch.setattr(torch, "_grouped_mm", counting)
    hidden, logits, w13, w2 = random_moe(tokens=40, experts=6)
    ops.fused_moe(hidden, logits, w13, w2, top_k=2, renormalize=False)
    assert calls == [6, 6]


# -- the simulated NPU's MoE ops ----------------------------------------------------------------------


@pytest.mark.parametrize("top_k, renormalize, first_expert, local", [(2, True, 0, 6), (3, False, 0, 6),
                                                                    (2, True, 3, 3), (1, False, 0, 6)])
def test_npu_moe_ops_equal_the_cpu_op_in_bfloat16(top_k, renormalize, first_expert, local):
    from atb_plugin.platform import use_platform
    from atb_plugin.testing import fake_torch_npu

    hidden, logits, w13, w2 = random_moe(tokens=21)
    w13, w2 = w13[first_expert:first_expert + local], w2[first_expert:first_expert + local]
    cpu = ops.fused_moe(hidden, logits, w13, w2, top_k=top_k, renormalize=renormalize, first_expert=first_expert)
    with fake_torch_npu.install() as fake, use_platform("npu"):
        npu = ops.fused_moe(hidden.bfloat16(), logits.bfloat16(), w13.bfloat16(), w2.bfloat16(), top_k=top_k,
                            renormalize=renormalize, first_expert=first_expert)
        calls = dict(fake.module.calls)
    for op in ("npu_moe_gating_top_k_softmax", "npu_moe_init_routing", "npu_moe_compute_expert_tokens",
               "npu_swiglu", "npu_moe_finalize_routing"):
        assert calls.get(op) == 1, (op, calls)
    assert calls["npu_grouped_matmul"] == 2
    assert npu.dtype == torch.bfloat16
    assert (npu.float() - cpu).abs().max() <= NPU_OP_TOL * cpu.abs().max()


def test_both_npu_kernel_sets_run_the_moe_ops(monkeypatch):
    """The FIA kernel set (the A2/A3 default) delegates the MoE ops to the ATB set's: same calls,
    same result."""
    from atb_plugin.platform import use_platform
    from atb_plugin.testing import fake_torch_npu

    hidden, logits, w13, w2 = (t.bfloat16() for t in random_moe(tokens=9))
    results = {}
    for kernels in ("atb", "fia"):
        monkeypatch.setenv("ATB_PLUGIN_NPU_KERNELS", kernels)
        with fake_torch_npu.install() as fake, use_platform("npu") as platform:
            assert platform.kernels.__name__.endswith("npu_fia_kernels" if kernels == "fia" else "npu_kernels")
            results[kernels] = ops.fused_moe(hidden, logits, w13, w2, top_k=2, renormalize=True)
            assert fake.module.calls["npu_grouped_matmul"] == 2
    assert torch.equal(results["atb"], results["fia"])


def test_npu_routing_ops_follow_their_documented_formulas():
    """The docs' worked example of npu_moe_init_routing, and finalize_routing's formula with
    skips and biases, on the fakes directly."""
    from atb_plugin.testing import fake_torch_npu as fake

    x = torch.tensor([[0.1] * 4, [0.2] * 4, [0.3] * 4])
    row_idx = torch.tensor([[0, 3], [1, 4], [2, 5]], dtype=torch.int32)
    expert_idx = torch.tensor([[1, 2], [0, 1], [0, 2]], dtype=torch.int32)
    expanded_x, expanded_row_idx, expanded_expert_idx = fake.npu_moe_init_routing(x, row_idx, expert_idx, 3)
    assert expanded_expert_idx.tolist() == [0, 0, 1, 1, 2, 2]
    assert expanded_x[:, 0].tolist() == pytest.approx([0.2, 0.3, 0.1, 0.2, 0.1, 0.3])
    for source, row in enumerate(expanded_row_idx.tolist()):  # expanded_x[row] is source row % 3
        assert torch.equal(expanded_x[row], x[source % 3])
    ends = fake.npu_moe_compute_expert_tokens(expanded_expert_idx, 4)
    assert ends.tolist() == [2, 4, 6, 6] and ends.dtype == torch.int32
    g = torch.Generator().manual_seed(0)
    rows, skip, bias = torch.randn(6, 4, generator=g), torch.randn(3, 4, generator=g), torch.randn(3, 4, generator=g)
    scales = torch.rand(3, 2, generator=g)
    out = fake.npu_moe_finalize_routing(rows, skip, None, bias, scales, expanded_row_idx, expert_idx)
    for i in range(3):
        expected = skip[i] + sum(scales[i, k] * (rows[expanded_row_idx[i + 3 * k]] + bias[expert_idx[i, k]])
                                 for k in range(2))
        assert torch.allclose(out[i], expected, atol=1e-6)


@pytest.mark.parametrize("call, says", [
    (lambda f, x: f.npu_moe_gating_top_k_softmax(x, None, k=9), "k must satisfy"),
    (lambda f, x: f.npu_moe_gating_top_k_softmax(x, torch.zeros(5, dtype=torch.bool), k=2), "finished is not"),
    (lambda f, x: f.npu_moe_compute_expert_tokens(torch.tensor([1, 0], dtype=torch.int32), 2), "non-decreasing"),
    (lambda f, x: f.npu_moe_compute_expert_tokens(torch.tensor([0, 2], dtype=torch.int32), 2), "must lie in"),
    (lambda f, x: f.npu_grouped_matmul([x], [torch.randn(2, 6, 4)], group_list=torch.tensor([2, 5], dtype=torch.int32),
                                       split_item=2, group_type=0), "must be a 1-D int64"),
    (lambda f, x: f.npu_grouped_matmul([x], [torch.randn(2, 6, 4)], group_list=torch.tensor([2, 4]), split_item=0,
                                       group_type=0), "only group_type=0"),
    (lambda f, x: f.npu_grouped_matmul([x], [torch.randn(2, 6, 4)], group_list=torch.tensor([2, 3]), split_item=2,
                                       group_type=0), "covers 3 rows, x has 5"),
    (lambda f, x: f.npu_grouped_matmul([x], [torch.randn(2, 6, 4).half()], group_list=torch.tensor([2, 5]),
                                       split_item=2, group_type=0), "must share"),
    (lambda f, x: f.npu_moe_finalize_routing(torch.randn(10, 6), None, torch.randn(5, 6), None, torch.rand(5, 2),
                                             torch.arange(10, dtype=torch.int32), None), "skip2 given without skip1"),
])
def test_npu_moe_fakes_refuse_what_the_real_ops_refuse(call, says):
    from atb_plugin.testing import fake_torch_npu as fake

    x = torch.randn(5, 6)
    with pytest.raises(fake.NpuOpError, match=says):
        call(fake, x)


# ------------------------------------------------------------------------------------------------
# The model against transformers

# name -> config.json overrides of the tiny Qwen3-MoE (the default: 8 experts, top-2, renormalised,
# layer 1 dense of 3)
VARIANTS = {
    "e8_k2_norm_dense1": {},
    "e16_k4_nonorm_step2": dict(num_experts=16, num_experts_per_tok=4, norm_topk_prob=False, decoder_sparse_step=2,
                                mlp_only_layers=[]),  # layer 1 sparse, 0 and 2 dense
    "e6_k1_norm": dict(num_experts=6, num_experts_per_tok=1, mlp_only_layers=[0]),
    "e4_k4_nonorm": dict(num_experts=4, num_experts_per_tok=4, norm_topk_prob=False, mlp_only_layers=[]),  # all sparse
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """variant -> checkpoint directory (the default variant is the cached tiny checkpoint)."""
    paths = {}
    for name, overrides in VARIANTS.items():
        if not overrides:
            paths[name] = tiny_checkpoint("qwen3_moe")
            continue
        paths[name] = tmp_path_factory.mktemp(name)
        build_qwen3_moe(paths[name], seed=1, **overrides)
    return paths


def prompt(n: int, vocab: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_match_transformers(variant, checkpoints):
    from atb_plugin.models.moe import SparseMoeBlock

    ours, reference = load_pair(checkpoints[variant])
    moe = ours.config.moe
    sparse = [isinstance(layer.mlp, SparseMoeBlock) for layer in ours.model.layers]
    assert sparse == [moe.is_sparse(i) for i in range(3)] and any(sparse)
    assert [type(layer.mlp).__name__ for layer in reference.model.layers] == [
        "Qwen3MoeSparseMoeBlock" if s else "Qwen3MoeMLP" for s in sparse]
    ids = prompt(23, ours.config.vocab_size)
    with torch.no_grad():
        expected = reference(ids[None]).logits[0]
    runner = SequenceRunner(ours, max_len=32)
    got = torch.cat([runner.step(ids[:9]), runner.step(ids[9:17])] + [runner.step(ids[i:i + 1]) for i in range(17, 23)])
    assert (got - expected).abs().max() <= FP32_ATOL


def test_qwen2_moe_with_its_shared_expert_matches_transformers():
    """Qwen2-MoE: the Qwen2 decoder (q/k/v biases) with the sparse layers plus a shared expert
    behind a sigmoid gate; chunked prefill and decode against transformers' full forward; greedy
    tokens against its generate."""
    from atb_plugin import LLM, SamplingParams

    path = tiny_checkpoint("qwen2_moe")
    ours, reference = load_pair(path)
    assert ours.config.qkv_bias and ours.config.moe.shared_expert_intermediate_size == 48
    assert ours.model.layers[0].mlp.shared_expert is not None and not hasattr(ours.model.layers[2].mlp, "experts")
    ids = prompt(23, ours.config.vocab_size)
    with torch.no_grad():
        expected = reference(ids[None]).logits[0]
    runner = SequenceRunner(ours, max_len=32)
    got = torch.cat([runner.step(ids[:11])] + [runner.step(ids[i:i + 1]) for i in range(11, 23)])
    assert (got - expected).abs().max() <= FP32_ATOL
    with LLM(path, block_size=4) as llm:
        outputs = llm.generate(PROMPTS[:2], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
        prompt_ids = [llm.router.tokenize(p) for p in PROMPTS[:2]]
    for ids, output in zip(prompt_ids, outputs):
        ids = torch.tensor([ids])
        expected = reference.generate(ids, max_new_tokens=10, min_new_tokens=10, do_sample=False,
                                      repetition_penalty=1.0, pad_token_id=0)[0, ids.shape[1]:]
        assert list(output.outputs[0].token_ids) == expected.tolist()


def test_the_experts_matter_to_the_logits(checkpoints):
    """The parity test would be vacuous if the experts' outputs were negligible: zeroing them
    moves the logits by far more than the tolerance."""
    ours, _ = load_pair(checkpoints["e8_k2_norm_dense1"])
    ids = prompt(12, ours.config.vocab_size)
    before = SequenceRunner(ours, max_len=16).step(ids)
    with torch.no_grad():
        for layer in ours.model.layers:
            if hasattr(layer.mlp, "experts"):
                layer.mlp.experts.w2.zero_()
    assert (SequenceRunner(ours, max_len=16).step(ids) - before).abs().max() > 100 * FP32_ATOL


def test_per_expert_tensors_fill_the_stacked_weights(checkpoints):
    from safetensors import safe_open

    path = checkpoints["e8_k2_norm_dense1"]
    ours, _ = load_pair(path)
    experts = ours.model.layers[0].mlp.experts
    assert tuple(experts.w13.shape) == (8, 64, 64) and tuple(experts.w2.shape) == (8, 32, 64)
    with safe_open(path / "model.safetensors", "pt") as f:
        assert "model.layers.0.mlp.experts.5.gate_proj.weight" in f.keys()
        assert "model.layers.1.mlp.gate_proj.weight" in f.keys()  # the dense layer
        gate = f.get_tensor("model.layers.0.mlp.experts.5.gate_proj.weight")
        up = f.get_tensor("model.layers.0.mlp.experts.5.up_proj.weight")
        down = f.get_tensor("model.layers.0.mlp.experts.5.down_proj.weight")
    assert torch.equal(experts.w13[5], torch.cat([gate.t(), up.t()], dim=1))
    assert torch.equal(experts.w2[5], down.t())


def test_a_missing_expert_tensor_is_named(checkpoints, tmp_path):
    from safetensors.torch import load_file, save_file

    from atb_plugin.models.weights import WeightLoadingError
    from tests.helpers import copy_checkpoint

    source = checkpoints["e8_k2_norm_dense1"]
    copy_checkpoint(source, tmp_path)
    state = load_file(str(source / "model.safetensors"))
    state.pop("model.layers.2.mlp.experts.7.down_proj.weight")
    state["model.layers.0.mlp.experts.8.up_proj.weight"] = torch.zeros(32, 64)  # expert 8 of 8: no such expert
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(WeightLoadingError, match=r"missing from the checkpoint: model\.layers\.2\.mlp\.experts\.w2"
                                                 r".*not used by the model: model\.layers\.0\.mlp\.experts\.8\.up_proj"):
        get_router(tmp_path).model_cls.from_pretrained(tmp_path)


def test_moe_config_errors_name_the_keys(checkpoints):
    from atb_plugin.models.moe import MoeConfig

    with pytest.raises(ValueError, match=r"num_experts_per_tok \(9\) must not exceed num_experts \(8\)"):
        MoeConfig.from_hf(dict(num_experts=8, num_experts_per_tok=9, moe_intermediate_size=4, num_hidden_layers=2))
    with pytest.raises(ValueError, match="decoder_sparse_step must be a positive integer"):
        MoeConfig.from_hf(dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=4, num_hidden_layers=2,
                               decoder_sparse_step=0))
    assert MoeConfig.from_hf(dict(num_experts=0, num_hidden_layers=2)) is None


def test_npu_path_equals_cpu_path_in_bfloat16(checkpoints):
    """The whole model through the simulated NPU (ATB attention, aclnn norms / rotary / MoE ops)
    in bfloat16 against the CPU path in float32: prefill, chunked prefill, decode."""
    ours, _ = load_pair(checkpoints["e16_k4_nonorm_step2"])
    calls = check_simulated_npu(ours, prompt(40, ours.config.vocab_size, seed=2), torch.bfloat16, NPU_MODEL_TOL)
    for op in ("npu_moe_gating_top_k_softmax", "npu_moe_init_routing", "npu_grouped_matmul",
               "npu_moe_finalize_routing", "npu_rms_norm", "_npu_paged_attention"):
        assert calls.get(op), f"{op} was not used"


# ------------------------------------------------------------------------------------------------
# Through the engine

PROMPTS = ["hello world", "the cat sat on the mat and then", "a", "numbers: 1 2 3 4 5 6 7 8 9 10 11 12"]


@pytest.mark.parametrize("variant", ["e8_k2_norm_dense1", "e16_k4_nonorm_step2"])
def test_llm_greedy_equals_transformers_generate(variant, checkpoints):
    """Four prompts batched (prefill and decode steps mixing tokens of several requests in one
    MoE call) against transformers' generate, one prompt at a time."""
    import transformers

    from atb_plugin import LLM, SamplingParams

    path = checkpoints[variant]
    with LLM(path, block_size=4) as llm:
        outputs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
        prompt_ids = [llm.router.tokenize(p) for p in PROMPTS]
    assert_greedy_equals_transformers(transformers.Qwen3MoeForCausalLM.from_pretrained(path).eval(), prompt_ids,
                                      outputs, 12)


def assert_greedy_equals_transformers(reference, prompt_ids, outputs, tokens: int) -> None:
    """Each output's greedy tokens against ``reference.generate`` on its prompt alone."""
    for ids, output in zip(prompt_ids, outputs):
        ids = torch.tensor([ids])
        expected = reference.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False,
                                      repetition_penalty=1.0, pad_token_id=0)[0, ids.shape[1]:]
        assert list(output.outputs[0].token_ids) == expected.tolist()


def test_decode_stays_eager_and_says_why(checkpoints):
    # float32 experts now run in the captured step (tests/test_native_decode_moe.py); bfloat16
    # experts still decode eagerly.
    from atb_plugin import LLM

    with LLM(checkpoints["e8_k2_norm_dense1"], block_size=4, dtype="bfloat16") as llm:
        outcome = llm.engine.core.runner.decode_capture
    assert "mixture-of-experts" in outcome


def test_expert_parallel_flag_reaches_the_engine_config():
    from atb_plugin.engine.config import EngineConfig
    from atb_plugin.server.cli import parse_config

    path = str(tiny_checkpoint("qwen3_moe"))
    assert parse_config(["--model", path, "--enable-expert-parallel", "-tp", "2"]).engine.enable_expert_parallel
    assert not parse_config(["--model", path]).engine.enable_expert_parallel
    with pytest.raises(ValueError, match="enable_expert_parallel must be a bool"):
        EngineConfig(model=path, enable_expert_parallel="yes")
    # 8 experts do not split over 3 ranks; their intermediate size (32) does not either
    with pytest.raises(ValueError, match=r"num_experts \(8\) is not divisible by tensor_parallel_size \(3\)"):
        EngineConfig(model=path, tensor_parallel_size=3, enable_expert_parallel=True,
                     hf_overrides={"num_attention_heads": 3, "num_key_value_heads": 3})
    with pytest.raises(ValueError, match=r"moe_intermediate_size \(32\) is not divisible by tensor_parallel_size \(3\).*--enable-expert-parallel"):
        EngineConfig(model=path, tensor_parallel_size=3, hf_overrides={"num_attention_heads": 3,
                                                                      "num_key_value_heads": 3})
