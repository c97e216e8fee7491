"""Text-only families: decoders (Qwen2, Llama) use InputBuilder unchanged; BERT-style encoders
have no chat template."""

from __future__ import annotations

from input_builders.base import InputBuilder
from input_builders.conversation import parse_conversation


class TextInputBuilder(InputBuilder):
    """Qwen2, Llama and other decoders: the checkpoint's chat template, no media."""


class BertInputBuilder(InputBuilder):
    """Encoders embed text: ``make_context`` joins the messages' text with newlines (there is no
    chat template to apply) and adds ``[CLS]`` / ``[SEP]`` like ``tokenize``."""

    def make_context(self, rank: int, conversation, add_generation_prompt: bool = True,
                     adapt_to_max_length: bool = False, **kwargs) -> list[int]:
        messages = parse_conversation(conversation)
        self._load_media(self.media_parts(part for message in messages for part in message.parts))  # refuses any
        return self.tokenize("\n".join(message.text for message in messages), **kwargs)
