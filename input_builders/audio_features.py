"""Whisper's log-mel input features, as transformers' ``WhisperFeatureExtractor`` computes them
(Qwen2-Audio's ``preprocessor_config.json`` names it).

One 30 s window of 16 kHz mono samples -> ``(feature_size, 3000)`` float32 (vectorised, torch)::

    samples ─pad with zeros to 480 000─► reflect-pad n_fft/2 each side ─► frames of 400, hop 160
      ─► × periodic Hann window ─► |rfft|² (201 bins) ─► mel filters (slaney, 0–8 kHz) ─► log10(max(·, 1e-10))
      ─► drop the last frame (3001 -> 3000) ─► max(·, window max − 8) ─► (· + 4) / 4

``num_frames`` (``ceil(samples / hop)``) is the valid part: transformers' ``feature_attention_mask``
sum, which fixes the encoder's output length (``qwen2_audio_tokens``). The padded frames are
still part of the features: the encoder's convolutions read two of them at the boundary.

The arithmetic is transformers' own (``_torch_extract_fbank_features``: ``torch.stft`` and the mel
product in float32, torch on the CPU), so the features equal the extractor's within 1e-5
(tests/test_audio_features.py; measured: equal or within a few 1e-7, from the matmul's thread
split). A float64 spectrum would be *closer to exact* but differs from the extractor by up to
4e-5 on a pure sweep: the extractor's own float32 rounding of quiet bins next to loud ones, which
the model was trained on. The mel filters are ours (numpy, float64, equal to transformers' within
1e-12). docs/wire-format.md, "Audio", says why the device does not recompute this from PCM.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from atb_plugin.multimodal.wire import qwen2_audio_tokens

__all__ = ["FEATURES_VERSION", "WhisperFeatures", "mel_filter_bank", "qwen2_audio_tokens"]

# Bumped whenever the computation changes: part of the dedup key of a segment.
FEATURES_VERSION = 1


def _hertz_to_mel(freq: np.ndarray) -> np.ndarray:
    """Slaney's mel scale: linear below 1 kHz, logarithmic above."""
    freq = np.asarray(freq, dtype=np.float64)
    mels = 3.0 * freq / 200.0
    log_region = freq >= 1000.0
    mels[log_region] = 15.0 + np.log(freq[log_region] / 1000.0) * (27.0 / np.log(6.4))
    return mels


def _mel_to_hertz(mels: np.ndarray) -> np.ndarray:
    mels = np.asarray(mels, dtype=np.float64)
    freq = 200.0 * mels / 3.0
    log_region = mels >= 15.0
    freq[log_region] = 1000.0 * np.exp((np.log(6.4) / 27.0) * (mels[log_region] - 15.0))
    return freq


