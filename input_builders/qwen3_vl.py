"""Qwen3-VL (and Qwen3-VL-MoE): Qwen2-VL's builder with its own video layout.

Images are Qwen2-VL's block (``QWEN2_VL_BLOCK``; 16-pixel patches from preprocessor_config.json).
A video's ``<|video_pad|>`` anchor widens, as transformers' ``Qwen3VLProcessor`` widens it, into
one block per temporal patch, each after its timestamp::

    <|vision_start|>  <0.3 seconds><|vision_start|> NAME SHAPE THW PATCH <|video_pad|> × (n − 4) <|vision_end|>
                      <1.8 seconds><|vision_start|> NAME SHAPE THW PATCH <|video_pad|> × (n − 4) <|vision_end|>
                      ...                                                                   <|vision_end|>
                                                                              n = h·w / merge²

(the template's own ``<|vision_start|>`` / ``<|vision_end|>`` stay around the whole, exactly as the
processor leaves them). All blocks of a video name one segment, its frames (uint8 ``(2t, 3, H, W)``)
or patches (float32); THW is the whole video's grid and PATCH (``wire.QWEN3_VL_VIDEO_BLOCK``) the
block's temporal patch, so the model reads each block as a one-patch video. Frames are sampled by
transformers' rule (``input_builders.video.Qwen3VideoSampling``). See docs/wire-format.md.
"""

from __future__ import annotations

from atb_plugin.multimodal.wire import QWEN3_VL_VIDEO_BLOCK
from input_builders.conversation import InputBuilderError
from input_builders.qwen2_vl import PreparedVideo, Qwen2VlInputBuilder
from input_builders.video import LoadedVideo
from shm import encode_shape_to_int64

PATCH_METADATA_SLOTS = QWEN3_VL_VIDEO_BLOCK.metadata_slots  # NAME, SHAPE, THW, PATCH


class Qwen3VlInputBuilder(Qwen2VlInputBuilder):
    model_type = "qwen3_vl"  # its model class declares the images and videos per prompt

    def __init__(self, tokenizer, **kwargs):
        super().__init__(tokenizer, **kwargs)
        self.vision_start_id = tokenizer.convert_tokens_to_ids(self.vision_start)
        self.vision_end_id = tokenizer.convert_tokens_to_ids(self.vision_end)
        self._timestamps: dict[str, tuple[int, ...]] = {}

    def timestamp_ids(self, seconds: float) -> tuple[int, ...]:
        """``<0.5 seconds>`` as the processor writes it (between special tokens, so tokenized alone)."""
        text = f"<{seconds:.1f} seconds>"
        if text not in self._timestamps:  # the same stamps recur across videos and turns
            self._timestamps[text] = tuple(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        return self._timestamps[text]

    def patch_tokens(self, grid_thw) -> int:
        """Slots of one temporal patch's block."""
        _, h, w = grid_thw
        return self.preprocessor.num_image_tokens((1, h, w))

    def num_media_tokens(self, item) -> int:
        if not isinstance(item, LoadedVideo):
            return super().num_media_tokens(item)
        per_patch = self.patch_tokens(self.grid_thw(item))
        if per_patch < PATCH_METADATA_SLOTS:
            raise InputBuilderError(f"the video ({item.source}) becomes {per_patch} tokens per frame; a block needs "
                                    f"at least {PATCH_METADATA_SLOTS}: raise the video's pixel budget")
        return sum(len(self.timestamp_ids(seconds)) + 2 + per_patch for seconds in item.plan.patch_timestamps)

    def media_block(self, item) -> list[int]:
        if not isinstance(item, PreparedVideo):
            return super().media_block(item)
        thw = encode_shape_to_int64(item.grid_thw)
        pads = [self.video_anchor_id] * (self.patch_tokens(item.grid_thw) - PATCH_METADATA_SLOTS)
        out: list[int] = []
        for patch, seconds in enumerate(item.timestamps):
            out += self.timestamp_ids(seconds)
            out += [self.vision_start_id, item.handle.name_value, item.handle.shape_value, thw,
                    encode_shape_to_int64((patch,)), *pads, self.vision_end_id]
        return out


__all__ = ["Qwen3VlInputBuilder"]
