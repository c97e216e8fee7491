"""Qwen2-VL and Qwen2.5-VL video on the tiny checkpoints against transformers: the real input
builder writes the video block through shared memory, and for a video prompt and an image + video
prompt the model's logits equal ``Qwen2VLForConditionalGeneration`` /
``Qwen2_5_VLForConditionalGeneration`` given ``pixel_values_videos``, ``video_grid_thw`` (and
``second_per_grid_ts``), as do the M-RoPE positions (``get_rope_index``); the offline ``LLM.chat``
greedy tokens equal transformers' greedy continuation; the simulated NPU (bf16) stays within the
bf16 tolerance of the CPU path; prefix caching and the segment dedup make a resent video free.

Tolerance 1e-4 (fp32), the image tests' (tests/test_models_qwen2_vl.py): the patch embed is a
matmul here and a Conv3d there, SDPA vs eager softmax, fused QKV / gate-up.

The reference's pixels come from transformers' Pil image processor per frame, paired into
temporal patches (tests/test_video.py, ``reference_pixels``), from frames PyAV decodes by
decoding the whole file: nothing of our decoding or preprocessing feeds the reference.
"""

from __future__ import annotations

import functools
import re

import numpy as np
import pytest
import torch
from PIL import Image

from atb_plugin import LLM, SamplingParams
from atb_plugin.multimodal import MultimodalPrompt
from atb_plugin.testing.sequence import SequenceRunner
from atb_plugin.testing.tiny import tiny_checkpoint
from atb_plugin.testing.videos import write_video
from input_builders.media_config import MediaConfig
from input_builders.video import decode_all_frames
from routers import get_router
from tests.helpers import model_pair, write_test_images
from tests.test_video import reference_indices, reference_nframes, reference_pixels, reference_size

pytest.importorskip("av")

FAMILIES = ["qwen2_vl", "qwen2_5_vl"]
TOLERANCE = 1e-4
# 30 frames at 7 fps: 8 frames sampled (4 temporal patches), sample fps 1.87, second_per_grid_t 1.071:
# Qwen2.5-VL's time positions 0, 2.14, 4.29, 6.43 truncate to 0, 2, 4, 6 (not a plain multiple).
VIDEO = dict(frames=30, fps=7, size=(64, 96), gop=6, seed=11)
OPTIONS = {"max_pixels": 28 * 28 * 6, "min_pixels": 28 * 28 * 2}  # small frames: 56x84, 6 tokens a patch


pytestmark = pytest.mark.usefixtures("atb_kernel_set")
load_pair = functools.cache(model_pair)


@pytest.fixture
def media(tmp_path):
    video = write_video(tmp_path / "clip.mp4", VIDEO["frames"], VIDEO["fps"], VIDEO["size"], gop=VIDEO["gop"],
                        seed=VIDEO["seed"])
    image = write_test_images(tmp_path, sizes=((60, 90),))[0]
    return tmp_path, video, image


def conversation(video, image=None, text="What happens in this clip?"):
    content = ([{"image": str(image)}] if image else []) + [{"video": str(video), **OPTIONS}, {"text": text}]
    return [{"role": "user", "content": content}]


