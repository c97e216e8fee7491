"""Qwen2-VL / Qwen2.5-VL: one block per image, sized by the image's patch grid.

    <|vision_start|> NAME SHAPE THW <|image_pad|> × (n − 3) <|vision_end|>,   n = t·h·w / merge²

NAME/SHAPE locate the ``(t·h·w, 3·2·14·14)`` patches in shared memory; THW is ``grid_thw``
encoded with the shape codec. The model puts back ``<|image_pad|>`` in the three metadata slots
and replaces all n slots with the merged patch features.
"""

from __future__ import annotations

from atb_plugin.multimodal.wire import QWEN2_VL_BLOCK
from input_builders.base import InputBuilder, PreparedImage
from input_builders.conversation import InputBuilderError
from input_builders.media import LoadedImage
from input_builders.preprocess import Qwen2VLPreprocessor
from shm import encode_shape_to_int64

METADATA_SLOTS = QWEN2_VL_BLOCK.metadata_slots  # NAME, SHAPE, THW


class Qwen2VlInputBuilder(InputBuilder):
    model_type = "qwen2_vl"  # its model class declares the images per prompt

    def __init__(self, tokenizer, *, vision_start_token_id: int, vision_end_token_id: int,
                 preprocessor: Qwen2VLPreprocessor, **kwargs):
        super().__init__(tokenizer, preprocessor=preprocessor, **kwargs)
        self.vision_start = tokenizer.convert_ids_to_tokens(vision_start_token_id)
        self.vision_end = tokenizer.convert_ids_to_tokens(vision_end_token_id)

    def image_prompt_text(self, index: int) -> str:
        return f"{self.vision_start}{self.image_anchor}{self.vision_end}"

    def grid_thw(self, image: LoadedImage) -> tuple[int, int, int]:
        # Known from the image size alone, so a reused segment needs no preprocessing.
        height, width = self.preprocessor.smart_resize(image.image.height, image.image.width)
        return 1, height // self.preprocessor.patch_size, width // self.preprocessor.patch_size

    def num_media_tokens(self, image: LoadedImage) -> int:
        tokens = self.preprocessor.num_image_tokens(self.grid_thw(image))
        if tokens < METADATA_SLOTS:
            raise InputBuilderError(
                f"a {image.image.width}x{image.image.height} image becomes {tokens} image tokens; a block "
                f"needs at least {METADATA_SLOTS}: raise min_pixels in preprocessor_config.json"
            )
        return tokens

    def media_block(self, image: PreparedImage) -> list[int]:
        metadata = [image.handle.name_value, image.handle.shape_value, encode_shape_to_int64(image.grid_thw)]
        return metadata + [self.image_anchor_id] * (image.num_tokens - METADATA_SLOTS)
