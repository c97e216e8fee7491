"""The fused mixture-of-experts op (Qwen3-MoE style): router softmax -> top-k -> optional
renormalisation of the k weights, then each token through its k SwiGLU experts, the outputs
summed with those weights.

    out = fused_moe(hidden, router_logits, w13, w2, top_k=k, renormalize=norm_topk_prob,
                    first_expert=0)

Layouts (one set for every platform; ``models/moe.py`` fills them from the checkpoint):

- ``hidden`` ``(T, H)``; ``router_logits`` ``(T, E)`` over all ``E`` experts of the layer;
- ``w13`` ``(E_local, H, 2 * I)``: per expert ``[gate_proj.T | up_proj.T]``, so ``x @ w13[e]`` feeds
  ``silu_and_mul`` directly; ``w2`` ``(E_local, I, H)``: ``down_proj.T``. Experts are stored
  (K, N) so that one grouped GEMM reads them in place: ``torch._grouped_mm`` on the CPU,
  ``npu_grouped_matmul`` on Ascend, neither needs a transposed copy;
- ``first_expert``: the global index of ``w13[0]``. A rank that holds experts
  ``[first_expert, first_expert + E_local)`` (expert parallelism) computes only their share
  of each token and returns the partial sum (the caller all-reduces); routing is always over all
  ``E`` experts, so every rank agrees on it.

Routing rule (both kernel sets): softmax in float32, the k largest probabilities, ties broken by
the lower expert index (``torch.topk`` does not promise an order among equal values; a serving
engine must give the same answer every time), then ``w / sum(w)`` when ``renormalize``. The
weights are cast to the activations' dtype before they scale the expert outputs, as
transformers' Qwen3MoeTopKRouter does.

Kernels (``current_platform().kernels``): ``moe_select_experts(router_logits, top_k,
renormalize) -> (weights (T, k), expert ids (T, k))`` and ``moe_experts(hidden, weights, ids,
w13, w2, first_expert) -> (T, H)``. CPU / CUDA (``torch_kernels``): tokens sorted by expert, one
grouped GEMM over the active experts per projection; NPU (``npu_kernels``):
``npu_moe_gating_top_k_softmax``, ``npu_moe_init_routing``, ``npu_moe_compute_expert_tokens``,
``npu_grouped_matmul``, ``npu_swiglu``, ``npu_moe_finalize_routing`` (vllm-ascend's sequence).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from atb_plugin.platform import current_platform

__all__ = ["GroupedRouting", "check_moe_shapes", "fused_moe", "grouped_topk", "moe_experts"]


def check_moe_shapes(hidden, router_logits, w13, w2, top_k: int, first_expert: int) -> None:
    """ValueError naming the shapes when they do not fit together (before any kernel runs)."""
    tokens, width = hidden.shape
    experts = router_logits.shape[-1]
    local, w13_in, w13_out = w13.shape
    if router_logits.shape != (tokens, experts) or w13_in != width or w13_out % 2:
        raise ValueError(f"fused_moe: hidden {tuple(hidden.shape)}, router_logits {tuple(router_logits.shape)}, "
                         f"w13 {tuple(w13.shape)} do not fit (w13 must be (E_local, H, 2 * I))")
    if w2.shape != (local, w13_out // 2, width):
        raise ValueError(f"fused_moe: w2 {tuple(w2.shape)} must be (E_local, I, H) = ({local}, {w13_out // 2}, {width})")
    if not 1 <= top_k <= experts:
        raise ValueError(f"fused_moe: top_k {top_k} must be in [1, num_experts = {experts}]")
    if not 0 <= first_expert <= experts - local:
        raise ValueError(f"fused_moe: experts [{first_expert}, {first_expert + local}) lie outside the {experts} "
                         "experts the router scores")


def fused_moe(hidden: torch.Tensor, router_logits: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, *,
              top_k: int, renormalize: bool, first_expert: int = 0) -> torch.Tensor:
    check_moe_shapes(hidden, router_logits, w13, w2, top_k, first_expert)
    kernels = current_platform().kernels
    weights, ids = kernels.moe_select_experts(router_logits, top_k, renormalize)
    return kernels.moe_experts(hidden, weights.to(hidden.dtype), ids, w13, w2, first_expert)


@dataclass(frozen=True)
class GroupedRouting:
    """DeepSeek's router (``grouped_topk``): ``scoring`` "sigmoid" (V3, with the
    ``e_score_correction_bias`` added for the choice only: noaux_tc) or "softmax" (V2); experts in
    ``n_group`` equal groups, of which the ``topk_group`` best are kept, a group's score being the
    sum of its two best biased scores (``group_score="top2_sum"``, V3) or its best score
    (``"max"``, V2's group_limited_greedy); ``n_group == 1`` is plain top-k (V2's greedy). The
    chosen experts' unbiased scores are the weights, divided by their sum (+1e-20) when
    ``renormalize``, then multiplied by ``routed_scaling_factor``."""

    top_k: int
    scoring: str = "sigmoid"
    n_group: int = 1
    topk_group: int = 1
    group_score: str = "top2_sum"
    renormalize: bool = True
    routed_scaling_factor: float = 1.0

    def __post_init__(self):
        if self.scoring not in ("sigmoid", "softmax") or self.group_score not in ("top2_sum", "max"):
            raise ValueError(f"GroupedRouting: scoring {self.scoring!r} / group_score {self.group_score!r} unknown")
        if not 1 <= self.topk_group <= self.n_group:
            raise ValueError(f"topk_group ({self.topk_group}) must be in [1, n_group = {self.n_group}]")


def grouped_topk(router_logits: torch.Tensor, routing: GroupedRouting,
                 correction_bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights (T, k) float32, expert ids (T, k))`` of DeepSeek's router over ``router_logits``
    ``(T, E)`` (computed in float32, as transformers computes them); ties go to the lower index
    (group and expert), as in ``fused_moe``."""
    experts = router_logits.shape[-1]
    if experts % routing.n_group or not 1 <= routing.top_k <= experts // routing.n_group * routing.topk_group:
        raise ValueError(f"grouped_topk: {experts} experts in {routing.n_group} groups, {routing.topk_group} "
                         f"groups kept, cannot choose {routing.top_k}")
    return current_platform().kernels.moe_grouped_topk(router_logits.float(), routing, correction_bias)


def moe_experts(hidden: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w13: torch.Tensor,
                w2: torch.Tensor, first_expert: int = 0) -> torch.Tensor:
    """The experts half of ``fused_moe`` for a routing chosen elsewhere (``grouped_topk``):
    this rank's partial sum of each token's k experts, weighted."""
    return current_platform().kernels.moe_experts(hidden, weights.to(hidden.dtype), ids, w13, w2, first_expert)
