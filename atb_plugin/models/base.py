"""``PretrainedModel``: building a model from a checkpoint directory."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from atb_plugin.models.weights import load_checkpoint


class PretrainedModel(nn.Module):
    """Contract: subclasses turn config.json into their config (``config_from_hf``), take it in
    ``__init__``, and implement ``load_weights`` / ``accepts_weight`` over HF parameter names."""

    @classmethod
    def config_from_hf(cls, config: dict):
        raise NotImplementedError

    @classmethod
    def from_pretrained(cls, model_dir, dtype: torch.dtype = torch.float32, device=None) -> "PretrainedModel":
        raw = json.loads((Path(model_dir) / "config.json").read_text())
        device = torch.device(device or "cpu")
        # Built on the meta device: no time spent initialising weights the checkpoint overwrites
        # (load_checkpoint refuses to leave any parameter unfilled).
        with torch.device("meta"):
            model = cls(cls.config_from_hf(raw))
        model = model.to_empty(device=device).to(dtype)
        model.init_non_persistent(device)
        load_checkpoint(model, model_dir, dtype)
        return model.eval()

    def init_non_persistent(self, device) -> None:
        """Recompute state that is not in the checkpoint after ``to_empty`` (e.g. rotary tables)."""
