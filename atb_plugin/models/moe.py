"""Sparse mixture-of-experts MLP layers (Qwen3-MoE; Qwen2-MoE with its shared expert), and
loading per-expert checkpoints into stacked expert weights.

A sparse layer replaces the decoder's SwiGLU MLP (``decoder.DecoderLayer`` picks it by layer:
``MoeConfig.is_sparse``)::

    router_logits = gate(x)                                    # mlp.gate.weight, (E, H), replicated
    out = fused_moe(x, router_logits, w13, w2, top_k, norm_topk_prob)   # atb_plugin/ops/moe.py

Checkpoints store each expert as three linears (``mlp.experts.E.gate_proj / up_proj /
down_proj.weight``); ``FusedExperts`` stacks them as the op takes them, ``w13 (E, H, 2I)`` =
``[gate.T | up.T]`` and ``w2 (E, I, H)`` = ``down.T``, filled expert by expert at load time
(``ExpertWeightsMixin``), never materialising the per-expert layout in memory twice. Qwen3-VL-MoE
publishes them stacked already (``mlp.experts.gate_up_proj (E, H, 2I)``, ``mlp.experts.down_proj
(E, I, H)``: the op's layout; transformers' own re-save, ``(E, 2I, H)`` / ``(E, H, I)``, is told
apart by shape and transposed, as transformers does), read slice by slice (``load_stacked``).

Tensor parallelism (docs/architecture.md, "Tensor parallelism"), two layouts, one collective:

- plain TP: every rank holds every expert, each sliced like the dense MLP (``I / tp`` of the
  gate / up rows and of the down columns); each rank's partial sums are all-reduced;
- expert parallelism (``--enable-expert-parallel``, ``distributed.expert_parallel()``): each rank
  holds ``E / tp`` whole experts. Every rank has every token (the attention before it ends in an
  all-reduce, so the hidden states are already replicated), runs only its own experts on the
  tokens routed to them, and the same all-reduce as plain TP sums the ranks' outputs. No
  all-to-all: at the sizes this backend runs on one node (a few ranks, decode batches of tens of
  tokens), moving tokens to their experts' ranks and back is two more collectives per layer
  plus the routing bookkeeping to save nothing: the tokens are already everywhere, and the
  all-reduce that combines the outputs is the one the dense layers pay anyway. All-to-all
  dispatch pays off when the token batch itself is too big to replicate (many nodes, data-parallel
  attention), which is not this layout.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

import torch
from torch import nn

from atb_plugin import ops
from atb_plugin.distributed import all_reduce, divide, expert_parallel, tp_rank, tp_size
from atb_plugin.models.weights import WeightLoadingError

__all__ = ["EXPERT_WEIGHT", "STACKED_EXPERT_WEIGHT", "ExpertWeightsMixin", "FusedExperts", "MoeConfig",
           "SparseMoeBlock"]

#: A per-expert checkpoint tensor: ``<prefix>.mlp.experts.<E>.<gate|up|down>_proj.weight``.
EXPERT_WEIGHT = re.compile(r"^(?P<experts>.+\.experts)\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")
#: All experts of a layer in one tensor (Qwen3-VL-MoE): ``<prefix>.mlp.experts.<gate_up_proj|down_proj>``.
STACKED_EXPERT_WEIGHT = re.compile(r"^(?P<experts>.+\.experts)\.(?P<proj>gate_up_proj|down_proj)$")


@dataclass(frozen=True)
class MoeConfig:
    """The sparse layers of a decoder: ``num_experts`` SwiGLU experts of ``intermediate_size``
    (config.json's ``moe_intermediate_size``), ``top_k`` per token (``num_experts_per_tok``),
    renormalised top-k weights when ``norm_topk_prob``; ``sparse_layers`` the indices of the
    layers that are sparse (the rest keep the dense MLP of ``intermediate_size``)."""

    num_experts: int
    top_k: int
    intermediate_size: int
    norm_topk_prob: bool
    sparse_layers: frozenset[int]
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE: one dense expert for every token; 0: none

    def __post_init__(self):
        for name in ("num_experts", "top_k", "intermediate_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"MoeConfig.{name} must be a positive integer, got {value!r}")
        if self.top_k > self.num_experts:
            raise ValueError(f"num_experts_per_tok ({self.top_k}) must not exceed num_experts ({self.num_experts})")

    @classmethod
    def from_hf(cls, config: dict) -> "MoeConfig | None":
        """From a Qwen3-MoE config.json (published layout ``num_experts``, transformers 5's
        ``num_local_experts``); None when the model has no experts. Layer i is sparse unless it
        is in ``mlp_only_layers`` or ``(i + 1) % decoder_sparse_step != 0`` (transformers' rule)."""
        experts = config.get("num_experts", config.get("num_local_experts")) or 0
        if experts == 0:
            return None
        step = config.get("decoder_sparse_step", 1)
        if isinstance(step, bool) or not isinstance(step, int) or step < 1:
            raise ValueError(f"decoder_sparse_step must be a positive integer, got {step!r}")
        dense = set(config.get("mlp_only_layers") or ())
        layers = config["num_hidden_layers"]
        return cls(
            num_experts=experts,
            top_k=config["num_experts_per_tok"],
            intermediate_size=config["moe_intermediate_size"],
            norm_topk_prob=bool(config.get("norm_topk_prob", False)),
            sparse_layers=frozenset(i for i in range(layers) if i not in dense and (i + 1) % step == 0),
            shared_expert_intermediate_size=config.get("shared_expert_intermediate_size") or 0,
        )

    def is_sparse(self, layer: int) -> bool:
        return layer in self.sparse_layers


class FusedExperts(nn.Module):
    """This rank's experts, stacked: ``w13 (E_local, H, 2 * I_local)``, ``w2 (E_local, I_local,
    H)``; global experts ``[first_expert, first_expert + E_local)``. Plain TP: all experts,
    ``I_local = I / tp``; expert parallelism: ``E / tp`` experts, ``I_local = I``."""

    def __init__(self, config: MoeConfig, hidden_size: int):
        super().__init__()
        tp, rank = tp_size(), tp_rank()
        self.num_experts = config.num_experts
        self.total_intermediate_size = config.intermediate_size
        if expert_parallel() and tp > 1:
            self.num_local_experts = divide(config.num_experts, tp, "num_experts (expert parallelism)")
            self.first_expert = rank * self.num_local_experts
            self.intermediate_size, self.first_column = config.intermediate_size, 0
        else:
            self.num_local_experts, self.first_expert = config.num_experts, 0
            self.intermediate_size = divide(config.intermediate_size, tp, "moe_intermediate_size")
            self.first_column = rank * self.intermediate_size
        self.hidden_size = hidden_size
        self.w13 = nn.Parameter(torch.empty(self.num_local_experts, hidden_size, 2 * self.intermediate_size))
        self.w2 = nn.Parameter(torch.empty(self.num_local_experts, self.intermediate_size, hidden_size))
        self._filled: set[tuple[int, str]] = set()

    def owns(self, expert: int) -> bool:
        return self.first_expert <= expert < self.first_expert + self.num_local_experts

    def load_expert(self, expert: int, proj: str, tensor, name: str) -> None:
        """Copy this rank's part of expert ``expert``'s ``proj`` (checkpoint layout: gate / up
        ``(I, H)``, down ``(H, I)``) into the stacked weights; another rank's expert is skipped."""
        if not self.owns(expert):
            return
        size, start = self.intermediate_size, self.first_column
        expected = (self.total_intermediate_size, self.hidden_size)
        if proj == "down_proj":
            expected = expected[::-1]
        if tuple(tensor.shape) != expected:
            raise WeightLoadingError(f"{name}: checkpoint shape {tuple(tensor.shape)}, expected {expected}")
        local = expert - self.first_expert
        dim = 1 if proj == "down_proj" else 0  # the intermediate dimension
        part = tensor.narrow(dim, start, size)  # a CheckpointTensor reads only this slice from the file
        with torch.no_grad():
            if proj == "down_proj":
                self.w2[local].copy_(part.t())
            else:
                offset = 0 if proj == "gate_proj" else size
                self.w13[local, :, offset:offset + size].copy_(part.t())
        self._filled.add((local, proj))

    def load_stacked(self, proj: str, tensor, name: str) -> None:
        """This rank's part of every local expert from one stacked tensor: ``gate_up_proj``
        ``(E, H, 2I)`` (gate columns, then up) or ``down_proj`` ``(E, I, H)``; the transposed
        forms ``(E, 2I, H)`` / ``(E, H, I)`` too (module docstring)."""
        experts, hidden, inter = self.num_experts, self.hidden_size, self.total_intermediate_size
        published = (experts, hidden, 2 * inter) if proj == "gate_up_proj" else (experts, inter, hidden)
        shape, transposed = tuple(tensor.shape), published[:1] + published[:0:-1]
        if shape not in (published, transposed):
            raise WeightLoadingError(f"{name}: checkpoint shape {shape}, expected {published} (or {transposed})")
        size, start = self.intermediate_size, self.first_column
        # A CheckpointTensor reads only this rank's experts.
        local = tensor.narrow(0, self.first_expert, self.num_local_experts)
        if shape != published:
            local = local.transpose(1, 2)
        with torch.no_grad():
            if proj == "down_proj":
                self.w2.copy_(local.narrow(1, start, size))
                self._filled |= {(e, "down_proj") for e in range(self.num_local_experts)}
                return
            self.w13[:, :, :size].copy_(local.narrow(2, start, size))
            self.w13[:, :, size:].copy_(local.narrow(2, inter + start, size))
        self._filled |= {(e, p) for e in range(self.num_local_experts) for p in ("gate_proj", "up_proj")}

    def complete(self) -> list[str]:
        """The parameters (``w13``, ``w2``) every local expert has been loaded into."""
        experts = range(self.num_local_experts)
        done = []
        if all((e, p) in self._filled for e in experts for p in ("gate_proj", "up_proj")):
            done.append("w13")
        if all((e, "down_proj") in self._filled for e in experts):
            done.append("w2")
        return done


class SparseMoeBlock(nn.Module):
    """The sparse MLP: router ``gate`` (replicated), experts (``FusedExperts``), one all-reduce
    (``ops.fused_moe`` returns this rank's partial sum). Qwen2-MoE adds a ``shared_expert`` (a
    SwiGLU MLP every token goes through, sharded like a dense MLP, its partial output not reduced
    on its own: passed in by the decoder) scaled by ``sigmoid(shared_expert_gate(x))``
    (replicated): the scale multiplies every rank's partial sum alike, so one all-reduce still
    sums the whole layer."""

    def __init__(self, config: MoeConfig, hidden_size: int, shared_expert: nn.Module | None = None):
        super().__init__()
        self.top_k, self.renormalize = config.top_k, config.norm_topk_prob
        self.gate = nn.Linear(hidden_size, config.num_experts, bias=False)
        self.experts = FusedExperts(config, hidden_size)
        self.shared_expert = shared_expert
        self.shared_expert_gate = nn.Linear(hidden_size, 1, bias=False) if shared_expert is not None else None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        router_logits = self.gate(hidden)
        out = ops.fused_moe(hidden, router_logits, self.experts.w13, self.experts.w2, top_k=self.top_k,
                            renormalize=self.renormalize, first_expert=self.experts.first_expert)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(hidden)) * self.shared_expert(hidden)
        return all_reduce(out)


class ExpertWeightsMixin:
    """For a ``PretrainedModel`` with ``FusedExperts`` modules: per-expert checkpoint tensors go
    to their ``FusedExperts`` (``load_expert``), everything else through the model's usual
    loader. Another rank's expert (expert parallelism) is accepted and skipped."""

    @functools.cached_property
    def _fused_experts(self) -> dict[str, FusedExperts]:
        return {prefix: module for prefix, module in self.named_modules() if isinstance(module, FusedExperts)}

    def _expert_target(self, name: str):
        """``(module, expert, proj)`` of a per-expert tensor, ``(module, None, proj)`` of a stacked one."""
        name = self.expert_weight_name(name)
        stacked = STACKED_EXPERT_WEIGHT.match(name)
        if stacked:
            module = self._fused_experts.get(stacked["experts"])
            return None if module is None else (module, None, stacked["proj"])
        match = EXPERT_WEIGHT.match(name)
        module = self._fused_experts.get(match["experts"]) if match else None
        if module is None or int(match["expert"]) >= module.num_experts:
            return None
        return module, int(match["expert"]), match["proj"]

    def expert_weight_name(self, name: str) -> str:
        """A checkpoint name as the model's module paths spell it (a family whose checkpoint
        names differ from its modules' maps them here; as is by default)."""
        return name

    def accepts_weight(self, name: str) -> bool:
        return self._expert_target(name) is not None or super().accepts_weight(name)

    def unquantizable_reason(self, name: str) -> str | None:
        """Why checkpoint weight ``name`` cannot be a quantized layer here, for the error a
        quantization description marking it gets (``quantize.MsModelSlimConfig``)."""
        if self._expert_target(name) is not None:
            return ("it is a routed expert's: the fused MoE op (ops/moe.py) runs float experts only; keep the "
                    "experts FLOAT in the description (the attention and dense / shared MLP projections may be int8)")
        return None

    def load_weights(self, weights) -> set[str]:
        def the_rest():
            for name, tensor in weights:
                target = self._expert_target(name)
                if target is None:
                    yield name, tensor
                else:
                    module, expert, proj = target
                    if expert is None:
                        module.load_stacked(proj, tensor, name)
                    else:
                        module.load_expert(expert, proj, tensor, name)

        loaded = super().load_weights(the_rest())
        for prefix, module in self._fused_experts.items():
            loaded |= {f"{prefix}.{param}" for param in module.complete()}
        return loaded
