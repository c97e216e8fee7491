"""LLaVA-1.5 on the tiny checkpoint: the CLIP tower's hidden states and the projected image
features equal transformers', full-model logits on a prompt with two images (built by the real
input builder, pixels read back from shared memory) equal transformers' on its processor's
inputs, and the paged path (decode, chunked prefill cutting the image blocks) equals the full
forward, on the CPU kernels and on the NPU kernels (simulated torch_npu). Weights: published names
and transformers 5's load with nothing missing or unexpected.

Tolerance 1e-4 (fp32): the same math in another order (fused QKV / gate-up, SDPA per image vs
transformers' batched attention); observed differences are ~1e-6.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from PIL import Image
from safetensors.torch import load_file, save_file

import shm
from atb_plugin.models.clip import CLIPVisionModel
from atb_plugin.models.llava import LlavaConfig, LlavaForConditionalGeneration
from atb_plugin.models.weights import WeightLoadingError
from atb_plugin.multimodal import MultimodalPrompt
from atb_plugin.testing.sequence import SequenceRunner
from tests.helpers import copy_checkpoint, model_pair, write_test_images
from atb_plugin.testing.tiny import tiny_checkpoint
from input_builders.media_config import MediaConfig
from routers import get_router

TOLERANCE = 1e-4
QUESTION = "What is in the picture?"


pytestmark = pytest.mark.usefixtures("atb_kernel_set")


@pytest.fixture(scope="module")
def path():
    return tiny_checkpoint("llava")


@pytest.fixture(scope="module")
def pair(path):
    return model_pair(path)


@pytest.fixture(scope="module")
def ours(pair):
    model = pair[0]
    assert isinstance(model, LlavaForConditionalGeneration)
    return model


@pytest.fixture(scope="module")
def reference(pair):
    return pair[1]


@pytest.fixture
def store():
    with shm.ShmStore(shm.ShmStoreConfig(reap_on_start=False, cache_bytes=0)) as store:
        yield store


def pixels(batch: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(batch, 3, 56, 56, generator=torch.Generator().manual_seed(seed))


def image_files(tmp_path) -> list:
    return write_test_images(tmp_path)


def two_image_prompt(path, store, tmp_path, model) -> tuple[MultimodalPrompt, list]:
    """The real builder's prompt for two images, parsed back into ids + pixels."""
    images = image_files(tmp_path)
    router = get_router(path, shm_store=store, media_config=MediaConfig(allowed_local_media_paths=(str(tmp_path),)))
    content = [{"image": str(p)} for p in images] + [{"text": QUESTION}]
    ids = router.input_builder.make_context(0, [{"role": "user", "content": content}], request_id="r")
    return MultimodalPrompt.from_ids(ids, model.media_layout, expected_instance=store.instance_id), images


def transformers_inputs(path, images):
    """transformers' own format: its processor's expanded ids and pixel values."""
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(path)
    chat = [{"role": "user", "content": [{"type": "image"}] * len(images) + [{"type": "text", "text": QUESTION}]}]
    text = processor.apply_chat_template(chat, add_generation_prompt=True)
    # The template already starts with <s>: no second one from the tokenizer (the builder adds none).
    return processor(images=[Image.open(p).convert("RGB") for p in images], text=text,
                     add_special_tokens=False, return_tensors="pt")


def full_logits(model, mm: MultimodalPrompt, block_size: int = 4) -> torch.Tensor:
    length = mm.token_ids.shape[0]
    with torch.no_grad():
        runner = SequenceRunner(model, max_len=length, block_size=block_size)
        return runner.step(mm.token_ids, inputs_embeds=mm.embed(model, 0, length))


# ---------------------------------------------------------------------------------------------


def test_config_and_media_layout(ours, path):
    raw = json.loads((path / "config.json").read_text())
    layout = ours.media_layout
    assert layout.placeholder_id == raw["image_token_index"]
    assert (layout.num_metadata_slots, layout.merge_size) == (2, 1)
    assert layout.tokens_per_block == raw["image_seq_length"] == 16
    assert ours.config.vision_feature_layer == -2 and ours.config.vision_feature_select_strategy == "default"
    full = LlavaConfig.from_hf({**raw, "vision_feature_select_strategy": "full"})
    assert full.tokens_per_image == 17