def reference_inputs(family, router, video, image=None, text="What happens in this clip?"):
    """transformers' inputs, built without our decoder or preprocessing."""
    from transformers import Qwen2VLImageProcessorPil

    ours, _ = load_pair(family)
    total, fps = VIDEO["frames"], float(VIDEO["fps"])
    count = reference_nframes(OPTIONS, total, fps)
    size = reference_size(OPTIONS, *VIDEO["size"], count)
    everything = decode_all_frames(video.read_bytes())
    frames = [everything[i] for i in reference_indices(total, count)]
    pixels_videos = torch.from_numpy(reference_pixels(frames, size, tiny_checkpoint(family)))
    video_grid = (count // 2, size[0] // 14, size[1] // 14)
    hf = {"pixel_values_videos": pixels_videos, "video_grid_thw": torch.tensor([video_grid])}
    grids = []
    parts = [{"type": "video"}, {"type": "text", "text": text}]
    if image is not None:
        processed = Qwen2VLImageProcessorPil.from_pretrained(tiny_checkpoint(family))(
            images=[Image.open(image).convert("RGB")], return_tensors="pt")
        hf.update(pixel_values=processed["pixel_values"], image_grid_thw=processed["image_grid_thw"])
        grids.append(tuple(int(v) for v in processed["image_grid_thw"][0]))
        parts.insert(0, {"type": "image"})
    grids.append(video_grid)
    if family == "qwen2_5_vl":
        hf["second_per_grid_ts"] = torch.tensor([2 / (count / total * fps)])  # the processor's float32 tensor
    template = router.tokenizer.apply_chat_template([{"role": "user", "content": parts}], tokenize=False,
                                                    add_generation_prompt=True)
    pieces = re.split(r"(<\|image_pad\|>|<\|video_pad\|>)", template)
    grid_iter = iter(grids)
    widened = "".join(piece * (np.prod(next(grid_iter)) // 4) if piece in ("<|image_pad|>", "<|video_pad|>")
                      else piece for piece in pieces)
    ids = torch.tensor(router.tokenizer(widened, add_special_tokens=False)["input_ids"])
    config = ours.config
    hf["mm_token_type_ids"] = ((ids == config.image_token_id).int() + 2 * (ids == config.video_token_id).int())[None]
    return ids, hf, grids


def build(family, store, directory, video, image=None):
    router = get_router(tiny_checkpoint(family), shm_store=store,
                        media_config=MediaConfig(allowed_local_media_paths=(str(directory),)))
    ids = router.input_builder.make_context(0, conversation(video, image), request_id="r")
    ours, _ = load_pair(family)
    mm = MultimodalPrompt.from_ids(ids, ours.media_layouts, expected_instance=store.instance_id)
    hf_ids, hf, grids = reference_inputs(family, router, video, image)
    assert torch.equal(mm.token_ids, hf_ids)
    assert [b.grid_thw for b in mm.blocks] == grids
    assert [b.modality for b in mm.blocks] == (["image"] if image else []) + ["video"]
    video_block = mm.blocks[-1]
    assert video_block.pixel_values.dtype == torch.uint8 and video_block.pixel_values.dim() == 4
    pixels = ours.encoder_input(video_block.pixel_values, video_block.grid_thw)
    torch.testing.assert_close(pixels, hf["pixel_values_videos"], atol=1e-5, rtol=0)
    assert video_block.second_per_grid_t == float(torch.tensor(2 / (8 / 30 * 7)))  # float32, exactly
    return mm, hf_ids, hf, grids


def positions_of(ours, mm, grids):
    return ours.get_mrope_positions(mm.token_ids, grids, [b.second_per_grid_t for b in mm.blocks])


def hf_logits(reference, ids, hf):
    inputs = {k: v for k, v in hf.items() if k != "mm_token_type_ids"}
    mm_types = hf["mm_token_type_ids"]
    if mm_types.shape[1] != ids.shape[0]:  # generated tokens appended: text
        mm_types = torch.cat([mm_types, torch.zeros(1, ids.shape[0] - mm_types.shape[1], dtype=mm_types.dtype)], 1)
    with torch.no_grad():
        return reference(input_ids=ids[None], mm_token_type_ids=mm_types, **inputs).logits[0]


@pytest.mark.parametrize("with_image", [False, True], ids=["video", "image+video"])
@pytest.mark.parametrize("family", FAMILIES)
def test_logits_and_positions_match_transformers(family, with_image, store, media):
    directory, video, image = media
    ours, reference = load_pair(family)
    mm, hf_ids, hf, grids = build(family, store, directory, video, image if with_image else None)
    positions, delta = positions_of(ours, mm, grids)
    kwargs = {k: hf[k] for k in ("image_grid_thw", "video_grid_thw", "second_per_grid_ts") if k in hf}
    expected, expected_delta = reference.model.get_rope_index(hf_ids[None], mm_token_type_ids=hf["mm_token_type_ids"],
                                                              **kwargs)
    assert torch.equal(positions, expected[:, 0]) and delta == int(expected_delta)
    if family == "qwen2_5_vl":  # the clock's spacing (2.14 per patch), truncated as transformers does
        block = mm.blocks[-1]
        time = positions[0, block.start:block.start + block.length].unique() - positions[0, block.start]
        assert time.tolist() == [0, 2, 4, 6]
    got = SequenceRunner(ours, max_len=len(mm.token_ids)).step(mm.token_ids, positions, inputs_embeds=mm.embed(ours))
    assert (got - hf_logits(reference, hf_ids, hf)).abs().max().item() <= TOLERANCE


@pytest.mark.parametrize("family", FAMILIES)
def test_offline_chat_greedy_tokens_equal_transformers(family, store, media):
    directory, video, image = media
    _, reference = load_pair(family)
    router = get_router(tiny_checkpoint(family), shm_store=store,
                        media_config=MediaConfig(allowed_local_media_paths=(str(directory),)))
    hf_ids, hf, _ = reference_inputs(family, router, video, image)
    config = MediaConfig(allowed_local_media_paths=(str(directory),))
    with LLM(tiny_checkpoint(family), block_size=16, media_config=config) as llm:
        output = llm.chat(conversation(video, image), SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))[0]
    assert len(output.prompt_token_ids) == len(hf_ids)
    ids = hf_ids
    for _ in range(5):  # transformers' greedy continuation, one full forward per token
        ids = torch.cat([ids, hf_logits(reference, ids, hf)[-1].argmax().view(1)])
    assert list(output.outputs[0].token_ids) == ids[len(hf_ids):].tolist()


@pytest.mark.parametrize("family", FAMILIES)
def test_video_chat_on_the_simulated_npu_matches_the_cpu_path(family, media, monkeypatch):
    from atb_plugin.platform import use_platform
    from atb_plugin.testing import fake_torch_npu
    from tests.test_npu_engine import BF16_LOGPROB_TOL

    directory, video, image = media
    config = MediaConfig(allowed_local_media_paths=(str(directory),))
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, logprobs=5)
    with LLM(tiny_checkpoint(family), block_size=16, media_config=config) as llm:
        cpu = llm.chat(conversation(video, image), params)[0].outputs[0]
    monkeypatch.setenv("ATB_PLUGIN_NPU_KERNELS", "fia")
    with fake_torch_npu.install() as fake, use_platform("npu"):
        with LLM(tiny_checkpoint(family), media_config=config) as llm:
            assert llm.engine.config.dtype == "bfloat16"
            npu = llm.chat(conversation(video, image), params)[0].outputs[0]
        assert fake.module.calls["_npu_flash_attention_unpad"] > 0  # the tower ran on the NPU path
    cpu_top = dict(zip(cpu.logprobs[0].top_token_ids, cpu.logprobs[0].top_logprobs))
    npu_top = dict(zip(npu.logprobs[0].top_token_ids, npu.logprobs[0].top_logprobs))
    diffs = {t: abs(cpu_top[t] - npu_top[t]) for t in set(cpu_top) & set(npu_top)}
    assert diffs and max(diffs.values()) <= BF16_LOGPROB_TOL, diffs


