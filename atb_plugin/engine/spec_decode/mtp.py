"""MTP (method ``"mtp"``): the multi-token-prediction block a checkpoint carries after its decoder
layers, in DeepSeek-V3's layout (config.json ``num_nextn_predict_layers`` > 0; block i is
``model.layers.{num_hidden_layers + i}``)::

    x = eh_proj([enorm(embed(t[p + 1])); hnorm(h_target[p])])      eh_proj.weight (H, 2H)
    h = decoder layer(x)           the family's own layer: the model's ``mtp_decoder_layer(i)``
    logits = shared_head.head(shared_head.norm(h)); h feeds the next draft

The embedding (``embed_tokens``) and the head (``shared_head.head``) are the block's when the
checkpoint holds them, else the target's. Block 0 drafts every position (vLLM does the same with
one block). The target model skips these tensors when it loads (``DecoderConfig.num_nextn_predict_layers``).

The family hook, for a family to get MTP: its language model's ``mtp_decoder_layer(index)``
returns a fresh decoder layer of block ``index``, called ``layer(hidden, cos, sin, kv_cache,
metadata)`` like the model's own layers, with rotary from the model's ``model.rotary``; its KV
cache is ``(num_blocks, block_size, self_attn.num_kv_heads, self_attn.head_dim)`` keys and
values unless the layer has ``make_kv_cache(num_blocks, block_size, dtype, device)``; its
checkpoint names are renamed by the model's ``checkpoint_own_name`` and fused by its
``stacked_params`` (docs/speculative.md, "MTP")."""

from __future__ import annotations

import torch
from torch import nn

from atb_plugin.engine.spec_decode.head_proposer import DraftHead
from atb_plugin.models.decoder import RMSNorm
from atb_plugin.models.moe import ExpertWeightsMixin


def mtp_prefix(target) -> str:
    """Where block 0 sits in the checkpoint."""
    return f"model.layers.{target.config.num_hidden_layers}."


class MtpHead(ExpertWeightsMixin, DraftHead):
    def __init__(self, target, own_embedding: bool, own_head: bool):
        super().__init__(target, own_embedding, own_head)
        self.stacked_params = type(target).stacked_params
        config = target.config
        hidden = config.hidden_size
        self.enorm = RMSNorm(hidden, config.rms_norm_eps)
        self.hnorm = RMSNorm(hidden, config.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * hidden, hidden, bias=False)
        self.shared_norm = RMSNorm(hidden, config.rms_norm_eps)
        self.layer = target.mtp_decoder_layer(0)

    def forward(self, input_ids, positions, hidden, kv_caches, metadata):
        x = self.eh_proj(torch.cat([self.enorm(self.embed(input_ids)), self.hnorm(hidden)], dim=-1))
        cos, sin = self.target.model.rotary.cos_sin(positions, x.dtype)
        x = self.layer(x, cos, sin, kv_caches[0], metadata)
        return self.shared_norm(x), x

    def make_kv_caches(self, num_blocks: int, block_size: int, dtype=None, device=None):
        make = getattr(self.layer, "make_kv_cache", None)
        if make is None:
            return super().make_kv_caches(num_blocks, block_size, dtype, device)
        return [make(num_blocks, block_size, dtype or self.dtype, device or self.device)]

    def expert_weight_name(self, name: str) -> str:
        """A routed expert of the block's layer (DeepSeek-V3's MoE MTP layer) as this module's
        path spells it: ``model.layers.{L}.mlp.experts.…`` is ``layer.mlp.experts.…`` here."""
        prefix = mtp_prefix(self.target)
        return "layer." + name.removeprefix(prefix) if name.startswith(prefix) else name

    def _own_name(self, name: str) -> str | None:
        prefix = mtp_prefix(self.target)
        rest = name.removeprefix(prefix)
        if rest in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "embed_tokens.weight"):
            return rest
        if rest == "shared_head.norm.weight":
            return "shared_norm.weight"
        if rest == "shared_head.head.weight":
            return "lm_head.weight"
        if not name.startswith(prefix):
            return None
        # The family's renaming of its layers' tensors, asked for layer 0's (the model skips the
        # block's own names).
        own = self.target.checkpoint_own_name("model.layers.0." + rest)
        return own if not own else "layer." + own.removeprefix("model.layers.0.")

    @classmethod
    def from_checkpoint(cls, tensors: dict[str, torch.Tensor], source: str, target, dtype, device,
                        pack: bool) -> "MtpHead":
        prefix = mtp_prefix(target)
        return cls.load(tensors, source, dtype, device, pack, target, prefix + "embed_tokens.weight" in tensors,
                        prefix + "shared_head.head.weight" in tensors)
