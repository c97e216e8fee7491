"""Tests for ``atb_plugin/testing/tiny.py``: the tiny checkpoints every other test builds on.

What must hold for each family, checked against transformers 5.23 itself where it implements the
family (all but Qwen-VL):

- the directory loads with AutoConfig / AutoTokenizer / the family's model class, no missing or
  unexpected keys, and the model runs (finite logits, with an image for the VL families);
- the special tokens are single tokens whose ids are the ones config.json names where the
  published config names them;
- the chat template renders the published layout (literal expected strings below) and one
  start/pad/end run per image;
- the image processors load from preprocessor_config.json and agree with the config;
- Qwen-VL's weights carry the published names and shapes (literal list below);
- bytes are a function of (family, seed); the CLI works.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from PIL import Image
from safetensors import safe_open

from atb_plugin.testing import tiny
from atb_plugin.testing.tiny import FAMILIES, make_tiny_checkpoint, qwen_vl_weight_shapes, tiny_checkpoint

REPO = Path(__file__).resolve().parents[1]

HF_FAMILIES = ["qwen2", "llama", "qwen2_vl", "qwen2_5_vl", "llava", "qwen2_audio", "bert", "qwen3", "qwen3_moe", "qwen2_moe"]
HF_FAMILIES += ["qwen3_vl", "qwen3_vl_moe"]
MODEL_CLASS = {
    "qwen2": "Qwen2ForCausalLM",
    "llama": "LlamaForCausalLM",
    "qwen2_vl": "Qwen2VLForConditionalGeneration",
    "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
    "llava": "LlavaForConditionalGeneration",
    "qwen2_audio": "Qwen2AudioForConditionalGeneration",
    "bert": "BertModel",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_vl": "Qwen3VLForConditionalGeneration",
    "qwen3_vl_moe": "Qwen3VLMoeForConditionalGeneration",
}
VL_TRANSFORMERS = ["qwen2_vl", "qwen2_5_vl", "llava"]

CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi there"},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": "Bye"},
]


@functools.lru_cache(maxsize=None)
def _config(family: str) -> dict:
    return json.loads((tiny_checkpoint(family) / "config.json").read_text())


@functools.lru_cache(maxsize=None)
def _tokenizer(family: str):
    if family == "qwen_vl":
        # AutoTokenizer works too (test_files_and_vocab_size) but warns that transformers has no
        # `qwen` config class; the tokenizer class itself loads quietly.
        return transformers.PreTrainedTokenizerFast.from_pretrained(tiny_checkpoint(family))
    return transformers.AutoTokenizer.from_pretrained(tiny_checkpoint(family))


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _chat_ids(tokenizer, conversation, **kw) -> list[int]:
    out = tokenizer.apply_chat_template(conversation, tokenize=True, **kw)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


# ---------------------------------------------------------------------------------------------
# Files, configs, loading
# ---------------------------------------------------------------------------------------------

EXPECTED_FILES = {
    "qwen2": {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
              "chat_template.jinja", "model.safetensors"},
    "llama": {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
              "chat_template.jinja", "model.safetensors"},
    "qwen_vl": {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                "chat_template.jinja", "model.safetensors"},
    "qwen2_vl": {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                 "chat_template.jinja", "preprocessor_config.json", "model.safetensors"},
    "qwen2_5_vl": {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                   "chat_template.jinja", "preprocessor_config.json", "model.safetensors"},
    "llava": {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
              "chat_template.jinja", "preprocessor_config.json", "processor_config.json", "model.safetensors"},
    "qwen2_audio": {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                    "chat_template.jinja", "preprocessor_config.json", "model.safetensors"},
    "bert": {"config.json", "tokenizer.json", "tokenizer_config.json", "vocab.txt", "model.safetensors",
             "modules.json", "sentence_bert_config.json", "1_Pooling/config.json"},
}
# Pooling variants: a family's files with another head.
POOLING_VARIANTS = {"qwen2_seq_cls": "qwen2", "qwen2_reward": "qwen2", "bert_cross_encoder": "bert"}
EXPECTED_FILES["qwen2_seq_cls"] = EXPECTED_FILES["qwen2_reward"] = EXPECTED_FILES["qwen2"]
# Template variants: a family's files with another chat template (and vocabulary additions).
TEMPLATE_VARIANTS = {"qwen2_5": "qwen2"}
EXPECTED_FILES["qwen2_5"] = EXPECTED_FILES["qwen2"]
EXPECTED_FILES["qwen3"] = EXPECTED_FILES["qwen3_moe"] = EXPECTED_FILES["qwen2_moe"] = EXPECTED_FILES["qwen2"]
EXPECTED_FILES["qwen3_vl"] = EXPECTED_FILES["qwen3_vl_moe"] = {
    *EXPECTED_FILES["qwen2_vl"], "video_preprocessor_config.json"}
EXPECTED_FILES["bert_cross_encoder"] = {"config.json", "tokenizer.json", "tokenizer_config.json", "vocab.txt",
                                        "model.safetensors"}


# DeepSeek-V2-Lite-like and V3-like (tests/test_models_deepseek.py checks them against transformers; the
# V3-like one carries its MTP layer, which transformers reports as unexpected keys, hence not in HF_FAMILIES).
DEEPSEEK_FAMILIES = ["deepseek_v2_lite", "deepseek_v3"]
for _family in DEEPSEEK_FAMILIES:
    EXPECTED_FILES[_family] = EXPECTED_FILES["qwen2"]


def test_registry_lists_the_seven_families_and_the_pooling_variants():
    assert set(FAMILIES) == set(EXPECTED_FILES) == {*HF_FAMILIES, "qwen_vl", *POOLING_VARIANTS, *TEMPLATE_VARIANTS,
                                                    *DEEPSEEK_FAMILIES}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_files_and_vocab_size(family):
    path = tiny_checkpoint(family)
    files = {p.relative_to(path).as_posix() for p in path.rglob("*") if p.is_file()}
    assert files == EXPECTED_FILES[family]
    with safe_open(path / "model.safetensors", "pt") as f:
        assert f.metadata() == {"format": "pt"}
    config = _config(family)
    # vocab_size is the tokenizer's size (for LLaVA also the text config's).
    assert config["vocab_size"] == len(transformers.AutoTokenizer.from_pretrained(path)) == len(_tokenizer(family))
    if family == "llava":
        assert config["text_config"]["vocab_size"] == config["vocab_size"]


@pytest.mark.parametrize("family", HF_FAMILIES)
def test_transformers_loads_without_missing_or_unexpected_keys(family):
    path = tiny_checkpoint(family)
    config = transformers.AutoConfig.from_pretrained(path)
    assert config.model_type == family
    model, info = getattr(transformers, MODEL_CLASS[family]).from_pretrained(path, output_loading_info=True)
    assert info == {"missing_keys": set(), "unexpected_keys": set(), "mismatched_keys": set(), "error_msgs": []}
    # Seeded weights everywhere: no norm scale left at 1 and no bias left at 0.
    for name, param in model.named_parameters():
        if param.ndim == 1 and name.endswith("bias"):
            assert param.abs().max() > 0, name
        if param.ndim == 1 and "norm" in name.lower() and name.endswith("weight"):
            assert (param != 1).any(), name


def test_structural_choices_reach_transformers():
    """The features that make each tiny model structurally real, as transformers reads them."""
    load = transformers.AutoConfig.from_pretrained
    qwen2 = load(tiny_checkpoint("qwen2"))
    assert qwen2.tie_word_embeddings and (qwen2.num_attention_heads, qwen2.num_key_value_heads) == (4, 2)
    with safe_open(tiny_checkpoint("qwen2") / "model.safetensors", "pt") as f:
        assert "lm_head.weight" not in f.keys()  # tied, as published
        assert "model.layers.0.self_attn.q_proj.bias" in f.keys()

    llama = load(tiny_checkpoint("llama"))
    assert not llama.tie_word_embeddings and (llama.num_attention_heads, llama.num_key_value_heads) == (4, 2)
    assert llama.rope_parameters["rope_type"] == "llama3"
    assert _config("llama")["rope_scaling"]["rope_type"] == "llama3"

    for family in ("qwen2_vl", "qwen2_5_vl"):
        config = load(tiny_checkpoint(family))
        # Published layout: flat config with rope_scaling {"type": "mrope", "mrope_section": ...};
        # transformers 5.23 keeps mrope_section in text_config.rope_parameters.
        assert _config(family)["rope_scaling"] == {"type": "mrope", "mrope_section": [2, 3, 3]}
        assert config.text_config.rope_parameters["mrope_section"] == [2, 3, 3]
        head_dim = config.text_config.hidden_size // config.text_config.num_attention_heads
        assert sum(config.text_config.rope_parameters["mrope_section"]) == head_dim // 2
        vision = config.vision_config
        assert (vision.patch_size, vision.temporal_patch_size, vision.spatial_merge_size, vision.in_channels) == (
            14, 2, 2, 3)
    qwen25 = load(tiny_checkpoint("qwen2_5_vl")).vision_config
    assert qwen25.window_size == 112 and list(qwen25.fullatt_block_indexes) == [1, 3] and qwen25.depth == 4

    llava = load(tiny_checkpoint("llava"))
    assert llava.vision_feature_layer == -2 and llava.vision_feature_select_strategy == "default"
    assert (llava.vision_config.image_size // llava.vision_config.patch_size) ** 2 == 16 == llava.image_seq_length
    with safe_open(tiny_checkpoint("llava") / "model.safetensors", "pt") as f:
        keys = set(f.keys())
    # llava-hf's published names.
    assert {"language_model.model.embed_tokens.weight", "language_model.lm_head.weight",
            "multi_modal_projector.linear_1.weight", "multi_modal_projector.linear_2.bias",
            "vision_tower.vision_model.embeddings.patch_embedding.weight",
            "vision_tower.vision_model.encoder.layers.1.self_attn.q_proj.weight"} <= keys

    with safe_open(tiny_checkpoint("bert") / "model.safetensors", "pt") as f:
        keys = set(f.keys())
        assert f.get_tensor("embeddings.position_ids").tolist() == [list(range(512))]
    # all-MiniLM-L6-v2's names: no "bert." prefix, pooler present, legacy position_ids buffer.
    assert {"embeddings.word_embeddings.weight", "encoder.layer.1.attention.self.query.weight",
            "encoder.layer.0.output.LayerNorm.bias", "pooler.dense.weight"} <= keys


# ---------------------------------------------------------------------------------------------
# Tokenizers and special tokens
# ---------------------------------------------------------------------------------------------

# family -> [(token, where its id must appear in config.json as a function of the dict, or None)]
NAMED_IDS = {
    "qwen2": [("<|endoftext|>", lambda c: c["bos_token_id"]), ("<|endoftext|>", lambda c: c["pad_token_id"]),
              ("<|im_end|>", lambda c: c["eos_token_id"]), ("<|im_start|>", None)],
    "llama": [("<|begin_of_text|>", lambda c: c["bos_token_id"]), ("<|eot_id|>", lambda c: c["eos_token_id"][2]),
              ("<|end_of_text|>", lambda c: c["eos_token_id"][0]), ("<|eom_id|>", lambda c: c["eos_token_id"][1]),
              ("<|finetune_right_pad_id|>", lambda c: c["pad_token_id"]),
              ("<|start_header_id|>", None), ("<|end_header_id|>", None)],
    "qwen_vl": [("<img>", lambda c: c["visual"]["image_start_id"]),
                ("</img>", lambda c: c["visual"]["image_start_id"] + 1),
                ("<imgpad>", lambda c: c["visual"]["image_start_id"] + 2),
                ("<|im_start|>", None), ("<|im_end|>", None), ("<|endoftext|>", None)],
    "qwen2_vl": [("<|vision_start|>", lambda c: c["vision_start_token_id"]),
                 ("<|vision_end|>", lambda c: c["vision_end_token_id"]),
                 ("<|vision_pad|>", lambda c: c["vision_token_id"]),
                 ("<|image_pad|>", lambda c: c["image_token_id"]),
                 ("<|video_pad|>", lambda c: c["video_token_id"]),
                 ("<|endoftext|>", lambda c: c["bos_token_id"]), ("<|im_end|>", lambda c: c["eos_token_id"]),
                 ("<|endoftext|>", lambda c: c["pad_token_id"]), ("<|im_start|>", None)],
    "llava": [("<image>", lambda c: c["image_token_index"]), ("<pad>", lambda c: c["pad_token_id"]),
              ("<s>", lambda c: c["text_config"]["bos_token_id"]), ("</s>", lambda c: c["text_config"]["eos_token_id"]),
              ("<unk>", None)],
    "qwen2_audio": [("<|AUDIO|>", lambda c: c["audio_token_index"]), ("<|audio_bos|>", None),
                    ("<|audio_eos|>", None), ("<|endoftext|>", lambda c: c["text_config"]["bos_token_id"]),
                    ("<|im_end|>", lambda c: c["text_config"]["eos_token_id"]), ("<|im_start|>", None)],
    "bert": [("[PAD]", lambda c: c["pad_token_id"]), ("[UNK]", None), ("[CLS]", None), ("[SEP]", None),
             ("[MASK]", None)],
}
NAMED_IDS["qwen2_5_vl"] = NAMED_IDS["qwen2_vl"]
NAMED_IDS["qwen3"] = NAMED_IDS["qwen3_moe"] = NAMED_IDS["qwen2"] + [("<think>", None), ("</think>", None)]
NAMED_IDS["qwen2_moe"] = NAMED_IDS["qwen2"]
NAMED_IDS["qwen3_vl"] = NAMED_IDS["qwen3_vl_moe"] = [
    ("<|vision_start|>", lambda c: c["vision_start_token_id"]), ("<|vision_end|>", lambda c: c["vision_end_token_id"]),
    ("<|image_pad|>", lambda c: c["image_token_id"]), ("<|video_pad|>", lambda c: c["video_token_id"]),
    ("<|endoftext|>", lambda c: c["text_config"]["bos_token_id"]),
    ("<|im_end|>", lambda c: c["text_config"]["eos_token_id"]), ("<|im_start|>", None), ("<think>", None)]
NAMED_IDS["deepseek_v2_lite"] = NAMED_IDS["deepseek_v3"] = [
    ("<｜begin▁of▁sentence｜>", lambda c: c["bos_token_id"]), ("<｜end▁of▁sentence｜>", lambda c: c["eos_token_id"]),
    ("<｜▁pad▁｜>", None), ("<｜User｜>", None), ("<｜Assistant｜>", None)]
for _variant, _family in {**POOLING_VARIANTS, **TEMPLATE_VARIANTS}.items():
    NAMED_IDS[_variant] = NAMED_IDS[_family]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_special_tokens_are_single_tokens_with_the_configured_ids(family):
    tokenizer, config = _tokenizer(family), _config(family)
    for token, where in NAMED_IDS[family]:
        token_id = tokenizer.convert_tokens_to_ids(token)
        assert token_id != tokenizer.unk_token_id or token in ("[UNK]", "<unk>"), token
        assert _ids(tokenizer, token) == [token_id], token
        in_text = _ids(tokenizer, f"ab{token}cd")  # never split, nor merged with its neighbours
        assert in_text.count(token_id) == 1, token
        decoded = tokenizer.decode(in_text)
        if POOLING_VARIANTS.get(family, family) == "bert":
            decoded = decoded.replace(" ", "")  # WordPiece decoding puts spaces around special tokens
        assert decoded == f"ab{token}cd", token
        if where is not None:
            assert where(config) == token_id, token


def test_fixed_special_token_layouts():
    """Ids that follow the published vocabularies' layout."""
    bert = _tokenizer("bert")
    assert [bert.convert_tokens_to_ids(t) for t in ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]] == [0, 100, 101, 102, 103]
    llava = _tokenizer("llava")
    assert [llava.convert_tokens_to_ids(t) for t in ["<unk>", "<s>", "</s>"]] == [0, 1, 2]
    assert llava.convert_tokens_to_ids("<image>") == len(llava) - 2  # like 32000 of 32002
    qwen = _tokenizer("qwen2")
    assert qwen.convert_tokens_to_ids("<|im_end|>") == len(qwen) - 1
    assert _config("llava")["image_token_index"] == transformers.AutoConfig.from_pretrained(
        tiny_checkpoint("llava")).image_token_id