def test_published_llava_config_defaults():
    """llava-hf/llava-1.5-7b-hf's config.json lists only what differs from transformers' defaults."""
    raw = {
        "architectures": ["LlavaForConditionalGeneration"], "ignore_index": -100, "image_token_index": 32000,
        "model_type": "llava", "pad_token_id": 32001, "projector_hidden_act": "gelu",
        "text_config": {"_name_or_path": "lmsys/vicuna-7b-v1.5", "architectures": ["LlamaForCausalLM"],
                        "max_position_embeddings": 4096, "model_type": "llama", "rms_norm_eps": 1e-05,
                        "torch_dtype": "float16", "vocab_size": 32064},
        "tie_word_embeddings": False, "torch_dtype": "float16", "transformers_version": "4.36.0.dev0",
        "vision_config": {"hidden_size": 1024, "image_size": 336, "intermediate_size": 4096,
                          "model_type": "clip_vision_model", "num_attention_heads": 16, "num_hidden_layers": 24,
                          "patch_size": 14, "projection_dim": 768, "vocab_size": 32000},
        "vision_feature_layer": -2, "vision_feature_select_strategy": "default", "vocab_size": 32064,
    }
    config = LlavaConfig.from_hf(raw)
    text, vision = config.text, config.vision
    assert (text.hidden_size, text.intermediate_size, text.num_hidden_layers, text.num_attention_heads,
            text.num_key_value_heads, text.vocab_size, text.rms_norm_eps) == (4096, 11008, 32, 32, 32, 32064, 1e-5)
    assert (vision.hidden_act, vision.layer_norm_eps, vision.num_channels) == ("quick_gelu", 1e-5, 3)
    assert config.tokens_per_image == 576 and config.image_token_id == 32000


def test_clip_hidden_states_match_transformers(ours, reference):
    pv = pixels(3)
    with torch.no_grad():
        expected = reference.model.vision_tower(pv, output_hidden_states=True).hidden_states
        got = ours.vision_tower(pv)
        partial = ours.vision_tower(pv, up_to=-2)
    assert len(got) == len(expected) == ours.config.vision.num_hidden_layers + 1
    for index, (a, b) in enumerate(zip(got, expected)):
        assert a.shape == b.shape and (a - b).abs().max() <= TOLERANCE, f"hidden_states[{index}]"
    assert len(partial) == len(got) - 1 and torch.equal(partial[-1], got[-2])  # the last layer is not run


def _reference_features(reference, pv, **kwargs) -> torch.Tensor:
    out = reference.get_image_features(pv, **kwargs)
    features = out.pooler_output if hasattr(out, "pooler_output") else out
    return torch.stack(list(features))


def test_image_features_match_transformers(ours, reference):
    pv = pixels(2, seed=1)
    with torch.no_grad():
        expected = _reference_features(reference, pv, vision_feature_layer=-2, vision_feature_select_strategy="default")
        got = ours.get_image_features(pv)
        one = ours.get_multimodal_embeddings(pv[1:2], None)
    assert got.shape == expected.shape == (2, 16, ours.config.text.hidden_size)
    assert (got - expected).abs().max() <= TOLERANCE
    assert one.shape == (16, 64) and (one - expected[1]).abs().max() <= TOLERANCE
    # "full" keeps CLS; another layer: same weights, other config.
    variant = LlavaForConditionalGeneration(dataclasses.replace(
        ours.config, vision_feature_select_strategy="full", vision_feature_layer=-1))
    variant.load_state_dict(ours.state_dict())
    with torch.no_grad():
        expected = _reference_features(reference, pv, vision_feature_layer=-1, vision_feature_select_strategy="full")
        got = variant.eval().get_image_features(pv)
    assert got.shape == (2, 17, 64) and (got - expected).abs().max() <= TOLERANCE


