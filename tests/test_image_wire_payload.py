"""The uint8 image wire's fast paths write the same bytes as the paths they replace:
``RgbImagePayload`` (Pillow packs the resized image straight into its segment) against
``store.put(np.asarray(image))``, ``Qwen2VLPreprocessor.shm_payload`` against its ``__call__``,
the builder's segment against the preprocessor's pixel values, and the decoded image (the file
image's pixels, not a copy of them) against a plain decode."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
from PIL import Image

import shm
from input_builders.image import load_image
from input_builders.media_config import MediaConfig
from input_builders.preprocess import Qwen2VLPreprocessor, RgbImagePayload
from shm.segment import SegmentPayload, list_segment_names


@pytest.fixture
def store():
    with shm.ShmStore(shm.ShmStoreConfig(reap_on_start=False)) as store:
        yield store


def noise(width: int, height: int, seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def segment_bytes(handle) -> bytes:
    return shm.read_array(handle.name_value, handle.shape_value).tobytes()


# Odd widths, long rows (a few per 1 MiB block) and heights over one block,
# so the image is packed in several blocks and the last one is short.
@pytest.mark.parametrize("size", [(1, 1), (7, 3), (333, 1), (1283, 401), (100_003, 7), (640, 1700)])
def test_payload_segment_equals_the_array_segment(store, size):
    image = noise(*size)
    payload = RgbImagePayload(image)
    assert payload.shape == (size[1], size[0], 3) and payload.nbytes == size[0] * size[1] * 3
    from_payload = store.put(payload, request_id="a")
    from_array = store.put(np.asarray(image), request_id="b")
    assert (from_payload.shape, from_payload.dtype, from_payload.shape_value) == \
           (from_array.shape, from_array.dtype, from_array.shape_value)
    assert segment_bytes(from_payload) == segment_bytes(from_array) == image.tobytes()


def test_payload_writes_whole_again_when_retried(store):
    """A store out of room evicts and writes the payload again (shm.store): each write starts over."""
    image = noise(1283, 401, seed=1)
    payload = RgbImagePayload(image)
    first, second = store.put(payload, request_id="a"), store.put(payload, request_id="b")
    assert first.name != second.name and segment_bytes(first) == segment_bytes(second) == image.tobytes()


def test_payload_reuses_a_key_like_an_array(store):
    image = noise(32, 16)
    first = store.put(np.asarray(image), key="k", request_id="a")
    assert store.put(RgbImagePayload(image), key="k", request_id="b") == first
    with pytest.raises(ValueError, match="the key must identify the content"):
        store.put(RgbImagePayload(noise(16, 16)), key="k", request_id="c")


def test_payload_takes_rgb_only():
    with pytest.raises(ValueError, match="RGB"):
        RgbImagePayload(noise(4, 4).convert("L"))


class _Short(SegmentPayload):
    shape, dtype = (4, 4, 3), np.dtype(np.uint8)

    def write_to(self, fd, offset):
        return 5


def test_a_short_payload_is_refused_and_leaves_no_segment(store):
    before = set(list_segment_names())
    with pytest.raises(ValueError, match="wrote 5 of its 48 bytes"):
        store.put(_Short(), request_id="a")
    assert set(list_segment_names()) - before == set()
    assert store.stats()["segments"] == 0


@pytest.mark.parametrize("size", [(1280, 720), (57, 911), (56, 56), (2000, 30)])
def test_qwen2_vl_shm_payload_equals_its_pixel_values(store, size):
    preprocessor = Qwen2VLPreprocessor(patch_size=16, min_pixels=65536, max_pixels=16777216)
    image = noise(*size, seed=size[0])
    payload, grid = preprocessor.shm_payload(image)
    processed = preprocessor(image)
    assert isinstance(payload, RgbImagePayload) and grid == processed.grid_thw
    assert segment_bytes(store.put(payload, request_id="a")) == processed.pixel_values.tobytes()


def test_float32_wire_keeps_its_array(store):
    preprocessor = Qwen2VLPreprocessor(wire_dtype="float32")
    image = noise(100, 60)
    payload, grid = preprocessor.shm_payload(image)
    processed = preprocessor(image)
    assert isinstance(payload, np.ndarray) and grid == processed.grid_thw
    np.testing.assert_array_equal(payload, processed.pixel_values)


def test_payload_refuses_what_the_preprocessor_refuses():
    with pytest.raises(ValueError, match="expected an RGB image"):
        Qwen2VLPreprocessor().shm_payload(noise(64, 64).convert("RGBA"))


@pytest.mark.parametrize("fmt", ["JPEG", "PNG"])
def test_decoded_image_is_the_file_pixels_alone(fmt):
    buffer = io.BytesIO()
    noise(97, 45, seed=3).save(buffer, fmt)
    data = buffer.getvalue()
    loaded = load_image("data:image/x;base64," + base64.b64encode(data).decode(), MediaConfig())
    with Image.open(io.BytesIO(data)) as reference:
        expected = reference.convert("RGB").tobytes()
    assert type(loaded.image) is Image.Image  # not a file image: holds no source bytes or reader
    assert loaded.image.mode == "RGB" and loaded.image.tobytes() == expected