def test_bos_and_post_processing():
    assert _tokenizer("llama")("hi")["input_ids"][0] == _config("llama")["bos_token_id"]
    assert _tokenizer("llava")("hi")["input_ids"][0] == _config("llava")["text_config"]["bos_token_id"]
    assert _tokenizer("qwen2")("hi")["input_ids"] == _ids(_tokenizer("qwen2"), "hi")  # Qwen adds no BOS
    bert = _tokenizer("bert")
    ids = bert("Hello, world")["input_ids"]
    assert ids[0] == bert.cls_token_id == 101 and ids[-1] == bert.sep_token_id == 102
    assert bert.decode(ids, skip_special_tokens=True) == "hello, world"
    for family in ("qwen2", "llama", "qwen_vl"):
        text = "The weather in the mountains changes quickly, 3.14!"
        tokenizer = _tokenizer(family)
        assert tokenizer.decode(_ids(tokenizer, text)) == text


# ---------------------------------------------------------------------------------------------
# Chat templates
# ---------------------------------------------------------------------------------------------

QWEN_CHATML_EXPECTED = (
    "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n"
    "<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\nBye<|im_end|>\n<|im_start|>assistant\n"
)
EXPECTED_CHAT = {
    "qwen2": QWEN_CHATML_EXPECTED,
    "qwen2_vl": QWEN_CHATML_EXPECTED,
    "qwen2_5_vl": QWEN_CHATML_EXPECTED,
    "qwen_vl": QWEN_CHATML_EXPECTED,
    "llama": (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nHi there<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\nHello!<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nBye<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    ),
    "llava": "<s>Be brief. USER: Hi there ASSISTANT: Hello!</s>USER: Bye ASSISTANT:",
}
EXPECTED_NO_SYSTEM = {
    "qwen2": "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n"
             "<|im_start|>assistant\n",
    "llama": "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi there<|eot_id|>"
             "<|start_header_id|>assistant<|end_header_id|>\n\n",
    "llava": "<s>A chat between a curious human and an artificial intelligence assistant. The assistant gives "
             "helpful, detailed, and polite answers to the human's questions. USER: Hi there ASSISTANT:",
}
for _family in ("qwen2_vl", "qwen2_5_vl", "qwen_vl"):
    EXPECTED_NO_SYSTEM[_family] = EXPECTED_NO_SYSTEM["qwen2"]


