"""MultimodalPrompt: blocks found in real builder output, pixels reloaded from shared memory in
either wire dtype, features merged at exactly the placeholder positions (also chunk by chunk),
and every failure named. The encoder here is a small deterministic module so each feature row is
recognisable, behind the family's real pixel format; the real encoders are checked against
transformers in the tests/test_models_*.py files."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image
from torch import nn

import shm
from atb_plugin.multimodal import MediaBlockError, MediaLayout, MultimodalPrompt
from atb_plugin.multimodal.pixels import ChwImageFormat, PixelFormat, Qwen2VLPatchFormat
from atb_plugin.multimodal.wire import PixelNormalization
from atb_plugin.testing.tiny import tiny_checkpoint
from input_builders.media_config import MediaConfig
from routers import get_router

HIDDEN = 8


class RowEncoder(nn.Module):
    """Feature row i of an image = (i, mean of its pixels, 0, ...): position and content visible."""

    def __init__(self, vocab: int, layout: MediaLayout, pixel_format: PixelFormat):
        super().__init__()
        self.embed = nn.Embedding(vocab, HIDDEN)
        self.layout = layout
        self.pixel_format = pixel_format
        self.calls = 0

    def get_input_embeddings(self, ids):
        return self.embed(ids)

    def encoder_input(self, pixels, grid_thw=None):
        return self.pixel_format.encoder_input(pixels, grid_thw, torch.float32)

    def get_multimodal_embeddings(self, pixel_values, grid_thw):
        self.calls += 1
        rows = torch.zeros(self.layout.block_length(grid_thw), HIDDEN)
        rows[:, 0] = torch.arange(rows.shape[0])
        rows[:, 1] = pixel_values.float().mean()
        return rows


def layout_for(family: str, raw: dict) -> MediaLayout:
    if family in ("qwen2_vl", "qwen2_5_vl"):
        return MediaLayout(raw["image_token_id"], 3, None, merge_size=2)
    if family == "llava":
        vision = raw["vision_config"]
        return MediaLayout(raw["image_token_index"], 2, (vision["image_size"] // vision["patch_size"]) ** 2)
    return MediaLayout(raw["visual"]["image_start_id"] + 2, 2, 256)


def format_for(family: str, raw: dict) -> PixelFormat:
    """The family's pixel format, as its model class builds it from the same config."""
    if family in ("qwen2_vl", "qwen2_5_vl"):
        vision = raw["vision_config"]
        return Qwen2VLPatchFormat(PixelNormalization(), vision.get("patch_size", 14),
                                  vision.get("temporal_patch_size", 2), vision.get("spatial_merge_size", 2))
    side = raw["vision_config"]["image_size"] if family == "llava" else raw["visual"]["image_size"]
    return ChwImageFormat(PixelNormalization(), side, side)


def encoder_for(family: str, router, layout: MediaLayout) -> RowEncoder:
    return RowEncoder(router.tokenizer.vocab_size + 64, layout, format_for(family, router.raw_config))


@pytest.fixture
def store():
    with shm.ShmStore(shm.ShmStoreConfig(reap_on_start=False, cache_bytes=0)) as store:
        yield store


def build(family, store, tmp_path, sizes=((60, 90), (120, 64)), wire_dtype="uint8"):
    rng = np.random.default_rng(1)
    parts = []
    for index, (height, width) in enumerate(sizes):
        path = tmp_path / f"image{index}.png"
        Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(path)
        parts.append({"image": str(path)})
    router = get_router(tiny_checkpoint(family), shm_store=store,
                        media_config=MediaConfig(allowed_local_media_paths=(str(tmp_path),)), mm_wire_dtype=wire_dtype)
    ids = router.input_builder.make_context(0, [{"role": "user", "content": parts + [{"text": "Describe."}]}],
                                            request_id="req")
    layout = layout_for(family, router.raw_config)
    return router, ids, layout


