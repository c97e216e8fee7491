"""DeepSeek-V2 / V3 (``DeepseekV2ForCausalLM``, ``DeepseekV3ForCausalLM``): multi-head latent
attention (MLA) over the latent paged KV cache, DeepSeekMoE, and the hooks an MTP head needs.

The decoder is ``decoder.DecoderModel`` with this family's layer (``DeepseekDecoderLayer``): the
same RMSNorms, residuals, embedding, LM head and vocabulary-parallel TP; what differs:

- **MLA** (``MLAttention``)::

      q        = q_b_proj(RMSNorm(q_a_proj(x)))      or q_proj(x) without q LoRA (V2-Lite)
      [q_nope | q_pe]  per head: qk_nope_head_dim + qk_rope_head_dim
      [c_kv | k_pe]    = kv_a_proj_with_mqa(x)       kv_lora_rank + qk_rope_head_dim, shared by all heads
      c_kv = RMSNorm(c_kv); rope(q_pe), rope(k_pe)   (DeepSeek's interleaved-pair rope)
      cache <- (c_kv, k_pe)                          one latent row per token per layer (ops/mla.py)
      [k_nope | v] per head = kv_b_proj(c_kv)        W_UK | W_UV

  prefill runs the expanded form (latents expanded into per-head keys / values), decode the
  absorbed form (``q_nope @ W_UK`` attends over the latents, ``W_UV`` after), ``ops/mla.py``.
  ``kv_b_proj`` stays a float weight (``LatentUpProjection``), read by both forms, never packed
  or quantized: the absorbed form slices it per head. Softmax scale ``(qk_nope + qk_rope) ** -0.5``
  times YaRN's ``mscale(factor, mscale_all_dim) ** 2``; cos / sin times YaRN's attention factor.

- **DeepSeekMoE** (``DeepseekMoE``): layers from ``first_k_dense_replace`` on are sparse
  (``moe_layer_freq``: every one on the published checkpoints): a router over
  ``n_routed_experts`` (``ops.grouped_topk``: V3's sigmoid + ``e_score_correction_bias`` with
  grouped top-k, V2's softmax with greedy or group-limited greedy; ``routed_scaling_factor``),
  the routed experts on the fused experts op (``ops.moe_experts``, expert parallelism as
  ``models/moe.py``) and ``n_shared_experts`` shared experts as one SwiGLU MLP every token goes
  through. V2's ``norm_topk_prob`` is ignored, as transformers' reference ignores it.

- **MTP** (``num_nextn_predict_layers``): the checkpoint's next-token layers sit after the
  decoder, ``model.layers.{num_hidden_layers + i}.*`` (a full decoder layer plus ``enorm``,
  ``hnorm``, ``eh_proj``, ``shared_head.{norm,head}``, ``embed_tokens``). The target ignores
  them; the speculative method "mtp" builds the layer through ``mtp_decoder_layer(i)`` and its KV
  cache through the layer's ``make_kv_cache`` (docs/models.md, "DeepSeek").

Tensor parallelism: query heads split (``q_proj`` / ``q_b_proj`` / ``kv_b_proj`` by output rows,
``o_proj`` by input columns); ``q_a_proj``, ``kv_a_proj_with_mqa``, the latent norms and the
latent cache are replicated (every rank's heads read the same latent).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from atb_plugin import ops
from atb_plugin.distributed import TPShard, all_reduce, divide, tp_size
from atb_plugin.models.decoder import MLP, DecoderForCausalLM, DecoderLayer, DecoderModel, RMSNorm
from atb_plugin.models.linear import DECODER, EXPERT, REPLICATED, LinearSpec, make_linear
from atb_plugin.models.moe import ExpertWeightsMixin, FusedExperts, MoeConfig
from atb_plugin.models.parallel_layers import column_parallel_linear, join, row_parallel_linear
from atb_plugin.models.weights import IGNORE
from atb_plugin.ops.rotary import yarn_softmax_scale

__all__ = ["DeepseekConfig", "DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "MLAttention"]

# The latent norms' epsilon: DeepSeek's modules and transformers' build them with the default,
# not config.json's rms_norm_eps.
LATENT_NORM_EPS = 1e-6
#: Attention forms (``DeepseekV2ForCausalLM.set_mla_form``): "auto" = absorbed for decode-only
#: steps, expanded otherwise; the other two force one form on every step (tests, benchmarks).
MLA_FORMS = ("auto", "absorbed", "expanded")


@dataclass(frozen=True)
class DeepseekConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    rms_norm_eps: float
    rope: dict
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool = True
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    moe: MoeConfig | None = None
    routing: ops.GroupedRouting | None = None
    correction_bias: bool = False  # V3's e_score_correction_bias (noaux_tc)
    n_shared_experts: int = 0
    num_nextn_predict_layers: int = 0
    mrope_section = None  # DecoderModel's rotary reads it: plain rope

    @property
    def head_dim(self) -> int:
        """The rotary width (``DecoderModel`` builds its tables from it)."""
        return self.qk_rope_head_dim

    @property
    def latent_width(self) -> int:
        """Values one token keeps per layer in the latent cache."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @classmethod
    def from_hf(cls, config: dict) -> "DeepseekConfig":
        """From a DeepSeek-V2 / V3 config.json (published ``rope_scaling`` + ``rope_theta``, or
        transformers 5's ``rope_parameters``)."""
        v3 = config.get("model_type") == "deepseek_v3"
        rope = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
        rope.setdefault("rope_theta", config.get("rope_theta", 10000.0))
        if "type" in rope:
            rope.setdefault("rope_type", rope.pop("type"))
        layers = config["num_hidden_layers"]
        nextn = config.get("num_nextn_predict_layers", 0) or 0
        experts = config.get("n_routed_experts") or 0
        moe = routing = None
        if experts:
            first_dense, freq = config.get("first_k_dense_replace", 0) or 0, config.get("moe_layer_freq", 1) or 1
            moe = MoeConfig(
                num_experts=experts, top_k=config["num_experts_per_tok"],
                intermediate_size=config["moe_intermediate_size"], norm_topk_prob=bool(config.get("norm_topk_prob")),
                # The MTP layers after the decoder are sparse too (their index is past first_k_dense_replace).
                sparse_layers=frozenset(i for i in range(layers + nextn) if i >= first_dense and i % freq == 0))
            grouped = v3 or config.get("topk_method") == "group_limited_greedy"
            routing = ops.GroupedRouting(
                top_k=moe.top_k, scoring="sigmoid" if v3 else "softmax",
                n_group=(config.get("n_group") or 1) if grouped else 1,
                topk_group=(config.get("topk_group") or 1) if grouped else 1,
                group_score="top2_sum" if v3 else "max", renormalize=v3 and moe.norm_topk_prob,
                routed_scaling_factor=float(config.get("routed_scaling_factor", 1.0)))
        return cls(
            vocab_size=config["vocab_size"], hidden_size=config["hidden_size"],
            intermediate_size=config["intermediate_size"], num_hidden_layers=layers,
            num_attention_heads=config["num_attention_heads"], rms_norm_eps=config.get("rms_norm_eps", 1e-6),
            rope=rope, q_lora_rank=config.get("q_lora_rank"), kv_lora_rank=config["kv_lora_rank"],
            qk_nope_head_dim=config["qk_nope_head_dim"], qk_rope_head_dim=config["qk_rope_head_dim"],
            v_head_dim=config["v_head_dim"], rope_interleave=config.get("rope_interleave", True) if v3 else True,
            attention_bias=bool(config.get("attention_bias", False)),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)), moe=moe, routing=routing,
            correction_bias=v3 and config.get("topk_method", "noaux_tc") == "noaux_tc" and bool(experts),
            n_shared_experts=config.get("n_shared_experts") or 0, num_nextn_predict_layers=nextn)


