"""Qwen3-VL and Qwen3-VL-MoE against transformers on the tiny checkpoints.

1. Preprocessing: our router's input builder (images and a short generated video, through shared
   memory, both wire dtypes) against transformers' ``Qwen3VLProcessor``: the same ids (the video's
   timestamped per-frame blocks included), the same grids, the encoder's input within 1e-5 of the
   processor's pixel values; the video's frame indices and size equal ``Qwen3VLVideoProcessor``'s.
   The processor needs torchvision for its video half, which this project does not install: it is
   built here from its parts (the video processor's own module, torchvision's ``normalize`` as the
   one-line op it is), fed our resized frames (Pillow bicubic, the image path's resize).
2. Logits equal transformers' within 1e-4 (fp32) for text, image, video and mixed prompts, dense
   and MoE (DeepStack rows, interleaved M-RoPE, per-frame video blocks); a prefill chunked inside
   the image equals the whole one; the simulated NPU: Qwen3-VL in bfloat16 within 5e-2 relative,
   Qwen3-VL-MoE in float32 within 1e-4 (its tiny router's ties flip experts in any bfloat16 run);
   the start-up memory profile's worst image and video; stacked MoE experts per rank.
3. TP = 2 equals TP = 1 (one spawned gloo group for the module, tests/test_tensor_parallel.py's).
4. The offline ``LLM`` (greedy equals transformers' argmax token by token; a resent chat reuses its
   segments and the prefix cache; chunked prefill) and the server with the openai client (MindIE
   items, ``mm_processor_kwargs``): one server for the module.
"""

from __future__ import annotations

import functools
import importlib
import types

import numpy as np
import pytest
import torch
from PIL import Image

from atb_plugin.multimodal import MultimodalPrompt
from atb_plugin.testing.sequence import SequenceRunner
from atb_plugin.testing.tiny import tiny_checkpoint
from atb_plugin.testing.videos import write_video
from input_builders.media_config import MediaConfig
from routers import get_router
from tests.helpers import model_pair, write_test_images

FAMILIES = ["qwen3_vl", "qwen3_vl_moe"]
TOLERANCE = 1e-4
IMAGE_SIZES = [(60, 90), (250, 170)]  # 4x6 and 16x10 patches of 16 pixels
# 25 frames at 10 fps: 5 sampled (2 / s, an odd count: the last temporal patch repeats its frame),
# 100x140 -> 96x128: 3 temporal patches of 6x8 patches, 12 tokens each.
VIDEO = dict(frames=25, fps=10, size=(100, 140))

load_pair = functools.cache(model_pair)
pytestmark = pytest.mark.usefixtures("atb_kernel_set")


@pytest.fixture
def media(tmp_path):
    images = write_test_images(tmp_path, IMAGE_SIZES)
    video = write_video(tmp_path / "clip.mp4", VIDEO["frames"], VIDEO["fps"], VIDEO["size"])
    return images, video


# ------------------------------------------------------------------------------------------------
# transformers' processor, assembled without torchvision


@functools.cache
def reference_processor(family: str):
    import transformers
    import transformers.image_processing_backends as backends

    if not hasattr(backends, "tvF"):  # torchvision's normalize: (x - mean) / std per channel
        backends.tvF = types.SimpleNamespace(normalize=lambda image, mean, std, inplace=False: (
            image - torch.as_tensor(mean).view(-1, 1, 1)) / torch.as_tensor(std).view(-1, 1, 1))
    video_module = importlib.import_module("transformers.models.qwen3_vl.video_processing_qwen3_vl")

    class Processor(transformers.Qwen3VLProcessor):
        def check_argument_for_proper_class(self, name, arg):  # its check needs torchvision's registry
            return None

    path = tiny_checkpoint(family)
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    return Processor(image_processor=transformers.AutoImageProcessor.from_pretrained(path), tokenizer=tokenizer,
                     video_processor=video_module.Qwen3VLVideoProcessor.from_pretrained(path),
                     chat_template=tokenizer.chat_template), video_module