@pytest.mark.parametrize("wire_dtype", ["uint8", "float32"])
@pytest.mark.parametrize("family", ["qwen_vl", "qwen2_vl", "llava"])
def test_blocks_pixels_and_merge(family, wire_dtype, store, tmp_path):
    router, ids, layout = build(family, store, tmp_path, wire_dtype=wire_dtype)
    prompt = MultimodalPrompt.from_ids(ids, layout, expected_instance=store.instance_id)
    assert len(prompt.blocks) == 2
    restored = prompt.token_ids.tolist()
    assert min(restored) >= 0
    for block in prompt.blocks:
        # Metadata slots are back to the placeholder; the block is exactly its placeholders.
        assert restored[block.start:block.start + block.length] == [layout.placeholder_id] * block.length
        assert ids[block.start] < 0 and ids[block.start + 1] < 0
        handle_pixels = shm.read_array(ids[block.start], ids[block.start + 1])
        assert handle_pixels.dtype == np.dtype(wire_dtype)  # the header says which form it is
        np.testing.assert_array_equal(block.pixel_values.numpy(), handle_pixels)
    model = encoder_for(family, router, layout)
    embeds = prompt.embed(model)
    text = model.embed(prompt.token_ids)
    in_block = torch.zeros(len(ids), dtype=torch.bool)
    for block in prompt.blocks:
        in_block[block.start:block.start + block.length] = True
        rows = embeds[block.start:block.start + block.length]
        assert torch.equal(rows[:, 0], torch.arange(block.length, dtype=torch.float32))
        pixels = model.encoder_input(block.pixel_values, block.grid_thw)
        assert torch.allclose(rows[:, 1], pixels.mean().expand(block.length))
    assert torch.equal(embeds[~in_block], text[~in_block])
    store.release("req")