def _replicated_linear(in_features: int, out_features: int, bias: bool, prefix: str) -> nn.Module:
    return make_linear(LinearSpec(in_features, out_features, bias, REPLICATED, DECODER), prefix)


class LatentUpProjection(nn.Module):
    """``kv_b_proj``: latent -> per-head ``[k_nope | v]``, this rank's heads. A float weight the
    two attention forms read differently: the expanded form as a linear layer, the absorbed form
    as per-head slices (``w_uk``, ``w_uv``: views, no copy)."""

    def __init__(self, kv_lora_rank: int, heads: int, nope: int, v: int):
        super().__init__()
        self.heads, self.nope, self.v = heads, nope, v
        self.weight = nn.Parameter(torch.empty(heads * (nope + v), kv_lora_rank))

    def forward(self, latent: torch.Tensor) -> torch.Tensor:
        return F.linear(latent, self.weight)

    def absorbed(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(W_UK (H, nope, R), W_UV (H, v, R))``."""
        per_head = self.weight.view(self.heads, self.nope + self.v, -1)
        return per_head[:, :self.nope], per_head[:, self.nope:]


class MLAttention(nn.Module):
    """Multi-head latent attention (module docstring); this rank's heads under TP."""

    def __init__(self, config: DeepseekConfig, prefix: str = ""):
        super().__init__()
        self.num_heads = divide(config.num_attention_heads, tp_size(), "num_attention_heads")
        self.q_lora_rank, self.kv_lora_rank = config.q_lora_rank, config.kv_lora_rank
        self.nope, self.rope_dim, self.v_head_dim = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
        self.qk_head_dim = self.nope + self.rope_dim
        self.hidden_size = config.hidden_size
        self.interleaved = config.rope_interleave
        q_rows = self.num_heads * self.qk_head_dim
        if self.q_lora_rank:
            self.q_a_proj = _replicated_linear(config.hidden_size, self.q_lora_rank, config.attention_bias,
                                               join(prefix, "q_a_proj"))
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = column_parallel_linear(self.q_lora_rank, q_rows, False, join(prefix, "q_b_proj"))
        else:
            self.q_proj = column_parallel_linear(config.hidden_size, q_rows, False, join(prefix, "q_proj"))
        self.kv_a_proj_with_mqa = _replicated_linear(config.hidden_size, config.latent_width, config.attention_bias,
                                                     join(prefix, "kv_a_proj_with_mqa"))
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b_proj = LatentUpProjection(self.kv_lora_rank, self.num_heads, self.nope, self.v_head_dim)
        self.o_proj = row_parallel_linear(self.num_heads * self.v_head_dim, config.hidden_size, config.attention_bias,
                                          join(prefix, "o_proj"))
        self.scale = yarn_softmax_scale(config.rope, self.qk_head_dim ** -0.5)
        self.form = "auto"

    def tp_shard(self, leaf: str, kind: str, shard: int | None) -> TPShard | None:
        if leaf in ("q_proj", "q_b_proj"):
            return TPShard.column(self.num_heads * self.qk_head_dim)
        if leaf == "kv_b_proj":
            return TPShard.column(self.num_heads * (self.nope + self.v_head_dim))
        if leaf == "o_proj":
            return TPShard.row(kind, self.num_heads * self.v_head_dim, self.hidden_size)
        return None  # the latent projections and norms: replicated

    def make_kv_cache(self, num_blocks: int, block_size: int, dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
        """This layer's latent cache (``ops/mla.py``): ``(c_kv, k_pe)`` blocks."""
        return (torch.zeros(num_blocks, block_size, 1, self.kv_lora_rank, dtype=dtype, device=device),
                torch.zeros(num_blocks, block_size, 1, self.rope_dim, dtype=dtype, device=device))

    def _absorbed(self, metadata) -> bool:
        return self.form == "absorbed" or (self.form == "auto" and metadata.is_decode_only)

    def forward(self, hidden, cos, sin, kv_cache, metadata):
        tokens = hidden.shape[0]
        if self.q_lora_rank:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden)))
        else:
            q = self.q_proj(hidden)
        q_nope, q_pe = q.view(tokens, self.num_heads, self.qk_head_dim).split([self.nope, self.rope_dim], dim=-1)
        if self.interleaved:
            q_pe = ops.deinterleave(q_pe)
        q_pe = ops.apply_rotary(q_pe.contiguous(), cos, sin)
        kv_c_cache, k_pe_cache = kv_cache
        kv_c, k_pe = ops.mla_write_latent(self.kv_a_proj_with_mqa(hidden), self.kv_a_layernorm.weight, LATENT_NORM_EPS,
                                          cos, sin, kv_c_cache, k_pe_cache, metadata.slot_mapping, self.interleaved)
        if self._absorbed(metadata):
            w_uk, w_uv = self.kv_b_proj.absorbed()
            q_latent = torch.bmm(q_nope.transpose(0, 1), w_uk.to(q_nope.dtype)).transpose(0, 1)  # (T, H, R)
            out = ops.mla_absorbed_attention(q_latent, q_pe, kv_c_cache, k_pe_cache, metadata, self.scale)
            out = torch.bmm(out.transpose(0, 1), w_uv.transpose(1, 2).to(out.dtype)).transpose(0, 1)  # (T, H, v)
        else:
            if metadata.is_prefill_only:  # the context is exactly this step's tokens: nothing to gather
                context_c, context_pe = kv_c, k_pe
            else:
                context_c, context_pe = ops.mla_gather_context(kv_c_cache, k_pe_cache, metadata)
            k_nope, value = self.kv_b_proj(context_c.to(hidden.dtype)).view(
                -1, self.num_heads, self.nope + self.v_head_dim).split([self.nope, self.v_head_dim], dim=-1)
            out = ops.mla_expanded_attention(q_nope, q_pe, k_nope, context_pe.to(hidden.dtype), value, metadata,
                                             self.scale)
        return all_reduce(self.o_proj(out.reshape(tokens, self.num_heads * self.v_head_dim)))