@pytest.mark.parametrize("family", sorted(EXPECTED_CHAT))
def test_chat_template_renders_the_published_layout(family):
    tokenizer = _tokenizer(family)
    text = tokenizer.apply_chat_template(CONVERSATION, tokenize=False, add_generation_prompt=True)
    assert text == EXPECTED_CHAT[family]
    no_system = tokenizer.apply_chat_template(CONVERSATION[1:2], tokenize=False, add_generation_prompt=True)
    assert no_system == EXPECTED_NO_SYSTEM[family]
    # List-of-parts content renders like the string form.
    parts = [{**m, "content": [{"type": "text", "text": m["content"]}]} for m in CONVERSATION]
    assert tokenizer.apply_chat_template(parts, tokenize=False, add_generation_prompt=True) == text
    # Tokenised, every special token of the layout is one id (the template carries BOS itself).
    ids = _chat_ids(tokenizer, CONVERSATION, add_generation_prompt=True)
    assert ids == _ids(tokenizer, text)


def test_bert_has_no_chat_template():
    assert _tokenizer("bert").chat_template is None


# Three spellings of an image part, one per image.
IMAGE_PARTS = [{"type": "image"}, {"type": "image_url", "image_url": {"url": "file:///a.png"}}, {"image": "/b.png"}]
# family -> (start, pad or None, end) token strings of one image block as the template writes it
IMAGE_BLOCK = {
    "qwen2_vl": ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>"),
    "qwen2_5_vl": ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>"),
    "qwen_vl": ("<img>", None, "</img>"),
    "llava": (None, "<image>", None),
}


