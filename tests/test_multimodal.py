"""MultimodalPrompt: blocks found in real builder output, pixels reloaded from shared memory,
features merged at exactly the placeholder positions (also chunk by chunk), and every failure
named. The encoder here is a small deterministic module so each feature row is recognisable;
the real encoders are checked against transformers in the tests/test_models_*.py files."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image
from torch import nn

import shm
from atb_plugin.multimodal import MediaBlockError, MediaLayout, MultimodalPrompt
from atb_plugin.testing.tiny import tiny_checkpoint
from input_builders.media import MediaConfig
from routers import get_router

HIDDEN = 8


class RowEncoder(nn.Module):
    """Feature row i of an image = (i, mean of its pixels, 0, ...): position and content visible."""

    def __init__(self, vocab: int, layout: MediaLayout):
        super().__init__()
        self.embed = nn.Embedding(vocab, HIDDEN)
        self.layout = layout
        self.calls = 0

    def get_input_embeddings(self, ids):
        return self.embed(ids)

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


@pytest.fixture
def store():
    with shm.ShmStore(shm.ShmStoreConfig(reap_on_start=False, cache_bytes=0)) as store:
        yield store


def build(family, store, tmp_path, sizes=((60, 90), (120, 64))):
    rng = np.random.default_rng(1)
    parts = []
    for index, (height, width) in enumerate(sizes):
        path = tmp_path / f"image{index}.png"
        Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(path)
        parts.append({"image": str(path)})
    router = get_router(tiny_checkpoint(family), shm_store=store,
                        media_config=MediaConfig(allowed_local_media_paths=(str(tmp_path),)))
    ids = router.input_builder.make_context(0, [{"role": "user", "content": parts + [{"text": "Describe."}]}],
                                            request_id="req")
    layout = layout_for(family, router.raw_config)
    return router, ids, layout


@pytest.mark.parametrize("family", ["qwen_vl", "qwen2_vl", "llava"])
def test_blocks_pixels_and_merge(family, store, tmp_path):
    router, ids, layout = build(family, store, tmp_path)
    prompt = MultimodalPrompt.from_ids(ids, layout, expected_instance=store.instance_id)
    assert len(prompt.blocks) == 2
    restored = prompt.token_ids.tolist()
    assert min(restored) >= 0
    for block in prompt.blocks:
        # Metadata slots are back to the placeholder; the block is exactly its placeholders.
        assert restored[block.start:block.start + block.length] == [layout.placeholder_id] * block.length
        assert ids[block.start] < 0 and ids[block.start + 1] < 0
        handle_pixels = shm.read_array(ids[block.start], ids[block.start + 1])
        np.testing.assert_array_equal(block.pixel_values.numpy(), handle_pixels)
    model = RowEncoder(router.tokenizer.vocab_size + 64, layout)
    embeds = prompt.embed(model)
    text = model.embed(prompt.token_ids)
    in_block = torch.zeros(len(ids), dtype=torch.bool)
    for block in prompt.blocks:
        in_block[block.start:block.start + block.length] = True
        rows = embeds[block.start:block.start + block.length]
        assert torch.equal(rows[:, 0], torch.arange(block.length, dtype=torch.float32))
        assert torch.allclose(rows[:, 1], block.pixel_values.float().mean().expand(block.length))
    assert torch.equal(embeds[~in_block], text[~in_block])
    store.release("req")


def test_chunks_cut_anywhere_equal_the_whole_and_encode_once(store, tmp_path):
    router, ids, layout = build("qwen2_vl", store, tmp_path)
    prompt = MultimodalPrompt.from_ids(ids, layout)
    model = RowEncoder(router.tokenizer.vocab_size + 64, layout)
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
    model = RowEncoder(router.tokenizer.vocab_size + 64, MediaLayout(layout.placeholder_id, 2, 12))
    with pytest.raises(MediaBlockError, match="produced 12 feature rows for 16 placeholder slots"):
        prompt.embed(model)
    store.release("req")


def test_grid_and_segment_must_agree(store, tmp_path):
    _, ids, layout = build("qwen2_vl", store, tmp_path)
    start = next(i for i, t in enumerate(ids) if t < 0)
    t, h, w = shm.decode_shape_from_int64(ids[start + 2])
    lying = list(ids)
    lying[start + 2] = shm.encode_shape_to_int64((t, h, w + 2))  # claims more patches...
    lying[start + 3:start + 3] = [layout.placeholder_id] * (h * 2 // 4)  # ...with matching slots
    with pytest.raises(MediaBlockError, match=rf"needs {t * h * (w + 2)} patch rows, the segment holds {t * h * w}"):
        MultimodalPrompt.from_ids(lying, layout)
    store.release("req")


def test_layout_validation():
    with pytest.raises(ValueError, match="needs the THW slot"):
        MediaLayout(5, 2, None)
    with pytest.raises(ValueError, match="2 or 3"):
        MediaLayout(5, 4, 10)