def mel_filter_bank(num_frequency_bins: int, num_mel_filters: int, min_frequency: float, max_frequency: float,
                    sampling_rate: int) -> np.ndarray:
    """``(num_frequency_bins, num_mel_filters)`` float64 triangular filters, slaney scale and area
    normalisation (librosa's default, Whisper's filters)."""
    mel_points = np.linspace(_hertz_to_mel(np.array([min_frequency]))[0], _hertz_to_mel(np.array([max_frequency]))[0],
                             num_mel_filters + 2)
    filter_freqs = _mel_to_hertz(mel_points)
    fft_freqs = np.linspace(0, sampling_rate // 2, num_frequency_bins)
    diff = np.diff(filter_freqs)
    slopes = filter_freqs[None, :] - fft_freqs[:, None]
    down = -slopes[:, :-2] / diff[:-1]
    up = slopes[:, 2:] / diff[1:]
    filters = np.maximum(0.0, np.minimum(down, up))
    return filters * (2.0 / (filter_freqs[2:num_mel_filters + 2] - filter_freqs[:num_mel_filters]))[None, :]


@dataclass(frozen=True)
class WhisperFeatures:
    """The feature extractor's settings (``preprocessor_config.json``) and the computation.

    ``__call__(samples)`` takes at most one window (``n_samples``) of mono float32 samples at
    ``sampling_rate`` and returns ``(features (feature_size, nb_max_frames) float32, num_frames)``."""

    feature_size: int = 128
    sampling_rate: int = 16000
    hop_length: int = 160
    chunk_length: int = 30
    n_fft: int = 400
    padding_value: float = 0.0

    def __post_init__(self):
        for name in ("feature_size", "sampling_rate", "hop_length", "chunk_length", "n_fft"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"WhisperFeatures.{name} must be a positive integer, got {value!r}")
        if self.n_samples % self.hop_length:
            raise ValueError(f"chunk_length * sampling_rate ({self.n_samples}) must be a multiple of hop_length "
                             f"({self.hop_length})")

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> WhisperFeatures:
        """From ``preprocessor_config.json``; refuses settings we do not reproduce (dither, a
        feature extractor other than Whisper's, per-utterance normalisation)."""
        kind = config.get("feature_extractor_type", "WhisperFeatureExtractor")
        if kind != "WhisperFeatureExtractor":
            raise ValueError(f"preprocessor_config.json: feature_extractor_type {kind!r}; only "
                             "WhisperFeatureExtractor is supported")
        if config.get("dither", 0.0):
            raise ValueError("preprocessor_config.json: dither is not supported (it makes features random)")
        if config.get("do_normalize"):
            raise ValueError("preprocessor_config.json: do_normalize is not supported")
        keys = ("feature_size", "sampling_rate", "hop_length", "chunk_length", "n_fft", "padding_value")
        return cls(**{key: config[key] for key in keys if config.get(key) is not None})

    @property
    def n_samples(self) -> int:
        """Samples in one window (480 000)."""
        return self.chunk_length * self.sampling_rate

    @property
    def nb_max_frames(self) -> int:
        """Mel frames in one window (3000): the encoder's fixed input length."""
        return self.n_samples // self.hop_length

    def cache_key(self) -> str:
        """What the features depend on besides the samples: the dedup key's second half."""
        return (f"whisper-v{FEATURES_VERSION}:{self.feature_size}:{self.sampling_rate}:{self.hop_length}:"
                f"{self.chunk_length}:{self.n_fft}:{self.padding_value}")

    @functools.cached_property
    def _filters_t(self):
        """float32 ``(feature_size, n_fft/2 + 1)``, the float64 bank rounded once (as transformers)."""
        import torch

        filters = mel_filter_bank(1 + self.n_fft // 2, self.feature_size, 0.0, 8000.0, self.sampling_rate)
        return torch.from_numpy(np.ascontiguousarray(filters.T)).to(torch.float32)

    @functools.cached_property
    def _window(self):
        import torch

        return torch.hann_window(self.n_fft)  # periodic

    def num_frames(self, num_samples: int) -> int:
        """Valid frames of a window of ``num_samples`` samples: ``ceil(num_samples / hop)``."""
        return -(-num_samples // self.hop_length)

    def __call__(self, samples: np.ndarray) -> tuple[np.ndarray, int]:
        import torch  # loaded with the tokenizer already (transformers); not at import time

        samples = np.asarray(samples)
        if samples.ndim != 1 or not 0 < samples.shape[0] <= self.n_samples:
            raise ValueError(f"one window of 1 to {self.n_samples} mono samples expected, got shape "
                             f"{list(samples.shape)}")
        wave = torch.full((self.n_samples,), self.padding_value, dtype=torch.float32)
        wave[:samples.shape[0]] = torch.from_numpy(np.array(samples, dtype=np.float32))  # a copy: ours to read
        stft = torch.stft(wave, self.n_fft, self.hop_length, window=self._window, return_complex=True)
        power = (stft[..., :-1].abs() ** 2).contiguous()  # (bins, frames): the last frame dropped
        log_spec = torch.clamp(self._filters_t @ power, min=1e-10).log10()
        log_spec = torch.maximum(log_spec, log_spec.max() - 8.0)
        features = ((log_spec + 4.0) / 4.0).numpy()
        return features, self.num_frames(samples.shape[0])