@pytest.mark.parametrize("n_images", [1, 3])
@pytest.mark.parametrize("family", sorted(IMAGE_BLOCK))
def test_chat_template_writes_one_block_per_image(family, n_images):
    tokenizer = _tokenizer(family)
    conversation = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [*IMAGE_PARTS[:n_images], {"type": "text", "text": "What is this?"}]},
        {"role": "assistant", "content": "An apple."},
        {"role": "user", "content": "Thanks"},
    ]
    ids = _chat_ids(tokenizer, conversation, add_generation_prompt=True)
    block = [tokenizer.convert_tokens_to_ids(t) for t in IMAGE_BLOCK[family] if t is not None]
    runs = [i for i in range(len(ids)) if ids[i:i + len(block)] == block]
    assert len(runs) == n_images
    for token in IMAGE_BLOCK[family]:
        if token is not None:
            assert ids.count(tokenizer.convert_tokens_to_ids(token)) == n_images, token
    text = tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    if family == "qwen_vl":
        assert "Picture 1: <img></img>\n" in text and (f"Picture {n_images}: <img></img>\n" in text)
    if family == "llava":
        assert ("USER: " + "<image>\n" * n_images + "What is this? ASSISTANT: An apple.</s>") in text


def test_qwen2_vl_template_videos_and_vision_ids():
    tokenizer = _tokenizer("qwen2_vl")
    conversation = [{"role": "user", "content": [{"type": "image"}, {"type": "video"}, {"type": "image"},
                                                 {"type": "text", "text": "Compare."}]}]
    text = tokenizer.apply_chat_template(conversation, tokenize=False, add_vision_id=True)
    assert text.endswith(
        "<|im_start|>user\nPicture 1: <|vision_start|><|image_pad|><|vision_end|>"
        "Video 1: <|vision_start|><|video_pad|><|vision_end|>"
        "Picture 2: <|vision_start|><|image_pad|><|vision_end|>Compare.<|im_end|>\n"
    )