def test_transformers5_names_and_a_list_of_feature_layers(path):
    """A model transformers 5 builds (its in-memory names ``model.vision_tower.*`` ...) with
    ``vision_feature_layer: [-2, -1]`` (features concatenated, projector twice as wide)."""
    import transformers

    raw = json.loads((path / "config.json").read_text())
    raw |= {"vision_feature_layer": [-2, -1], "vision_feature_select_strategy": "full"}
    torch.manual_seed(0)
    reference = transformers.LlavaForConditionalGeneration(transformers.LlavaConfig.from_dict(raw)).eval()
    state = reference.state_dict()
    assert any(k.startswith("model.vision_tower.embeddings.") for k in state) and "lm_head.weight" in state
    ours = LlavaForConditionalGeneration(LlavaForConditionalGeneration.config_from_hf(raw))
    assert all(ours.accepts_weight(name) for name in state)
    loaded = ours.load_weights(state.items())
    assert loaded == set(dict(ours.named_parameters()))
    pv = pixels(2, seed=2)
    with torch.no_grad():
        expected = _reference_features(reference, pv, vision_feature_layer=[-2, -1],
                                       vision_feature_select_strategy="full")
        got = ours.eval().get_image_features(pv)
    assert got.shape == (2, 17, 64) and (got - expected).abs().max() <= TOLERANCE


def test_unknown_and_missing_weights_are_named(path, tmp_path):
    copy_checkpoint(path, tmp_path)
    state = load_file(str(path / "model.safetensors"))
    state.pop("vision_tower.vision_model.encoder.layers.0.self_attn.k_proj.bias")
    state["vision_tower.encoder.layers.0.mlp.fc1.weight"] = torch.zeros(2)  # no vision_model level: unknown
    state["multi_modal_projector.linear_3.weight"] = torch.zeros(2)
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(WeightLoadingError, match=(
            r"missing from the checkpoint: vision_tower\.encoder\.layers\.0\.self_attn\.qkv_proj\.bias.*"
            r"not used by the model: multi_modal_projector\.linear_3\.weight, "
            r"vision_tower\.encoder\.layers\.0\.mlp\.fc1\.weight")):
        LlavaForConditionalGeneration.from_pretrained(tmp_path)


def test_logits_with_two_images_match_transformers(ours, reference, path, store, tmp_path):
    mm, images = two_image_prompt(path, store, tmp_path, ours)
    assert len(mm.blocks) == 2
    inputs = transformers_inputs(path, images)
    assert mm.token_ids.tolist() == inputs["input_ids"][0].tolist()
    # The builder's uint8 images, normalised by the model: transformers' pixel values.
    shm_pixels = torch.cat([ours.encoder_input(block.pixel_values) for block in mm.blocks])
    assert (shm_pixels - inputs["pixel_values"]).abs().max() <= 1e-5
    with torch.no_grad():
        expected = reference(input_ids=inputs["input_ids"], pixel_values=inputs["pixel_values"]).logits[0]
    got = full_logits(ours, mm)
    assert got.shape == expected.shape
    assert (got - expected).abs().max() <= TOLERANCE
    # The same images through the builder's pixels: transformers agrees too (no preprocessing slack).
    with torch.no_grad():
        again = reference(input_ids=mm.token_ids[None], pixel_values=shm_pixels).logits[0]
    assert (got - again).abs().max() <= TOLERANCE
    # The multimodal merge of get_input_embeddings(ids, mm_embeds) is the same as mm.embed's.
    features = torch.cat(mm.features(ours))
    with torch.no_grad():
        assert torch.equal(ours.get_input_embeddings(mm.token_ids, features), mm.embed(ours))
        with pytest.raises(ValueError, match=r"32 image placeholder tokens \(id \d+\) but 16 image feature rows"):
            ours.get_input_embeddings(mm.token_ids, features[:16])
    store.release("r")


