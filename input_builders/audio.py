"""Audio loading for the input builders: an audio reference from a request -> 16 kHz mono float32
samples plus a digest, or a ``MediaError`` (HTTP 400) that says what is wrong and how to fix it.

Sources (``input_builders.sources.read_media_bytes``, the same policy as images: local files only
under the allowed directories, http(s) only from allowed domains, data: URLs of type ``audio/...``,
raw base64, bytes) and what each request spelling hands us:

    OpenAI   {"type": "input_audio", "input_audio": {"data": <base64>, "format": "wav"}}
    vLLM     {"type": "audio_url", "audio_url": {"url": "data:audio/wav;base64,..." | "file:///..." | "https://..."}}
    MindIE   {"audio": "/data/clip.flac"}

Decoding is PyAV (FFmpeg's demuxers, decoders and libswresample), then::

    container (wav | mp3 | flac | ogg; one with a video stream is refused)
      ─► first audio stream, decoded frame by frame
      ─► libswresample: float32 planar at 16 kHz, every channel kept (its default polyphase filter)
      ─► mono = the mean of the channels (librosa's ``to_mono``)

Limits (``MediaConfig``, server flags of the same names): encoded bytes (``max_audio_bytes``, 25 MiB,
checked before decoding), duration (``max_audio_seconds``, 240 s, checked from the container header
when it states one and again while decoding, so a long file is cut off rather than decoded whole),
clips per prompt (the builder's: ``--limit-mm-per-prompt audio=N``), wall-clock decode time
(``media_decode_timeout``, input_builders.decode_budget).
A clip longer than one 30 s window is split into windows, each a media block of its own
(docs/wire-format.md, "Audio").
"""

from __future__ import annotations

import hashlib
import io
import threading
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from input_builders.decode_budget import DecodeBudget
from input_builders.media_config import MediaConfig, knob
from input_builders.media_errors import MediaDecodeError, MediaError, MediaTooLargeError
from input_builders.pyav import pyav
from input_builders.sources import read_base64, read_media_bytes

__all__ = ["AUDIO_FORMATS", "AudioRef", "LoadedAudio", "SAMPLE_RATE", "load_audio", "load_audios"]

SAMPLE_RATE = 16000  # what every Whisper-style encoder takes

# input_audio's "format" -> the name PyAV gives the container (container.format.name). These are
# also the only containers accepted from any source: each demuxer is attack surface.
AUDIO_FORMATS = {"wav": "wav", "mp3": "mp3", "flac": "flac", "ogg": "ogg"}

_INPUT_AUDIO_HINT = ("; input_audio.data takes the audio file's bytes as base64 (OpenAI's input_audio), a URL or "
                     'server path goes in an audio_url part: {"type": "audio_url", "audio_url": {"url": ...}}')


@dataclass(frozen=True)
class AudioRef:
    """One audio item of a request: where it is, and for ``input_audio`` the declared format. With
    a ``format`` (``input_audio``) ``ref`` is base64 and nothing else, as OpenAI defines
    ``input_audio.data``; without, any source ``read_media_bytes`` takes."""

    ref: object  # str (path / file:// / data: / http(s) URL / base64) or bytes
    format: str | None = None


@dataclass(frozen=True)
class LoadedAudio:
    samples: np.ndarray  # float32, mono, SAMPLE_RATE, read-only
    digest: str  # sha256 of the encoded bytes
    source: str  # for messages: path, "data: URL (1234 bytes)", ...

    @property
    def seconds(self) -> float:
        return self.samples.shape[0] / SAMPLE_RATE


def load_audios(refs, config: MediaConfig) -> list[LoadedAudio]:
    return [load_audio(ref, config) for ref in refs]


def load_audio(ref, config: MediaConfig) -> LoadedAudio:
    """``ref`` (an ``AudioRef``, or what ``read_media_bytes`` takes) -> 16 kHz mono samples."""
    declared = ref.format if isinstance(ref, AudioRef) else None
    raw = ref.ref if isinstance(ref, AudioRef) else ref
    if declared is not None and declared not in AUDIO_FORMATS:
        raise MediaDecodeError(f"input_audio format {declared!r} is not supported; use one of "
                               f"{', '.join(AUDIO_FORMATS)}")
    if declared is None:
        data, source = read_media_bytes(raw, config, kind="audio", max_bytes=config.limits.max_audio_bytes)
    else:
        data = read_base64(raw, "input_audio.data", config, kind="audio", max_bytes=config.limits.max_audio_bytes,
                           hint=_INPUT_AUDIO_HINT)
        source = f"input_audio.data: {len(data)} bytes of base64-decoded data"
    if not data:
        raise MediaDecodeError(f"audio ({source}) is empty; send the audio file's contents")
    digest = hashlib.sha256(data).hexdigest()
    key = (digest, config.limits.max_audio_seconds)  # the duration was checked under this limit
    known = _recently_decoded.get(key)
    if known is None:
        known = _decode(data, source, declared, config)
        _recently_decoded.put(key, known)
    else:
        _check_declared(known[1], declared, source)  # the same bytes may come with another format
    return LoadedAudio(known[0], digest, source)