# ---------------------------------------------------------------------------------------------
# Image processors and forward passes
# ---------------------------------------------------------------------------------------------

def _image(width: int, height: int) -> Image.Image:
    g = torch.Generator().manual_seed(width * 1000 + height)
    pixels = torch.randint(0, 256, (height, width, 3), generator=g, dtype=torch.uint8)
    return Image.fromarray(pixels.numpy())


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl"])
def test_qwen2_vl_image_processor_matches_config(family):
    path = tiny_checkpoint(family)
    processor = transformers.AutoImageProcessor.from_pretrained(path)
    assert type(processor).__name__ == "Qwen2VLImageProcessorPil"
    assert processor.size["shortest_edge"] == tiny.QWEN2_VL_MIN_PIXELS == 56 * 56
    assert processor.size["longest_edge"] == tiny.QWEN2_VL_MAX_PIXELS == 28 * 28 * 64 * 4
    vision = transformers.AutoConfig.from_pretrained(path).vision_config
    width = 3 * vision.temporal_patch_size * vision.patch_size**2
    # 150x100 -> smart_resize to 140x112 -> a 1 x 8 x 10 patch grid of 1176 values each
    out = processor(images=[_image(150, 100)], return_tensors="pt")
    assert out["image_grid_thw"].tolist() == [[1, 8, 10]]
    assert tuple(out["pixel_values"].shape) == (80, width) == (80, 1176)
    # A large image is capped by max_pixels: 1000x1000 -> 448x448 -> 32 x 32 patches
    out = processor(images=[_image(1000, 1000)], return_tensors="pt")
    assert out["image_grid_thw"].tolist() == [[1, 32, 32]]


