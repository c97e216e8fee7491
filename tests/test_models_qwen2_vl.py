"""Qwen2-VL and Qwen2.5-VL against transformers on the tiny checkpoints: the vision tower (one
image, several sizes, windows cut by the image edge), M-RoPE positions (``get_rope_index``), full
logits for a prompt with two images of different sizes built by the real input builder through
shared memory, the paged path (prefill + decode with ``decode_positions``, chunked prefill cut
inside image blocks) and weight loading (published and transformers-5 names, missing/unexpected).

Tolerance 1e-4 (fp32); observed differences are ~1e-6 (the patch embed is a matmul here and a
Conv3d there, SDPA vs eager softmax, fused QKV / gate-up)."""

from __future__ import annotations

import dataclasses
import functools
import json

import pytest
import torch
from PIL import Image

from atb_plugin.models.qwen2_vl import Qwen2VLForConditionalGeneration, decode_positions
from atb_plugin.models.weights import WeightLoadingError
from atb_plugin.multimodal import MultimodalPrompt
from atb_plugin.testing.sequence import SequenceRunner
from atb_plugin.testing.tiny import tiny_checkpoint
from input_builders.media_config import MediaConfig
from routers import get_router
from tests.helpers import copy_checkpoint, model_pair, write_test_images

FAMILIES = ["qwen2_vl", "qwen2_5_vl"]
TOLERANCE = 1e-4
# (height, width) in pixels. Qwen2.5's windows are 4x4 merged tokens = 112 pixels: the second
# image (252x168 after smart_resize, 9x6 merged tokens) has windows cut by both edges.
IMAGE_SIZES = [(60, 90), (250, 170)]


load_pair = functools.cache(model_pair)


pytestmark = pytest.mark.usefixtures("atb_kernel_set")


@pytest.fixture
def image_paths(tmp_path):
    return write_test_images(tmp_path, IMAGE_SIZES)


