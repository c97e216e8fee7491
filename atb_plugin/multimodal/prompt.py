"""From a prompt's ids to merged input embeddings: the device side of docs/wire-format.md.

A media block is found by its first metadata slot (ids < 0 are always metadata)::

    ids:   ... t  t  NAME SHAPE [THW] pad pad ... pad  t  t ...
                     └──────────── block: length n ───┘
    restored ids:    pad  pad   [pad] pad pad ... pad          (metadata -> placeholder id)
    embeddings:      f0   f1    [f2]  f3  ...     f(n-1)       (the encoder's n feature rows)

``MultimodalPrompt.from_ids`` checks every block (layout, handle, segment header) and reads the
pixels zero-copy from shared memory; the model's ``pixel_format`` checks their dtype and shape
and makes the encoder's input on its device (atb_plugin/multimodal/pixels.py); the encoder runs
once per prompt (not at all for a block the prefix cache already holds) and
``merge_features(model, embeds, start, end)`` writes the rows that fall in a prefill chunk
``[start, end)`` over that chunk's text embeddings (``embed(model, start, end)``: both steps), so
a chunk boundary may cut a block anywhere. Any problem raises ``MediaBlockError`` for this prompt only, naming
the block and the counts; nothing is ever replaced by zeros.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

import numpy as np
import torch

import shm
from atb_plugin.multimodal.pixels import PixelFormatError
from atb_plugin.multimodal.shipped import MediaReader, read_shared_memory
from atb_plugin.multimodal.wire import decode_second_per_grid_t


def encode_pixels(model, pixels: torch.Tensor, grid_thw) -> torch.Tensor:
    """One block's pixels as its segment holds them (uint8 image or float32 values, on the model's
    device: uint8 moves a quarter of the bytes) -> the encoder's feature rows. The one path of
    real requests and of the start-up memory profile."""
    return model.get_multimodal_embeddings(model.encoder_input(pixels, grid_thw), grid_thw)


class MediaBlockError(ValueError):
    """A prompt's media block is malformed, its segment is missing/foreign/mismatched, or the
    encoder's output does not fit it. Fails the request that owns the prompt, nothing else."""


@dataclass(frozen=True)
class MediaLayout:
    """How a family lays out a block (docs/wire-format.md), as the model's config says: the
    family's ``wire.MediaBlockShape`` (metadata slots, a fixed length or none; shared with its input
    builder) completed with the checkpoint's placeholder id, block length and merge size."""

    placeholder_id: int  # what every slot holds once the metadata is restored
    num_metadata_slots: int  # NAME, SHAPE (2) or NAME, SHAPE, THW / FRAMES (3)
    tokens_per_block: int | None = None  # None: from the third slot (THW: t·h·w / merge_size²)
    merge_size: int = 1
    # Audio: the third slot is FRAMES, a 1-d ``(valid mel frames,)``, and this maps it to the
    # block length (Qwen2-Audio: the encoder's output rows). None: the slot is an image's THW.
    frames_to_tokens: Callable[[int], int] | None = None
    # What the block holds: "image", "video" (a fourth slot, SPG: second_per_grid_t), "audio".
    modality: str = "image"
    # A video block of one temporal patch (wire.QWEN3_VL_VIDEO_BLOCK): the fourth slot is PATCH, its
    # index; the block reads that patch's share of the segment, as a video of one temporal patch.
    per_temporal_patch: bool = False

    def __post_init__(self):
        if self.num_metadata_slots not in (2, 3, 4):
            raise ValueError(f"num_metadata_slots must be 2, 3 or 4, got {self.num_metadata_slots}")
        if self.per_temporal_patch and self.num_metadata_slots != 4:
            raise ValueError("a per-temporal-patch block has 4 metadata slots (NAME, SHAPE, THW, PATCH)")
        if self.num_metadata_slots == 4 and (self.modality != "video" or self.tokens_per_block is not None):
            raise ValueError("4 metadata slots (NAME, SHAPE, THW, SPG) are a video block's, sized by its THW")
        if self.tokens_per_block is None and self.num_metadata_slots < 3:
            raise ValueError("a block whose length comes from grid_thw needs the THW slot (3 metadata slots)")
        if self.tokens_per_block is not None and self.tokens_per_block < self.num_metadata_slots:
            raise ValueError(f"tokens_per_block {self.tokens_per_block} < {self.num_metadata_slots} metadata slots")

    def block_length(self, grid_thw) -> int:
        if self.tokens_per_block is not None:
            return self.tokens_per_block
        if self.frames_to_tokens is not None:
            return self.frames_to_tokens(grid_thw[0])
        t, h, w = grid_thw
        return t * h * w // self.merge_size**2


