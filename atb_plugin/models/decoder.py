"""The decoder-only transformer shared by Qwen2, Qwen3, Llama and the language models of the VL
families: RMSNorm, GQA attention over the paged KV cache with rotary positions, SwiGLU MLP.
Options a family turns on in its ``DecoderConfig``: q/k/v biases (Qwen2), per-head RMSNorm of
queries and keys before rotary (``qk_norm``: Qwen3), sparse mixture-of-experts MLPs in some or
all layers (``moe``: Qwen3-MoE, Qwen2-MoE with its shared expert; ``models/moe.py``).

Parameters follow transformers' names (``model.layers.N.self_attn.o_proj.weight`` ...) except
two fused projections, filled from the checkpoint's separate ones at load time::

    qkv_proj     = [q_proj; k_proj; v_proj]   (one matmul instead of three)
    gate_up_proj = [gate_proj; up_proj]       (feeds silu_and_mul directly)

Under tensor parallelism (``atb_plugin.distributed``) each rank builds the same modules at its
share of the sizes: attention heads and the MLP's intermediate features are split (qkv_proj and
gate_up_proj by output rows, o_proj and down_proj by input columns, one all-reduce after each),
KV heads are split too, or replicated when there are fewer of them than ranks; the embedding and
the LM head are split by vocabulary rows (``parallel_layers``). Norms and rotary are replicated.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch import nn

from atb_plugin import ops
from atb_plugin.distributed import TPShard, all_reduce, divide, kv_heads_per_rank, tp_rank, tp_size
from atb_plugin.models.base import PretrainedModel
from atb_plugin.models.moe import MoeConfig, SparseMoeBlock
from atb_plugin.models.linear import DECODER, EXPERT, attach, linear_method
from atb_plugin.models.parallel_layers import (VocabParallelEmbedding, column_parallel_linear, gather_vocab_logits,
                                               join, lm_head_linear, lm_head_spec, row_parallel_linear)
from atb_plugin.models.weights import IGNORE, OLD_ROTARY_BUFFER, STACKED_QKV_GATE_UP
from atb_plugin.ops import AttentionMetadata

KVCache = tuple[torch.Tensor, torch.Tensor]  # (key_cache, value_cache) of one layer
_LAYER_INDEX = re.compile(r"^model\.layers\.(\d+)\.")



@dataclass(frozen=True)
class DecoderConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: dict
    qkv_bias: bool = False
    tie_word_embeddings: bool = False
    mrope_section: tuple[int, ...] | None = None
    qk_norm: bool = False  # RMSNorm over each query / key head (weights of head_dim), before rotary
    moe: MoeConfig | None = None  # sparse layers and their experts; None: every layer dense
    # Multi-token-prediction blocks after the decoder layers (DeepSeek-V3's layout): loaded by the
    # "mtp" speculative method only (docs/speculative.md), skipped by the model itself.
    num_nextn_predict_layers: int = 0

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"DecoderConfig.{name} must be > 0, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )

    @classmethod
    def from_hf(cls, config: dict, *, qkv_bias: bool = False, qk_norm: bool = False,
                moe: MoeConfig | None = None) -> "DecoderConfig":
        """From a (text) config.json dict, published layout or transformers 5's ``rope_parameters``."""
        heads = config["num_attention_heads"]
        rope = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
        rope.setdefault("rope_theta", config.get("rope_theta", 10000.0))
        mrope = rope.get("mrope_section")
        return cls(
            vocab_size=config["vocab_size"],
            hidden_size=config["hidden_size"],
            intermediate_size=config["intermediate_size"],
            num_hidden_layers=config["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=config.get("num_key_value_heads") or heads,
            head_dim=config.get("head_dim") or config["hidden_size"] // heads,
            rms_norm_eps=config.get("rms_norm_eps", 1e-6),
            rope=rope,
            qkv_bias=config.get("attention_bias", qkv_bias),
            tie_word_embeddings=config.get("tie_word_embeddings", False),
            mrope_section=tuple(mrope) if mrope else None,
            qk_norm=qk_norm,
            moe=moe,
            num_nextn_predict_layers=config.get("num_nextn_predict_layers") or 0,
        )


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.rms_norm(x, self.weight, self.eps)


class Attention(nn.Module):
    """GQA attention; under TP, this rank's heads (``ShardedWeights``)."""

    def __init__(self, config: DecoderConfig, prefix: str = ""):
        super().__init__()
        tp = tp_size()
        self.total_q_size = config.num_attention_heads * config.head_dim
        self.total_kv_size = config.num_key_value_heads * config.head_dim
        self.num_heads = divide(config.num_attention_heads, tp, "num_attention_heads")
        self.num_kv_heads = kv_heads_per_rank(config.num_key_value_heads, tp)
        # Fewer KV heads than ranks: ranks r .. r + tp / KV - 1 share KV head r * KV / tp (their
        # query heads all belong to it).
        self.first_kv_head = (tp_rank() * self.num_kv_heads if config.num_key_value_heads >= tp
                              else tp_rank() // (tp // config.num_key_value_heads))
        self.head_dim = config.head_dim
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qkv_proj = column_parallel_linear(config.hidden_size, self.q_size + 2 * self.kv_size, config.qkv_bias,
                                               join(prefix, "qkv_proj"))
        self.o_proj = row_parallel_linear(self.q_size, config.hidden_size, False, join(prefix, "o_proj"))
        # Qwen3: one RMSNorm weight of head_dim shared by all query heads, one by all key heads:
        # replicated under TP (every rank's heads use the whole weight).
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.hidden_size = config.hidden_size
        self.scale = self.head_dim**-0.5

    def shard_sizes(self, fused: str) -> list[int]:
        return [self.q_size, self.kv_size, self.kv_size]

    def checkpoint_shard_sizes(self, fused: str) -> list[int]:
        return [self.total_q_size, self.total_kv_size, self.total_kv_size]

    def tp_shard(self, leaf: str, kind: str, shard: int | None) -> TPShard | None:
        if leaf in ("q_norm", "k_norm"):
            return None
        if leaf == "o_proj":
            return TPShard.row(kind, self.q_size, self.hidden_size)
        if shard == 0:
            return TPShard.column(self.q_size)
        return TPShard(0, self.first_kv_head * self.head_dim, self.kv_size)

    def forward(self, hidden, cos, sin, kv_cache: KVCache, metadata: AttentionMetadata):
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = q.view(-1, self.num_heads, self.head_dim), k.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = ops.apply_rotary(q, cos, sin)
        k = ops.apply_rotary(k, cos, sin)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        key_cache, value_cache = kv_cache
        ops.write_kv_cache(k, v, key_cache, value_cache, metadata.slot_mapping)
        out = ops.paged_attention(q, key_cache, value_cache, metadata, self.scale)
        return all_reduce(self.o_proj(out.reshape(-1, self.q_size)))


class MLP(nn.Module):
    """SwiGLU; under TP, this rank's intermediate features (``ShardedWeights``). ``intermediate_size``
    other than the config's: a MoE layer's shared expert, whose partial output its layer reduces
    together with the experts' (``reduce=False``); its projections' ``role`` is then ``EXPERT``
    (``models/linear.py``: quantized on the fly only in dense layers)."""

    def __init__(self, config: DecoderConfig, intermediate_size: int | None = None, reduce: bool = True,
                 prefix: str = "", role: str = DECODER):
        super().__init__()
        self.total_intermediate_size = intermediate_size or config.intermediate_size
        self.reduce = reduce
        self.intermediate_size = divide(self.total_intermediate_size, tp_size(), "intermediate_size")
        self.hidden_size = config.hidden_size
        self.gate_up_proj = column_parallel_linear(config.hidden_size, 2 * self.intermediate_size, False,
                                                   join(prefix, "gate_up_proj"), role)
        self.down_proj = row_parallel_linear(self.intermediate_size, config.hidden_size, False,
                                             join(prefix, "down_proj"), role)

    def shard_sizes(self, fused: str) -> list[int]:
        return [self.intermediate_size, self.intermediate_size]

    def checkpoint_shard_sizes(self, fused: str) -> list[int]:
        return [self.total_intermediate_size, self.total_intermediate_size]

    def tp_shard(self, leaf: str, kind: str, shard: int | None) -> TPShard | None:
        if leaf == "down_proj":
            return TPShard.row(kind, self.intermediate_size, self.hidden_size)
        return TPShard.column(self.intermediate_size)

    def forward(self, hidden):
        out = self.down_proj(ops.silu_and_mul(self.gate_up_proj(hidden)))
        return all_reduce(out) if self.reduce else out


class DecoderLayer(nn.Module):
    def __init__(self, config: DecoderConfig, index: int = 0, prefix: str = ""):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, join(prefix, "self_attn"))
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        if config.moe is not None and config.moe.is_sparse(index):
            shared = config.moe.shared_expert_intermediate_size
            shared_expert = MLP(config, shared, reduce=False, prefix=join(prefix, "mlp.shared_expert"),
                                role=EXPERT) if shared else None
            self.mlp = SparseMoeBlock(config.moe, config.hidden_size, shared_expert)
        else:
            self.mlp = MLP(config, prefix=join(prefix, "mlp"))

    def forward(self, hidden, cos, sin, kv_cache, metadata):
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), cos, sin, kv_cache, metadata)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class DecoderModel(nn.Module):
    layer_class = DecoderLayer  # a family with another attention (DeepSeek's MLA) brings its own layer

    def __init__(self, config: DecoderConfig, prefix: str = ""):
        super().__init__()
        self.config = config
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(self.layer_class(config, i, join(prefix, f"layers.{i}"))
                                    for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = ops.RotaryEmbedding(config.head_dim, config.rope, config.mrope_section)
        self.captured_decode = None  # a NativeDecodeStep once the engine captured one (capture_decode_step)

    def tp_shard(self, leaf: str, kind: str, shard: int | None) -> TPShard | None:
        return self.embed_tokens.tp_shard() if leaf == "embed_tokens" else None

    def forward(self, positions, kv_caches: list[KVCache], metadata: AttentionMetadata, inputs_embeds):
        captured = self.captured_decode is not None and self.captured_decode.applies(kv_caches, metadata)
        # The captured step computes in float32 whatever the model's dtype (native_decode.py): its
        # rotary tables too.
        cos, sin = self.rotary.cos_sin(positions, torch.float32 if captured else inputs_embeds.dtype)
        if captured:
            return self.captured_decode(inputs_embeds, cos, sin, metadata)
        hidden = inputs_embeds
        for layer, kv_cache in zip(self.layers, kv_caches):
            hidden = layer(hidden, cos, sin, kv_cache, metadata)
        return self.norm(hidden)


class DecoderForCausalLM(PretrainedModel):
    """A decoder LM. Contract shared by every model here (vLLM's, simplified):

    - ``get_input_embeddings(input_ids, mm_embeds=None)`` -> ``(T, hidden)``;
    - ``forward(input_ids, positions, kv_caches, attn_metadata, inputs_embeds=None)`` -> hidden states
      of the step's tokens; ``compute_logits(hidden)`` -> ``(T, vocab)``;
    - ``make_kv_caches(num_blocks, block_size)``; ``capture_decode_step(kv_caches, max_rows)``
      where the platform replays captured decode steps; ``load_weights(pairs)`` -> names filled;
      ``accepts_weight(name)`` says whether a checkpoint tensor belongs to the model.

    ``prefix``: its module path in the model that holds it ("" at the root; a VL model's
    ``language_model``), the start of its linear layers' paths (``models/linear.py``).
    """

    model_class = DecoderModel  # a family with its own layers (models/deepseek.py) brings its own model

    def __init__(self, config: DecoderConfig, prefix: str = ""):
        super().__init__()
        self.config = config
        self.model = self.model_class(config, join(prefix, "model"))
        # Vocabulary-parallel like the embedding (the same rows per rank: a tied head is its weight).
        rows = self.model.embed_tokens.num_embeddings
        head = join(prefix, "lm_head")
        self.lm_head = None if config.tie_word_embeddings else lm_head_linear(config.hidden_size, rows, head)
        # A tied head's own layer is made after loading (share_tied_lm_head), by the method the
        # head is given now, while the model is built under its quantization config.
        self._tied_head = None
        if self.lm_head is None:
            spec = lm_head_spec(config.hidden_size, rows)
            self._tied_head = spec, linear_method(spec, head)

    def tp_shard(self, leaf: str, kind: str, shard: int | None) -> TPShard | None:
        return self.model.embed_tokens.tp_shard() if leaf == "lm_head" else None

    def get_language_model(self) -> "DecoderForCausalLM":
        return self

    def get_input_embeddings(self, input_ids: torch.Tensor, mm_embeds=None) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def forward(self, input_ids, positions, kv_caches, attn_metadata, inputs_embeds=None):
        if inputs_embeds is None:
            inputs_embeds = self.get_input_embeddings(input_ids)
        return self.model(positions, kv_caches, attn_metadata, inputs_embeds)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.lm_head is None:  # tied word embeddings: the input embedding is the output projection
            logits = hidden @ self.model.embed_tokens.weight.t()
        else:
            logits = self.lm_head(hidden)
        # Every rank gets the whole row (and samples it the same way: engine/worker.py).
        return gather_vocab_logits(logits, self.config.vocab_size)

    def share_tied_lm_head(self) -> None:
        """Give a tied head a layer of its own over the embedding's weight (the same tensor, not a
        copy), made by the method the head was given when the model was built, so that its
        ``process_weights_after_loading`` packs or quantizes the head like any linear layer (a
        copy; the embedding keeps its float rows). Called after loading (the checkpoint fills the
        embedding; a tied checkpoint's ``lm_head.weight`` stays ignored), and only for a model that
        generates (``PretrainedModel.from_pretrained``)."""
        if self.lm_head is None and self._tied_head is not None:
            spec, method = self._tied_head
            with torch.device("meta"):
                head = attach(method.create_weights(spec), method, spec)
            head.weight = self.model.embed_tokens.weight
            self.lm_head = head

    def capture_decode_step(self, kv_caches: list[KVCache], max_rows: int) -> str:
        """Capture the decode forward over ``kv_caches`` (made by ``make_kv_caches``, never
        reallocated) for up to ``max_rows`` requests where the platform can replay it
        (``native_decode``: the CPU with the native kernels); decode-only steps then run it.
        Returns "captured", or why the decode step stays eager."""
        from atb_plugin.models import native_decode  # the native kernels' side: loaded on use

        self.model.captured_decode, outcome = native_decode.capture(self.model, kv_caches, max_rows)
        return outcome

    def make_kv_caches(self, num_blocks: int, block_size: int, dtype=None, device=None) -> list[KVCache]:
        weight = self.model.embed_tokens.weight
        # This rank's KV heads (all of them without tensor parallelism).
        shape = (num_blocks, block_size, self.model.layers[0].self_attn.num_kv_heads, self.config.head_dim)
        return [
            (torch.zeros(shape, dtype=dtype or weight.dtype, device=device or weight.device),
             torch.zeros(shape, dtype=dtype or weight.dtype, device=device or weight.device))
            for _ in range(self.config.num_hidden_layers)
        ]

    # -- weights ---------------------------------------------------------------------------------

    stacked_params = STACKED_QKV_GATE_UP

    def _own_name(self, name: str) -> str | None:
        if OLD_ROTARY_BUFFER.match(name) or (name == "lm_head.weight" and self.lm_head is None):
            return IGNORE  # known and deliberately unused (tied head, rotary buffers)
        layer = _LAYER_INDEX.match(name)
        if layer and int(layer.group(1)) >= self.config.num_hidden_layers and self.config.num_nextn_predict_layers:
            return IGNORE  # an MTP block: the speculative method "mtp" loads it (mtp_decoder_layer)
        return name

    def mtp_decoder_layer(self, index: int) -> nn.Module:
        """A fresh decoder layer for multi-token-prediction block ``index`` (checkpoint
        ``model.layers.{num_hidden_layers + index}``), called as this model's layers are: the
        family hook of the speculative method "mtp" (engine/spec_decode/mtp.py)."""
        return DecoderLayer(self.config, self.config.num_hidden_layers + index, "layer")


def build_language_model(config: DecoderConfig) -> DecoderForCausalLM:
    """A multimodal model's text half, which it holds as ``language_model`` (the module path its
    linear layers' paths start with: models/linear.py)."""
    return DecoderForCausalLM(config, prefix="language_model")


class Qwen2ForCausalLM(DecoderForCausalLM):
    @classmethod
    def config_from_hf(cls, config: dict) -> DecoderConfig:
        return DecoderConfig.from_hf(config, qkv_bias=True)  # Qwen2 has q/k/v biases, no flag for it


class LlamaForCausalLM(DecoderForCausalLM):
    @classmethod
    def config_from_hf(cls, config: dict) -> DecoderConfig:
        return DecoderConfig.from_hf(config)
