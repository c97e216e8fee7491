"""Generated test audio (no recordings, no downloads): signals with a known formula, encoded into
real audio files with PyAV, for the audio tests and ``benchmarks/bench_audio.py``.

``sweep`` / ``noise`` / ``bursts`` / ``tones`` give ``(channels, samples)`` float32 in [-1, 1];
``encode(samples, rate, "wav" | "flac" | "mp3" | "ogg")`` gives the file's bytes; ``encode_video``
a small mp4 with a video and an audio stream (what "a video sent as audio" looks like)."""

from __future__ import annotations

import io
import wave

import numpy as np

__all__ = ["bursts", "empty_wav", "encode", "encode_video", "noise", "sweep", "tones"]

# container -> (codec, the sample format its encoder takes)
_CODECS = {"wav": ("pcm_f32le", "flt"), "wav16": ("pcm_s16le", "s16"), "flac": ("flac", "s16"),
           "mp3": ("libmp3lame", "fltp"), "ogg": ("libopus", "flt")}


def _times(seconds: float, rate: int) -> np.ndarray:
    return np.arange(int(round(seconds * rate)), dtype=np.float64) / rate


def tones(seconds: float, rate: int, freqs=(440.0,), amplitude: float = 0.3, channels: int = 1) -> np.ndarray:
    """A sum of sines; channel c is shifted in phase by c radians (so channels differ)."""
    t = _times(seconds, rate)
    out = [sum(amplitude * np.sin(2 * np.pi * f * t + c) for f in freqs) / len(freqs) for c in range(channels)]
    return np.stack(out).astype(np.float32)


def sweep(seconds: float, rate: int, low: float = 100.0, high: float = 6000.0, channels: int = 1,
          amplitude: float = 0.5) -> np.ndarray:
    """A linear chirp from ``low`` to ``high`` Hz (band-limited below 7 kHz by default)."""
    t = _times(seconds, rate)
    phase = 2 * np.pi * (low * t + (high - low) * t**2 / (2 * seconds))
    return np.stack([amplitude * np.sin(phase + c) for c in range(channels)]).astype(np.float32)


def noise(seconds: float, rate: int, channels: int = 1, seed: int = 0, amplitude: float = 0.2) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return (amplitude * rng.standard_normal((channels, len(_times(seconds, rate))))).clip(-1, 1).astype(np.float32)


def bursts(seconds: float, rate: int, channels: int = 1, seed: int = 0) -> np.ndarray:
    """Speech-like: 80-250 ms bursts of a harmonic tone (a 120-220 Hz fundamental with formant-ish
    harmonics) under a Hann envelope, separated by short silences."""
    rng = np.random.default_rng(seed)
    total = len(_times(seconds, rate))
    out = np.zeros((channels, total), dtype=np.float64)
    position = int(0.05 * rate)
    while position < total:
        length = int(rng.uniform(0.08, 0.25) * rate)
        f0 = rng.uniform(120, 220)
        t = np.arange(length) / rate
        voice = sum(np.sin(2 * np.pi * f0 * k * t) / k for k in range(1, 12) if f0 * k < 7000)
        burst = 0.3 * voice * np.hanning(length)
        end = min(total, position + length)
        out[:, position:end] += burst[:end - position]
        position = end + int(rng.uniform(0.03, 0.15) * rate)
    return out.clip(-1, 1).astype(np.float32)


def encode(samples: np.ndarray, rate: int, container: str) -> bytes:
    """``(channels, samples)`` float32 -> the bytes of a ``container`` file ("wav" is float32 PCM,
    "wav16" 16-bit PCM; "flac" 16-bit; "mp3", "ogg" lossy)."""
    import av

    codec, sample_format = _CODECS[container]
    samples = np.atleast_2d(samples)
    channels = samples.shape[0]
    layout = {1: "mono", 2: "stereo"}[channels]
    buffer = io.BytesIO()
    with av.open(buffer, mode="w", format="wav" if container.startswith("wav") else container) as out:
        stream = out.add_stream(codec, rate=rate, layout=layout)
        if sample_format == "s16":
            data = np.round(np.clip(samples, -1, 1) * 32767).astype(np.int16).T.reshape(1, -1)
        elif sample_format == "flt":
            data = np.ascontiguousarray(samples.T.reshape(1, -1))
        else:  # planar float
            data = np.ascontiguousarray(samples)
        frame = av.AudioFrame.from_ndarray(data, format=sample_format, layout=layout)
        frame.sample_rate = rate
        for packet in stream.encode(frame):
            out.mux(packet)
        for packet in stream.encode(None):
            out.mux(packet)
    return buffer.getvalue()


def empty_wav(rate: int = 16000) -> bytes:
    """A valid 16-bit mono wav header with no samples (silence of zero length)."""
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(rate)
    return buffer.getvalue()


def encode_video(seconds: float = 0.5, rate: int = 16000) -> bytes:
    """A small mp4: 32x32 grey frames (mpeg4) and a 440 Hz tone (aac)."""
    import av

    buffer = io.BytesIO()
    with av.open(buffer, mode="w", format="mp4") as out:
        video = out.add_stream("mpeg4", rate=10)
        video.width, video.height, video.pix_fmt = 32, 32, "yuv420p"
        audio = out.add_stream("aac", rate=rate, layout="mono")
        for index in range(max(1, int(seconds * 10))):
            image = np.full((32, 32, 3), 40 * index % 255, dtype=np.uint8)
            for packet in video.encode(av.VideoFrame.from_ndarray(image, format="rgb24")):
                out.mux(packet)
        frame = av.AudioFrame.from_ndarray(tones(seconds, rate), format="fltp", layout="mono")
        frame.sample_rate = rate
        for packet in audio.encode(frame):
            out.mux(packet)
        for stream in (video, audio):
            for packet in stream.encode(None):
                out.mux(packet)
    return buffer.getvalue()