def test_llava_image_processor_and_processor():
    path = tiny_checkpoint("llava")
    image_processor = transformers.AutoImageProcessor.from_pretrained(path)
    assert type(image_processor).__name__ == "CLIPImageProcessorPil"
    out = image_processor(images=[_image(90, 70)], return_tensors="pt")
    assert tuple(out["pixel_values"].shape) == (1, 3, 56, 56)
    processor = transformers.AutoProcessor.from_pretrained(path)
    prompt = processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this?"}]}],
        add_generation_prompt=True, tokenize=False)
    ids = processor(images=[_image(90, 70)], text=[prompt], return_tensors="pt")["input_ids"][0].tolist()
    assert ids.count(_config("llava")["image_token_index"]) == tiny.LLAVA_IMAGE_TOKENS == 16


def _qwen2_vl_inputs(family: str):
    """A one-image prompt expanded the way Qwen2VLProcessor does (its AutoProcessor needs torchvision
    for the video processor in transformers 5.23): each <|image_pad|> becomes t*h*w / merge**2 pads."""
    path = tiny_checkpoint(family)
    tokenizer = _tokenizer(family)
    image_inputs = transformers.AutoImageProcessor.from_pretrained(path)(images=[_image(224, 168)], return_tensors="pt")
    grid = image_inputs["image_grid_thw"]
    n = int(grid.prod()) // 4
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe it."}]}],
        tokenize=False, add_generation_prompt=True)
    text = text.replace("<|image_pad|>", "<|image_pad|>" * n)
    input_ids = torch.tensor([_ids(tokenizer, text)])
    # 1 marks image tokens (what the processor returns; M-RoPE needs it)
    mm_token_type_ids = (input_ids == tokenizer.convert_tokens_to_ids("<|image_pad|>")).long()
    inputs = dict(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), mm_token_type_ids=mm_token_type_ids)
    return {**inputs, **image_inputs}, n


@pytest.mark.parametrize("family", HF_FAMILIES)
def test_forward_gives_finite_logits(family):
    path = tiny_checkpoint(family)
    model = getattr(transformers, MODEL_CLASS[family]).from_pretrained(path).eval()
    tokenizer = _tokenizer(family)
    if family in ("qwen2_vl", "qwen2_5_vl"):
        inputs, n_pads = _qwen2_vl_inputs(family)
        # 224x168 -> 16 x 12 patches: two 112-pixel windows across, so Qwen2.5-VL's window blocks matter
        assert inputs["image_grid_thw"].tolist() == [[1, 12, 16]] and n_pads == 48
    elif family == "llava":
        processor = transformers.AutoProcessor.from_pretrained(path)
        prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe it."}]}],
            tokenize=False, add_generation_prompt=True)
        inputs = dict(processor(images=[_image(80, 60)], text=[prompt], return_tensors="pt", add_special_tokens=False))
    else:
        inputs = dict(tokenizer(["The quick brown fox jumps"], return_tensors="pt"))
    with torch.no_grad():
        out = model(**inputs)
    if family == "bert":
        hidden = out.last_hidden_state
        assert hidden.shape == (1, inputs["input_ids"].shape[1], model.config.hidden_size)
        assert torch.isfinite(hidden).all() and torch.isfinite(out.pooler_output).all()
        return
    logits = out.logits
    assert logits.shape == (1, inputs["input_ids"].shape[1], len(tokenizer))
    assert torch.isfinite(logits).all()
    assert logits.std() > 0.1  # seeded weights at a useful scale, not a flat distribution
    if family in VL_TRANSFORMERS:
        # The image changes the logits at the text positions after it.
        key = "pixel_values"
        with torch.no_grad():
            other = model(**{**inputs, key: inputs[key].flip(0) * 0.5}).logits
        assert not torch.allclose(other[0, -1], logits[0, -1])


# ---------------------------------------------------------------------------------------------
# Qwen-VL (no transformers implementation: names and shapes against the published checkpoint)
# ---------------------------------------------------------------------------------------------

