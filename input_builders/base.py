"""``InputBuilder``: conversation or prompt -> ``input_ids`` with shared-memory handles.

How a chat becomes ids (``make_context``)::

    conversation ──parse──► messages ──load images──► (window: drop oldest turns to fit)
         ──apply_chat_template──► text with ONE anchor token per image ──tokenize──► ids
         ──for each image: preprocess (or reuse by key) → ShmStore.put(lease=request_id)──►
         ──replace each anchor by the family's media block──► input_ids

A media block is the family's layout from docs/wire-format.md, e.g. Qwen2-VL (n = t·h·w / merge²)::

    ... <|vision_start|> NAME SHAPE THW <|image_pad|> × (n − 3) <|vision_end|> ...
                         └─ int64 < 0 ─┘
                         └────────── n slots, one per merged patch ──┘

The anchor is the single token the chat template renders for an image (``<|image_pad|>``,
``<image>``, ``<img>``); the template's text around it is kept verbatim, so the ids equal the
template's ids with each anchor widened into its block.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from jinja2 import TemplateError, TemplateSyntaxError

from input_builders.conversation import (
    ChatTemplateError,
    ContextTooLongError,
    ConversationError,
    ImagePart,
    InputBuilderError,
    Message,
    TextPart,
    TooManyImagesError,
    UnsupportedContentError,
    parse_conversation,
    parse_prompt,
)
from input_builders.image import LoadedImage, load_images
from input_builders.media_config import MediaConfig
from input_builders.preprocess import ImagePreprocessor
from shm import ShmHandle, ShmStore


@dataclass(frozen=True)
class PreparedImage:
    """An image in shared memory, leased to the request, with what its media block needs."""

    handle: ShmHandle
    num_tokens: int  # length of the block that replaces the anchor
    grid_thw: tuple[int, int, int] | None = None


class InputBuilder:
    """Turns a conversation (``make_context``) or a plain prompt (``tokenize``) into input ids.

    Contract (MindIE's signature, so MindIE services can call it unchanged):

    - ``make_context(rank, conversation, add_generation_prompt=True, adapt_to_max_length=False,
      **kwargs) -> list[int]`` applies the checkpoint's chat template; ``tokenize(inputs,
      **kwargs) -> list[int]`` is the non-chat form (a string or MindIE's item list).
    - ids are token ids (>= 0) except the metadata slots of media blocks (< 0, shm handles).
    - every segment a call writes or reuses is leased to ``kwargs["request_id"]`` (required when
      there are images); if the call fails, that request's leases are released before the error
      propagates. The caller ends the lease with ``store.release(request_id)``.
    - bad input raises a ``ValueError`` subclass (``InputBuilderError`` or ``MediaError``) whose
      message names the limit and how to fix the input.

    Text-only families use this class as is. Multimodal families set ``model_type`` (whose model
    class declares how many items of its modality a prompt may carry), are given ``media_token_id``
    (the anchor of that modality: the image token, or the audio token; from the model config) and an ``ImagePreprocessor``, and implement ``num_media_tokens`` and
    ``media_block`` (and ``grid_thw`` where blocks vary). ``max_images_per_prompt`` (the engine's
    ``limit_mm_per_prompt``) may lower the family's limit, not raise it.
    """

    max_images_per_prompt: int = 0  # 0: the family takes no images
    model_type: str | None = None  # a multimodal family's key in atb_plugin.models.registry
    media_part_type: type = ImagePart  # the kind of media part this family loads (AudioPart for audio models)

    def __init__(
        self,
        tokenizer,
        *,
        store: Callable[[], ShmStore] | None = None,
        preprocessor: ImagePreprocessor | None = None,
        media_config: MediaConfig | None = None,
        max_length: int | None = None,
        max_images_per_prompt: int | None = None,
        media_token_id: int | None = None,
    ):
        self.tokenizer = tokenizer
        self._store = store  # a callable: text-only use never creates a store
        self.preprocessor = preprocessor
        self.media_config = media_config or MediaConfig()
        self.max_length = max_length
        family_limit = self.family_max_images()
        if max_images_per_prompt is None:  # the media config's limit, if any (None: the family's)
            max_images_per_prompt = self.media_config.limits.limit_mm_per_prompt
        if max_images_per_prompt is not None:
            if not 0 <= max_images_per_prompt <= family_limit:
                raise ValueError(f"max_images_per_prompt = {max_images_per_prompt}: {type(self).__name__} takes "
                                 f"0 to {family_limit} images per prompt")
            self.max_images_per_prompt = max_images_per_prompt
        else:
            self.max_images_per_prompt = family_limit
        # The anchor: the one token the template renders per item of the family's own modality
        # (an image, an audio clip; from the model config).
        self.media_anchor_id = media_token_id
        self.media_anchor = None if media_token_id is None else tokenizer.convert_ids_to_tokens(media_token_id)
        if self.max_images_per_prompt and media_token_id is None:
            raise ValueError(f"{type(self).__name__} takes media but got no media_token_id")

    @classmethod
    def family_max_images(cls) -> int:
        """The family's own limit, as its model class declares it (``supported_mm_limits``): one
        declaration for this builder and the engine's ``limit_mm_per_prompt``. The class is imported
        here, when a builder is made (torch is loaded by then, with the tokenizer), not when a
        router is picked."""
        if cls.model_type is None:
            return cls.max_images_per_prompt
        from atb_plugin.models import registry
        from atb_plugin.models.interfaces import supported_mm_limit

        return supported_mm_limit(registry.import_model_class(registry.MODEL_CLASSES[cls.model_type]))

    # -- public (MindIE's signatures) -------------------------------------------------------------

    def make_context(self, rank: int, conversation, add_generation_prompt: bool = True,
                     adapt_to_max_length: bool = False, **kwargs) -> list[int]:
        """Chat template + media blocks. kwargs: ``request_id``, ``max_length``, ``truncate``,
        ``chat_template_kwargs`` (extra variables for the template, e.g. ``enable_thinking``),
        ``check_length`` (called with the prompt's length before its media are decoded: may raise),
        ``tools`` (OpenAI's list of ``{"type": "function", "function": {...}}``, given to the
        template as ``tools``; a template that does not use them renders without them, as in
        transformers), ``mm_processor_kwargs`` (handed to ``_load_media``: video sampling overrides).

        With ``adapt_to_max_length`` the oldest turns are dropped (the system prompt stays) until
        the prompt fits ``max_length``; if the last user turn alone is too long the call raises
        ``ContextTooLongError``, or with ``truncate=True`` keeps the last ``max_length`` tokens
        (never cutting through a media block). ``rank`` is MindIE's and unused here.
        """
        messages = parse_conversation(conversation)
        template_kwargs = kwargs.get("chat_template_kwargs") or {}
        if not isinstance(template_kwargs, dict):
            raise InputBuilderError(f"chat_template_kwargs must be an object, got {type(template_kwargs).__name__}")
        tools = kwargs.get("tools")
        if tools is not None:
            if not isinstance(tools, (list, tuple)) or not all(isinstance(tool, dict) for tool in tools):
                raise InputBuilderError('tools must be a list of {"type": "function", "function": {...}} objects')
            # A template variable like any other (so the history window renders with it too); the
            # explicit argument wins over a "tools" key in chat_template_kwargs.
            template_kwargs = {**template_kwargs, "tools": list(tools)}
        images = self._load_media(self.media_parts(part for message in messages for part in message.parts),
                                  kwargs.get("mm_processor_kwargs"))
        max_length = kwargs.get("max_length", self.max_length)
        if adapt_to_max_length and max_length is None:
            raise ValueError("adapt_to_max_length needs max_length (from the model config or the call)")
        if adapt_to_max_length:
            messages, images = self._drop_oldest_turns(messages, images, add_generation_prompt, max_length,
                                                       template_kwargs)
        ids = self._render(messages, add_generation_prompt, template_kwargs)
        if adapt_to_max_length:
            length = self._expanded_length(ids, images)
            if length > max_length and kwargs.get("truncate", False):
                ids, images = self._truncate_left(ids, images, max_length)
            elif length > max_length:
                raise ContextTooLongError(
                    f"the last user turn alone needs {length} tokens (with the system prompt and "
                    f"{len(images)} image(s)); max_length is {max_length}. Shorten it, send fewer or "
                    "smaller images, or pass truncate=True"
                )
        return self._with_media(ids, images, kwargs.get("request_id"), kwargs.get("check_length"))

    def tokenize(self, inputs, **kwargs) -> list[int]:
        """A string, or MindIE's list of ``{"text": ...}`` / ``{"image": ...}`` items, in order."""
        parts = parse_prompt(inputs)
        images = self._load_media(self.media_parts(parts), kwargs.get("mm_processor_kwargs"))
        text = self._prompt_text(parts)
        ids = self.tokenizer(text, add_special_tokens=kwargs.get("add_special_tokens", True))["input_ids"]
        return self._with_media(list(ids), images, kwargs.get("request_id"), kwargs.get("check_length"))

    # -- family hooks ----------------------------------------------------------------------------

    def media_prompt_text(self, index: int) -> str:
        """How image ``index`` (0-based) appears in a non-chat prompt; defaults to the anchor."""
        return self.media_anchor

    def template_message(self, message: Message) -> dict:
        """A message as the chat template expects it: role and content, an assistant's
        ``tool_calls`` in OpenAI's shape but with ``arguments`` as a mapping (what vLLM hands the
        template, and what Qwen2.5's renders with ``tojson``), a tool message's ``tool_call_id``."""
        rendered = {"role": message.role, "content": self.template_content(message)}
        if message.tool_calls:
            rendered["tool_calls"] = [
                {**({"id": call.id} if call.id is not None else {}), "type": "function",
                 "function": {"name": call.name, "arguments": call.arguments_object}}
                for call in message.tool_calls
            ]
        if message.tool_call_id is not None:
            rendered["tool_call_id"] = message.tool_call_id
        return rendered

    def template_content(self, message: Message):
        """A message's content as the chat template expects it."""
        if not self.max_images_per_prompt:
            return message.text
        return [
            {"type": "text", "text": part.text} if isinstance(part, TextPart) else {"type": part.kind}
            for part in message.parts
        ]

    def num_media_tokens(self, image: LoadedImage) -> int:
        """Length of the block that replaces this image's anchor (known before preprocessing)."""
        raise NotImplementedError

    def media_block(self, image: PreparedImage) -> list[int]:
        raise NotImplementedError

    def grid_thw(self, image: LoadedImage) -> tuple[int, int, int] | None:
        return None

    # -- steps -----------------------------------------------------------------------------------

    def render_text(self, messages: list[Message], add_generation_prompt: bool, template_kwargs=None) -> str:
        """The prompt text with one anchor per image: the checkpoint's chat template by default."""
        chat = [self.template_message(m) for m in messages]
        try:
            return self.tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=add_generation_prompt,
                                                      **(template_kwargs or {}))
        except TemplateSyntaxError:
            raise  # the template itself is broken: the server's fault, not the request's
        except TemplateError as error:  # the template's raise_exception: it refuses this conversation
            hint = ""
            if any(m.role == "tool" or m.tool_calls for m in messages):
                hint = "; the conversation has tool calls or tool messages, which this model's template may not support"
            raise ChatTemplateError(f"the chat template cannot render this conversation: {error}{hint}") from error

    def _render(self, messages: list[Message], add_generation_prompt: bool, template_kwargs=None) -> list[int]:
        text = self.render_text(messages, add_generation_prompt, template_kwargs)
        # The template already wrote BOS / role markers: adding special tokens again would double them.
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def _prompt_text(self, parts) -> str:
        pieces, index = [], 0
        for part in parts:
            if isinstance(part, TextPart):
                pieces.append(part.text)
            else:
                pieces.append(self.part_prompt_text(part, index))
                index += 1
        return "".join(pieces)

    def part_prompt_text(self, part, index: int) -> str:
        """How media part ``index`` (0-based, all kinds counted) appears in a non-chat prompt."""
        return self.media_prompt_text(index)

    def anchor_id(self, item) -> int:
        """The anchor token a loaded media item (what ``_load_media`` returned) replaces."""
        return self.media_anchor_id

    def anchor_ids(self) -> frozenset:
        """Every anchor token of this family (an image family: just the image's)."""
        return frozenset({self.media_anchor_id})

    def media_parts(self, parts) -> list:
        """The media parts of ``parts`` in order, all of this family's kind (``media_part_type``):
        a part of another kind (audio to an image or text model, an image to an audio model) is
        refused here, naming it; how many of its own kind it takes is ``_load_media``' check."""
        found = []
        for part in parts:
            if isinstance(part, TextPart):
                continue
            if not isinstance(part, self.media_part_type):
                raise UnsupportedContentError(
                    f"this server serves a model without {part.kind} input: the prompt has {part.kind} "
                    f"content; remove the {part.kind} parts or use a model that takes them"
                )
            found.append(part)
        return found

    def _load_media(self, parts: list[ImagePart], mm_processor_kwargs=None) -> list[LoadedImage]:
        """The loaded media of ``parts`` (this family's kind), in order. ``mm_processor_kwargs``:
        the request's processing overrides (vLLM's), for a family whose media take any (video)."""
        if parts and not self.max_images_per_prompt:
            raise UnsupportedContentError(
                f"this server serves a text-only model: the prompt has {len(parts)} image(s); "
                "remove the image parts"
            )
        if len(parts) > self.max_images_per_prompt:
            raise TooManyImagesError(
                f"the prompt has {len(parts)} images; this model takes at most "
                f"{self.max_images_per_prompt} per prompt (--limit-mm-per-prompt image=N)"
            )
        # One call per request: its images share the request's pixel budget (max_request_pixels).
        return load_images([part.ref for part in parts], self.media_config)

    def _expanded_length(self, ids: list[int], images: list[LoadedImage]) -> int:
        return len(ids) + sum(self.num_media_tokens(image) - 1 for image in images)

    def _drop_oldest_turns(self, messages, images, add_generation_prompt, max_length, template_kwargs=None):
        """Drop whole turns from the front (never the system prompt nor the last user turn)."""
        system = messages[:1] if messages[0].role == "system" else []
        turns = messages[len(system):]
        while True:
            kept_images = images[len(images) - sum(len(self.media_parts(m.parts)) for m in turns):]
            if self._expanded_length(self._render(system + turns, add_generation_prompt, template_kwargs),
                                    kept_images) <= max_length:
                break
            # A turn starts at a user message: cut up to the next one after the oldest kept.
            next_user = next((i for i, m in enumerate(turns) if i > 0 and m.role == "user"), None)
            if next_user is None:
                break  # only the last user turn is left: the caller truncates or refuses
            turns = turns[next_user:]
        return system + turns, kept_images

    def _truncate_left(self, ids: list[int], images: list[LoadedImage], max_length: int):
        """Keep the last ``max_length`` tokens, never cutting through a media block."""
        anchor_ids = self.anchor_ids()
        anchors = [i for i, token in enumerate(ids) if token in anchor_ids]
        widths = {position: self.num_media_tokens(image) for position, image in zip(anchors, images)}
        cut, total = len(ids), 0
        while cut > 0 and total + widths.get(cut - 1, 1) <= max_length:
            cut -= 1
            total += widths.get(cut, 1)
        dropped = sum(1 for position in anchors if position < cut)
        return ids[cut:], images[dropped:]

    def _with_media(self, ids: list[int], images: list[LoadedImage], request_id, check_length=None) -> list[int]:
        """``ids`` with each anchor replaced by its item's media block, the items preprocessed into
        shared memory (leased to ``request_id``). ``check_length(n)`` first sees the length the
        prompt will have: a caller refuses an over-long prompt there, before its media are decoded
        (a video's tokens are known from its container's header and packet index alone)."""
        if not images:
            return ids
        if request_id is None:
            raise ValueError("request_id is required when the prompt has images: the segments are leased to it")
        anchor_ids = self.anchor_ids()
        anchors = [i for i, token in enumerate(ids) if token in anchor_ids]
        if len(anchors) != len(images) or any(ids[i] != self.anchor_id(item) for i, item in zip(anchors, images)):
            raise InputBuilderError(
                f"found {len(anchors)} image placeholders ({self.media_anchor!r}) for {len(images)} images: "
                "the text must not contain the image token itself"
            )
        if check_length is not None:
            check_length(self._expanded_length(ids, images))
        with self._leases_released_on_error(request_id) as store:
            out, start = [], 0
            for position, image in zip(anchors, images):
                out += ids[start:position]
                out += self.media_block(self._prepare(image, store, request_id))
                start = position + 1
            return out + ids[start:]

    def _prepare(self, image: LoadedImage, store: ShmStore, request_id) -> PreparedImage:
        # Content-addressed: the same source bytes under the same preprocessing reuse one segment.
        key = f"{image.digest}:{self.preprocessor.cache_key()}"
        grid = self.grid_thw(image)
        handle = store.get(key, request_id=request_id)
        if handle is None:
            payload, grid_thw = self.preprocessor.shm_payload(image.image)
            if grid_thw is not None and tuple(grid_thw) != grid:
                raise AssertionError(f"grid {grid_thw} differs from the predicted {grid}")
            handle = store.put(payload, key=key, request_id=request_id)
        return PreparedImage(handle, self.num_media_tokens(image), grid)

    @contextmanager
    def _leases_released_on_error(self, request_id) -> Iterator[ShmStore]:
        store = self._store()
        try:
            yield store
        except BaseException:
            store.release(request_id)
            raise


__all__ = ["ContextTooLongError", "ConversationError", "InputBuilder", "PreparedImage"]
