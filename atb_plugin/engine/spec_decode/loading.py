"""What a speculative method loads besides the target (a draft model, an EAGLE / EAGLE-3 / MTP
head), loaded by the worker right after the target and before the KV budget is set, so that its
weights are in memory when the start-up profile measures the peak and its KV blocks are counted
in each block's bytes (``Worker._blocks_for_budget``: its cache holds as many blocks as the
target's). N-gram loads nothing."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from torch import nn

from atb_plugin.engine.spec_decode.eagle import EagleHead
from atb_plugin.engine.spec_decode.eagle3 import Eagle3Head, aux_layer_ids
from atb_plugin.engine.spec_decode.hidden_states import TargetHiddenStates
from atb_plugin.engine.spec_decode.mtp import MtpHead, mtp_prefix
from atb_plugin.models.weights import iter_weights, materialize

HEAD_METHODS = ("eagle", "eagle3", "mtp")


@dataclass
class SpecModel:
    """``module``: the draft model or the head; ``hidden_states``: what a head drafts from (the
    model runner records it), None for a draft model."""

    module: nn.Module
    hidden_states: TargetHiddenStates | None = None


def _read_tensors(source: str, dtype, prefix: str = "") -> dict:
    """The checkpoint's tensors at ``source`` whose names start with ``prefix``, in memory."""
    return {name: materialize(tensor) for name, tensor in iter_weights(source, dtype, progress=False)
            if name.startswith(prefix)}


def load_spec_model(config, model, device, load_model: Callable) -> SpecModel | None:
    """The speculative method's model for ``config`` (an ``EngineConfig``) next to the target
    ``model`` on ``device``; ``load_model(config, device) -> (model, pooler)`` loads a draft
    checkpoint as the worker loads any. None for n-gram or no speculative decoding, and for a
    draft model under TP: the engine core loads it whole (``proposer.make_proposer``), the ranks
    hold the target alone."""
    spec = config.speculative_config
    if spec is None or spec.method == "ngram":
        return None
    if spec.method == "draft_model":
        return SpecModel(load_model(config.draft_config(), device)[0]) if config.tensor_parallel_size == 1 else None
    target = model.get_language_model()
    dtype = next(target.parameters()).dtype
    if spec.method == "mtp":
        tensors = _read_tensors(config.model, dtype, mtp_prefix(target))
        head = MtpHead.from_checkpoint(tensors, f"{config.model} (MTP block)", target, dtype, device,
                                       config.pack_weights)
        return SpecModel(head, TargetHiddenStates())
    hf_config = json.loads((Path(spec.model) / "config.json").read_text())
    tensors = _read_tensors(spec.model, dtype)
    if spec.method == "eagle":
        head = EagleHead.from_checkpoint(hf_config, tensors, spec.model, target, dtype, device, config.pack_weights)
        return SpecModel(head, TargetHiddenStates())
    head = Eagle3Head.from_checkpoint(hf_config, tensors, spec.model, target, dtype, device, config.pack_weights)
    return SpecModel(head, TargetHiddenStates(target.model.layers,
                                              aux_layer_ids(hf_config, target.config.num_hidden_layers)))
