"""EAGLE-3 (method ``"eagle3"``): the head of an EAGLE-3 checkpoint for a Llama-style target, in
the layout vLLM loads (``Eagle3LlamaForCausalLM``)::

    g = fc([a1; a2; a3])                      fc.weight (H, 3 H_target): the target's residual
                                              stream at three auxiliary layers (``aux_layer_ids``)
    x = [input_layernorm(embed(t[p + 1])); hidden_norm(g)]         midlayer.*: attention over 2H
    r = g + attn(x);  m = r + mlp(post_attention_layernorm(r))     (norm_before_residual: the
                                                                    residual is hidden_norm(g))
    logits = lm_head(norm(m)) over the draft vocabulary -> target ids by d2t (id + d2t[id]);
    m feeds the next draft (in place of fc's output)

``aux_layer_ids``: the checkpoint's ``eagle_aux_hidden_state_layer_ids`` (top level or in
``eagle_config``), else vLLM's default ``(2, L // 2, L - 3)`` for a target of L layers; id j is
the output of target layer j - 1. The embedding is the target's unless the checkpoint ships one."""

from __future__ import annotations

import torch
from torch import nn

from atb_plugin import ops
from atb_plugin.engine.spec_decode.eagle import HEAD_LAYER, head_config
from atb_plugin.engine.spec_decode.head_proposer import DraftHead
from atb_plugin.models.decoder import DecoderConfig, DecoderLayer, RMSNorm
from atb_plugin.models.parallel_layers import column_parallel_linear
from atb_plugin.models.weights import IGNORE, STACKED_QKV_GATE_UP


def aux_layer_ids(hf_config: dict, target_layers: int) -> tuple[int, ...]:
    ids = hf_config.get("eagle_aux_hidden_state_layer_ids") or (hf_config.get("eagle_config") or {}).get(
        "eagle_aux_hidden_state_layer_ids")
    return tuple(ids) if ids else (2, target_layers // 2, target_layers - 3)


class Eagle3Head(DraftHead):
    stacked_params = STACKED_QKV_GATE_UP

    def __init__(self, config: DecoderConfig, target, own_embedding: bool, draft_vocab_size: int,
                 target_hidden_size: int, num_aux: int, has_d2t: bool, norm_before_residual: bool):
        super().__init__(target, own_embedding, own_head=False)
        hidden = config.hidden_size
        self.fc = nn.Linear(num_aux * target_hidden_size, hidden, bias=False)
        self.layer = DecoderLayer(config, 0, "layer")
        attention = self.layer.self_attn
        attention.qkv_proj = column_parallel_linear(2 * hidden, attention.q_size + 2 * attention.kv_size,
                                                    config.qkv_bias, "layer.self_attn.qkv_proj")
        self.layer.hidden_norm = RMSNorm(hidden, config.rms_norm_eps)
        self.norm = RMSNorm(hidden, config.rms_norm_eps)
        self.draft_head = nn.Linear(hidden, draft_vocab_size, bias=False)
        # Draft id -> target id offset; none: the draft vocabulary is the target's.
        self.d2t = nn.Parameter(torch.zeros(draft_vocab_size, dtype=torch.long), requires_grad=False) if has_d2t \
            else None
        self.vocab_size = config.vocab_size
        self.norm_before_residual = norm_before_residual
        self.rotary = ops.RotaryEmbedding(config.head_dim, config.rope)

    def combine(self, features: torch.Tensor) -> torch.Tensor:
        return self.fc(features)

    def forward(self, input_ids, positions, hidden, kv_caches, metadata):
        layer = self.layer
        normed = layer.hidden_norm(hidden)
        residual = normed if self.norm_before_residual else hidden
        x = torch.cat([layer.input_layernorm(self.embed(input_ids)), normed], dim=-1)
        cos, sin = self.rotary.cos_sin(positions, x.dtype)
        residual = residual + layer.self_attn(x, cos, sin, kv_caches[0], metadata)
        residual = residual + layer.mlp(layer.post_attention_layernorm(residual))
        return self.norm(residual), residual

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.draft_head(hidden)
        if self.d2t is None:
            return logits
        ids = torch.arange(logits.shape[-1], device=logits.device) + self.d2t
        full = logits.new_full((logits.shape[0], self.vocab_size), float("-inf"))
        full[:, ids] = logits
        return full

    def _own_name(self, name: str) -> str | None:
        if HEAD_LAYER.match(name):
            return HEAD_LAYER.sub("layer.", name)
        name = name.removeprefix("model.")
        if name == "t2d":
            return IGNORE  # the target -> draft mask: drafting needs only d2t
        return "draft_head.weight" if name == "lm_head.weight" else name

    @classmethod
    def from_checkpoint(cls, hf_config: dict, tensors: dict[str, torch.Tensor], source: str, target, dtype, device,
                        pack: bool) -> "Eagle3Head":
        config = head_config(hf_config, target.config)
        names = {name.removeprefix("model.") for name in tensors}
        num_aux = len(aux_layer_ids(hf_config, target.config.num_hidden_layers))
        draft_vocab = hf_config.get("draft_vocab_size") or target.config.vocab_size
        return cls.load(tensors, source, dtype, device, pack, config, target, "embed_tokens.weight" in names,
                        draft_vocab, hf_config.get("target_hidden_size") or target.config.hidden_size, num_aux,
                        "d2t" in names, bool(hf_config.get("norm_before_residual", False)))