def build(family, store, tmp_path, images=(), video=None, text="Describe.", wire="uint8"):
    """Our builder's prompt (through shm) and transformers' inputs for the same content."""
    from transformers.video_utils import VideoMetadata

    router = get_router(tiny_checkpoint(family), shm_store=store, mm_wire_dtype=wire,
                        media_config=MediaConfig(allowed_local_media_paths=(str(tmp_path),)))
    content = [{"image": str(p)} for p in images] + ([{"video": str(video)}] if video else []) + [{"text": text}]
    ids = router.input_builder.make_context(0, [{"role": "user", "content": content}], request_id="r")
    ours, _ = load_pair(family)
    mm = MultimodalPrompt.from_ids(ids, ours.media_layouts, expected_instance=store.instance_id)

    processor, _ = reference_processor(family)
    chat = [{"role": "user", "content": [{"type": "image"}] * len(images) + [{"type": "video"}] * bool(video)
             + [{"type": "text", "text": text}]}]
    kwargs = {}
    if video:
        loaded = router.input_builder._load_media([_video_part(video)])[0]
        frames = loaded.resized_frames()[:loaded.plan.num_frames]  # the processor pads by itself
        kwargs = dict(videos=[torch.from_numpy(frames)], video_metadata=[VideoMetadata(
            total_num_frames=loaded.stream.total_frames, fps=loaded.stream.fps,
            frames_indices=list(loaded.plan.indices))], videos_kwargs=dict(
            do_resize=False, do_convert_rgb=False, do_sample_frames=False, cap_pixels_per_frame=False))
    hf = processor(text=[processor.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)],
                   images=[Image.open(p).convert("RGB") for p in images] or None, return_tensors="pt", **kwargs)
    hf = {key: value[0] if key in ("input_ids", "mm_token_type_ids") else value for key, value in hf.items()
          if key != "attention_mask"}
    return ours, mm, hf


def _video_part(path):
    from input_builders.conversation import VideoPart

    return VideoPart(ref=str(path))


def encoder_inputs(ours, mm, modality):
    return torch.cat([ours.encoder_input(b.pixel_values, b.grid_thw) for b in mm.blocks if b.modality == modality])


def ours_logits(ours, mm):
    positions, _ = ours.get_mrope_positions(mm.token_ids, [b.grid_thw for b in mm.blocks])
    return SequenceRunner(ours, max_len=len(mm.token_ids)).step(mm.token_ids, positions, inputs_embeds=mm.embed(ours))


def hf_logits(reference, hf, ids=None):
    inputs = dict(hf, input_ids=hf["input_ids"] if ids is None else ids)
    extra = len(inputs["input_ids"]) - len(hf["mm_token_type_ids"])
    inputs["mm_token_type_ids"] = torch.nn.functional.pad(hf["mm_token_type_ids"], (0, extra))
    inputs = {k: v[None] if k in ("input_ids", "mm_token_type_ids") else v for k, v in inputs.items()}
    with torch.no_grad():
        return reference(**inputs).logits[0]


def max_diff(a, b) -> float:
    return (a - b).abs().max().item()


# ------------------------------------------------------------------------------------------------
# 1. preprocessing


@pytest.mark.parametrize("wire", ["uint8", "float32"])
def test_preprocessing_equals_qwen3vl_processor(wire, store, tmp_path, media):
    images, video = media
    ours, mm, hf = build("qwen3_vl", store, tmp_path, images, video, wire=wire)
    assert torch.equal(mm.token_ids, hf["input_ids"])  # the timestamped per-frame video blocks too
    assert [list(b.grid_thw) for b in mm.blocks if b.modality == "image"] == hf["image_grid_thw"].tolist()
    (t, h, w), = hf["video_grid_thw"].tolist()
    assert [b.grid_thw for b in mm.blocks if b.modality == "video"] == [(1, h, w)] * t == [(1, 6, 8)] * 3
    assert {b.pixel_values.dtype for b in mm.blocks} == {torch.uint8 if wire == "uint8" else torch.float32}
    torch.testing.assert_close(encoder_inputs(ours, mm, "image"), hf["pixel_values"], atol=1e-5, rtol=0)
    torch.testing.assert_close(encoder_inputs(ours, mm, "video"), hf["pixel_values_videos"], atol=1e-5, rtol=0)
    # All of a video's blocks share its one segment.
    assert len({b.pixel_values.data_ptr() for b in mm.blocks if b.modality == "video"}) == t


@pytest.mark.parametrize("frames, fps, size", [(25, 10, (100, 140)), (300, 30, (360, 640)), (9, 4, (20, 900)),
                                               (40, 24, (1080, 1920))])