# Tiny config: hidden 256 (= visual.output_dim; 256 // 128 = 2 resampler heads), 2 layers, 4 heads of 64,
# intermediate 512 (-> 256-wide w1/w2); visual width 64, 2 layers, 4 heads, mlp_ratio 4.9231
# (-> int(64 * 4.9231) = 315), 448px images in 14px patches, 256 queries.
QWEN_VL_EXPECTED_SHAPES = {
    "transformer.wte.weight": ("V", 256),
    "transformer.h.0.ln_1.weight": (256,),
    "transformer.h.0.attn.c_attn.weight": (768, 256),
    "transformer.h.0.attn.c_attn.bias": (768,),
    "transformer.h.1.attn.c_proj.weight": (256, 256),
    "transformer.h.1.ln_2.weight": (256,),
    "transformer.h.1.mlp.w1.weight": (256, 256),
    "transformer.h.1.mlp.w2.weight": (256, 256),
    "transformer.h.1.mlp.c_proj.weight": (256, 256),
    "transformer.ln_f.weight": (256,),
    "lm_head.weight": ("V", 256),
    "transformer.visual.conv1.weight": (64, 3, 14, 14),
    "transformer.visual.positional_embedding": (256, 64),
    "transformer.visual.ln_pre.weight": (64,),
    "transformer.visual.ln_pre.bias": (64,),
    "transformer.visual.transformer.resblocks.0.ln_1.weight": (64,),
    "transformer.visual.transformer.resblocks.0.attn.in_proj.weight": (192, 64),
    "transformer.visual.transformer.resblocks.0.attn.in_proj.bias": (192,),
    "transformer.visual.transformer.resblocks.1.attn.out_proj.weight": (64, 64),
    "transformer.visual.transformer.resblocks.1.attn.out_proj.bias": (64,),
    "transformer.visual.transformer.resblocks.1.ln_2.bias": (64,),
    "transformer.visual.transformer.resblocks.1.mlp.c_fc.weight": (315, 64),
    "transformer.visual.transformer.resblocks.1.mlp.c_fc.bias": (315,),
    "transformer.visual.transformer.resblocks.1.mlp.c_proj.weight": (64, 315),
    "transformer.visual.transformer.resblocks.1.mlp.c_proj.bias": (64,),
    "transformer.visual.attn_pool.query": (256, 256),
    "transformer.visual.attn_pool.pos_embed": (256, 256),
    "transformer.visual.attn_pool.kv_proj.weight": (256, 64),
    "transformer.visual.attn_pool.attn.in_proj_weight": (768, 256),
    "transformer.visual.attn_pool.attn.in_proj_bias": (768,),
    "transformer.visual.attn_pool.attn.out_proj.weight": (256, 256),
    "transformer.visual.attn_pool.attn.out_proj.bias": (256,),
    "transformer.visual.attn_pool.ln_q.weight": (256,),
    "transformer.visual.attn_pool.ln_kv.bias": (256,),
    "transformer.visual.ln_post.weight": (256,),
    "transformer.visual.ln_post.bias": (256,),
    "transformer.visual.proj": (256, 256),
}


def test_qwen_vl_weights_have_the_published_names_and_shapes():
    path = tiny_checkpoint("qwen_vl")
    config = _config("qwen_vl")
    vocab = config["vocab_size"]
    with safe_open(path / "model.safetensors", "pt") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
        pos_embed = f.get_tensor("transformer.visual.attn_pool.pos_embed")
    for name, shape in QWEN_VL_EXPECTED_SHAPES.items():
        assert shapes.get(name) == tuple(vocab if d == "V" else d for d in shape), name
    # Exactly the documented set: 8 per decoder layer + wte, ln_f, lm_head; 12 per resblock + conv1,
    # positional_embedding, ln_pre (2) + 11 in attn_pool + ln_post (2), proj.
    assert shapes == qwen_vl_weight_shapes(config)
    assert len(shapes) == 8 * 2 + 3 + 12 * 2 + 4 + 11 + 3
    # No bias where the published model has none.
    for absent in ("transformer.h.0.attn.c_proj.bias", "transformer.h.0.mlp.w1.bias", "transformer.visual.conv1.bias",
                   "transformer.visual.attn_pool.kv_proj.bias", "transformer.h.0.ln_1.bias"):
        assert absent not in shapes
    # pos_embed is the fixed 2-D sin-cos table (channel 0: sin(x * 1) of the column x; 64: cos(x))
    assert pos_embed[:16, 0].tolist() == pytest.approx(torch.arange(16.0).sin().tolist(), abs=1e-6)
    assert pos_embed[::16, 128].tolist() == pytest.approx(torch.arange(16.0).sin().tolist(), abs=1e-6)
    assert pos_embed[:16, 64].tolist() == pytest.approx(torch.arange(16.0).cos().tolist(), abs=1e-6)


