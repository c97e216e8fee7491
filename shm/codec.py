"""int64 codec for shared-memory handles carried inside ``input_ids``.

The values are identical to MindIE-LLM's ``atb_llm/utils/shm_utils.py`` so builders and models
interoperate with that ecosystem. Both encodings are negative: real token ids are >= 0, so a
negative id in a prompt is always a metadata slot.

Name (``psm_`` prefix stripped, 1..11 characters from ``ALPHABET``, 5 bits each)::

    bit 63    62..58    57..53    52..48    ...    12..8     7..3      (unused)   2..0
    sign(0)   length    char 0    char 1    ...    char 9    char 10   zeros      sum(idx) % 8
                        char i occupies bits (57 - 5*i)..(53 - 5*i)               then negated

Shape (1..5 dims packed from bit 59 down; every plan uses exactly bits 59..3)::

    bit 63     62..60     59 ............................................ 3     2..0
    sign(0)    ndim       dims, widths SHAPE_WIDTHS[ndim], most significant     popcount % 3
                                                                                 then negated

Each dim must be <= 2**(width-1) (MindIE's limit, kept for bit-compatibility).

Decoders are stricter than MindIE's: they also refuse non-negative values, values that do not
fit in 63 bits, stray bits in the unused region of a name, and out-of-range dims. Anything a
MindIE encoder produces still decodes.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

ALPHABET = "0123456789abcdefpsmnwABCDEF"
NAME_PREFIX = "psm_"
MAX_NAME_CHARS = 11
MAX_SHAPE_DIMS = 5
SHAPE_WIDTHS: dict[int, tuple[int, ...]] = {
    1: (57,),
    2: (29, 28),
    3: (19, 19, 19),
    4: (18, 3, 18, 18),
    5: (13, 13, 3, 14, 14),
}

_CHAR_INDEX = {char: index for index, char in enumerate(ALPHABET)}
_LENGTH_SHIFT = 58
_NDIM_SHIFT = 60
_CHECKSUM_MASK = 0b111
_MAGNITUDE_LIMIT = 1 << 63  # the negated value must fit a signed int64


def _char_shift(position: int) -> int:
    return 53 - 5 * position


def as_python_int(value, what: str) -> int:
    """Coerce an int, numpy integer, or 0-d / 1-element integer array or tensor to ``int``.

    Torch is duck-typed (``numel``/``item``/``is_floating_point``) so ``shm`` never imports it.
    """
    if isinstance(value, (bool, np.bool_)):
        raise ValueError(f"{what}: got the boolean {value!r}; expected an integer")
    if isinstance(value, int):
        return value
    if isinstance(value, np.integer):
        return int(value)
    if isinstance(value, np.ndarray):
        if value.size != 1 or not np.issubdtype(value.dtype, np.integer):
            raise ValueError(
                f"{what}: got a numpy array of shape {value.shape} and dtype {value.dtype}; "
                "expected a single integer element"
            )
        return int(value.reshape(-1)[0])
    numel = getattr(value, "numel", None)
    if callable(numel) and hasattr(value, "item") and hasattr(value, "is_floating_point"):
        count = numel()
        if count != 1:
            raise ValueError(f"{what}: got a tensor with {count} elements; expected a 0-d or 1-element tensor")
        if value.is_floating_point() or value.is_complex():
            raise ValueError(f"{what}: got a tensor of dtype {value.dtype}; expected an integer dtype")
        item = value.item()
        if isinstance(item, bool):
            raise ValueError(f"{what}: got a boolean tensor; expected an integer dtype")
        return int(item)
    raise ValueError(
        f"{what}: got {type(value).__name__} {value!r}; expected an int, a numpy integer, "
        "or a 0-d / 1-element integer tensor"
    )


def _magnitude(value, what: str) -> int:
    """Return ``-value`` for an encoded handle, refusing anything an encoder cannot produce."""
    number = as_python_int(value, what)
    if number >= 0:
        raise ValueError(
            f"{what}: {number} is not negative; encoded handles are always < 0 "
            "(non-negative ids are ordinary tokens)"
        )
    magnitude = -number
    if magnitude >= _MAGNITUDE_LIMIT:
        raise ValueError(f"{what}: {number} does not fit in a signed int64 (limit -(2**63 - 1))")
    return magnitude


# ---------------------------------------------------------------------------------------------
# names


def encode_shm_name_to_int64(name: str) -> int:
    """Encode ``psm_XXXX`` (or the bare ``XXXX``) into a negative int64."""
    if not isinstance(name, str):
        raise ValueError(f"shm name: got {type(name).__name__} {name!r}; expected a str")
    body = name[1:] if name.startswith("/") else name  # POSIX spelling "/psm_..."
    if body.startswith(NAME_PREFIX):
        body = body[len(NAME_PREFIX):]
    if not 1 <= len(body) <= MAX_NAME_CHARS:
        raise ValueError(
            f"shm name {name!r} has {len(body)} characters after the {NAME_PREFIX!r} prefix; "
            f"the codec holds 1 to {MAX_NAME_CHARS}"
        )
    value = len(body) << _LENGTH_SHIFT
    index_sum = 0
    for position, char in enumerate(body):
        index = _CHAR_INDEX.get(char)
        if index is None:
            raise ValueError(
                f"shm name {name!r}: character {char!r} at position {position} is not in the "
                f"codec alphabet {ALPHABET!r}"
            )
        index_sum += index
        value |= index << _char_shift(position)
    value |= index_sum % 8
    return -value


def decode_shm_name_from_int64(value) -> str:
    """Decode a value produced by :func:`encode_shm_name_to_int64`; returns ``psm_`` + body."""
    bits = _magnitude(value, "encoded shm name")
    length = (bits >> _LENGTH_SHIFT) & 0b11111
    if not 1 <= length <= MAX_NAME_CHARS:
        raise ValueError(
            f"encoded shm name {-bits}: declares {length} characters; a name holds 1 to {MAX_NAME_CHARS}"
        )
    chars = []
    index_sum = 0
    for position in range(length):
        index = (bits >> _char_shift(position)) & 0b11111
        if index >= len(ALPHABET):
            raise ValueError(
                f"encoded shm name {-bits}: character {position} has index {index}; "
                f"the alphabet has {len(ALPHABET)} characters (0..{len(ALPHABET) - 1})"
            )
        index_sum += index
        chars.append(ALPHABET[index])
    # Bits between the last character and the checksum are never set by an encoder; refusing
    # them catches tampering the 3-bit checksum alone would miss.
    lowest_char_bit = _char_shift(length - 1)
    stray = (bits >> 3) & ((1 << (lowest_char_bit - 3)) - 1)
    if stray:
        raise ValueError(
            f"encoded shm name {-bits}: bits outside the {length} declared characters are set; "
            "the value is corrupted"
        )
    stored = bits & _CHECKSUM_MASK
    expected = index_sum % 8
    if stored != expected:
        raise ValueError(
            f"encoded shm name {-bits}: checksum {stored} does not match {expected} "
            f"(sum of character indices {index_sum} mod 8); the value is corrupted"
        )
    return NAME_PREFIX + "".join(chars)


# ---------------------------------------------------------------------------------------------
# shapes


def encode_shape_to_int64(shape: Sequence[int]) -> int:
    """Encode a 1..5-d shape into a negative int64."""
    try:
        dims = [as_python_int(dim, f"shape {shape!r}") for dim in shape]
    except TypeError:
        raise ValueError(f"shape: got {type(shape).__name__} {shape!r}; expected a sequence of ints") from None
    ndim = len(dims)
    if not 1 <= ndim <= MAX_SHAPE_DIMS:
        raise ValueError(f"shape {tuple(dims)} has {ndim} dimensions; the codec holds 1 to {MAX_SHAPE_DIMS}")
    value = ndim << _NDIM_SHIFT
    shift = _NDIM_SHIFT
    for axis, (dim, width) in enumerate(zip(dims, SHAPE_WIDTHS[ndim])):
        limit = 1 << (width - 1)
        if dim < 0:
            raise ValueError(f"shape {tuple(dims)}: dim {axis} is negative ({dim})")
        if dim > limit:
            raise ValueError(
                f"shape {tuple(dims)}: dim {axis} = {dim} exceeds {limit} (2**{width - 1}), "
                f"the largest value slot {axis} of a {ndim}-d shape holds"
            )
        shift -= width
        value |= dim << shift
    value |= bin(value).count("1") % 3
    return -value


def decode_shape_from_int64(value) -> list[int]:
    """Decode a value produced by :func:`encode_shape_to_int64`."""
    bits = _magnitude(value, "encoded shape")
    stored = bits & _CHECKSUM_MASK
    expected = bin(bits >> 3).count("1") % 3
    if stored != expected:
        raise ValueError(
            f"encoded shape {-bits}: checksum {stored} does not match {expected} "
            "(popcount mod 3); the value is corrupted"
        )
    ndim = bits >> _NDIM_SHIFT
    if not 1 <= ndim <= MAX_SHAPE_DIMS:
        raise ValueError(f"encoded shape {-bits}: declares {ndim} dimensions; the codec holds 1 to {MAX_SHAPE_DIMS}")
    dims = []
    shift = _NDIM_SHIFT
    for axis, width in enumerate(SHAPE_WIDTHS[ndim]):
        shift -= width
        dim = (bits >> shift) & ((1 << width) - 1)
        limit = 1 << (width - 1)
        if dim > limit:
            raise ValueError(
                f"encoded shape {-bits}: dim {axis} = {dim} exceeds {limit} (2**{width - 1}); "
                "no encoder produces it, the value is corrupted"
            )
        dims.append(dim)
    return dims