def _decode(data: bytes, source: str, declared: str | None, config: MediaConfig) -> tuple[np.ndarray, str]:
    """``(samples, container format name)``."""
    av = pyav()

    try:
        with DecodeBudget(config, "audio", source).running() as budget, av.open(io.BytesIO(data), mode="r") as container:
            return _decode_container(container, source, declared, config, budget), container.format.name
    except MediaError:
        raise
    except MemoryError:
        raise
    except Exception as exc:  # av.error.FFmpegError and its zoo (InvalidDataError, EOFError ...)
        raise MediaDecodeError(
            f"audio ({source}) could not be decoded ({type(exc).__name__}: {exc}); send a complete "
            f"{' / '.join(AUDIO_FORMATS)} file"
        ) from None


def _decode_container(container, source: str, declared: str | None, config: MediaConfig,
                      budget: DecodeBudget) -> np.ndarray:
    av = pyav()

    name = container.format.name
    videos = [s for s in container.streams.video if not _is_cover_art(s)]
    if videos:
        raise MediaDecodeError(f"audio ({source}) is a video file ({name}, with a {videos[0].codec_context.name} "
                               "video stream); send an audio file, or extract its audio track first")
    if name not in AUDIO_FORMATS.values():
        raise MediaDecodeError(f"audio ({source}) is a {name!r} file; supported: {', '.join(AUDIO_FORMATS)}")
    _check_declared(name, declared, source)
    if not container.streams.audio:
        raise MediaDecodeError(f"audio ({source}) has no audio stream; send an audio file")
    limit, max_samples = config.limits.max_audio_seconds, int(config.limits.max_audio_seconds * SAMPLE_RATE)
    if container.duration is not None and container.duration / av.time_base > limit + 1:
        raise _too_long(source, container.duration / av.time_base, config)
    stream = container.streams.audio[0]
    resampler = av.AudioResampler(format="fltp", rate=SAMPLE_RATE)  # the stream's own channels
    chunks, total = [], 0
    for frame in container.decode(stream):
        budget.tick()  # the clip's wall-clock budget (media_decode_timeout)
        for out in resampler.resample(frame):
            total += _keep(out, chunks)
        if total > max_samples:
            raise _too_long(source, None, config)
    for out in resampler.resample(None):  # the filter's tail
        total += _keep(out, chunks)
    if total > max_samples:
        raise _too_long(source, total / SAMPLE_RATE, config)
    if total == 0:
        raise MediaDecodeError(f"audio ({source}) has no samples (zero length); send a non-empty recording")
    samples = np.concatenate(chunks, axis=1).mean(axis=0, dtype=np.float32) if len(chunks) > 1 else \
        chunks[0].mean(axis=0, dtype=np.float32)
    if not np.isfinite(samples).all():
        raise MediaDecodeError(f"audio ({source}) decodes to non-finite samples; send a valid recording")
    samples.flags.writeable = False
    return samples


def _check_declared(name: str, declared: str | None, source: str) -> None:
    if declared is not None and AUDIO_FORMATS[declared] != name:
        raise MediaDecodeError(f"audio ({source}) was sent with format {declared!r} but is a {name} file; "
                               "set input_audio.format to the file's real format")


def _keep(frame, chunks: list) -> int:
    array = frame.to_ndarray()  # planar float32: (channels, samples)
    if array.shape[-1]:
        chunks.append(array.reshape(-1, array.shape[-1]))
    return array.shape[-1]


def _is_cover_art(stream) -> bool:
    """An mp3 / flac may carry its album cover as a one-picture video stream: still audio."""
    av = pyav()

    disposition = getattr(stream, "disposition", 0)
    return bool(disposition & av.stream.Disposition.attached_pic)


def _too_long(source: str, seconds: float | None, config: MediaConfig) -> MediaTooLargeError:
    limit = config.limits.max_audio_seconds
    length = f"{seconds:.1f} s long" if seconds is not None else f"longer than {limit:g} s"
    return MediaTooLargeError(f"audio ({source}) is {length}; the limit is {limit:g} s per clip "
                              f"({knob(config, 'max_audio_seconds')}); send a shorter clip or split it")


class _DecodedAudio:
    """The last clips decoded in this process, by source digest: a chat resends its audio every
    turn, and decoding + resampling is most of the frontend's work for it. Bounded by bytes."""

    def __init__(self, max_bytes: int):
        self.max_bytes, self._bytes = max_bytes, 0
        self._items: OrderedDict[tuple, tuple[np.ndarray, str]] = OrderedDict()  # (samples, container)
        self._lock = threading.Lock()

    def get(self, key: tuple) -> tuple[np.ndarray, str] | None:
        with self._lock:
            samples = self._items.get(key)
            if samples is not None:
                self._items.move_to_end(key)
            return samples

    def put(self, key: tuple, decoded: tuple[np.ndarray, str]) -> None:
        with self._lock:
            if decoded[0].nbytes > self.max_bytes or key in self._items:
                return
            self._items[key] = decoded
            self._bytes += decoded[0].nbytes
            while self._bytes > self.max_bytes:
                self._bytes -= self._items.popitem(last=False)[1][0].nbytes


_recently_decoded = _DecodedAudio(64 << 20)
