"""LLaVA-1.5: the placeholder run of ``image_token_index`` × n (576 for 336 px / 14), whose first
two slots carry NAME and SHAPE of the ``[1, 3, H, W]`` pixel values.

    ... <image> × n ...   →   ... NAME SHAPE <image> × (n − 2) ...
"""

from __future__ import annotations

from atb_plugin.multimodal.wire import LLAVA_BLOCK
from input_builders.base import InputBuilder, PreparedImage
from input_builders.image import LoadedImage
from input_builders.preprocess import ClipPreprocessor


class LlavaInputBuilder(InputBuilder):
    model_type = "llava"  # its model class declares the images per prompt

    def __init__(self, tokenizer, *, image_size: int, patch_size: int, feature_select_strategy: str,
                 preprocessor: ClipPreprocessor, **kwargs):
        super().__init__(tokenizer, preprocessor=preprocessor, **kwargs)
        if feature_select_strategy not in ("default", "full"):
            raise ValueError(f"vision_feature_select_strategy {feature_select_strategy!r}: expected 'default' or 'full'")
        # "default" drops the CLS feature, "full" keeps it.
        self.tokens_per_image = (image_size // patch_size) ** 2 + (feature_select_strategy == "full")

    def media_prompt_text(self, index: int) -> str:
        return f"{self.media_anchor}\n"

    def num_media_tokens(self, image: LoadedImage) -> int:
        return self.tokens_per_image

    def media_block(self, image: PreparedImage) -> list[int]:
        metadata = [image.handle.name_value, image.handle.shape_value]
        return metadata + [self.media_anchor_id] * (image.num_tokens - LLAVA_BLOCK.metadata_slots)