def build_prompt(family, store, tmp_path, image_paths, text="Describe both pictures."):
    """The real path: input builder -> shm -> MultimodalPrompt, and transformers' own inputs."""
    from transformers import Qwen2VLImageProcessorPil

    router = get_router(tiny_checkpoint(family), shm_store=store,
                        media_config=MediaConfig(allowed_local_media_paths=(str(tmp_path),)))
    conversation = [{"role": "user", "content": [{"image": str(p)} for p in image_paths] + [{"text": text}]}]
    ids = router.input_builder.make_context(0, conversation, request_id="r")
    ours, _ = load_pair(family)
    mm = MultimodalPrompt.from_ids(ids, ours.media_layout, expected_instance=store.instance_id)

    # transformers' format: processor pixels + grids, the template's <|image_pad|> widened to n.
    processor = Qwen2VLImageProcessorPil.from_pretrained(tiny_checkpoint(family))
    processed = processor(images=[Image.open(p).convert("RGB") for p in image_paths], return_tensors="pt")
    grids = [tuple(int(v) for v in grid) for grid in processed["image_grid_thw"]]
    chat = [{"role": "user", "content": [{"type": "image"}] * len(image_paths) + [{"type": "text", "text": text}]}]
    template = router.tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    pieces = template.split("<|image_pad|>")
    widened = pieces[0] + "".join("<|image_pad|>" * (t * h * w // 4) + rest
                                  for (t, h, w), rest in zip(grids, pieces[1:]))
    hf_ids = torch.tensor(router.tokenizer(widened, add_special_tokens=False)["input_ids"])
    hf = {"input_ids": hf_ids, "pixel_values": processed["pixel_values"], "image_grid_thw": processed["image_grid_thw"]}

    # Same prompt on both sides: restored ids equal transformers' widened ids, and the encoder's
    # input (the uint8 images from shm, patchified and normalised by the model) equals
    # transformers' pixel values.
    assert torch.equal(mm.token_ids, hf_ids)
    assert [block.grid_thw for block in mm.blocks] == grids
    assert all(b.pixel_values.dtype == torch.uint8 for b in mm.blocks)
    pixels = torch.cat([ours.encoder_input(b.pixel_values, b.grid_thw) for b in mm.blocks])
    torch.testing.assert_close(pixels, hf["pixel_values"], atol=1e-5, rtol=0)
    return mm, grids, hf


def hf_logits(reference, ids, hf):
    image_token = reference.config.image_token_id
    with torch.no_grad():
        return reference(input_ids=ids[None], pixel_values=hf["pixel_values"], image_grid_thw=hf["image_grid_thw"],
                         mm_token_type_ids=(ids == image_token).int()[None]).logits[0]


def max_diff(a, b) -> float:
    return (a - b).abs().max().item()


# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("grid", [(1, 4, 4), (1, 6, 10), (1, 18, 12), (1, 16, 22), (2, 8, 12)])
def test_vision_features_match_transformers(family, grid):
    ours, reference = load_pair(family)
    pixels = torch.randn(grid[0] * grid[1] * grid[2], 1176, generator=torch.Generator().manual_seed(sum(grid)))
    with torch.no_grad():
        expected = reference.model.visual(pixels, grid_thw=torch.tensor([grid])).pooler_output
        got = ours.get_multimodal_embeddings(pixels, grid)
    assert got.shape == (grid[0] * grid[1] * grid[2] // 4, ours.config.text.hidden_size)
    assert max_diff(got, expected) <= TOLERANCE


@pytest.mark.parametrize("family", FAMILIES)
def test_vision_batch_of_images_equals_one_at_a_time(family):
    ours, reference = load_pair(family)
    grids = [(1, 6, 10), (1, 16, 22)]
    pixels = torch.randn(sum(t * h * w for t, h, w in grids), 1176, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        batched = ours.visual(pixels, grids)
        expected = reference.model.visual(pixels, grid_thw=torch.tensor(grids)).pooler_output
        single = [ours.visual(part, [grid]) for part, grid in zip(pixels.split([60, 352]), grids)]
    assert max_diff(batched, expected) <= TOLERANCE
    assert max_diff(batched, torch.cat(single)) <= TOLERANCE


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_transformers_for_two_images(family, store, tmp_path, image_paths):
    ours, reference = load_pair(family)
    mm, grids, hf = build_prompt(family, store, tmp_path, image_paths)
    positions, _ = ours.get_mrope_positions(mm.token_ids, grids)
    got = SequenceRunner(ours, max_len=len(mm.token_ids)).step(mm.token_ids, positions, inputs_embeds=mm.embed(ours))
    assert max_diff(got, hf_logits(reference, mm.token_ids, hf)) <= TOLERANCE


@pytest.mark.parametrize("family", FAMILIES)
def test_mrope_positions_equal_get_rope_index(family, store, tmp_path, image_paths):
    ours, reference = load_pair(family)
    mm, grids, _ = build_prompt(family, store, tmp_path, image_paths)
    image = ours.config.image_token_id
    text = torch.tensor([5, 6, 7])
    cases = [
        (mm.token_ids, grids),
        # images first and last, back to back but for one text token, a wide and a tall one
        (torch.cat([torch.full((6,), image), text[:1], torch.full((12,), image), text]), [(1, 4, 6), (1, 12, 4)]),
        (torch.cat([text, torch.full((20,), image)]), [(1, 4, 20)]),
        (torch.cat([text, torch.full((8,), image), text]), [(2, 4, 4)]),  # two frames
    ]
    for ids, case_grids in cases:
        expected, expected_delta = reference.model.get_rope_index(
            ids[None], mm_token_type_ids=(ids == image).int()[None], image_grid_thw=torch.tensor(case_grids))
        positions, delta = ours.get_mrope_positions(ids, case_grids)
        assert torch.equal(positions, expected[:, 0]) and delta == int(expected_delta)
    # Raw prompt ids (metadata slots still negative) give the same positions as restored ones.
    raw = mm.token_ids.clone()
    raw[mm.blocks[0].start:mm.blocks[0].start + 3] = torch.tensor([-1, -2, -3])
    assert torch.equal(ours.get_mrope_positions(raw, grids)[0], ours.get_mrope_positions(mm.token_ids, grids)[0])
    with pytest.raises(ValueError, match="image block 0 at position 3 has 8 slots, grid_thw \\[1, 4, 4\\] needs 4"):
        ours.get_mrope_positions(cases[3][0], [(1, 4, 4)])
    with pytest.raises(ValueError, match="2 image blocks, 1 grid_thw"):
        ours.get_mrope_positions(cases[1][0], [(1, 4, 6)])


@pytest.mark.parametrize("family", FAMILIES)
def test_prefill_then_decode_equals_the_full_forward(family, store, tmp_path, image_paths):
    ours, reference = load_pair(family)
    mm, grids, hf = build_prompt(family, store, tmp_path, image_paths)
    prompt_len, steps = len(mm.token_ids), 6
    positions, delta = ours.get_mrope_positions(mm.token_ids, grids)
    runner = SequenceRunner(ours, max_len=prompt_len + steps)
    logits = runner.step(mm.token_ids, positions, inputs_embeds=mm.embed(ours))
    generated, decoded = [], []
    for i in range(steps):  # greedy
        token = int(logits[-1].argmax())
        generated.append(token)
        logits = runner.step(torch.tensor([token]), ours.decode_positions(prompt_len + i, 1, delta))
        decoded.append(logits)
    decoded = torch.cat(decoded)
    # The full sequence in one forward, positions from get_rope_index semantics over all of it.
    full_ids = torch.cat([mm.token_ids, torch.tensor(generated)])
    full_positions, _ = ours.get_mrope_positions(full_ids, grids)
    assert torch.equal(full_positions[:, prompt_len:], decode_positions(prompt_len, steps, delta))
    embeds = torch.cat([mm.embed(ours), ours.get_input_embeddings(torch.tensor(generated))])
    full = SequenceRunner(ours, max_len=len(full_ids)).step(full_ids, full_positions, inputs_embeds=embeds)
    assert max_diff(decoded, full[prompt_len:]) <= TOLERANCE
    assert max_diff(decoded, hf_logits(reference, full_ids, hf)[prompt_len:]) <= TOLERANCE


@pytest.mark.parametrize("family", FAMILIES)
def test_chunked_prefill_cut_inside_image_blocks_equals_unchunked(family, store, tmp_path, image_paths):
    ours, _ = load_pair(family)
    mm, grids, _ = build_prompt(family, store, tmp_path, image_paths)
    length = len(mm.token_ids)
    positions, _ = ours.get_mrope_positions(mm.token_ids, grids)
    whole = SequenceRunner(ours, max_len=length).step(mm.token_ids, positions, inputs_embeds=mm.embed(ours))
    first, second = mm.blocks
    # Cuts inside block 0's metadata slots, inside block 1 twice, then the tail.
    cuts = [0, first.start + 2, second.start + 5, second.start + second.length - 7, length]
    assert first.start < cuts[1] < first.start + first.length
    assert second.start < cuts[2] < cuts[3] < second.start + second.length
    runner = SequenceRunner(ours, max_len=length, block_size=4)
    chunks = [runner.step(mm.token_ids[s:e], positions[:, s:e], inputs_embeds=mm.embed(ours, s, e))
              for s, e in zip(cuts[:-1], cuts[1:])]
    assert max_diff(torch.cat(chunks), whole) <= TOLERANCE


@pytest.mark.parametrize("family", FAMILIES)
def test_npu_path_equals_cpu_path(family):
    """The same model on the simulated torch_npu (ATB kernels: flash attention unpad for the tower,
    rotary, rms_norm, swiglu, reshape_and_cache + paged attention) as on the CPU kernels."""
    fake_torch_npu = pytest.importorskip("atb_plugin.testing.fake_torch_npu")
    from atb_plugin.platform import reset_current_platform, use_platform

    ours, _ = load_pair(family)  # transformers imported before the fake exists
    grid = (1, 18, 12)
    pixels = torch.randn(grid[1] * grid[2], 1176, generator=torch.Generator().manual_seed(3))
    image = torch.full((grid[1] * grid[2] // 4,), ours.config.image_token_id)
    ids = torch.cat([torch.tensor([1, 2, 3]), image, torch.tensor([4, 5, 6, 7])])
    positions, _ = ours.get_mrope_positions(ids, [grid])

    def run():
        features = ours.get_multimodal_embeddings(pixels, grid)
        embeds = ours.get_input_embeddings(ids)
        embeds[3:3 + len(image)] = features
        runner = SequenceRunner(ours, max_len=len(ids), block_size=16)
        logits = [runner.step(ids[s:e], positions[:, s:e], inputs_embeds=embeds[s:e]) for s, e in ((0, 30), (30, 50))]
        logits += [runner.step(ids[i:i + 1], positions[:, i:i + 1], inputs_embeds=embeds[i:i + 1])
                   for i in range(50, len(ids))]
        return features, torch.cat(logits)

    with torch.no_grad():
        cpu_features, cpu_logits = run()
        # About the mrope / tower paths, not precision: fp32 on the simulated NPU, opted in explicitly.
        handle = fake_torch_npu.install(allow_fp32_attention=True)
        try:
            with use_platform("npu"):
                npu_features, npu_logits = run()
            calls = dict(handle.module.calls)
        finally:
            handle.uninstall()
            reset_current_platform()
    assert calls.get("_npu_flash_attention_unpad") and calls.get("_npu_reshape_and_cache")
    assert calls.get("npu_rotary_mul")
    assert max_diff(npu_features, cpu_features) <= TOLERANCE
    assert max_diff(npu_logits, cpu_logits) <= TOLERANCE


# ------------------------------------------------------------------------------------------------
# configuration and weights


def test_media_layout_and_config():
    ours, _ = load_pair("qwen2_5_vl")
    raw = json.loads((tiny_checkpoint("qwen2_5_vl") / "config.json").read_text())
    layout = ours.media_layout
    assert (layout.placeholder_id, layout.num_metadata_slots, layout.tokens_per_block, layout.merge_size) == (
        raw["image_token_id"], 3, None, 2)
    assert ours.config.vision.window_attention and ours.config.vision.fullatt_block_indexes == (1, 3)
    assert ours.config.text.mrope_section == (2, 3, 3) and ours.config.text.qkv_bias
    assert not load_pair("qwen2_vl")[0].config.vision.window_attention


@pytest.mark.parametrize("family", FAMILIES)
def test_transformers5_config_and_weight_names_load(family, tmp_path):
    import transformers
    from safetensors.torch import load_file, save_file

    ours, _ = load_pair(family)
    copy_checkpoint(tiny_checkpoint(family), tmp_path)
    transformers.AutoConfig.from_pretrained(tiny_checkpoint(family)).save_pretrained(tmp_path)  # nested text_config
    assert "text_config" in json.loads((tmp_path / "config.json").read_text())
    state = load_file(str(tmp_path / "model.safetensors"))
    renamed = {}
    for name, tensor in state.items():
        if name.startswith("visual."):
            name = "model." + name
        elif name.startswith("model."):
            name = "model.language_model." + name[len("model."):]
        renamed[name] = tensor
    save_file(renamed, str(tmp_path / "model.safetensors"))
    again = Qwen2VLForConditionalGeneration.from_pretrained(tmp_path)
    # Same config, but for the spelling of the rope dict (transformers 5 adds rope_type "default").
    assert dataclasses.replace(again.config, text=dataclasses.replace(again.config.text, rope={})) == \
        dataclasses.replace(ours.config, text=dataclasses.replace(ours.config.text, rope={}))
    assert torch.equal(again.model.rotary.inv_freq, ours.model.rotary.inv_freq)
    for (name, param), (_, expected) in zip(again.state_dict().items(), ours.state_dict().items()):
        assert torch.equal(param, expected), name


@pytest.mark.parametrize("family, drop, missing", [
    ("qwen2_vl", "visual.blocks.1.attn.qkv.bias", r"visual\.blocks\.1\.attn\.qkv\.bias"),
    ("qwen2_5_vl", "visual.blocks.0.mlp.up_proj.bias", r"visual\.blocks\.0\.mlp\.gate_up_proj\.bias"),
])
def test_missing_and_unexpected_weights_are_named(family, drop, missing, tmp_path):
    from safetensors.torch import load_file, save_file

    copy_checkpoint(tiny_checkpoint(family), tmp_path)
    state = load_file(str(tmp_path / "model.safetensors"))
    state.pop(drop)
    state["visual.blocks.0.extra.weight"] = torch.zeros(2)
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(WeightLoadingError, match=f"missing from the checkpoint: {missing}.*"
                                                 r"not used by the model: visual\.blocks\.0\.extra\.weight"):
        Qwen2VLForConditionalGeneration.from_pretrained(tmp_path)


def test_bad_inputs_are_refused():
    ours, _ = load_pair("qwen2_vl")
    with pytest.raises(ValueError, match=r"expected \(16, 1176\)"):
        ours.get_multimodal_embeddings(torch.zeros(15, 1176), (1, 4, 4))
    with pytest.raises(ValueError, match="grid_thw"):
        ours.get_multimodal_embeddings(torch.zeros(16, 1176), None)
    with pytest.raises(ValueError, match="multiples of spatial_merge_size"):
        ours.get_multimodal_embeddings(torch.zeros(15, 1176), (1, 3, 5))


def test_a_text_prompt_holding_media_pad_ids_is_text():
    """A prompt of token ids without media that holds the image and video pad ids (sent as text,
    or sampled and then recomputed after a preemption) is positioned as text, as transformers
    does without pixel values: greedy tokens equal transformers' (it used to fail the step)."""
    from atb_plugin import LLM, SamplingParams

    model_dir = tiny_checkpoint("qwen2_vl")
    config = json.loads((model_dir / "config.json").read_text())
    ids = [11, 12, config["image_token_id"], 13, config["video_token_id"], 14, 15]
    reference = model_pair("qwen2_vl")[1]
    with torch.no_grad():
        expected = reference.generate(torch.tensor([ids]), max_new_tokens=6, do_sample=False)[0, len(ids):].tolist()
    with LLM(model_dir) as llm:
        out = llm.generate(ids, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    assert out[0].outputs[0].token_ids == expected