def test_qwen_vl_config_and_generation_config():
    config = _config("qwen_vl")
    assert config["model_type"] == "qwen" and config["architectures"] == ["QWenLMHeadModel"]
    assert config["kv_channels"] * config["num_attention_heads"] == config["hidden_size"]
    visual = config["visual"]
    assert (visual["image_size"], visual["patch_size"]) == (448, 14)
    assert visual["output_dim"] == config["hidden_size"] and visual["output_dim"] // 128 == 2
    for key in ("heads", "layers", "mlp_ratio", "width", "image_start_id"):
        assert key in visual
    for key in ("layer_norm_epsilon", "rotary_emb_base", "seq_length", "intermediate_size"):
        assert key in config
    generation = json.loads((tiny_checkpoint("qwen_vl") / "generation_config.json").read_text())
    assert generation["chat_format"] == "chatml" and generation["max_window_size"] > 0
    assert generation["eos_token_id"] == _tokenizer("qwen_vl").convert_tokens_to_ids("<|endoftext|>")


# ---------------------------------------------------------------------------------------------
# Determinism, caching, CLI
# ---------------------------------------------------------------------------------------------

def _file_bytes(path: Path) -> dict[str, bytes]:
    return {p.relative_to(path).as_posix(): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_same_seed_same_bytes_other_seed_other_weights(family, tmp_path):
    cached = _file_bytes(tiny_checkpoint(family, seed=0))
    again = _file_bytes(make_tiny_checkpoint(family, tmp_path / "again", seed=0))
    assert again == cached
    other = _file_bytes(make_tiny_checkpoint(family, tmp_path / "other", seed=1))
    assert other.keys() == cached.keys()
    for name in cached:
        if name == "model.safetensors":
            assert other[name] != cached[name]
        else:
            assert other[name] == cached[name], name  # only the weights depend on the seed


def test_building_leaves_the_global_rng_alone(tmp_path):
    torch.manual_seed(1234)
    expected = torch.rand(3)
    torch.manual_seed(1234)
    make_tiny_checkpoint("qwen2", tmp_path, seed=5)
    assert torch.equal(torch.rand(3), expected)


def test_tiny_checkpoint_is_cached_per_content():
    first = tiny_checkpoint("qwen2")
    assert tiny_checkpoint("qwen2") == first
    assert first.name.startswith("qwen2-0-") and first.parent.name.startswith("atb-plugin-tiny-")
    assert tiny_checkpoint("qwen2", seed=1) != first
    with pytest.raises(ValueError, match="unknown family"):
        tiny_checkpoint("gpt2")


@pytest.mark.slow
def test_tiny_checkpoint_is_built_once_by_racing_processes(tmp_path):
    """Three processes ask for the same checkpoint at once (as pytest-xdist workers would): all get
    the same complete directory and no scratch directory is left behind. Qwen-VL, because building
    it needs no transformers import (checked too), keeps the three processes quick."""
    code = (
        "import sys\n"
        "from atb_plugin.testing.tiny import tiny_checkpoint\n"
        "print(tiny_checkpoint('qwen_vl', seed=3), 'transformers' in sys.modules)\n"
    )
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    procs = [subprocess.Popen([sys.executable, "-c", code], cwd=REPO, env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for _ in range(3)]
    results = [proc.communicate(timeout=120) for proc in procs]
    assert [proc.returncode for proc in procs] == [0, 0, 0], [err for _, err in results]
    lines = {out.strip() for out, _ in results}
    assert len(lines) == 1
    path, imported_transformers = lines.pop().rsplit(" ", 1)
    assert imported_transformers == "False"
    root = Path(path).parent
    assert root.parent == tmp_path and [p.name for p in root.iterdir()] == [Path(path).name]
    assert _file_bytes(Path(path)) == _file_bytes(make_tiny_checkpoint("qwen_vl", tmp_path / "ref", seed=3))


@pytest.mark.slow
def test_cli_writes_the_same_checkpoint_in_a_fresh_process(tmp_path):
    out = tmp_path / "cli"
    done = subprocess.run(
        [sys.executable, "-m", "atb_plugin.testing.tiny", "--family", "qwen2", "--out", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 0, done.stderr
    # Another process, another hash seed: still byte-identical to this process's build.
    assert _file_bytes(out) == _file_bytes(tiny_checkpoint("qwen2"))
    bad = subprocess.run([sys.executable, "-m", "atb_plugin.testing.tiny", "--family", "gpt2", "--out", str(out)],
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "invalid choice" in bad.stderr
