"""Segments: format, zero-copy reads, cross-process reads, and every way a handle can be bad."""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest
import torch

import shm
from shm.process import ProcessIdentity
from shm.segment import (
    DTYPE_CODES,
    HEADER_SIZE,
    SegmentHeader,
    ShmReader,
    read_header,
    segment_name,
    unlink_segment,
    write_segment,
)
from tests.helpers import patch_bytes, run_python, shm_path


def image(seed: int = 0, shape=(3, 448, 448)) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape, dtype=np.float32)


@pytest.mark.parametrize("dtype", sorted(DTYPE_CODES, key=str))
def test_round_trip_every_dtype(store, dtype):
    array = (np.arange(2 * 3 * 5) % 7).reshape(2, 3, 5).astype(dtype)
    handle = store.put(array, request_id="r")
    view = shm.read_array(handle.name_value, handle.shape_value)
    assert view.dtype == dtype and view.shape == (2, 3, 5)
    np.testing.assert_array_equal(view, array)


def test_view_is_read_only_and_zero_copy(store):
    handle = store.put(image(), request_id="r")
    first = shm.read_array(handle.name_value, handle.shape_value)
    second = shm.read_array(handle.name_value, handle.shape_value)
    assert not first.flags.writeable
    with pytest.raises(ValueError):
        first[0, 0, 0] = 1.0
    # Both views look at the same shared pages: no copy was made.
    assert np.shares_memory(first, second)


def test_writable_view_is_copy_on_write_and_feeds_torch_without_copy(store):
    array = image()
    handle = store.put(array, request_id="r")
    private = shm.read_array(handle.name_value, handle.shape_value, writable=True)
    tensor = torch.from_numpy(private)
    assert tensor.data_ptr() == private.ctypes.data  # zero-copy
    tensor.mul_(0)
    assert float(tensor.abs().sum()) == 0.0
    # The segment itself is untouched: another read sees the original pixels.
    np.testing.assert_array_equal(shm.read_array(handle.name_value, handle.shape_value), array)


def test_header_records_owner_and_layout(store):
    array = image(shape=(4, 8))
    handle = store.put(array, request_id="r")
    header = read_header(handle.name)
    assert header.name == handle.name
    assert header.instance_id == store.instance_id
    assert header.owner == ProcessIdentity.current()
    assert header.shape == (4, 8) and header.dtype == np.float32
    assert header.payload_nbytes == array.nbytes
    assert os.path.getsize(shm_path(handle.name)) == HEADER_SIZE + array.nbytes


def test_names_are_ours_and_fit_the_codec(store):
    handles = [store.put(image(i, (2, 2)), request_id="r") for i in range(3)]
    for handle in handles:
        assert handle.name.startswith("psm_" + store.instance_id)
        assert len(handle.name) == len("psm_") + 11
        assert shm.decode_shm_name_from_int64(handle.name_value) == handle.name
    assert len({h.name for h in handles}) == 3


def test_cross_process_read_does_not_unlink_or_warn(store):
    array = image(7)
    handle = store.put(array, request_id="r")
    result = run_python(f"""
        import numpy as np, shm
        view = shm.read_array({handle.name_value}, {handle.shape_value}, dtype=np.float32)
        expected = np.random.default_rng(7).standard_normal((3, 448, 448), dtype=np.float32)
        assert np.array_equal(view, expected), "payload differs across processes"
        print("ok", view.shape)
    """)
    assert result.returncode == 0, result.stderr
    assert "ok (3, 448, 448)" in result.stdout
    # The reader neither unlinked the segment nor produced resource_tracker warnings at exit.
    assert "resource_tracker" not in result.stderr and "leaked" not in result.stderr, result.stderr
    assert os.path.exists(shm_path(handle.name))
    np.testing.assert_array_equal(shm.read_array(handle.name_value, handle.shape_value), array)


def test_cross_process_read_in_spawned_multiprocessing_child(store):
    import multiprocessing

    handle = store.put(image(3, (5, 6)), request_id="r")
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(1) as pool:
        total = pool.apply(_sum_segment, (handle.name_value, handle.shape_value))
    assert total == pytest.approx(float(image(3, (5, 6)).sum(dtype=np.float64)))


def _sum_segment(name_value: int, shape_value: int) -> float:
    return float(shm.read_array(name_value, shape_value).sum(dtype=np.float64))


# ---------------------------------------------------------------------------------------------
# bad handles: each one fails loudly, none returns zeros


def test_missing_segment(store):
    handle = store.put(image(shape=(2, 2)), request_id="r")
    store.close()
    with pytest.raises(shm.ShmHandleError, match="does not exist"):
        shm.read_array(handle.name_value, handle.shape_value)


def test_shape_mismatch_names_both_shapes(store):
    handle = store.put(image(shape=(3, 4)), request_id="r")
    wrong_shape = shm.encode_shape_to_int64((4, 3))
    with pytest.raises(shm.ShmHandleError, match=r"\[4, 3\].*\[3, 4\]"):
        shm.read_array(handle.name_value, wrong_shape)


def test_dtype_mismatch(store):
    handle = store.put(np.zeros((2, 2), np.uint8), request_id="r")
    with pytest.raises(shm.ShmHandleError, match="uint8.*float32"):
        shm.read_array(handle.name_value, handle.shape_value, dtype=np.float32)


