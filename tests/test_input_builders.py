"""Input builders end to end on the tiny checkpoints: golden layouts per family, pixels in shared
memory equal to transformers' processors, both content spellings, history window, leases, and
every bad input.

The expected ids are built here independently of the builders: the checkpoint's chat template
rendered and tokenized by transformers, each image anchor widened into the block docs/wire-format.md
describes, with the token counts taken from transformers' own image processors.
"""

from __future__ import annotations

import base64

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import CLIPImageProcessorPil, Qwen2VLImageProcessorPil

import shm
from atb_plugin.testing.tiny import tiny_checkpoint
from input_builders import (
    ContextTooLongError,
    ConversationError,
    InputBuilderError,
    TooManyImagesError,
    UnsupportedContentError,
)
from input_builders.media_config import MediaConfig
from input_builders.media_errors import MediaNotAllowedError
from routers import get_router

VL_FAMILIES = ["qwen_vl", "qwen2_vl", "qwen2_5_vl", "llava"]


def router_for(family, store, tmp_path, **kwargs):
    media = MediaConfig(allowed_local_media_paths=(str(tmp_path),))
    return get_router(tiny_checkpoint(family), shm_store=store, media_config=media, **kwargs)


def data_url(path) -> str:
    return "data:image/png;base64," + base64.b64encode(path.read_bytes()).decode()


def openai_chat(image_paths, text="What is in the picture?"):
    parts = [{"type": "image_url", "image_url": {"url": data_url(p)}} for p in image_paths]
    return [{"role": "user", "content": parts + [{"type": "text", "text": text}]}]


def mindie_chat(image_paths, text="What is in the picture?"):
    return [{"role": "user", "content": [{"image": str(p)} for p in image_paths] + [{"text": text}]}]


# ---------------------------------------------------------------------------------------------
# independent reference: template ids + blocks from transformers' processors


def reference_pixels(family, path) -> tuple[np.ndarray, tuple | None]:
    image = Image.open(path).convert("RGB")
    if family in ("qwen2_vl", "qwen2_5_vl"):
        out = Qwen2VLImageProcessorPil.from_pretrained(tiny_checkpoint(family))(images=[image], return_tensors="np")
        return out["pixel_values"], tuple(int(x) for x in out["image_grid_thw"][0])
    if family == "llava":
        out = CLIPImageProcessorPil.from_pretrained(tiny_checkpoint(family))(images=[image], return_tensors="np")
        return out["pixel_values"], None
    # Qwen-VL: 448x448 bicubic + CLIP normalisation, i.e. CLIP's processor without the crop.
    processor = CLIPImageProcessorPil(size={"height": 448, "width": 448}, do_center_crop=False)
    return processor(images=[image], return_tensors="np")["pixel_values"], None


def template_ids(router, chat) -> list[int]:
    text = router.tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    return router.tokenizer(text, add_special_tokens=False)["input_ids"]


def hf_chat(image_count, text="What is in the picture?"):
    return [{"role": "user", "content": [{"type": "image"}] * image_count + [{"type": "text", "text": text}]}]


