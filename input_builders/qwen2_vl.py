"""Qwen2-VL / Qwen2.5-VL: one block per image or video, sized by its patch grid.

    image: <|vision_start|> NAME SHAPE THW     <|image_pad|> × (n − 3) <|vision_end|>
    video: <|vision_start|> NAME SHAPE THW SPG <|video_pad|> × (n − 4) <|vision_end|>
                                                      n = t·h·w / merge²

NAME/SHAPE locate the pixels in shared memory (an image ``(H, W, 3)`` or video frames
``(2t, 3, H, W)`` in uint8, or the ``(t·h·w, 3·2·14·14)`` patches in float32); THW is ``grid_thw``
encoded with the shape codec; SPG is a video's ``second_per_grid_t`` (``wire.encode_second_per_grid_t``),
which Qwen2.5-VL's M-RoPE needs. The model puts back the placeholder in the metadata slots and
replaces all n slots with the merged patch features. See docs/wire-format.md.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from atb_plugin.multimodal.wire import QWEN2_VL_BLOCK, QWEN2_VL_VIDEO_BLOCK, encode_second_per_grid_t
from input_builders.base import InputBuilder, PreparedImage
from input_builders.conversation import (
    ImagePart,
    InputBuilderError,
    TooManyVideosError,
    UnsupportedContentError,
    VideoPart,
)
from input_builders.preprocess import Qwen2VLPreprocessor
from input_builders.pyav import pyav
from input_builders.video import LoadedVideo, VideoOptionError, VideoSampling, load_video
from shm import ShmHandle, ShmStore, encode_shape_to_int64

METADATA_SLOTS = QWEN2_VL_BLOCK.metadata_slots  # NAME, SHAPE, THW
VIDEO_METADATA_SLOTS = QWEN2_VL_VIDEO_BLOCK.metadata_slots  # NAME, SHAPE, THW, SPG

@dataclass(frozen=True)
class PreparedVideo:
    """A video's frames in shared memory, leased to the request, with what its block needs."""

    handle: ShmHandle
    num_tokens: int
    grid_thw: tuple[int, int, int]
    second_per_grid_t: float
    timestamps: tuple[float, ...] = ()  # seconds of each temporal patch (Qwen3-VL's prompt shows them)


