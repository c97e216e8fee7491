"""Qwen-VL: Qwen's own ChatML with ``Picture N:`` labels (the checkpoint has no HF chat template)
and a fixed 256-slot block per image, one slot per resampler query:

    Picture 1: <img> NAME SHAPE <imgpad> × 254 </img>\\n

The prompt text is what Qwen-VL's ``make_context`` + ``from_list_format`` produce (pictures
numbered from 1 in each message), with the image path replaced by the block; ``<img>``, ``</img>``, ``<imgpad>`` are ``visual.image_start_id``
and the two ids after it, as in the public checkpoint.
"""

from __future__ import annotations

from atb_plugin.multimodal.wire import QWEN_VL_BLOCK
from input_builders.base import InputBuilder, PreparedImage
from input_builders.conversation import ImagePart, Message, TextPart
from input_builders.image import LoadedImage
from input_builders.preprocess import QwenVLPreprocessor

NUM_QUERIES = QWEN_VL_BLOCK.tokens_per_block  # resampler queries: slots between <img> and </img>
DEFAULT_SYSTEM = "You are a helpful assistant."


class QwenVlInputBuilder(InputBuilder):
    model_type = "qwen_vl"  # its model class declares the images per prompt

    def __init__(self, tokenizer, *, image_start_id: int, preprocessor: QwenVLPreprocessor,
                 system_prompt: str = DEFAULT_SYSTEM, **kwargs):
        super().__init__(tokenizer, media_token_id=image_start_id, preprocessor=preprocessor, **kwargs)
        self.image_end = tokenizer.convert_ids_to_tokens(image_start_id + 1)
        self.image_pad_id = image_start_id + 2
        self.system_prompt = system_prompt

    def media_prompt_text(self, index: int) -> str:
        return f"Picture {index + 1}: {self.media_anchor}{self.image_end}\n"

    def render_text(self, messages: list[Message], add_generation_prompt: bool, template_kwargs=None) -> str:
        # Qwen-VL's make_context: ChatML and a default system prompt; its from_list_format numbers
        # the pictures of each message from 1.
        if messages[0].role != "system":
            messages = [Message("system", (TextPart(self.system_prompt),))] + messages
        pieces = []
        for message in messages:
            body, image_index = [], 0
            for part in message.parts:
                if isinstance(part, ImagePart):
                    body.append(self.media_prompt_text(image_index))
                    image_index += 1
                else:
                    body.append(part.text)
            pieces.append(f"<|im_start|>{message.role}\n{''.join(body)}<|im_end|>")
        text = "\n".join(pieces)
        return text + "\n<|im_start|>assistant\n" if add_generation_prompt else text

    def num_media_tokens(self, image: LoadedImage) -> int:
        return NUM_QUERIES + 1  # <img> itself, then the 256 slots; </img> stays in the text

    def media_block(self, image: PreparedImage) -> list[int]:
        metadata = [image.handle.name_value, image.handle.shape_value]
        return [self.media_anchor_id] + metadata + [self.image_pad_id] * (NUM_QUERIES - len(metadata))