def expected_layout(family, router, image_paths, ids):
    """The ids docs/wire-format.md prescribes, taking NAME/SHAPE values from ``ids`` (checked separately)."""
    raw = router.raw_config
    tokens = template_ids(router, hf_chat(len(image_paths)))
    negatives = iter([i for i in ids if i < 0])
    expected = []
    images = iter(image_paths)
    for token in tokens:
        if family in ("qwen2_vl", "qwen2_5_vl") and token == raw["image_token_id"]:
            _, grid = reference_pixels(family, next(images))
            n = grid[0] * grid[1] * grid[2] // 4
            expected += [next(negatives), next(negatives), shm.encode_shape_to_int64(grid)]
            next(negatives)
            expected += [token] * (n - 3)
        elif family == "llava" and token == raw["image_token_index"]:
            vision = raw["vision_config"]
            n = (vision["image_size"] // vision["patch_size"]) ** 2
            next(images)
            expected += [next(negatives), next(negatives)] + [token] * (n - 2)
        elif family == "qwen_vl" and token == raw["visual"]["image_start_id"]:
            next(images)
            expected += [token, next(negatives), next(negatives)] + [token + 2] * 254
        else:
            expected.append(token)
    return expected


def handles_in(family, ids) -> list[tuple[int, int]]:
    negatives = [i for i in ids if i < 0]
    step = 3 if family in ("qwen2_vl", "qwen2_5_vl") else 2
    return [(negatives[i], negatives[i + 1]) for i in range(0, len(negatives), step)]


@pytest.mark.parametrize("wire_dtype", ["uint8", "float32"])
@pytest.mark.parametrize("family", VL_FAMILIES)
def test_golden_layout_and_pixels(family, wire_dtype, store, images, tmp_path):
    router = router_for(family, store, tmp_path, mm_wire_dtype=wire_dtype)
    ids = router.input_builder.make_context(0, openai_chat(images), request_id="req")
    assert ids == expected_layout(family, router, images, ids)
    # Every handle reads back transformers' pixel values for its image: as they are on the
    # float32 wire (MindIE's form), through the family's model on the uint8 wire.
    model = router.model_cls.from_pretrained(router.model_dir) if wire_dtype == "uint8" else None
    for (name_value, shape_value), path in zip(handles_in(family, ids), images):
        pixels = shm.read_array(name_value, shape_value, expected_instance=store.instance_id)
        assert pixels.dtype == np.dtype(wire_dtype)
        reference, grid = reference_pixels(family, path)
        if model is not None:
            pixels = model.encoder_input(torch.tensor(pixels), grid).numpy()
        assert pixels.shape == reference.shape
        np.testing.assert_allclose(pixels, reference, atol=1e-5, rtol=0)
    assert store.stats()["leased_segments"] == 2
    assert store.release("req") == 2


def test_qwen_vl_text_matches_its_template_and_numbers_pictures(store, images, tmp_path):
    router = router_for("qwen_vl", store, tmp_path)
    ids = router.input_builder.make_context(0, mindie_chat(images), request_id="req")
    text = router.tokenizer.decode([i for i in ids if i >= 0])
    assert "Picture 1: <img>" in text and "Picture 2: <img>" in text
    start, end = router.raw_config["visual"]["image_start_id"], router.raw_config["visual"]["image_start_id"] + 1
    starts = [i for i, t in enumerate(ids) if t == start]
    ends = [i for i, t in enumerate(ids) if t == end]
    assert [e - s - 1 for s, e in zip(starts, ends)] == [256, 256]  # one slot per resampler query
    store.release("req")


@pytest.mark.parametrize("family", VL_FAMILIES)
def test_both_spellings_and_mixed_give_the_same_ids(family, store, images, tmp_path):
    builder = router_for(family, store, tmp_path).input_builder
    openai = builder.make_context(0, openai_chat(images), request_id="a")
    mindie = builder.make_context(0, mindie_chat(images), request_id="b")
    mixed_chat = [{"role": "user", "content": [
        {"image": str(images[0])},
        {"type": "image_url", "image_url": {"url": f"file://{images[1]}"}},
        {"type": "text", "text": "What is in the picture?"},
    ]}]
    mixed = builder.make_context(0, mixed_chat, request_id="c")
    assert openai == mindie == mixed  # same bytes -> same segments, same handles
    assert store.stats()["segments"] == 2


def test_same_image_twice_uses_one_segment(store, images, tmp_path):
    builder = router_for("qwen2_vl", store, tmp_path).input_builder
    ids = builder.make_context(0, mindie_chat([images[0], images[0]]), request_id="req")
    first, second = handles_in("qwen2_vl", ids)
    assert first == second and store.stats()["segments"] == 1


def test_multi_turn_resend_reuses_the_cached_segment(store, images, tmp_path):
    builder = router_for("llava", store, tmp_path).input_builder
    turn_one = builder.make_context(0, mindie_chat(images[:1]), request_id="turn-1")
    store.release("turn-1")
    chat = mindie_chat(images[:1]) + [
        {"role": "assistant", "content": "Noise."},
        {"role": "user", "content": "Are you sure?"},
    ]
    turn_two = builder.make_context(0, chat, request_id="turn-2")
    assert handles_in("llava", turn_one) == handles_in("llava", turn_two)
    stats = store.stats()
    assert stats["segments"] == 1 and stats["leased_segments"] == 1
    store.release("turn-2")


def test_tokenize_the_mindie_item_list(store, images, tmp_path):
    router = router_for("qwen2_vl", store, tmp_path)
    ids = router.tokenize([{"image": str(images[0])}, {"text": "Describe it."}], request_id="req")
    _, grid = reference_pixels("qwen2_vl", images[0])
    n = grid[0] * grid[1] * grid[2] // 4
    start = router.raw_config["vision_start_token_id"]
    assert ids[0] == start and ids[n + 1] == router.raw_config["vision_end_token_id"]
    assert router.tokenizer.decode(ids[n + 2:]) == "Describe it."
    store.release("req")


# ---------------------------------------------------------------------------------------------
# text families


@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_text_families_apply_their_chat_template(family, store, tmp_path):
    router = router_for(family, store, tmp_path)
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": [{"text": "Hi"}]}]
    ids = router.input_builder.make_context(0, chat)
    assert ids == template_ids(router, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}])
    assert store.stats()["segments"] == 0


