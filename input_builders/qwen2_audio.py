"""Qwen2-Audio: the checkpoint's chat template renders each clip as
``Audio N: <|audio_bos|><|AUDIO|><|audio_eos|>``; the anchor ``<|AUDIO|>`` becomes one block per
30 s window of the clip (docs/wire-format.md, "Audio")::

    <|audio_bos|>  NAME SHAPE FRAMES <|AUDIO|> × (n − 3)  [next window's block ...]  <|audio_eos|>
                   └────────── n slots: one window ──────┘      n = ((F − 1) // 2 + 1 − 2) // 2 + 1

NAME/SHAPE locate the window's float32 log-mel features ``(128, 3000)`` in shared memory; FRAMES
is the window's valid mel frame count ``F`` as a 1-d shape ``(F,)`` (the shape codec), from which
the model knows n before it reads the segment. n is what transformers' ``Qwen2AudioProcessor``
expands ``<|AUDIO|>`` to for the same clip.
"""

from __future__ import annotations

from dataclasses import dataclass

from atb_plugin.multimodal.wire import QWEN2_AUDIO_BLOCK
from input_builders.audio import AudioRef, LoadedAudio, load_audios
from input_builders.audio_features import WhisperFeatures, qwen2_audio_tokens
from input_builders.base import InputBuilder
from input_builders.conversation import (
    AudioPart,
    InputBuilderError,
    Message,
    TextPart,
    TooManyAudiosError,
    UnsupportedContentError,
)
from shm import ShmHandle, ShmStore, encode_shape_to_int64

METADATA_SLOTS = QWEN2_AUDIO_BLOCK.metadata_slots  # NAME, SHAPE, FRAMES


@dataclass(frozen=True)
class AudioWindow:
    handle: ShmHandle
    num_frames: int
    num_tokens: int


@dataclass(frozen=True)
class PreparedAudio:
    """A clip in shared memory, one segment per 30 s window, leased to the request."""

    windows: tuple[AudioWindow, ...]


class Qwen2AudioInputBuilder(InputBuilder):
    model_type = "qwen2_audio"  # its model class declares the clips per prompt
    media_part_type = AudioPart

    def __init__(self, tokenizer, *, audio_token_id: int, features: WhisperFeatures, **kwargs):
        super().__init__(tokenizer, media_token_id=audio_token_id, **kwargs)
        self.features = features  # bytes and seconds per clip: self.media_config (max_audio_*)
        self.audio_bos, self.audio_eos = "<|audio_bos|>", "<|audio_eos|>"
        # The shortest window that still gives a block: its metadata slots need n >= 3.
        self.min_window_frames = next(f for f in range(1, features.nb_max_frames + 1)
                                      if qwen2_audio_tokens(f) >= METADATA_SLOTS)

    # -- family hooks ----------------------------------------------------------------------------

    def media_prompt_text(self, index: int) -> str:
        return f"Audio {index + 1}: {self.audio_bos}{self.media_anchor}{self.audio_eos}\n"

    def template_content(self, message: Message):
        # The template tests `'audio' in content`: the part needs an "audio" key, not just a type.
        return [{"type": "text", "text": part.text} if isinstance(part, TextPart) else {"type": "audio", "audio": ""}
                for part in message.parts]

    def _load_media(self, parts: list[AudioPart], mm_processor_kwargs=None) -> list[LoadedAudio]:
        if parts and not self.max_images_per_prompt:
            raise UnsupportedContentError("this server takes no audio (--limit-mm-per-prompt audio=0); "
                                          "remove the audio parts")
        if len(parts) > self.max_images_per_prompt:
            raise TooManyAudiosError(f"the prompt has {len(parts)} audio clips; this model takes at most "
                                     f"{self.max_images_per_prompt} per prompt (--limit-mm-per-prompt audio=N)")
        clips = load_audios([AudioRef(part.ref, part.format) for part in parts], self.media_config)
        for clip in clips:
            self.window_bounds(clip)  # refuses a clip too short for one block, before anything is stored
        return clips

    def window_bounds(self, clip: LoadedAudio) -> list[tuple[int, int]]:
        """The clip's 30 s windows as sample ranges. A tail shorter than ``min_window_frames``
        (0.1 s) after a full window is dropped: it would give no feature row of its own."""
        size, total = self.features.n_samples, clip.samples.shape[0]
        bounds = [(start, min(start + size, total)) for start in range(0, total, size)]
        frames = self.features.num_frames
        if len(bounds) > 1 and frames(bounds[-1][1] - bounds[-1][0]) < self.min_window_frames:
            bounds.pop()
        if frames(bounds[0][1] - bounds[0][0]) < self.min_window_frames:
            shortest = self.min_window_frames * self.features.hop_length / self.features.sampling_rate
            raise InputBuilderError(f"audio ({clip.source}) is {clip.seconds * 1000:.0f} ms long; the shortest "
                                    f"clip this model takes is {shortest * 1000:.0f} ms")
        return bounds

    def num_media_tokens(self, clip: LoadedAudio) -> int:
        return sum(qwen2_audio_tokens(self.features.num_frames(end - start)) for start, end in self.window_bounds(clip))

    def _prepare(self, clip: LoadedAudio, store: ShmStore, request_id) -> PreparedAudio:
        windows = []
        for index, (start, end) in enumerate(self.window_bounds(clip)):
            # Content-addressed per window: a resent clip reuses its segments (and so its handles,
            # which is what lets the prefix cache match the blocks).
            key = f"{clip.digest}:{index}:{self.features.cache_key()}"
            frames = self.features.num_frames(end - start)
            handle = store.get(key, request_id=request_id)
            if handle is None:
                features, _ = self.features(clip.samples[start:end])
                handle = store.put(features, key=key, request_id=request_id)
            windows.append(AudioWindow(handle, frames, qwen2_audio_tokens(frames)))
        return PreparedAudio(tuple(windows))

    def media_block(self, clip: PreparedAudio) -> list[int]:
        ids = []
        for window in clip.windows:
            ids += [window.handle.name_value, window.handle.shape_value, encode_shape_to_int64((window.num_frames,))]
            ids += [self.media_anchor_id] * (window.num_tokens - METADATA_SLOTS)
        return ids