def test_video_sampling_equals_the_video_processor(frames, fps, size):
    from transformers.video_utils import VideoMetadata

    from input_builders.video import VideoStream

    router = get_router(tiny_checkpoint("qwen3_vl"))
    sampling = router.input_builder.video_sampling
    _, module = reference_processor("qwen3_vl")
    reference = module.Qwen3VLVideoProcessor.from_pretrained(tiny_checkpoint("qwen3_vl"))
    stream = VideoStream(size[1], size[0], float(fps), frames / fps, "h264", np.arange(frames), np.zeros(1))
    plan = sampling.plan(stream)
    indices = reference.sample_frames(VideoMetadata(total_num_frames=frames, fps=fps))
    assert plan.indices == tuple(indices.tolist())
    expected = module.smart_resize(len(indices), *size, temporal_factor=2, factor=32,
                                   min_pixels=reference.size["shortest_edge"], max_pixels=reference.size["longest_edge"])
    assert plan.size == tuple(expected)
    processor, _ = reference_processor("qwen3_vl")
    assert plan.patch_timestamps == tuple(processor._calculate_timestamps(list(indices), fps, 2))


# ------------------------------------------------------------------------------------------------
# 2. logits


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("content", ["text", "image", "video", "mixed"])
def test_logits_equal_transformers(family, content, store, tmp_path, media):
    images, video = media
    ours, reference = load_pair(family)
    ours, mm, hf = build(family, store, tmp_path, images if content in ("image", "mixed") else (),
                         video if content in ("video", "mixed") else None)
    assert torch.equal(mm.token_ids, hf["input_ids"])
    assert max_diff(ours_logits(ours, mm), hf_logits(reference, hf)) <= TOLERANCE


def test_chunked_prefill_cut_inside_the_image_equals_unchunked(store, tmp_path, media):
    images, video = media
    ours, mm, _ = build("qwen3_vl", store, tmp_path, images[1:], video)
    positions, _ = ours.get_mrope_positions(mm.token_ids, [b.grid_thw for b in mm.blocks])
    whole = ours_logits(ours, mm)
    image, frame = mm.blocks[0], mm.blocks[2]
    cuts = [0, image.start + 2, image.start + 17, frame.start + 5, len(mm.token_ids)]
    runner = SequenceRunner(ours, max_len=len(mm.token_ids), block_size=4)
    chunks = [runner.step(mm.token_ids[s:e], positions[:, s:e], inputs_embeds=mm.embed(ours, s, e))
              for s, e in zip(cuts, cuts[1:])]
    assert max_diff(torch.cat(chunks), whole) <= TOLERANCE


@pytest.mark.parametrize("family, dtype, tolerance", [("qwen3_vl", torch.bfloat16, 5e-2),
                                                       ("qwen3_vl_moe", torch.float32, TOLERANCE)])
def test_simulated_npu_within_tolerance(family, dtype, tolerance, store, tmp_path, media):
    """The image prompt through the simulated torch_npu (ATB attention for tower and decoder, rotary,
    norms; the MoE ops for Qwen3-VL-MoE), chunked inside the image, against the CPU in float32:
    Qwen3-VL in bfloat16 (relative to the largest logit). Qwen3-VL-MoE in float32, exact to 1e-4:
    the tiny checkpoint's random router puts experts within bfloat16's rounding of each other, so
    any two bfloat16 runs (the CPU's own included) pick different experts somewhere."""
    import copy

    from atb_plugin.platform import reset_current_platform, use_platform
    from atb_plugin.testing import fake_torch_npu

    images, _ = media
    ours, mm, _ = build(family, store, tmp_path, images[1:])
    positions, _ = ours.get_mrope_positions(mm.token_ids, [b.grid_thw for b in mm.blocks])
    block = mm.blocks[0]

    def run(model):
        features = model.get_multimodal_embeddings(model.encoder_input(block.pixel_values, block.grid_thw),
                                                   block.grid_thw)
        embeds = model.get_input_embeddings(mm.token_ids)
        embeds[block.start:block.start + block.length] = features
        runner = SequenceRunner(model, max_len=len(mm.token_ids), block_size=16)
        cuts = (0, block.start + 9, len(mm.token_ids))
        return torch.cat([runner.step(mm.token_ids[s:e], positions[:, s:e], inputs_embeds=embeds[s:e])
                          for s, e in zip(cuts, cuts[1:])]).float()

    with torch.no_grad():
        cpu = run(ours)
        try:
            with fake_torch_npu.install(allow_fp32_attention=dtype == torch.float32) as fake, use_platform("npu"):
                npu = run(copy.deepcopy(ours).to(dtype))
                calls = dict(fake.module.calls)
        finally:
            reset_current_platform()
    scale = cpu.abs().max() if dtype != torch.float32 else 1.0
    assert max_diff(npu, cpu) <= tolerance * scale
    assert torch.equal(npu[-1].argmax(), cpu[-1].argmax())
    assert calls.get("_npu_flash_attention_unpad") and calls.get("npu_rotary_mul")
    if family == "qwen3_vl_moe":
        assert calls.get("npu_grouped_matmul") and calls.get("npu_moe_gating_top_k_softmax")


