"""Model capabilities (``atb_plugin.models.interfaces``): each tiny family's model class has
exactly the protocols it should, checked with ``isinstance`` as the engine does."""

from __future__ import annotations

import functools
import json

import pytest
import torch

from atb_plugin.models.bert import BertModel
from atb_plugin.models.interfaces import SupportsMedia, SupportsMRoPE
from atb_plugin.models.llama import LlamaForCausalLM
from atb_plugin.models.llava import LlavaForConditionalGeneration
from atb_plugin.models.qwen2 import Qwen2ForCausalLM
from atb_plugin.models.qwen2_vl import Qwen2VLForConditionalGeneration
from atb_plugin.models.qwen_vl import QwenVLForCausalLM
from atb_plugin.multimodal import MediaLayout
from atb_plugin.testing.tiny import tiny_checkpoint

# family -> (model class, SupportsMedia, SupportsMRoPE)
EXPECTED = {
    "qwen2": (Qwen2ForCausalLM, False, False),
    "llama": (LlamaForCausalLM, False, False),
    "bert": (BertModel, False, False),
    "llava": (LlavaForConditionalGeneration, True, False),
    "qwen_vl": (QwenVLForCausalLM, True, False),
    "qwen2_vl": (Qwen2VLForConditionalGeneration, True, True),
    "qwen2_5_vl": (Qwen2VLForConditionalGeneration, True, True),
}


@functools.cache
def build(family: str):
    """The family's model built from its tiny checkpoint's config.json (meta tensors: the
    capabilities do not depend on the weights)."""
    cls = EXPECTED[family][0]
    raw = json.loads((tiny_checkpoint(family) / "config.json").read_text())
    with torch.device("meta"):
        return cls(cls.config_from_hf(raw))


@pytest.mark.parametrize("family", list(EXPECTED))
def test_each_family_has_exactly_its_capabilities(family):
    cls, media, mrope = EXPECTED[family]
    model = build(family)
    assert type(model) is cls
    assert isinstance(model, SupportsMedia) is media
    assert isinstance(model, SupportsMRoPE) is mrope
    if media:
        assert isinstance(model.media_layout, MediaLayout)


def test_loaded_model_keeps_its_capabilities():
    model = Qwen2VLForConditionalGeneration.from_pretrained(tiny_checkpoint("qwen2_vl"))
    assert isinstance(model, SupportsMedia) and isinstance(model, SupportsMRoPE)
    positions, delta = model.get_mrope_positions(torch.tensor([1, 2, 3]), [])
    assert torch.equal(positions, torch.arange(3).expand(3, -1)) and delta == 0
    assert torch.equal(model.decode_positions(3, 2, delta), torch.tensor([[3, 4]] * 3))


def test_every_member_is_needed():
    """A capability is all of its members: any one missing loses it."""

    class Media:
        media_layout = MediaLayout(placeholder_id=5, num_metadata_slots=2, tokens_per_block=4)
        media_layouts = (media_layout,)

        def encoder_input(self, pixels, grid_thw=None): ...

        def get_multimodal_embeddings(self, pixel_values, grid_thw=None): ...

        def get_input_embeddings(self, input_ids, mm_embeds=None): ...

        def get_processing_info(self, model_dir): ...

    class MRoPE:
        def get_mrope_positions(self, token_ids, grid_thws): ...

        def decode_positions(self, num_computed, num_new, rope_delta): ...

    assert isinstance(Media(), SupportsMedia) and not isinstance(Media(), SupportsMRoPE)
    assert isinstance(MRoPE(), SupportsMRoPE) and not isinstance(MRoPE(), SupportsMedia)
    for member in ("media_layout", "media_layouts", "encoder_input", "get_multimodal_embeddings", "get_input_embeddings",
                   "get_processing_info"):
        partial = type("Partial", (), {k: v for k, v in vars(Media).items() if k != member})
        assert not isinstance(partial(), SupportsMedia), member
    for member in ("get_mrope_positions", "decode_positions"):
        partial = type("Partial", (), {k: v for k, v in vars(MRoPE).items() if k != member})
        assert not isinstance(partial(), SupportsMRoPE), member


def test_qwen2_vl_is_a_multimodal_model_like_the_other_vl_families():
    """One multimodal base: the LM half is ``language_model``, the KV caches are its."""
    from atb_plugin.models.base import MultimodalModel
    from atb_plugin.models.decoder import DecoderForCausalLM

    for family in ("llava", "qwen_vl", "qwen2_vl", "qwen2_5_vl"):
        model = build(family)
        assert isinstance(model, MultimodalModel) and not isinstance(model, DecoderForCausalLM), family
        assert type(model.get_language_model()) is DecoderForCausalLM
    model = build("qwen2_vl")
    assert model.model is model.language_model.model and model.lm_head is model.language_model.lm_head
    assert "make_kv_caches" not in vars(Qwen2VLForConditionalGeneration)
    text = model.config.text
    caches = model.make_kv_caches(3, 4, dtype=torch.float16, device="cpu")
    assert len(caches) == text.num_hidden_layers
    assert all(k.shape == v.shape == (3, 4, text.num_key_value_heads, text.head_dim) and k.dtype == torch.float16
               for k, v in caches)


def test_pooling_capabilities_of_native_and_adapted_classes():
    from atb_plugin.models.bert import BertEmbeddingModel, BertForSequenceClassification
    from atb_plugin.models.interfaces import SupportsPooling, SupportsTokenTypes
    from atb_plugin.models.qwen2 import Qwen2ForRewardModel
    from atb_plugin.models.pooling_adapters import as_pooling_model

    for cls in (BertEmbeddingModel, BertForSequenceClassification, Qwen2ForRewardModel):
        assert issubclass(cls, SupportsPooling) and as_pooling_model(cls, "embed", {}) is cls  # used as they are
    for cls in (Qwen2ForCausalLM, LlamaForCausalLM, BertModel, Qwen2VLForConditionalGeneration):
        assert not issubclass(cls, SupportsPooling)
    assert issubclass(BertForSequenceClassification, SupportsTokenTypes) and not issubclass(Qwen2ForCausalLM,
                                                                                            SupportsTokenTypes)
    adapted = as_pooling_model(Qwen2ForCausalLM, "classify", {"num_labels": 3})
    assert issubclass(adapted, SupportsPooling) and issubclass(adapted, Qwen2ForCausalLM)
    assert adapted.__name__ == "Qwen2ForCausalLMForClassification"