@pytest.mark.parametrize("family", ["qwen2", "llama", "bert"])
def test_text_families_refuse_images(family, store, images, tmp_path):
    with pytest.raises(UnsupportedContentError, match="text-only model"):
        router_for(family, store, tmp_path).input_builder.make_context(0, mindie_chat(images[:1]), request_id="r")


def test_bert_adds_cls_and_sep(store, tmp_path):
    router = router_for("bert", store, tmp_path)
    ids = router.input_builder.make_context(0, [{"role": "user", "content": "hello world"}])
    assert ids[0] == router.tokenizer.cls_token_id and ids[-1] == router.tokenizer.sep_token_id
    assert ids == router.tokenize("hello world")


# ---------------------------------------------------------------------------------------------
# history window


def long_chat(turns: int):
    chat = [{"role": "system", "content": "You are terse."}]
    for index in range(turns):
        chat += [{"role": "user", "content": f"question number {index} about many things"},
                 {"role": "assistant", "content": f"answer number {index} with some words"}]
    return chat + [{"role": "user", "content": "the final question"}]


def test_oldest_turns_are_dropped_to_fit(store, tmp_path):
    router = router_for("qwen2", store, tmp_path)
    builder = router.input_builder
    full = builder.make_context(0, long_chat(6))
    ids = builder.make_context(0, long_chat(6), adapt_to_max_length=True, max_length=len(full) // 2)
    assert len(ids) <= len(full) // 2
    text = router.tokenizer.decode(ids)
    assert "You are terse." in text and "the final question" in text
    assert "question number 0" not in text and "question number 5" in text
    # Whole turns go: what is left is the template rendering of a suffix of the chat.
    kept = [m for m in long_chat(6) if m["role"] == "system"]
    for start in range(1, 13, 2):
        candidate = kept + long_chat(6)[start:]
        if builder.make_context(0, candidate) == ids:
            break
    else:
        pytest.fail("the windowed prompt is not a turn-aligned suffix of the conversation")


def test_window_keeps_images_of_kept_turns_only(store, images, tmp_path):
    builder = router_for("llava", store, tmp_path).input_builder
    chat = mindie_chat(images[:1], "first") + [{"role": "assistant", "content": "ok"}] + mindie_chat(images[1:], "second")
    full = builder.make_context(0, chat, request_id="full")
    store.release("full")
    ids = builder.make_context(0, chat, adapt_to_max_length=True, max_length=len(full) - 5, request_id="cut")
    assert len(handles_in("llava", ids)) == 1
    assert store.stats()["leased_segments"] == 1
    store.release("cut")


def test_last_turn_too_long_names_the_numbers(store, tmp_path):
    builder = router_for("qwen2", store, tmp_path).input_builder
    with pytest.raises(ContextTooLongError, match=r"needs \d+ tokens.*max_length is 8"):
        builder.make_context(0, long_chat(1), adapt_to_max_length=True, max_length=8)


def test_truncate_keeps_the_tail_without_splitting_a_block(store, images, tmp_path):
    builder = router_for("llava", store, tmp_path).input_builder
    full = builder.make_context(0, mindie_chat(images, "x"), request_id="full")
    store.release("full")
    block = 16
    # A budget that ends mid-way through the first block: that whole block must go.
    budget = len(full) - full.index(next(i for i in full if i < 0)) - block // 2
    ids = builder.make_context(0, mindie_chat(images, "x"), adapt_to_max_length=True,
                               max_length=budget, truncate=True, request_id="cut")
    assert len(ids) <= budget and ids == full[len(full) - len(ids):]
    assert len(handles_in("llava", ids)) == 1 and store.stats()["leased_segments"] == 1
    store.release("cut")


# ---------------------------------------------------------------------------------------------
# bad input: a specific error, and no lease left behind


@pytest.mark.parametrize(
    "conversation, error, message",
    [
        ([], ConversationError, "non-empty list"),
        ([{"role": "robot", "content": "hi"}], ConversationError, "role 'robot'"),
        ([{"role": "user"}], ConversationError, "'role' and 'content'"),
        ([{"role": "user", "content": [{"type": "video_url", "video_url": {}}]}], ConversationError, "video_url"),
        ([{"role": "user", "content": [{"video": ["a.png", "b.png"]}]}], UnsupportedContentError, "list of frames"),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}], ConversationError, "url"),
        ([{"role": "user", "content": [{"colour": "red"}]}], ConversationError, "unknown content item"),
        ([{"role": "user", "content": 42}], ConversationError, "string or a list"),
    ],
)
def test_malformed_conversations(conversation, error, message, store, tmp_path):
    with pytest.raises(error, match=message):
        router_for("qwen2_vl", store, tmp_path).input_builder.make_context(0, conversation, request_id="r")
    assert store.stats()["requests"] == 0