def test_tampered_name_value_is_an_invalid_handle(store):
    handle = store.put(image(shape=(2, 2)), request_id="r")
    with pytest.raises(shm.ShmHandleError, match="invalid handle"):
        # Flip bit 1 of the magnitude: a checksum bit (XOR on the negative value itself would
        # flip two's-complement bits, which can carry into a character instead).
        shm.read_array(-((-handle.name_value) ^ 0b10), handle.shape_value)


def test_other_instance_is_refused_when_an_instance_is_expected(store):
    handle = store.put(image(shape=(2, 2)), request_id="r")
    assert shm.read_array(handle.name_value, handle.shape_value, expected_instance=store.instance_id).shape == (2, 2)
    with pytest.raises(shm.ShmHandleError, match="belongs to instance"):
        shm.read_array(handle.name_value, handle.shape_value, expected_instance="0000")


def _orphan_name(store) -> str:
    # A name in the store's namespace that the store itself never hands out.
    return segment_name(store.instance_id, 26_000_000)


def test_foreign_file_with_our_name_pattern(store):
    name = _orphan_name(store)
    with open(shm_path(name), "wb") as foreign:
        foreign.write(b"somebody else's bytes".ljust(HEADER_SIZE + 16, b"!"))
    try:
        with pytest.raises(shm.ShmHandleError, match="foreign: magic"):
            shm.read_array(shm.encode_shm_name_to_int64(name), shm.encode_shape_to_int64((4,)))
    finally:
        unlink_segment(name)


def test_copied_segment_is_foreign(store):
    handle = store.put(image(shape=(2, 2)), request_id="r")
    copy = _orphan_name(store)
    shutil.copyfile(shm_path(handle.name), shm_path(copy))
    try:
        with pytest.raises(shm.ShmHandleError, match=f"foreign: its header names {handle.name}"):
            shm.read_array(shm.encode_shm_name_to_int64(copy), handle.shape_value)
    finally:
        unlink_segment(copy)


def test_uncommitted_segment_is_not_read(store):
    name = _orphan_name(store)
    fd = os.open(shm_path(name), os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    os.ftruncate(fd, HEADER_SIZE + 64)  # a writer that died before writing its header
    os.close(fd)
    try:
        with pytest.raises(shm.ShmHandleError, match="not committed"):
            shm.read_array(shm.encode_shm_name_to_int64(name), shm.encode_shape_to_int64((16,)))
    finally:
        unlink_segment(name)


def test_corrupted_header_fails_its_crc(store):
    handle = store.put(image(shape=(2, 2)), request_id="r")
    patch_bytes(handle.name, 16, (9).to_bytes(8, "little"))  # shape[0] := 9
    with pytest.raises(shm.ShmHandleError, match="CRC"):
        ShmReader().read_array(handle.name_value, handle.shape_value)


def test_truncated_payload(store):
    handle = store.put(image(shape=(64, 64)), request_id="r")
    os.truncate(shm_path(handle.name), HEADER_SIZE + 100)
    with pytest.raises(shm.ShmHandleError, match="truncated"):
        ShmReader().read_array(handle.name_value, handle.shape_value)


def test_marker_is_not_a_data_segment(store):
    marker_value = shm.encode_shm_name_to_int64("psm_" + store.instance_id)
    with pytest.raises(shm.ShmHandleError, match="not an atb-plugin data segment"):
        shm.read_array(marker_value, shm.encode_shape_to_int64((1,)))


def test_write_never_overwrites_an_existing_name(store):
    handle = store.put(image(shape=(2, 2)), request_id="r")
    with pytest.raises(FileExistsError):
        write_segment(handle.name, np.zeros((2, 2), np.float32), store.instance_id, store.owner)


# ---------------------------------------------------------------------------------------------
# the reader's mapping cache


def test_reader_notices_a_recreated_name():
    instance = "w0w0"
    name = segment_name(instance, 5)
    owner = ProcessIdentity.current()
    reader = ShmReader()
    handle = (shm.encode_shm_name_to_int64(name), shm.encode_shape_to_int64((3,)))
    try:
        write_segment(name, np.array([1, 2, 3], np.int64), instance, owner)
        np.testing.assert_array_equal(reader.read_array(*handle), [1, 2, 3])
        unlink_segment(name)
        write_segment(name, np.array([7, 8, 9], np.int64), instance, owner)
        # Same name, new inode: the cached mapping of the old segment must not be served.
        np.testing.assert_array_equal(reader.read_array(*handle), [7, 8, 9])
    finally:
        unlink_segment(name)


def test_reader_sweep_drops_unlinked_and_cache_is_bounded(store):
    reader = ShmReader(max_cached_segments=2)
    handles = [store.put(image(i, (8,)), request_id=str(i)) for i in range(3)]
    for handle in handles:
        reader.read_array(handle.name_value, handle.shape_value)
    assert reader.cached_segments == 2
    store.close()
    reader.sweep()
    assert reader.cached_segments == 0


def test_header_pack_unpack_round_trip():
    header = SegmentHeader(1, (1, 3, 448, 448), 4 * 3 * 448 * 448, "psm_abcd0000001", "abcd", ProcessIdentity(42, 7))
    assert SegmentHeader.unpack(header.pack(), header.name) == header