def test_paged_decode_equals_the_full_forward(ours, path, store, tmp_path):
    mm, _ = two_image_prompt(path, store, tmp_path, ours)
    full = full_logits(ours, mm)
    length = mm.token_ids.shape[0]
    prefill = mm.blocks[-1].start + mm.blocks[-1].length + 2  # both images in the prefill
    runner = SequenceRunner(ours, max_len=length, block_size=4)
    pieces = [runner.step(mm.token_ids[:prefill], inputs_embeds=mm.embed(ours, 0, prefill))]
    pieces += [runner.step(mm.token_ids[i:i + 1], inputs_embeds=mm.embed(ours, i, i + 1))
               for i in range(prefill, length)]
    assert (torch.cat(pieces) - full).abs().max() <= TOLERANCE
    # Decode steps with plain text ids (no inputs_embeds) are the same: the tail has no image slots.
    runner = SequenceRunner(ours, max_len=length, block_size=4)
    pieces = [runner.step(mm.token_ids[:prefill], inputs_embeds=mm.embed(ours, 0, prefill))]
    pieces += [runner.step(mm.token_ids[i:i + 1]) for i in range(prefill, length)]
    assert (torch.cat(pieces) - full).abs().max() <= TOLERANCE
    store.release("r")


def test_chunked_prefill_cutting_the_image_blocks_equals_unchunked(ours, path, store, tmp_path):
    mm, _ = two_image_prompt(path, store, tmp_path, ours)
    full = full_logits(ours, mm)
    first, second = mm.blocks
    length = mm.token_ids.shape[0]
    # Cuts inside block 0 (after its metadata slots and in its middle), inside block 1, then text.
    cuts = [0, first.start + 1, first.start + 7, second.start + 5, length - 3, length]
    assert first.start < cuts[1] < cuts[2] < first.start + first.length
    assert second.start < cuts[3] < second.start + second.length
    runner = SequenceRunner(ours, max_len=length, block_size=4)
    pieces = [runner.step(mm.token_ids[a:b], inputs_embeds=mm.embed(ours, a, b)) for a, b in zip(cuts[:-1], cuts[1:])]
    assert (torch.cat(pieces) - full).abs().max() <= TOLERANCE
    store.release("r")


def test_clip_tower_refuses_other_image_sizes(ours):
    with pytest.raises(ValueError, match=r"CLIP expects pixel values \(B, 3, 56, 56\), got \(1, 3, 64, 64\)"):
        ours.get_multimodal_embeddings(torch.zeros(1, 3, 64, 64))
    with pytest.raises(ValueError, match="one image's pixel values"):
        ours.get_multimodal_embeddings(torch.zeros(2, 3, 56, 56))
    with pytest.raises(ValueError, match="out of range"):
        CLIPVisionModel(ours.config.vision).layer_index(-4)


def test_npu_path_equals_the_cpu_path(ours, path, store, tmp_path):
    """The same prompt through the NPU kernels (simulated torch_npu): the tower's unpadded flash
    attention, the LM's cache writes / prefill / paged decode."""
    from atb_plugin.platform import use_platform
    from atb_plugin.testing import fake_torch_npu

    mm, _ = two_image_prompt(path, store, tmp_path, ours)
    cpu = full_logits(ours, mm, block_size=16)
    length = mm.token_ids.shape[0]
    # About routing tower / LM ops, not precision: fp32 on the simulated NPU, opted in explicitly.
    with fake_torch_npu.install(allow_fp32_attention=True) as fake, use_platform("npu"):
        fresh = MultimodalPrompt(mm.token_ids, mm.blocks)  # features not cached: the tower runs here
        runner = SequenceRunner(ours, max_len=length, block_size=16)
        cut = mm.blocks[0].start + 5  # chunked prefill through block 0, then the rest, then decode
        pieces = [runner.step(mm.token_ids[:cut], inputs_embeds=fresh.embed(ours, 0, cut)),
                  runner.step(mm.token_ids[cut:length - 2], inputs_embeds=fresh.embed(ours, cut, length - 2))]
        pieces += [runner.step(mm.token_ids[i:i + 1]) for i in (length - 2, length - 1)]
        calls = dict(fake.module.calls)
    layers_run = ours.vision_tower.layer_index(ours.config.vision_feature_layer)  # 1 of 2 for -2
    assert calls["_npu_flash_attention_unpad"] == layers_run * len(mm.blocks), calls  # one tower call per image
    assert calls.get("_npu_paged_attention", 0) + calls.get("_npu_paged_attention_splitfuse", 0) > 0, calls
    assert (torch.cat(pieces) - cpu).abs().max() <= 1e-5
    store.release("r")
