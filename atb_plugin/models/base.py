"""``PretrainedModel``: building a model from a checkpoint directory."""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable
from pathlib import Path

import torch
from torch import nn

from atb_plugin.models.linear import building, process_weights_after_loading
from atb_plugin.models.quantization.layers import QUANT_KINDS
from atb_plugin.models.quantization.quantize import quantization_config
from atb_plugin.models.weights import IGNORE, FusedWeights, load_checkpoint
from atb_plugin.multimodal.wire import PixelNormalization


class PretrainedModel(nn.Module):
    """Contract: subclasses turn config.json into their config (``config_from_hf``) and take it in
    ``__init__``. Weights load through ``weights.FusedWeights``: a subclass names the projections
    it stores fused (``stacked_params``) and maps checkpoint names to its own (``_own_name``:
    the name, ``weights.IGNORE`` for known unused tensors, None for unknown ones)."""

    stacked_params: dict[str, tuple[str, int]] = {}

    def _own_name(self, name: str) -> str | None:
        return name

    @functools.cached_property
    def _fused(self) -> FusedWeights:
        return FusedWeights(self, self.stacked_params)

    def checkpoint_own_name(self, name: str) -> str | None:
        """``_own_name``, extended to a quantized layer's tensors (``weight_scale``, ...:
        docs/quantization.md): they are renamed as that layer's weight is, whatever suffixes the
        family's own rules spell out."""
        layer, _, kind = name.rpartition(".")
        if kind not in QUANT_KINDS:
            return self._own_name(name)
        own = self._own_name(f"{layer}.weight")
        return own if own in (None, IGNORE) else f"{own.rpartition('.')[0]}.{kind}"

    def checkpoint_target(self, name: str, fused: FusedWeights | None = None):
        """What checkpoint tensor ``name`` fills (``FusedWeights.target`` of its own name, through
        ``fused``, by default the model's loader), or None for a tensor the model ignores or lacks."""
        own = self.checkpoint_own_name(name)
        if own in (None, IGNORE):
            return None
        return (self._fused if fused is None else fused).target(own)

    def accepts_weight(self, name: str) -> bool:
        return self._fused.accepts(self.checkpoint_own_name(name))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Fill parameters from ``(checkpoint name, tensor)`` pairs; returns the names filled."""
        return self._fused.load(weights, self.checkpoint_own_name)

    @classmethod
    def config_from_hf(cls, config: dict):
        raise NotImplementedError

    @classmethod
    def from_pretrained(cls, model_dir, dtype: torch.dtype = torch.float32, device=None,
                        quantization: str | None = None, quantize_lm_head: bool = False, *,
                        pack_weights: bool = False, share_lm_head: bool = False) -> "PretrainedModel":
        """The model, its linear layers each made, loaded and finished by its method
        (``models/linear.py``; docs/quantization.md): ``quantization``, an msModelSlim
        checkpoint's described layers (the flag may be None or must agree), or a float
        checkpoint's language-model projections quantized on the fly (w8a16 / w8a8), and its LM
        head with ``quantize_lm_head``; ``pack_weights``: CPU float layers packed for the CPU
        kernels (``ops.packed_linear``); ``share_lm_head``: a tied LM head gets a layer of its own
        (``share_tied_lm_head``: a generating engine's, so that it is packed too)."""
        hf_config = cls.config_from_hf(json.loads((Path(model_dir) / "config.json").read_text()))
        device = torch.device(device or "cpu")
        # Built on the meta device: no time spent initialising weights the checkpoint overwrites
        # (load_checkpoint refuses to leave any parameter unfilled).
        with torch.device("meta"):
            quant_config = quantization_config(lambda: cls(hf_config), model_dir, quantization, quantize_lm_head,
                                               pack_weights)
            with building(quant_config):
                model = cls(hf_config)
        quant_config.finish_building(model)
        model = model.to_empty(device=device).to(dtype)
        model.init_non_persistent(device)
        load_checkpoint(model, model_dir, dtype)
        model.read_checkpoint_files(Path(model_dir))
        if share_lm_head or quantize_lm_head:
            model.get_language_model().share_tied_lm_head()
        process_weights_after_loading(model, quant_config)
        return model.eval()

    def init_non_persistent(self, device) -> None:
        """Recompute state that is not in the checkpoint after ``to_empty`` (e.g. rotary tables)."""

    def read_checkpoint_files(self, model_dir: Path) -> None:
        """Read what the model needs from the checkpoint besides config.json and the weights
        (e.g. a VL model's pixel normalisation); nothing by default."""


class MultimodalModel(PretrainedModel):
    """A vision(-language) model whose text half is ``self.language_model`` (a
    ``decoder.DecoderForCausalLM``): the LM part of the model contract (``forward``,
    ``compute_logits``, ``make_kv_caches``, text embeddings) is delegated to it. A family adds its
    encoder, ``media_layout`` and ``get_multimodal_embeddings`` (``interfaces.SupportsMedia``),
    ``config_from_hf`` and the checkpoint's names (``_own_name``); one with M-RoPE also
    ``get_mrope_positions`` and ``decode_positions`` (``interfaces.SupportsMRoPE``).

    Pixels: a family declares ``pixel_format`` (``atb_plugin.multimodal.pixels``), and
    ``encoder_input`` turns a segment's array (either wire dtype) into the encoder's input with
    it. The normalisation is the checkpoint's ``preprocessor_config.json`` (read when the model is
    loaded, the same keys the input builder reads), the CLIP constants without one."""

    language_model: nn.Module
    pixel_normalization: PixelNormalization = PixelNormalization()

    def __init__(self, config, **modules: nn.Module):
        """``config``: the family's; ``modules``: its encoder(s), projector and ``language_model``
        (``decoder.build_language_model``) by name, registered in that order."""
        super().__init__()
        self.config = config
        for name, module in modules.items():
            self.add_module(name, module)

    def read_checkpoint_files(self, model_dir: Path) -> None:
        path = model_dir / "preprocessor_config.json"
        if path.is_file():
            self.pixel_normalization = PixelNormalization.from_preprocessor_config(json.loads(path.read_text()))

    @property
    def media_layouts(self) -> tuple:
        """Every block layout this model reads (``MultimodalPrompt.from_ids`` tells them apart by
        their metadata slots): its ``media_layout``, and a family with more kinds adds theirs
        (Qwen2-VL: the video block)."""
        return (self.media_layout,)

    @property
    def pixel_format(self):
        """The family's ``atb_plugin.multimodal.pixels.PixelFormat``."""
        raise NotImplementedError

    def encoder_input(self, pixels: torch.Tensor, grid_thw=None) -> torch.Tensor:
        """A block's segment array (on this model's device, as stored: uint8 image or float32
        values) -> the encoder's input in the model's dtype; ``PixelFormatError`` if it does not fit."""
        return self.pixel_format.encoder_input(pixels, grid_thw, next(self.parameters()).dtype)

    def get_language_model(self) -> nn.Module:
        return self.language_model

    def forward(self, input_ids, positions, kv_caches, attn_metadata, inputs_embeds=None):
        return self.language_model(input_ids, positions, kv_caches, attn_metadata, inputs_embeds=inputs_embeds)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.language_model.compute_logits(hidden)

    def make_kv_caches(self, num_blocks: int, block_size: int, dtype=None, device=None):
        return self.language_model.make_kv_caches(num_blocks, block_size, dtype=dtype, device=device)

    def get_input_embeddings(self, input_ids: torch.Tensor, mm_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """Text embeddings of ``input_ids``; with ``mm_embeds``, those rows replace the positions
        holding ``media_layout.placeholder_id``, in order (their counts must agree)."""
        embeds = self.language_model.get_input_embeddings(input_ids)
        if mm_embeds is None:
            return embeds
        placeholder = self.media_layout.placeholder_id
        mask = input_ids == placeholder
        count = int(mask.sum())
        if count != mm_embeds.shape[0]:
            raise ValueError(f"{count} image placeholder tokens (id {placeholder}) but "
                             f"{mm_embeds.shape[0]} image feature rows")
        return embeds.masked_scatter(mask.unsqueeze(-1), mm_embeds.to(embeds.dtype))