def test_chunks_cut_anywhere_equal_the_whole_and_encode_once(store, tmp_path):
    router, ids, layout = build("qwen2_vl", store, tmp_path)
    prompt = MultimodalPrompt.from_ids(ids, layout)
    model = encoder_for("qwen2_vl", router, layout)
    whole = prompt.embed(model)
    block = prompt.blocks[0]
    cuts = [0, block.start + 1, block.start + block.length // 2, len(ids) - 3, len(ids)]
    pieces = [prompt.embed(model, a, b) for a, b in zip(cuts[:-1], cuts[1:])]
    assert torch.equal(torch.cat(pieces), whole)
    assert model.calls == 2  # once per image, not once per chunk
    store.release("req")


def test_a_released_segment_fails_that_prompt_only(store, tmp_path):
    _, ids, layout = build("llava", store, tmp_path)
    store.release("req")  # cache_bytes=0: unlinked right away
    with pytest.raises(MediaBlockError, match=r"media block 0 at position \d+: segment psm_\w+ does not exist"):
        MultimodalPrompt.from_ids(ids, layout)
    # Another request's text-only prompt is untouched by that failure.
    assert MultimodalPrompt.from_ids([1, 2, 3], layout).blocks == []


def test_tampered_name_and_wrong_shape(store, tmp_path):
    _, ids, layout = build("llava", store, tmp_path)
    start = next(i for i, t in enumerate(ids) if t < 0)
    tampered = list(ids)
    tampered[start] = -((-ids[start]) ^ 0b100)
    with pytest.raises(MediaBlockError, match="invalid handle"):
        MultimodalPrompt.from_ids(tampered, layout)
    wrong = list(ids)
    wrong[start + 1] = shm.encode_shape_to_int64((1, 3, 8, 8))
    with pytest.raises(MediaBlockError, match=r"shape \[1, 3, 8, 8\] does not match the segment's"):
        MultimodalPrompt.from_ids(wrong, layout)
    store.release("req")


def test_missing_placeholders_are_counted(store, tmp_path):
    _, ids, layout = build("llava", store, tmp_path)
    start = next(i for i, t in enumerate(ids) if t < 0)
    cut = ids[: start + 10] + ids[start + layout.tokens_per_block:]  # drop 6 placeholders
    with pytest.raises(MediaBlockError, match=r"needs 16 slots \(2 metadata \+ 14 placeholders \d+\), found (\d+)") as error:
        MultimodalPrompt.from_ids(cut, layout)
    assert int(error.value.args[0].rsplit("found ", 1)[1].split()[0]) < 14
    store.release("req")


def test_feature_count_mismatch_names_both_counts(store, tmp_path):
    router, ids, layout = build("llava", store, tmp_path)
    prompt = MultimodalPrompt.from_ids(ids, layout)
    model = RowEncoder(router.tokenizer.vocab_size + 64, MediaLayout(layout.placeholder_id, 2, 12),
                       format_for("llava", router.raw_config))
    with pytest.raises(MediaBlockError, match="produced 12 feature rows for 16 placeholder slots"):
        prompt.embed(model)
    store.release("req")


@pytest.mark.parametrize("wire_dtype", ["uint8", "float32"])
def test_grid_and_segment_must_agree(wire_dtype, store, tmp_path):
    router, ids, layout = build("qwen2_vl", store, tmp_path, wire_dtype=wire_dtype)
    start = next(i for i, t in enumerate(ids) if t < 0)
    t, h, w = shm.decode_shape_from_int64(ids[start + 2])
    lying = list(ids)
    lying[start + 2] = shm.encode_shape_to_int64((t, h, w + 2))  # claims more patches...
    lying[start + 3:start + 3] = [layout.placeholder_id] * (h * 2 // 4)  # ...with matching slots
    prompt = MultimodalPrompt.from_ids(lying, layout)
    expected = (rf"does not fit grid_thw \[{t}, {h}, {w + 2}\]" if wire_dtype == "uint8"
                else rf"expected \[{t * h * (w + 2)}, \d+\]")
    with pytest.raises(MediaBlockError, match=rf"media block 0 at position {start}: .*{expected}"):
        prompt.features(encoder_for("qwen2_vl", router, layout))
    store.release("req")


@pytest.mark.parametrize("dtype", [np.float16, np.int32, np.float64])
@pytest.mark.parametrize("family", ["qwen2_vl", "llava"])
def test_a_segment_of_another_dtype_fails_that_request_clearly(family, dtype, store, tmp_path):
    """A frontend speaking another wire format: the header's dtype is neither uint8 nor float32."""
    router, ids, layout = build(family, store, tmp_path)
    start = next(i for i, t in enumerate(ids) if t < 0)
    original = shm.read_array(ids[start], ids[start + 1])
    foreign = store.put(original.astype(dtype), request_id="req")
    ids = list(ids)
    ids[start:start + 2] = [foreign.name_value, foreign.shape_value]
    prompt = MultimodalPrompt.from_ids(ids, layout)
    with pytest.raises(MediaBlockError, match=rf"media block 0 at position {start}: the segment holds "
                                              rf"{np.dtype(dtype).name} pixels; this model reads uint8 .* or float32"):
        prompt.features(encoder_for(family, router, layout))
    store.release("req")
    assert store.stats()["segments"] == 0  # nothing left behind (cache_bytes=0)


def test_layout_validation():
    with pytest.raises(ValueError, match="needs the THW slot"):
        MediaLayout(5, 2, None)
    with pytest.raises(ValueError, match="2, 3 or 4"):
        MediaLayout(5, 5, 10)
    with pytest.raises(ValueError, match="a video block's"):  # NAME, SHAPE, THW, SPG: video only
        MediaLayout(5, 4, 10)


def test_the_chw_format_names_what_it_takes():
    from atb_plugin.multimodal.pixels import PixelFormatError

    fmt = ChwImageFormat(PixelNormalization(), 336, 336)
    with pytest.raises(PixelFormatError, match="the image is 400x300 pixels; this model's encoder takes 336x336"):
        fmt.encoder_input(torch.zeros(300, 400, 3, dtype=torch.uint8), None, torch.float32)
    with pytest.raises(PixelFormatError, match=r"RGB image \[H, W, 3\] .*got shape \[336, 336\]"):
        fmt.encoder_input(torch.zeros(336, 336, dtype=torch.uint8), None, torch.float32)
    with pytest.raises(PixelFormatError, match=r"float32 pixel values of shape \[1, 3, 224, 224\]"):
        fmt.encoder_input(torch.zeros(1, 3, 224, 224), None, torch.float32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_models_get_the_float32_values_cast(dtype):
    """Normalised in float32 then cast: exactly what float32 pixels from the frontend become on a
    half-precision model, for both layouts."""
    image = torch.from_numpy(np.random.default_rng(3).integers(0, 256, (56, 84, 3), dtype=np.uint8))
    for fmt, grid in ((Qwen2VLPatchFormat(PixelNormalization(), 14, 2, 2), (1, 4, 6)),
                      (ChwImageFormat(PixelNormalization(), 56, 84), None)):
        full = fmt.encoder_input(image, grid, torch.float32)
        half = fmt.encoder_input(image, grid, dtype)
        assert half.dtype == dtype and torch.equal(half, full.to(dtype))
        assert torch.equal(fmt.encoder_input(full, grid, dtype), half)  # the float32 wire, same model