# ------------------------------------------------------------------------------------------------
# configuration and weights


def test_config_layouts_and_budgets():
    ours, _ = load_pair("qwen3_vl_moe")
    config = ours.config
    assert config.vision.deepstack_visual_indexes == (0, 2) and config.deepstack_levels == 2
    assert config.vision.patch_size == 16 and config.text.qk_norm and config.text.moe.norm_topk_prob
    assert ours.model.rotary.mrope_rows.tolist() == [0, 1, 2] * 5 + [0]
    image, video = ours.media_layouts
    assert (image.num_metadata_slots, video.num_metadata_slots, video.per_temporal_patch) == (3, 4, True)
    info = ours.get_processing_info(tiny_checkpoint("qwen3_vl_moe"))
    assert info.max_tokens_per_item == 64 and info.pixel_shape[1] == 3 * 2 * 16 * 16
    video_info = ours.get_video_processing_info(tiny_checkpoint("qwen3_vl_moe"), 10_000, 64)
    # 64 merge windows of 32x32 pixels over two frames: the budget allows 32 tokens per video
    assert video_info.max_tokens_per_item == 32 and video_info.frames <= 16


def test_memory_profile_runs_the_worst_case_image_and_video():
    """The start-up profile's largest image (64 windows: max_pixels) and video (the video
    processor's budget: 64 windows' pixels over two frames = 32 tokens), which our sampler indeed
    makes from a clip of that many frames and that size, through the encoder and the LM (wide rows)."""
    from atb_plugin.engine.config import EngineConfig
    from atb_plugin.engine.memory_profile import profile_run
    from tests.test_video_memory_profile import MeterPlatform

    ours, _ = load_pair("qwen3_vl")
    config = EngineConfig(tiny_checkpoint("qwen3_vl"), kv_cache_blocks=8, device="cpu", limit_mm_per_prompt=2)
    profile = profile_run(ours, config, MeterPlatform())
    assert (profile.num_items, profile.feature_tokens) == (2, 128)
    assert (profile.num_videos, profile.video_tokens, profile.video_grid_thw) == (4, 4 * 32, (1, 8, 16))
    sampling = get_router(tiny_checkpoint("qwen3_vl")).input_builder.video_sampling
    assert sampling.num_frames(profile.video_frames, 2.0) == profile.video_frames == 2
    assert sampling.frame_size(*profile.video_frame_size, profile.video_frames) == profile.video_frame_size


def test_transformers_internal_expert_layout_loads_too(tmp_path):
    from safetensors.torch import load_file, save_file

    from tests.helpers import copy_checkpoint

    ours, _ = load_pair("qwen3_vl_moe")
    copy_checkpoint(tiny_checkpoint("qwen3_vl_moe"), tmp_path)
    state = load_file(str(tmp_path / "model.safetensors"))
    state = {k: v.transpose(1, 2).contiguous() if k.endswith(("gate_up_proj", "down_proj")) and v.dim() == 3 else v
             for k, v in state.items()}
    save_file(state, str(tmp_path / "model.safetensors"))
    again = type(ours).from_pretrained(tmp_path)
    for (name, param), (_, expected) in zip(again.state_dict().items(), ours.state_dict().items()):
        assert torch.equal(param, expected), name


def test_stacked_experts_load_each_rank_s_share():
    """Rank 1 of 2, with and without expert parallelism: the stacked tensors fill the same weights
    as the per-expert ones (Qwen3-MoE's layout) do."""
    from atb_plugin import distributed
    from atb_plugin.models.moe import FusedExperts, MoeConfig

    config = MoeConfig(num_experts=4, top_k=2, intermediate_size=6, norm_topk_prob=True, sparse_layers=frozenset({0}))
    generator = torch.Generator().manual_seed(0)
    gate, up, down = (torch.randn(shape, generator=generator) for shape in ((4, 6, 8), (4, 6, 8), (4, 8, 6)))
    saved = distributed._group
    try:
        for expert_parallel in (True, False):
            distributed._group = distributed._Group(1, 2, expert_parallel=expert_parallel)
            per_expert, stacked = FusedExperts(config, 8), FusedExperts(config, 8)
            for expert in range(4):
                for proj, weight in (("gate_proj", gate), ("up_proj", up), ("down_proj", down)):
                    per_expert.load_expert(expert, proj, weight[expert], proj)
            stacked.load_stacked("gate_up_proj", torch.cat([gate, up], dim=1).transpose(1, 2), "gate_up_proj")
            stacked.load_stacked("down_proj", down.transpose(1, 2), "down_proj")
            assert torch.equal(stacked.w13, per_expert.w13) and torch.equal(stacked.w2, per_expert.w2)
            assert stacked.complete() == ["w13", "w2"]
    finally:
        distributed._group = saved