def test_too_many_images(store, images, tmp_path):
    builder = router_for("llava", store, tmp_path, max_images_per_prompt=1).input_builder
    with pytest.raises(TooManyImagesError, match="at most 1 per prompt"):
        builder.make_context(0, mindie_chat(images), request_id="r")
    assert store.stats()["segments"] == 0


def test_image_outside_allowed_dirs(store, tmp_path):
    builder = router_for("qwen2_vl", store, tmp_path).input_builder
    with pytest.raises(MediaNotAllowedError, match="outside the allowed media directories"):
        builder.make_context(0, mindie_chat(["/etc/hostname"]), request_id="r")
    assert store.stats()["segments"] == 0


def test_images_need_a_request_id(store, images, tmp_path):
    with pytest.raises(ValueError, match="request_id is required"):
        router_for("llava", store, tmp_path).input_builder.make_context(0, mindie_chat(images))
    assert store.stats()["segments"] == 0


def test_image_token_typed_by_the_user_is_refused(store, images, tmp_path):
    router = router_for("qwen2_vl", store, tmp_path)
    with pytest.raises(InputBuilderError, match="must not contain the image token"):
        router.input_builder.make_context(0, mindie_chat(images[:1], "sneaky <|image_pad|>"), request_id="r")
    assert store.stats()["requests"] == 0


def test_a_failure_after_the_first_image_releases_its_lease(store, images, tmp_path, monkeypatch):
    builder = router_for("qwen2_vl", store, tmp_path).input_builder
    calls = []
    original = type(builder.preprocessor).shm_payload  # what the builder preprocesses an image with

    def fail_on_second(self, image):
        calls.append(image)
        if len(calls) == 2:
            raise RuntimeError("preprocessing blew up")
        return original(self, image)

    monkeypatch.setattr(type(builder.preprocessor), "shm_payload", fail_on_second)
    with pytest.raises(RuntimeError, match="blew up"):
        builder.make_context(0, mindie_chat(images), request_id="r")
    stats = store.stats()
    assert stats["requests"] == 0 and stats["leased_segments"] == 0  # the first image is only cached


def test_image_too_small_for_a_qwen2_vl_block(store, tmp_path):
    import dataclasses

    builder = router_for("qwen2_vl", store, tmp_path).input_builder
    # With min_pixels of one merge window a tiny image is one token: no room for NAME/SHAPE/THW.
    builder.preprocessor = dataclasses.replace(builder.preprocessor, min_pixels=28 * 28)
    path = tmp_path / "dot.png"
    Image.new("RGB", (28, 28), "red").save(path)
    with pytest.raises(InputBuilderError, match="1 image tokens; a block needs at least 3"):
        builder.make_context(0, mindie_chat([path]), request_id="r")
    assert store.stats()["requests"] == 0
