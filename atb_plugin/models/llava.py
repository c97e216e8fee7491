"""LLaVA-1.5 (llava-hf/llava-1.5-*-hf): CLIP vision tower -> 2-layer projector -> Llama decoder.

Image features: the tower's ``hidden_states[vision_feature_layer]`` (-2 for LLaVA-1.5: the output
of the second-to-last layer; a list of layers concatenates along the channels), without the CLS
row for ``vision_feature_select_strategy == "default"`` or with it for ``"full"``, then
``linear_2(act(linear_1(x)))``. One image gives ``num_patches (+1 for "full")`` rows, which replace
its block of ``image_token_index`` slots in the prompt (docs/wire-format.md: the first two slots carry
the NAME / SHAPE handles of the ``[1, 3, H, W]`` pixel values).

Parameters (the model's own names)::

    vision_tower.*            CLIPVisionModel (clip.py; q/k/v fused into qkv_proj)
    multi_modal_projector.*   linear_1, linear_2
    language_model.*          DecoderForCausalLM (decoder.py; qkv_proj, gate_up_proj fused)

Checkpoint names accepted, published llava-hf layout and transformers 5's::

    vision_tower.vision_model.X        | model.vision_tower.X          -> vision_tower.X
    multi_modal_projector.X            | model.multi_modal_projector.X -> multi_modal_projector.X
    language_model.model.X             | model.language_model.X        -> language_model.model.X
    language_model.lm_head.X           | lm_head.X                     -> language_model.lm_head.X
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType

import torch
from torch import nn

from atb_plugin.models.base import MultimodalModel
from atb_plugin.models.clip import CLIPVisionConfig, CLIPVisionModel, activation
from atb_plugin.models.decoder import DecoderConfig, build_language_model
from atb_plugin.models.interfaces import MultimodalProcessingInfo
from atb_plugin.models.weights import PROJECTOR_AND_LANGUAGE_MODEL_PREFIXES, STACKED_QKV_GATE_UP, prefixed_name
from atb_plugin.multimodal.pixels import ChwImageFormat
from atb_plugin.multimodal.wire import LLAVA_BLOCK

# transformers' LlamaConfig defaults: llava-hf's published text_config lists only what differs
# from them (llava-1.5-7b-hf gives no hidden_size, no num_hidden_layers ...).
_LLAMA_DEFAULTS = {
    "vocab_size": 32000,
    "hidden_size": 4096,
    "intermediate_size": 11008,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
}
_TEXT_MODEL_TYPES = {"llama": False, "qwen2": True}  # model_type -> q/k/v biases without a config flag

# checkpoint prefix -> the model's own prefix (first match wins; longer prefixes first)
_PREFIXES = (
    ("vision_tower.vision_model.", "vision_tower."),
    ("model.vision_tower.", "vision_tower."),
    *PROJECTOR_AND_LANGUAGE_MODEL_PREFIXES,
)


@dataclass(frozen=True)
class LlavaConfig:
    text: DecoderConfig
    vision: CLIPVisionConfig
    image_token_id: int
    vision_feature_layer: int | tuple[int, ...] = -2
    vision_feature_select_strategy: str = "default"
    projector_hidden_act: str = "gelu"
    projector_bias: bool = True

    def __post_init__(self):
        if self.vision_feature_select_strategy not in ("default", "full"):
            raise ValueError(f"vision_feature_select_strategy {self.vision_feature_select_strategy!r}: "
                             "expected 'default' or 'full'")
        activation(self.projector_hidden_act)

    @property
    def feature_layers(self) -> tuple[int, ...]:
        layer = self.vision_feature_layer
        return (layer,) if isinstance(layer, int) else tuple(layer)

    @property
    def tokens_per_image(self) -> int:
        return self.vision.num_patches + (self.vision_feature_select_strategy == "full")

    @classmethod
    def from_hf(cls, raw: dict) -> "LlavaConfig":
        text_raw = dict(raw.get("text_config") or {})
        model_type = text_raw.get("model_type", "llama")
        if model_type not in _TEXT_MODEL_TYPES:
            raise ValueError(f"LLaVA text model {model_type!r} is not supported ({', '.join(_TEXT_MODEL_TYPES)})")
        if model_type == "llama":
            text_raw = {**_LLAMA_DEFAULTS, **text_raw}
        token_key = "image_token_index" if "image_token_index" in raw else "image_token_id"
        layer = raw.get("vision_feature_layer", -2)
        return cls(
            text=DecoderConfig.from_hf(text_raw, qkv_bias=_TEXT_MODEL_TYPES[model_type]),
            vision=CLIPVisionConfig.from_hf(raw.get("vision_config") or {}),
            image_token_id=raw.get(token_key, 32000),
            vision_feature_layer=layer if isinstance(layer, int) else tuple(layer),
            vision_feature_select_strategy=raw.get("vision_feature_select_strategy", "default"),
            projector_hidden_act=raw.get("projector_hidden_act", "gelu"),
            projector_bias=raw.get("multimodal_projector_bias", True),
        )


class LlavaMultiModalProjector(nn.Module):
    def __init__(self, config: LlavaConfig):
        super().__init__()
        width = config.vision.hidden_size * len(config.feature_layers)
        self.linear_1 = nn.Linear(width, config.text.hidden_size, bias=config.projector_bias)
        self.act = activation(config.projector_hidden_act)
        self.linear_2 = nn.Linear(config.text.hidden_size, config.text.hidden_size, bias=config.projector_bias)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(features)))


class LlavaForConditionalGeneration(MultimodalModel):
    def __init__(self, config: LlavaConfig):
        super().__init__(config, vision_tower=CLIPVisionModel(config.vision),
                         multi_modal_projector=LlavaMultiModalProjector(config),
                         language_model=build_language_model(config.text))
        self._feature_indices = [self.vision_tower.layer_index(layer) for layer in config.feature_layers]

    @classmethod
    def config_from_hf(cls, config: dict) -> LlavaConfig:
        return LlavaConfig.from_hf(config)

    @property
    def media_layout(self):
        from atb_plugin.multimodal import MediaLayout

        return MediaLayout(placeholder_id=self.config.image_token_id, num_metadata_slots=LLAVA_BLOCK.metadata_slots,
                           tokens_per_block=self.config.tokens_per_image, merge_size=1)

    # Images one prompt may carry: the input builder's limit and the most EngineConfig's
    # limit_mm_per_prompt may be (one declaration, read by both).
    supported_mm_limits = MappingProxyType({"image": 4})

    def get_processing_info(self, model_dir) -> MultimodalProcessingInfo:
        """Every image is cropped to ``image_size`` square: one size, a fixed feature count
        (``model_dir`` is unused: nothing in the preprocessor config changes it)."""
        side = self.config.vision.image_size
        return MultimodalProcessingInfo(
            modality="image", max_items_per_prompt=self.supported_mm_limits["image"],
            max_tokens_per_item=self.config.tokens_per_image, max_item_size=(side, side),
            pixel_shape=(1, self.config.vision.num_channels, side, side))

    @property
    def pixel_format(self) -> ChwImageFormat:
        side = self.config.vision.image_size
        return ChwImageFormat(self.pixel_normalization, side, side)

    # -- vision ----------------------------------------------------------------------------------

    def get_image_features(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """``(B, 3, H, W)`` -> ``(B, tokens_per_image, text hidden)``."""
        states = self.vision_tower(pixel_values, up_to=max(self._feature_indices))
        selected = [states[index] for index in self._feature_indices]
        if self.config.vision_feature_select_strategy == "default":
            selected = [state[:, 1:] for state in selected]  # drop CLS
        return self.multi_modal_projector(torch.cat(selected, dim=-1))

    def get_multimodal_embeddings(self, pixel_values: torch.Tensor, grid_thw=None) -> torch.Tensor:
        """The rows for ONE image's block: ``[1, 3, H, W]`` (or ``[3, H, W]``) -> ``(tokens, hidden)``."""
        if grid_thw is not None:
            raise ValueError("LLaVA images have no grid_thw")
        if pixel_values.dim() == 3:
            pixel_values = pixel_values.unsqueeze(0)
        if pixel_values.dim() != 4 or pixel_values.shape[0] != 1:
            raise ValueError(f"one image's pixel values [1, 3, H, W] expected, got {list(pixel_values.shape)}")
        return self.get_image_features(pixel_values)[0]

    # -- weights ---------------------------------------------------------------------------------

    stacked_params = STACKED_QKV_GATE_UP

    def _own_name(self, name: str) -> str | None:
        """The model's name for a checkpoint tensor, ``IGNORE`` for known unused ones, else None."""
        return prefixed_name(name, _PREFIXES, tied_lm_head=self.language_model.lm_head is None)