def test_mindie_item_list_and_mm_processor_kwargs(store, tmp_path, media):
    """MindIE's non-chat form (``tokenize`` of ``{"image"}`` / ``{"video"}`` / ``{"text"}`` items)
    lays out the same blocks as the chat; ``mm_processor_kwargs`` and a video item's own keys
    resample the video (the item's keys win)."""
    images, video = media
    router = get_router(tiny_checkpoint("qwen3_vl"), shm_store=store,
                        media_config=MediaConfig(allowed_local_media_paths=(str(tmp_path),)))
    ours, _ = load_pair("qwen3_vl")

    def kinds(ids):
        mm = MultimodalPrompt.from_ids(ids, ours.media_layouts, expected_instance=store.instance_id)
        return [(b.modality, b.grid_thw) for b in mm.blocks]

    items = [{"image": str(images[0])}, {"video": str(video)}, {"text": "Compare."}]
    expected = [("image", (1, 4, 6))] + [("video", (1, 6, 8))] * 3
    assert kinds(router.input_builder.tokenize(items, request_id="a")) == expected
    fewer = router.input_builder.tokenize(items, request_id="b", mm_processor_kwargs={"fps": 1})
    assert kinds(fewer) == expected[:1] + [("video", (1, 6, 8))] * 2  # 4 frames (min_frames), not 5
    own = [items[0], {"video": str(video), "fps": 2}, items[2]]
    assert kinds(router.input_builder.tokenize(own, request_id="c", mm_processor_kwargs={"fps": 1})) == expected


def test_bad_blocks_are_refused(store, tmp_path, media):
    from atb_plugin.multimodal import MediaBlockError
    from shm import encode_shape_to_int64

    images, video = media
    router = get_router(tiny_checkpoint("qwen3_vl"), shm_store=store,
                        media_config=MediaConfig(allowed_local_media_paths=(str(tmp_path),)))
    ids = router.input_builder.make_context(0, [{"role": "user", "content": [{"video": str(video)}]}],
                                            request_id="r")
    ours, _ = load_pair("qwen3_vl")
    patch_slot = next(i for i, v in enumerate(ids) if v < 0) + 3
    ids[patch_slot] = encode_shape_to_int64((7,))
    with pytest.raises(MediaBlockError, match="PATCH 7 of a video of 3 temporal patches"):
        MultimodalPrompt.from_ids(ids, ours.media_layouts, expected_instance=store.instance_id)


# ------------------------------------------------------------------------------------------------
# 3. tensor parallelism: one spawned group for the module


def _tp_outputs(family: str) -> dict:
    from tests.test_tensor_parallel import _load

    model = _load(family)
    generator = torch.Generator().manual_seed(1)
    grid = (1, 4, 6)
    pixels = torch.randn(24, 3 * 2 * 16 * 16, generator=generator)
    with torch.no_grad():
        features = model.get_multimodal_embeddings(pixels, grid)
        ids = torch.cat([torch.tensor([5, 6, 7]), torch.full((6,), model.config.image_token_id),
                         torch.tensor([8, 9, 10, 11])])
        embeds = model.get_input_embeddings(ids)
        embeds[3:9] = features
        positions, delta = model.get_mrope_positions(ids, [grid])
        runner = SequenceRunner(model, len(ids) + 1)
        logits = [runner.step(ids[:6], positions[:, :6], inputs_embeds=embeds[:6]),
                  runner.step(ids[6:], positions[:, 6:], inputs_embeds=embeds[6:]),
                  runner.step(torch.tensor([7]), model.decode_positions(len(ids), 1, delta))]
    return {"features": features.numpy(), "logits": torch.cat(logits).numpy()}