class DeepseekRouter(nn.Module):
    """``mlp.gate``: router weight ``(E, H)`` and V3's ``e_score_correction_bias`` (E,); logits in
    float32 whatever the model's dtype (as transformers' DeepseekV3TopkRouter). Replicated."""

    def __init__(self, num_experts: int, hidden_size: int, correction_bias: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))
        self.e_score_correction_bias = nn.Parameter(torch.empty(num_experts)) if correction_bias else None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden.float(), self.weight.float())


class DeepseekMoE(nn.Module):
    """Routed experts (``FusedExperts``, grouped top-k routing) plus the shared experts, one
    all-reduce for both (each rank's partial sums)."""

    def __init__(self, config: DeepseekConfig, prefix: str = ""):
        super().__init__()
        self.routing = config.routing
        self.gate = DeepseekRouter(config.moe.num_experts, config.hidden_size, config.correction_bias)
        self.experts = FusedExperts(config.moe, config.hidden_size)
        self.shared_experts = None
        if config.n_shared_experts:
            self.shared_experts = MLP(config, config.moe.intermediate_size * config.n_shared_experts, reduce=False,
                                      prefix=join(prefix, "shared_experts"), role=EXPERT)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        weights, ids = ops.grouped_topk(self.gate(hidden), self.routing, self.gate.e_score_correction_bias)
        out = ops.moe_experts(hidden, weights, ids, self.experts.w13, self.experts.w2, self.experts.first_expert)
        if self.shared_experts is not None:
            out = out + self.shared_experts(hidden)
        return all_reduce(out)