class Qwen2VlInputBuilder(InputBuilder):
    model_type = "qwen2_vl"  # its model class declares the images and videos per prompt
    media_part_type = (ImagePart, VideoPart)

    def __init__(self, tokenizer, *, vision_start_token_id: int, vision_end_token_id: int,
                 preprocessor: Qwen2VLPreprocessor, video_token_id: int | None = None,
                 video_sampling: VideoSampling | None = None, **kwargs):
        super().__init__(tokenizer, preprocessor=preprocessor, **kwargs)
        self.vision_start = tokenizer.convert_ids_to_tokens(vision_start_token_id)
        self.vision_end = tokenizer.convert_ids_to_tokens(vision_end_token_id)
        family_videos = self.family_max_videos() if video_token_id is not None else 0
        limit = self.media_config.limits.limit_videos_per_prompt
        if limit is not None and limit > family_videos:
            raise ValueError(f"limit_videos_per_prompt = {limit} (--limit-mm-per-prompt video=N): this model takes at "
                             f"most {family_videos} videos per prompt; set it to {family_videos} or less")
        self.max_videos_per_prompt = family_videos if limit is None else limit
        self.video_anchor_id = video_token_id
        self.video_anchor = None if video_token_id is None else tokenizer.convert_ids_to_tokens(video_token_id)
        # Qwen's defaults, with the checkpoint's temporal patch and merge window.
        self.video_sampling = video_sampling or VideoSampling(frame_factor=preprocessor.temporal_patch_size,
                                                              image_factor=preprocessor.factor)

    @classmethod
    def family_max_videos(cls) -> int:
        from atb_plugin.models import registry
        from atb_plugin.models.interfaces import supported_mm_limit

        return supported_mm_limit(registry.import_model_class(registry.MODEL_CLASSES[cls.model_type]), "video")

    # -- loading -----------------------------------------------------------------------------------

    def _load_media(self, parts: list, mm_processor_kwargs=None) -> list:
        """Images (``InputBuilder._load_media``: the pixel budget) and videos (probed and planned,
        not decoded: ``input_builders.video``), in prompt order. ``mm_processor_kwargs`` (a dict)
        overrides the sampling of every video of the request; a video part's own keys win over it."""
        if mm_processor_kwargs is not None and not isinstance(mm_processor_kwargs, Mapping):
            raise VideoOptionError(f"mm_processor_kwargs must be an object, got {type(mm_processor_kwargs).__name__}")
        request = dict(mm_processor_kwargs or {})
        videos = [part for part in parts if isinstance(part, VideoPart)]
        if videos and not self.max_videos_per_prompt:
            raise UnsupportedContentError(
                f"this model takes no video (video_token_id is not in its config, or the server allows 0 videos "
                f"per prompt): the prompt has {len(videos)} video(s); remove the video parts")
        if len(videos) > self.max_videos_per_prompt:
            raise TooManyVideosError(f"the prompt has {len(videos)} videos; this model takes at most "
                                     f"{self.max_videos_per_prompt} per prompt (--limit-mm-per-prompt video=N)")
        images = iter(super()._load_media([part for part in parts if not isinstance(part, VideoPart)]))
        loaded = iter([load_video(part.ref, self.media_config, self.video_sampling, {**request, **dict(part.options)})
                       for part in videos])
        return [next(loaded) if isinstance(part, VideoPart) else next(images) for part in parts]

    # -- family hooks ----------------------------------------------------------------------------

    def media_prompt_text(self, index: int) -> str:
        return f"{self.vision_start}{self.media_anchor}{self.vision_end}"

    def part_prompt_text(self, part, index: int) -> str:
        if isinstance(part, VideoPart):
            return f"{self.vision_start}{self.video_anchor}{self.vision_end}"
        return self.media_prompt_text(index)

    def anchor_id(self, item) -> int:
        return self.video_anchor_id if isinstance(item, LoadedVideo) else self.media_anchor_id

    def anchor_ids(self) -> frozenset:
        return frozenset(a for a in (self.media_anchor_id, self.video_anchor_id) if a is not None)

    def grid_thw(self, item) -> tuple[int, int, int]:
        # Known from the image size, or the video's stream header and plan alone, so a reused
        # segment needs no decoding.
        patch = self.preprocessor.patch_size
        if isinstance(item, LoadedVideo):
            height, width = item.plan.size
            return item.plan.num_patches, height // patch, width // patch
        height, width = self.preprocessor.smart_resize(item.image.height, item.image.width)
        return 1, height // patch, width // patch

    def num_media_tokens(self, item) -> int:
        tokens = self.preprocessor.num_image_tokens(self.grid_thw(item))
        if isinstance(item, LoadedVideo):
            if tokens < VIDEO_METADATA_SLOTS:
                raise InputBuilderError(f"the video ({item.source}) becomes {tokens} video tokens; a block needs at "
                                        f"least {VIDEO_METADATA_SLOTS}: raise min_pixels or the frame count")
            return tokens
        if tokens < METADATA_SLOTS:
            raise InputBuilderError(
                f"a {item.image.width}x{item.image.height} image becomes {tokens} image tokens; a block "
                f"needs at least {METADATA_SLOTS}: raise min_pixels in preprocessor_config.json"
            )
        return tokens

    def _prepare(self, item, store: ShmStore, request_id):
        if not isinstance(item, LoadedVideo):
            return super()._prepare(item, store, request_id)
        # Content-addressed like images: the same bytes under the same sampling and preprocessing
        # (and the same decoder: frames follow FFmpeg's version) reuse one segment, undecoded.
        av = pyav()
        key = f"{item.digest}:{item.sampling.cache_key()}:{self.preprocessor.cache_key()};av={av.__version__}"
        grid = self.grid_thw(item)
        handle = store.get(key, request_id=request_id)
        if handle is None:
            processed = self.preprocessor.preprocess_video(item.resized_frames())
            if tuple(processed.grid_thw) != grid:
                raise AssertionError(f"grid {processed.grid_thw} differs from the predicted {grid}")
            handle = store.put(processed.pixel_values, key=key, request_id=request_id)
        return PreparedVideo(handle, self.num_media_tokens(item), grid, item.plan.second_per_grid_t,
                             item.plan.patch_timestamps)

    def media_block(self, item: PreparedImage | PreparedVideo) -> list[int]:
        metadata = [item.handle.name_value, item.handle.shape_value, encode_shape_to_int64(item.grid_thw)]
        if isinstance(item, PreparedVideo):
            metadata.append(encode_second_per_grid_t(item.second_per_grid_t))
            return metadata + [self.video_anchor_id] * (item.num_tokens - VIDEO_METADATA_SLOTS)
        return metadata + [self.media_anchor_id] * (item.num_tokens - METADATA_SLOTS)


__all__ = ["PreparedVideo", "Qwen2VlInputBuilder"]
