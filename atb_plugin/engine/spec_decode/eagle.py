"""EAGLE (method ``"eagle"``): the head of an EAGLE checkpoint for a Llama-style target, in the
layout vLLM loads (``EagleLlamaForCausalLM``)::

    x = fc([embed(t[p + 1]); h_target[p]])        fc.weight (H, 2H), fc.bias optional
    h = decoder layer(x)                           layers.0.* (or model.layers.0.*), its
                                                   input_layernorm off (EAGLE's first layer)
    logits = lm_head(h); h feeds the next draft    no final norm

The embedding and the LM head are the target's unless the checkpoint ships its own
(``embed_tokens.weight``, ``lm_head.weight``). Drafting: ``head_proposer.HeadProposer``."""

from __future__ import annotations

import re

import torch
from torch import nn

from atb_plugin import ops
from atb_plugin.engine.spec_decode.head_proposer import DraftHead
from atb_plugin.models.decoder import DecoderConfig, DecoderLayer
from atb_plugin.models.weights import IGNORE, STACKED_QKV_GATE_UP

# The one decoder layer, as EAGLE and vLLM's speculators export name it.
HEAD_LAYER = re.compile(r"^(?:model\.)?(?:layers\.0|midlayer)\.")


def head_config(hf_config: dict, target_config: DecoderConfig) -> DecoderConfig:
    """A head's decoder config from its config.json: the target's vocabulary (drafts are target ids)."""
    return DecoderConfig.from_hf({**hf_config, "vocab_size": target_config.vocab_size})


class EagleHead(DraftHead):
    stacked_params = STACKED_QKV_GATE_UP

    def __init__(self, config: DecoderConfig, target, own_embedding: bool, own_head: bool, fc_bias: bool):
        super().__init__(target, own_embedding, own_head)
        self.fc = nn.Linear(2 * config.hidden_size, config.hidden_size, bias=fc_bias)
        self.layer = DecoderLayer(config, 0, "layer")
        self.layer.input_layernorm = nn.Identity()
        self.rotary = ops.RotaryEmbedding(config.head_dim, config.rope)

    def forward(self, input_ids, positions, hidden, kv_caches, metadata):
        x = self.fc(torch.cat([self.embed(input_ids), hidden], dim=-1))
        cos, sin = self.rotary.cos_sin(positions, x.dtype)
        x = self.layer(x, cos, sin, kv_caches[0], metadata)
        return x, x

    def _own_name(self, name: str) -> str | None:
        if HEAD_LAYER.match(name):
            own = HEAD_LAYER.sub("layer.", name)
            return IGNORE if own.startswith("layer.input_layernorm.") else own
        return name.removeprefix("model.")

    @classmethod
    def from_checkpoint(cls, hf_config: dict, tensors: dict[str, torch.Tensor], source: str, target, dtype, device,
                        pack: bool) -> "EagleHead":
        names = {name.removeprefix("model.") for name in tensors}
        return cls.load(tensors, source, dtype, device, pack, head_config(hf_config, target.config), target,
                        "embed_tokens.weight" in names, "lm_head.weight" in names, "fc.bias" in names)