@dataclass
class MediaBlock:
    index: int
    start: int  # prompt position of the block's first slot (NAME)
    length: int
    pixel_values: torch.Tensor
    grid_thw: tuple[int, int, int] | None = None
    modality: str = "image"
    second_per_grid_t: float | None = None  # a video's (its SPG slot)


def _temporal_patch(pixels: np.ndarray, num_patches: int, patch: int, where: str) -> np.ndarray:
    """Temporal patch ``patch`` of a video segment (a zero-copy view): both wire forms lead with
    time, uint8 frames ``(t·T, 3, H, W)`` and float32 patch rows ``(t·h·w, C·T·p·p)``."""
    if pixels.shape[0] % num_patches:
        raise MediaBlockError(f"{where}: a segment of shape {list(pixels.shape)} does not split into {num_patches} "
                              "temporal patches")
    step = pixels.shape[0] // num_patches
    return pixels[patch * step:(patch + 1) * step]


class MultimodalPrompt:
    def __init__(self, token_ids: torch.Tensor, blocks: list[MediaBlock]):
        self.token_ids = token_ids
        self.blocks = blocks
        self._features: list[torch.Tensor] | None = None

    @classmethod
    def from_ids(cls, prompt_ids, layout: MediaLayout | Sequence[MediaLayout], *,
                 expected_instance: str | Collection[str] | None = None,
                 read: MediaReader = read_shared_memory) -> "MultimodalPrompt":
        """``layout``: the model's block layout, or its layouts (``media_layouts``: Qwen2-VL's image
        and video blocks), told apart by their numbers of metadata slots: a block's kind is the
        layout with as many slots as the run of ids < 0 that starts it (blocks never abut: a
        family's template puts text, at least its start and end tokens, between them). With one
        layout, blocks may abut: a Qwen2-Audio clip's 30 s windows follow each other directly, each
        found by its NAME slot. ``read`` reloads a block's pixels: from this node's shared memory,
        or (a rank on another node) from what the engine core shipped with the step (shipped.py)."""
        layouts = (layout,) if isinstance(layout, MediaLayout) else tuple(layout)
        by_slots = {item.num_metadata_slots: item for item in layouts}
        if len(by_slots) != len(layouts):
            raise ValueError(f"media layouts need distinct numbers of metadata slots, got {layouts}")
        ids = np.asarray(prompt_ids, dtype=np.int64)
        restored = ids.copy()
        blocks: list[MediaBlock] = []
        position = 0
        for first in np.flatnonzero(ids < 0):
            if first < position:
                continue  # a metadata slot of the block just read
            layout = layouts[0] if len(layouts) == 1 else cls._layout_of(ids, int(first), len(blocks), by_slots)
            block = cls._read_block(ids, int(first), len(blocks), layout, expected_instance, read)
            restored[block.start:block.start + layout.num_metadata_slots] = layout.placeholder_id
            blocks.append(block)
            position = block.start + block.length
        return cls(torch.from_numpy(restored), blocks)

    @staticmethod
    def _layout_of(ids: np.ndarray, start: int, index: int, by_slots: dict) -> MediaLayout:
        longest = max(by_slots)
        run = ids[start:start + longest + 1]
        count = int(np.argmax(run >= 0)) if (run >= 0).any() else len(run)
        if count not in by_slots:
            raise MediaBlockError(f"media block {index} at position {start}: {count} metadata slots in a row; this "
                                  f"model's blocks have {' or '.join(map(str, sorted(by_slots)))}")
        return by_slots[count]

    @staticmethod
    def _read_block(ids: np.ndarray, start: int, index: int, layout: MediaLayout, expected_instance,
                    read: MediaReader) -> MediaBlock:
        where = f"media block {index} at position {start}"
        meta = ids[start:start + layout.num_metadata_slots]
        if len(meta) < layout.num_metadata_slots or (meta >= 0).any():
            raise MediaBlockError(
                f"{where}: expected {layout.num_metadata_slots} metadata slots (NAME, SHAPE"
                f"{', THW' if layout.num_metadata_slots >= 3 else ''}"
                f"{(', PATCH' if layout.per_temporal_patch else ', SPG') if layout.num_metadata_slots == 4 else ''}), "
                f"found ids {meta.tolist()}"
            )
        grid = seconds = patch = None
        if layout.per_temporal_patch:
            try:
                (patch,) = shm.decode_shape_from_int64(int(meta[3]))
            except ValueError as error:
                raise MediaBlockError(f"{where}: bad PATCH slot: {error}") from error
        elif layout.num_metadata_slots == 4:
            try:
                seconds = decode_second_per_grid_t(int(meta[3]))
            except ValueError as error:
                raise MediaBlockError(f"{where}: bad SPG slot: {error}") from error
        if layout.num_metadata_slots >= 3:
            try:
                grid = tuple(shm.decode_shape_from_int64(int(meta[2])))
            except ValueError as error:
                raise MediaBlockError(f"{where}: bad {'FRAMES' if layout.frames_to_tokens else 'THW'} slot: "
                                      f"{error}") from error
            if layout.frames_to_tokens is not None:
                if len(grid) != 1 or grid[0] <= 0:
                    raise MediaBlockError(f"{where}: FRAMES decodes to {list(grid)}, expected one positive dim")
            elif len(grid) != 3 or min(grid) <= 0:
                raise MediaBlockError(f"{where}: THW decodes to {list(grid)}, expected 3 positive dims")
        video_grid = grid
        if patch is not None:
            if patch >= grid[0]:
                raise MediaBlockError(f"{where}: PATCH {patch} of a video of {grid[0]} temporal patches")
            grid = (1, *grid[1:])
        length = layout.block_length(grid)
        slots = ids[start + layout.num_metadata_slots:start + length]
        placeholders = int((slots == layout.placeholder_id).sum())
        expected = length - layout.num_metadata_slots
        if len(slots) != expected or placeholders != expected:
            raise MediaBlockError(
                f"{where}: the block needs {length} slots ({layout.num_metadata_slots} metadata + {expected} "
                f"placeholders {layout.placeholder_id}), found {placeholders} placeholders"
            )
        try:
            pixels = read(int(meta[0]), int(meta[1]), expected_instance)
        except shm.ShmHandleError as error:
            raise MediaBlockError(f"{where}: {error}") from error
        if patch is not None:
            pixels = _temporal_patch(pixels, video_grid[0], patch, where)
        return MediaBlock(index, start, length, torch.from_numpy(pixels), grid, layout.modality, seconds)

    def features(self, model, cached_tokens: int = 0) -> list[torch.Tensor | None]:
        """Encoder output per block, computed once per prompt and checked against the block size.
        A block that ends within the first ``cached_tokens`` positions (their KV came from the
        prefix cache: no chunk will ever embed them) is not encoded: None. That is what makes a
        chat that resends its image skip the encoder on every later turn."""
        if self._features is None:
            device = next(model.parameters()).device
            features = []
            for block in self.blocks:
                if block.start + block.length <= cached_tokens:
                    features.append(None)
                    continue
                try:
                    rows = encode_pixels(model, block.pixel_values.to(device), block.grid_thw)
                except PixelFormatError as error:
                    raise MediaBlockError(f"media block {block.index} at position {block.start}: {error}") from error
                if rows.shape[0] != block.length:
                    raise MediaBlockError(
                        f"media block {block.index} at position {block.start}: the encoder produced "
                        f"{rows.shape[0]} feature rows for {block.length} placeholder slots"
                    )
                features.append(rows)
            self._features = features
        return self._features

    def embed(self, model, start: int = 0, end: int | None = None) -> torch.Tensor:
        """Input embeddings of prompt positions ``[start, end)`` with the image features merged."""
        end = self.token_ids.shape[0] if end is None else end
        weight = next(model.parameters())
        embeds = model.get_input_embeddings(self.token_ids[start:end].to(weight.device))
        return self.merge_features(model, embeds, start, end)

    def merge_features(self, model, embeds: torch.Tensor, start: int, end: int) -> torch.Tensor:
        """Write the feature rows of the media blocks in prompt positions ``[start, end)`` into
        ``embeds`` (``(end - start, hidden)``: those positions' text embeddings, i.e. of the
        restored ``token_ids[start:end]``), in place, and return it. The model runner passes its
        slice of the whole step's embeddings, so the text is embedded once."""
        for block, rows in zip(self.blocks, self.features(model) if self.blocks else []):
            lo, hi = max(start, block.start), min(end, block.start + block.length)
            if lo < hi:
                if rows is None:
                    raise RuntimeError(f"media block {block.index} was skipped as cached, yet positions [{lo}, {hi}) "
                                       "of it are being computed")
                embeds[lo - start:hi - start] = rows[lo - block.start:hi - block.start].to(embeds.dtype)
        return embeds