class DeepseekDecoderLayer(nn.Module):
    """Pre-norm residual block of MLA and a dense MLP or DeepSeekMoE (``index`` decides: the MTP
    layers after the decoder are built here too, by index ``num_hidden_layers + i``)."""

    def __init__(self, config: DeepseekConfig, index: int = 0, prefix: str = ""):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = MLAttention(config, join(prefix, "self_attn"))
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        if config.moe is not None and config.moe.is_sparse(index):
            self.mlp = DeepseekMoE(config, join(prefix, "mlp"))
        else:
            self.mlp = MLP(config, prefix=join(prefix, "mlp"))

    forward = DecoderLayer.forward

    def make_kv_cache(self, num_blocks: int, block_size: int, dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
        """This layer's latent cache (an MTP block's: engine/spec_decode/mtp.py asks the layer)."""
        return self.self_attn.make_kv_cache(num_blocks, block_size, dtype, device)


class DeepseekModel(DecoderModel):
    layer_class = DeepseekDecoderLayer


_LAYER_INDEX = re.compile(r"^model\.layers\.(\d+)\.")


class DeepseekV2ForCausalLM(ExpertWeightsMixin, DecoderForCausalLM):
    model_class = DeepseekModel

    @classmethod
    def config_from_hf(cls, config: dict) -> DeepseekConfig:
        return DeepseekConfig.from_hf(config)

    def set_mla_form(self, form: str) -> None:
        """Which attention form every layer runs (``MLA_FORMS``)."""
        if form not in MLA_FORMS:
            raise ValueError(f"MLA form {form!r}: expected one of {', '.join(MLA_FORMS)}")
        for layer in self.model.layers:
            layer.self_attn.form = form

    def make_kv_caches(self, num_blocks: int, block_size: int, dtype=None, device=None):
        weight = self.model.embed_tokens.weight
        return [layer.make_kv_cache(num_blocks, block_size, dtype or weight.dtype, device or weight.device)
                for layer in self.model.layers]

    # Read by the model runner: MLA's kernels derive each step's context gathers on the host
    # (ops/torch_kernels.py, _MlaStep), which a device graph would replay stale (docs/graph-mode.md).
    no_decode_graphs = "multi-head latent attention is not graph-capturable yet"

    def capture_decode_step(self, kv_caches, max_rows: int) -> str:
        return "eager: the captured decode step runs the GQA decoder, not multi-head latent attention"

    # -- the MTP hook (engine/spec_decode/mtp.py's; this model never runs the block) ----------------

    def mtp_decoder_layer(self, index: int) -> "DeepseekDecoderLayer":
        """A fresh DeepSeek decoder layer for MTP block ``index`` (checkpoint
        ``model.layers.{num_hidden_layers + index}``; sparse or dense as that index says), its
        linear layers made under the quantization config being built; run as this model's layers
        are, ``layer(hidden, cos, sin, kv_cache, metadata)`` with ``model.rotary``'s tables, over
        its own latent cache (``layer.make_kv_cache``)."""
        if not 0 <= index < self.config.num_nextn_predict_layers:
            raise ValueError(f"MTP block {index}: the checkpoint has {self.config.num_nextn_predict_layers}")
        return DeepseekDecoderLayer(self.config, self.config.num_hidden_layers + index, "layer")

    def _own_name(self, name: str) -> str | None:
        match = _LAYER_INDEX.match(name)
        if match and int(match[1]) >= self.config.num_hidden_layers:
            return IGNORE  # an MTP block's tensor: the proposer's (mtp_decoder_layer), not the target's
        return super()._own_name(name)


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    """V3 / R1: the same model; config.json says what differs (sigmoid routing with the
    correction bias and grouped top-k, q LoRA, YaRN)."""
