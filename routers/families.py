"""One router per model family: what each checkpoint's config says its builder needs."""

from __future__ import annotations

import functools
from functools import cached_property

from atb_plugin.models.registry import config_value
from input_builders.llava import LlavaInputBuilder
from input_builders.preprocess import ClipPreprocessor, Qwen2VLPreprocessor, QwenVLPreprocessor
from input_builders.audio_features import WhisperFeatures
from input_builders.qwen2_audio import Qwen2AudioInputBuilder
from input_builders.qwen2_vl import Qwen2VlInputBuilder
from input_builders.qwen3_vl import Qwen3VlInputBuilder
from input_builders.video import Qwen3VideoSampling, VideoSampling
from input_builders.qwen_vl import QwenVlInputBuilder
from input_builders.text import BertInputBuilder, TextInputBuilder
from routers.base import BaseRouter, read_json
from routers.registry import register_router


@register_router("qwen2", "llama", "qwen3", "qwen3_moe", "qwen2_moe", "deepseek_v2", "deepseek_v3")
class TextRouter(BaseRouter):
    """Decoder-only text models: Qwen2 (dense and MoE), Qwen3 (dense and MoE) and Llama share
    everything the front end needs (Qwen3's thinking switch is its chat template's: ``chat_template_kwargs``)."""

    def make_input_builder(self):
        return TextInputBuilder(self.tokenizer, **self.builder_kwargs())


@register_router("qwen2_vl", "qwen2_5_vl")
class Qwen2VlRouter(BaseRouter):
    builder_cls = Qwen2VlInputBuilder

    def make_input_builder(self):
        preprocessor = self.make_preprocessor(Qwen2VLPreprocessor, self.preprocessor_config())
        return self.builder_cls(
            self.tokenizer,
            media_token_id=self.config_value("image_token_id"),
            video_token_id=config_value(self.raw_config, "video_token_id", None),  # None: no video
            vision_start_token_id=self.config_value("vision_start_token_id"),
            vision_end_token_id=self.config_value("vision_end_token_id"),
            preprocessor=preprocessor,
            video_sampling=self.video_sampling(preprocessor),
            **self.builder_kwargs(),
        )

    def video_sampling(self, preprocessor: Qwen2VLPreprocessor) -> VideoSampling | None:
        """None: the builder's default (qwen-vl-utils' rule with the checkpoint's patch sizes)."""
        return None


@register_router("qwen3_vl", "qwen3_vl_moe")
class Qwen3VlRouter(Qwen2VlRouter):
    """Qwen3-VL (dense and MoE): Qwen2-VL's images with 16-pixel patches; videos sampled as its
    ``video_preprocessor_config.json`` says, by transformers' Qwen3-VL rule."""

    builder_cls = Qwen3VlInputBuilder

    def video_sampling(self, preprocessor: Qwen2VLPreprocessor) -> VideoSampling:
        return Qwen3VideoSampling.from_config(read_json(self.model_dir / "video_preprocessor_config.json"),
                                              preprocessor.temporal_patch_size, preprocessor.factor)


@register_router("llava")
class LlavaRouter(BaseRouter):
    def make_input_builder(self):
        vision = self.config_value("vision_config")
        token_key = "image_token_index" if "image_token_index" in self.raw_config else "image_token_id"
        return LlavaInputBuilder(
            self.tokenizer,
            media_token_id=self.config_value(token_key),
            image_size=vision["image_size"],
            patch_size=vision["patch_size"],
            feature_select_strategy=self.raw_config.get("vision_feature_select_strategy", "default"),
            preprocessor=self.make_preprocessor(ClipPreprocessor, self.preprocessor_config()),
            **self.builder_kwargs(),
        )


@register_router("qwen2_audio")
class Qwen2AudioRouter(BaseRouter):
    """Qwen2-Audio: the checkpoint's chat template, Whisper features from its
    ``preprocessor_config.json``; audio always crosses as float32 features (``--mm-wire-dtype``
    is about images)."""

    def make_input_builder(self):
        return Qwen2AudioInputBuilder(
            self.tokenizer,
            audio_token_id=self.config_value("audio_token_index"),
            features=WhisperFeatures.from_config(self.preprocessor_config()),
            **self.builder_kwargs(),
        )


@register_router("qwen_vl")
class QwenVlRouter(BaseRouter):
    """Qwen-VL (``model_type: qwen`` + ``visual``): not in transformers, so its config is read
    as a plain ``PretrainedConfig`` and its prompt format is the builder's own."""

    @cached_property
    def config(self):
        return _qwen_config_class().from_dict(self.raw_config)

    @cached_property
    def eos_token_ids(self) -> list[int]:
        # The published generation_config stops only at <|endoftext|>; Qwen-VL's chat() also
        # stops at the ChatML turn markers, so a chat reply ends with its turn.
        markers = self.tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|im_start|>"])
        return super().eos_token_ids + [t for t in markers if isinstance(t, int) and t != self.tokenizer.unk_token_id]

    def make_input_builder(self):
        visual = self.config_value("visual")
        return QwenVlInputBuilder(
            self.tokenizer,
            image_start_id=visual["image_start_id"],
            preprocessor=self.make_preprocessor(QwenVLPreprocessor, visual),
            **self.builder_kwargs(),
        )


@functools.cache
def _qwen_config_class():
    from transformers import PretrainedConfig  # lazily: picking a router must stay cheap

    class QWenConfig(PretrainedConfig):
        model_type = "qwen"

    return QWenConfig


@register_router("bert")
class BertRouter(BaseRouter):
    def make_input_builder(self):
        return BertInputBuilder(self.tokenizer, **self.builder_kwargs())