def test_a_resent_video_reuses_its_segment_and_the_prefix_cache(media):
    """Turn 2 resends turn 1's video: one segment (the dedup key), and the prefix cache holds the
    whole first turn (its video block included), so only the new tokens are computed."""
    directory, video, _ = media
    config = MediaConfig(allowed_local_media_paths=(str(directory),))
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    with LLM(tiny_checkpoint("qwen2_5_vl"), block_size=16, media_config=config) as llm:
        first_turn = conversation(video)
        first = llm.chat(first_turn, params)[0]
        segments = set(llm.engine.shm_store.names())
        second_turn = first_turn + [{"role": "assistant", "content": first.outputs[0].text},
                                    {"role": "user", "content": "And then?"}]
        second = llm.chat(second_turn, params)[0]
        assert second.num_cached_tokens >= len(first.prompt_token_ids) // 16 * 16  # every full block of turn 1
        assert set(llm.engine.shm_store.names()) == segments  # no second segment for the same video
    # the two prompts carry the same handles: the second's start is the first's prompt
    assert second.prompt_token_ids[:len(first.prompt_token_ids)] == first.prompt_token_ids


def test_a_video_to_a_model_without_video_is_refused(media):
    from input_builders import UnsupportedContentError

    directory, video, _ = media
    config = MediaConfig(allowed_local_media_paths=(str(directory),))
    router = get_router(tiny_checkpoint("llava"), media_config=config)
    with pytest.raises(UnsupportedContentError, match="without video input"):
        router.input_builder.make_context(0, conversation(video), request_id="r")


def test_images_and_videos_in_one_batch_equal_each_alone(media):
    """A video prompt, an image prompt and an image + video prompt scheduled together (one batch
    for the engine) answer as each does alone: the blocks, M-RoPE positions and features stay per
    request."""
    directory, video, image = media
    config = MediaConfig(allowed_local_media_paths=(str(directory),))
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    conversations = [conversation(video), [{"role": "user", "content": [{"image": str(image)}, {"text": "Describe."}]}],
                     conversation(video, image)]
    with LLM(tiny_checkpoint("qwen2_5_vl"), block_size=16, media_config=config, enable_prefix_caching=False) as llm:
        together = llm.chat(conversations, params)
        alone = [llm.chat(c, params)[0] for c in conversations]
    assert [list(o.outputs[0].token_ids) for o in together] == [list(o.outputs[0].token_ids) for o in alone]


def test_the_float32_wire_reads_the_same_as_uint8(media):
    """MindIE's form (float32 patches, normalised by the frontend) and ours (uint8 frames, patchified
    and normalised on the device) give the same logprobs: on the CPU the two paths' pixels are
    equal bit for bit (tests/test_video.py)."""
    directory, video, image = media
    config = MediaConfig(allowed_local_media_paths=(str(directory),))
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, logprobs=3)
    outputs = {}
    for wire in ("uint8", "float32"):
        with LLM(tiny_checkpoint("qwen2_vl"), block_size=16, media_config=config, mm_wire_dtype=wire) as llm:
            outputs[wire] = llm.chat(conversation(video, image), params)[0].outputs[0]
    assert list(outputs["uint8"].token_ids) == list(outputs["float32"].token_ids)
    assert outputs["uint8"].logprobs[0].top_logprobs == outputs["float32"].logprobs[0].top_logprobs
