"""From a media block's segment to the vision encoder's input, on the model's device.

A segment holds one image in either wire dtype (``atb_plugin.multimodal.wire``); the header's
dtype says which, and the family's ``PixelFormat`` turns it into the encoder's input::

    uint8  [H, W, 3]   resized RGB image ──► to the device (1/4 of the float32 bytes, 1/8 for
                                              Qwen2-VL), then layout + x * scale + offset there
    float32            normalised pixels ──► checked, used as they are (MindIE's form)
    anything else      refused: PixelFormatError (the request fails with a clear message)

The uint8 path does, as torch ops on the device, exactly the arithmetic of the frontend's
float32 path (``input_builders.preprocess``): a float32 multiply by ``scale`` and a float32 add
of ``offset`` per element, the layout being pure data movement. On CPU the two are equal bit for
bit; on NPU / CUDA the same two float32 operations run there, and the result is then cast to the
model's dtype, as float32 pixels from the frontend would be.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from atb_plugin.multimodal.wire import PixelNormalization

__all__ = ["ChwImageFormat", "PixelFormat", "PixelFormatError", "Qwen2VLPatchFormat", "normalize_image"]

GridTHW = tuple[int, int, int]


class PixelFormatError(ValueError):
    """A segment whose dtype or shape this model does not read (a frontend speaking another wire
    format, or a handle pointing at the wrong array). Fails the request, names what was expected."""


def normalize_image(image: torch.Tensor, norm: PixelNormalization) -> torch.Tensor:
    """uint8 ``[..., 3, rows, cols]`` -> float32 ``x * scale + offset`` per channel.

    Two separate float32 operations, as the frontend's numpy path does them: a fused multiply-add
    would round once instead of twice and differ in the last bit."""
    scale = torch.tensor(norm.scale, device=image.device)[:, None, None]
    offset = torch.tensor(norm.offset, device=image.device)[:, None, None]
    values = image.to(torch.float32)
    values.mul_(scale)
    values.add_(offset)
    return values


@dataclass(frozen=True)
class PixelFormat(ABC):
    """Contract: how one family's encoder input is made from a block's segment.

    ``encoder_input(pixels, grid_thw, dtype)`` takes the segment's array as a tensor (already on
    the model's device, in the stored dtype) and returns the encoder's input in ``dtype``:

    * float32: checked against ``_check_values`` and used as is;
    * uint8: must be an ``[H, W, 3]`` image of the size the family expects; ``_from_image``
      does the layout and normalisation;
    * anything else, or a shape that does not fit: ``PixelFormatError``.
    """

    normalization: PixelNormalization

    def encoder_input(self, pixels: torch.Tensor, grid_thw: GridTHW | None, dtype: torch.dtype) -> torch.Tensor:
        if pixels.dtype == torch.uint8:
            if pixels.dim() == 4 and pixels.shape[1] == 3:  # video frames
                return self._from_frames(pixels, grid_thw, dtype)
            if pixels.dim() != 3 or pixels.shape[2] != 3:
                raise PixelFormatError(f"a uint8 segment must hold an RGB image [H, W, 3] or video frames "
                                       f"[t, 3, H, W], got shape {list(pixels.shape)}")
            self._check_image(pixels.shape[0], pixels.shape[1], grid_thw)
            return self._from_image(pixels, grid_thw, dtype)
        if pixels.dtype == torch.float32:
            self._check_values(tuple(pixels.shape), grid_thw)
            return pixels.to(dtype)
        raise PixelFormatError(
            f"the segment holds {str(pixels.dtype).removeprefix('torch.')} pixels; this model reads uint8 (the resized "
            "RGB image) or float32 (normalised pixel values): the frontend that wrote it speaks another wire format "
            "(see docs/wire-format.md)")

    def _from_frames(self, frames: torch.Tensor, grid_thw: GridTHW | None, dtype: torch.dtype) -> torch.Tensor:
        """uint8 video frames ``[t, 3, H, W]`` -> the encoder input; families without video refuse."""
        raise PixelFormatError(f"the segment holds video frames {list(frames.shape)}; this model reads no video")

    @abstractmethod
    def _check_image(self, height: int, width: int, grid_thw: GridTHW | None) -> None:
        """Raise ``PixelFormatError`` unless an image of this size fits the block."""

    @abstractmethod
    def _from_image(self, image: torch.Tensor, grid_thw: GridTHW | None, dtype: torch.dtype) -> torch.Tensor:
        """uint8 ``[H, W, 3]`` -> the encoder input in ``dtype`` (normalised in float32, then cast)."""

    @abstractmethod
    def _check_values(self, shape: tuple[int, ...], grid_thw: GridTHW | None) -> None:
        """Raise ``PixelFormatError`` unless float32 pixel values of this shape fit the block."""


@dataclass(frozen=True)
class ChwImageFormat(PixelFormat):
    """CLIP-style towers with a fixed input size (LLaVA-1.5, Qwen-VL): ``[1, 3, H, W]``."""

    height: int
    width: int

    def _check_image(self, height: int, width: int, grid_thw: GridTHW | None) -> None:
        if (height, width) != (self.height, self.width):
            raise PixelFormatError(f"the image is {width}x{height} pixels; this model's encoder takes "
                                   f"{self.width}x{self.height} (the frontend resizes to it)")

    def _from_image(self, image: torch.Tensor, grid_thw: GridTHW | None, dtype: torch.dtype) -> torch.Tensor:
        # The layout moves uint8 (a quarter of the bytes), and the float passes run contiguously:
        # also what the float32 path hands the encoder (a channels-last input could pick another
        # conv kernel).
        return normalize_image(image.permute(2, 0, 1).contiguous(), self.normalization).unsqueeze(0).to(dtype)

    def _check_values(self, shape: tuple[int, ...], grid_thw: GridTHW | None) -> None:
        if shape not in ((1, 3, self.height, self.width), (3, self.height, self.width)):
            raise PixelFormatError(f"float32 pixel values of shape {list(shape)}; this model takes "
                                   f"[1, 3, {self.height}, {self.width}]")


@dataclass(frozen=True)
class Qwen2VLPatchFormat(PixelFormat):
    """Qwen2-VL / Qwen2.5-VL: one row per ``patch x patch`` patch, merge-window-major, each row
    ``(channel, temporal, patch_row, patch_col)``; a still image is one frame repeated
    ``temporal_patch_size`` times. ``grid_thw`` (the block's THW slot) gives the patch grid.

    The image ``[H, W, 3]`` with ``H = grid_h * p`` and ``W = grid_w * p`` is cut as::

        [H, W, 3] -> (gh/m, m, p, gw/m, m, p, 3) -> (gh/m, gw/m, m, m, 3, p, p) -> + time axis
          rows:  merge window row, window col, patch row in window, patch col in window
          cols:  channel, temporal, pixel row, pixel col        (transformers' order)
    """

    patch_size: int
    temporal_patch_size: int
    merge_size: int

    @property
    def patch_dim(self) -> int:
        return 3 * self.temporal_patch_size * self.patch_size**2

    def _grid(self, grid_thw: GridTHW | None) -> GridTHW:
        if grid_thw is None:
            raise PixelFormatError("Qwen2-VL needs the image's grid_thw (the block's THW slot)")
        return grid_thw

    def _check_image(self, height: int, width: int, grid_thw: GridTHW | None) -> None:
        t, h, w = self._grid(grid_thw)
        p, m = self.patch_size, self.merge_size
        if t != 1 or (height, width) != (h * p, w * p) or h % m or w % m:
            raise PixelFormatError(
                f"a {width}x{height} image does not fit grid_thw {[t, h, w]}: a still image needs t = 1 and "
                f"{w * p}x{h * p} pixels ({p}-pixel patches, sides multiples of {m} patches)")

    def _from_image(self, image: torch.Tensor, grid_thw: GridTHW | None, dtype: torch.dtype) -> torch.Tensor:
        _, h, w = grid_thw
        p, m, frames = self.patch_size, self.merge_size, self.temporal_patch_size
        # Gather on uint8, normalise contiguously, cast, then write the frame ``frames`` times:
        # the fastest order on the CPU of the alternatives measured (vs a strided float gather:
        # benchmarks/RESULTS.md, bench_preprocess.py), and the repeat moves the model's dtype, not float32.
        windows = image.reshape(h // m, m, p, w // m, m, p, 3).permute(0, 3, 1, 4, 6, 2, 5).contiguous()
        values = normalize_image(windows, self.normalization).to(dtype)  # (gh/m, gw/m, m, m, 3, p, p)
        values = values.unsqueeze(-3).expand(*values.shape[:5], frames, p, p)
        return values.reshape(h * w, self.patch_dim)

    def _from_frames(self, frames: torch.Tensor, grid_thw: GridTHW | None, dtype: torch.dtype) -> torch.Tensor:
        """Video frames ``[n, 3, H, W]`` (``n = t·T``) -> ``(t·h·w, 3·T·p·p)``: transformers'
        ``Qwen2VLVideoProcessor.patchify`` order, rows ``(t, window row, window col, row, col)``,
        each row ``(channel, frame of the temporal patch, pixel row, pixel col)``."""
        t, h, w = self._grid(grid_thw)
        p, m, frames_per_patch = self.patch_size, self.merge_size, self.temporal_patch_size
        count, _, height, width = frames.shape
        if count != t * frames_per_patch or (height, width) != (h * p, w * p) or h % m or w % m:
            raise PixelFormatError(
                f"video frames {list(frames.shape)} do not fit grid_thw {[t, h, w]}: expected "
                f"[{t * frames_per_patch}, 3, {h * p}, {w * p}] ({frames_per_patch} frames per temporal patch, "
                f"{p}-pixel patches, sides multiples of {m} patches)")
        # Gather on uint8 (the layout is pure data movement), then normalise contiguously and cast.
        patches = frames.reshape(t, frames_per_patch, 3, h // m, m, p, w // m, m, p)
        patches = patches.permute(0, 3, 6, 4, 7, 2, 1, 5, 8).contiguous()
        values = normalize_image(patches.reshape(-1, 3, frames_per_patch * p, p), self.normalization)
        return values.to(dtype).reshape(t * h * w, self.patch_dim)

    def _check_values(self, shape: tuple[int, ...], grid_thw: GridTHW | None) -> None:
        t, h, w = self._grid(grid_thw)
        if shape != (t * h * w, self.patch_dim):
            raise PixelFormatError(f"float32 pixel values of shape {list(shape)} do not fit grid_thw {[t, h, w]}: "
                                   f"expected [{t * h * w}, {self.patch_dim}] (one row per patch)")