def _tp_rank(rank: int, size: int, init_method: str) -> dict:
    from tests.test_tensor_parallel import join_group

    join_group(rank, size, init_method)
    return {family: _tp_outputs(family) for family in FAMILIES}


def test_tp2_equals_tp1():
    from tests.test_tensor_parallel import run_ranks

    expected = {family: _tp_outputs(family) for family in FAMILIES}
    for rank_outputs in run_ranks(_tp_rank, 2):
        for family in FAMILIES:
            for key, value in rank_outputs[family].items():
                assert np.abs(value - expected[family][key]).max() <= TOLERANCE, (family, key)


# ------------------------------------------------------------------------------------------------
# 4. offline LLM and the server


def test_offline_greedy_equals_transformers_generate_with_media_reuse(tmp_path, media):
    """Greedy tokens through the engine (prefill chunks of 32 tokens: cuts inside the image and the
    video's blocks) equal transformers' argmax one token at a time; the same chat again reuses its
    segments and the prefix cache and answers the same."""
    from atb_plugin import LLM, SamplingParams

    images, video = media
    _, reference = load_pair("qwen3_vl")
    chat = [{"role": "user", "content": [{"image": str(images[1])}, {"video": str(video)},
                                         {"text": "What happens?"}]}]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    with LLM(tiny_checkpoint("qwen3_vl"), block_size=16, enable_prefix_caching=True, max_num_batched_tokens=32,
             media_config=MediaConfig(allowed_local_media_paths=(str(tmp_path),))) as llm:
        first = llm.chat(chat, params)[0].outputs[0].token_ids
        again = llm.chat(chat, params)[0]  # the same image and video: reused segments, cached prefix
    assert list(again.outputs[0].token_ids) == list(first)
    assert again.num_cached_tokens > 0
    with store_for_reference() as store:
        _, mm, hf = build("qwen3_vl", store, tmp_path, images[1:], video, text="What happens?")
        ids = hf["input_ids"]
        for _ in range(6):  # greedy, one full forward per token (transformers' positions for each)
            token = hf_logits(reference, hf, ids)[-1].argmax()
            ids = torch.cat([ids, token[None]])
    assert list(first) == ids[len(hf["input_ids"]):].tolist()


def store_for_reference():
    import shm

    return shm.ShmStore(shm.ShmStoreConfig(reap_on_start=False))


def test_server_openai_and_mindie(serve, tmp_path, media):
    """Qwen3-VL-MoE served: the openai client's image_url + video_url chat answers as the offline
    engine does, and again the same; ``mm_processor_kwargs`` samples fewer frames (fewer prompt
    tokens); MindIE's ``{"image"}`` / ``{"video"}`` items give the same prompt as vLLM's parts."""
    import base64

    from atb_plugin import LLM, SamplingParams

    images, video = media
    image_url = "data:image/png;base64," + base64.b64encode(images[0].read_bytes()).decode()
    video_url = "data:video/mp4;base64," + base64.b64encode(video.read_bytes()).decode()
    content = [{"type": "image_url", "image_url": {"url": image_url}},
               {"type": "video_url", "video_url": {"url": video_url}}, {"type": "text", "text": "Compare."}]
    messages = [{"role": "user", "content": content}]
    greedy = dict(max_tokens=5, temperature=0, extra_body={"ignore_eos": True})
    with serve(tiny_checkpoint("qwen3_vl_moe")) as server:
        client = server.client()
        model = client.models.list().data[0].id
        first, again = (client.chat.completions.create(model=model, messages=messages, **greedy) for _ in range(2))
        fewer = client.chat.completions.create(model=model, messages=messages, max_tokens=1, temperature=0,
                                               extra_body={"mm_processor_kwargs": {"fps": 1}})
        mindie = server.post("/v1/chat/completions", {"messages": [{"role": "user", "content": [
            {"image": image_url}, {"video": video_url}, {"text": "Compare."}]}], "max_tokens": 5, "temperature": 0,
            "ignore_eos": True})
    with LLM(tiny_checkpoint("qwen3_vl_moe"), block_size=16) as llm:
        offline = llm.chat(messages, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))[0]
    assert first.choices[0].message.content == again.choices[0].message.content == offline.outputs[0].text
    assert first.usage.prompt_tokens == len(offline.prompt_token_ids)
    assert fewer.usage.prompt_tokens < first.usage.prompt_tokens  # 4 frames (min_frames) instead of 5: 2 blocks, not 3
    assert mindie.status_code == 200, mindie.text
    assert mindie.json()["choices"][0]["message"]["content"] == offline.outputs[0].text
