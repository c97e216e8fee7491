"""Audio loading (PyAV decode + resample to 16 kHz mono) and the Whisper log-mel features.

References, and why each tolerance:

- features: transformers' ``WhisperFeatureExtractor`` (128 bins, the Qwen2-Audio settings) on the
  SAME decoded waveform, within 1e-5 (the issue's bound). transformers computes the spectrum with
  ``torch.stft`` in float32, and so do we (measured: equal; a float64 spectrum would differ by up
  to 4e-5, see input_builders/audio_features.py).
- resampling: a band-limited signal (a sum of sines below 7 kHz) written at 8 / 22.05 / 44.1 /
  48 kHz as float32 PCM and loaded must equal the same formula sampled at 16 kHz directly. The
  tolerance (``RESAMPLE_TOL`` = 2e-5) covers libswresample's default filter's passband ripple and
  float32 rounding (measured: at most 4e-6); the first and last 10 ms (the filter's edges) are left out.
- mono: the mean of the channels, exactly (float32 PCM at 16 kHz: no resampling involved).
"""

from __future__ import annotations

import base64

import numpy as np
import pytest

from atb_plugin.testing import audio_signals as sig
from input_builders.audio import AudioRef, load_audio
from input_builders.audio_features import WhisperFeatures, mel_filter_bank
from input_builders.media_config import MediaConfig
from input_builders.media_errors import MediaDecodeError, MediaTooLargeError

av = pytest.importorskip("av")

FEATURE_TOL = 1e-5
RESAMPLE_TOL = 2e-5
FEATURES = WhisperFeatures(feature_size=128)


@pytest.fixture(scope="module")
def extractor():
    from transformers import WhisperFeatureExtractor

    return WhisperFeatureExtractor(feature_size=128)


def reference(extractor, samples):
    out = extractor(samples, sampling_rate=16000, return_attention_mask=True, padding="max_length",
                    return_tensors="np")
    return out["input_features"][0], int(out["attention_mask"][0].sum())


def load_bytes(data: bytes, fmt: str | None = None, config: MediaConfig | None = None):
    return load_audio(AudioRef(base64.b64encode(data).decode(), fmt), config or MediaConfig())


SIGNALS = {
    "sweep": lambda seconds, rate, channels: sig.sweep(seconds, rate, channels=channels),
    "noise": lambda seconds, rate, channels: sig.noise(seconds, rate, channels=channels),
    "bursts": lambda seconds, rate, channels: sig.bursts(seconds, rate, channels=channels),
}


@pytest.mark.parametrize("signal, seconds, rate, channels, container", [
    ("sweep", 3.0, 16000, 1, "wav"),
    ("sweep", 2.5, 44100, 2, "flac"),
    ("noise", 1.7, 48000, 1, "mp3"),
    ("noise", 4.0, 22050, 2, "wav16"),
    ("bursts", 5.3, 8000, 1, "flac"),
    ("bursts", 3.1, 48000, 2, "mp3"),
    ("bursts", 2.0, 48000, 1, "ogg"),  # opus: 48 kHz
    ("sweep", 30.0, 16000, 1, "wav"),  # a whole window: no zero padding at all
])
def test_features_equal_whisper_feature_extractor(extractor, signal, seconds, rate, channels, container):
    data = sig.encode(SIGNALS[signal](seconds, rate, channels), rate, container)
    clip = load_bytes(data)
    assert clip.samples.dtype == np.float32 and clip.samples.ndim == 1
    assert abs(clip.seconds - seconds) < 0.1  # lossy codecs add their priming / padding
    ours, frames = FEATURES(clip.samples[:FEATURES.n_samples])
    expected, expected_frames = reference(extractor, clip.samples[:FEATURES.n_samples])
    assert ours.shape == expected.shape == (128, 3000) and ours.dtype == np.float32
    assert frames == expected_frames
    assert np.abs(ours - expected).max() <= FEATURE_TOL


@pytest.mark.parametrize("num_samples", [1, 159, 160, 161, 1600, 12345, 479999, 480000])
def test_valid_frames_equal_the_attention_mask(extractor, num_samples):
    samples = sig.noise(num_samples / 16000, 16000)[0][:num_samples]
    samples = np.resize(samples, num_samples)
    ours, frames = FEATURES(samples)
    expected, expected_frames = reference(extractor, samples)
    assert frames == expected_frames
    assert np.abs(ours - expected).max() <= FEATURE_TOL


def test_mel_filters_equal_transformers():
    from transformers.audio_utils import mel_filter_bank as reference_bank

    expected = reference_bank(num_frequency_bins=201, num_mel_filters=128, min_frequency=0.0, max_frequency=8000.0,
                              sampling_rate=16000, norm="slaney", mel_scale="slaney")
    np.testing.assert_allclose(mel_filter_bank(201, 128, 0.0, 8000.0, 16000), expected, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("rate", [8000, 22050, 44100, 48000])
def test_resampling_equals_the_signal_sampled_at_16k(rate):
    freqs = (220.0, 1000.0, 3500.0) if rate > 8000 else (220.0, 1000.0, 3000.0)  # below both Nyquists
    clip = load_bytes(sig.encode(sig.tones(2.0, rate, freqs), rate, "wav"))
    expected = sig.tones(2.0, 16000, freqs)[0]
    assert abs(clip.samples.shape[0] - expected.shape[0]) <= 1
    edge = 160  # 10 ms
    n = min(clip.samples.shape[0], expected.shape[0]) - edge
    assert np.abs(clip.samples[edge:n] - expected[edge:n]).max() <= RESAMPLE_TOL


def test_mono_is_the_mean_of_the_channels():
    stereo = sig.tones(1.0, 16000, (300.0, 1200.0), channels=2)
    clip = load_bytes(sig.encode(stereo, 16000, "wav"))
    np.testing.assert_allclose(clip.samples, stereo.mean(axis=0), rtol=0, atol=1e-7)


def test_long_audio_is_cut_into_30_second_windows():
    from input_builders.qwen2_audio import Qwen2AudioInputBuilder

    clip = load_bytes(sig.encode(sig.tones(65.0, 16000), 16000, "wav"))
    builder = Qwen2AudioInputBuilder.__new__(Qwen2AudioInputBuilder)  # only the window arithmetic
    builder.features, builder.min_window_frames = FEATURES, 11
    assert builder.window_bounds(clip) == [(0, 480000), (480000, 960000), (960000, 1040000)]
    assert builder.num_media_tokens(clip) == 750 + 750 + 125
    # A tail shorter than one block (0.1 s) after a full window is dropped.
    clip = load_bytes(sig.encode(sig.tones(30.05, 16000), 16000, "wav"))
    assert builder.window_bounds(clip) == [(0, 480000)]


# ------------------------------------------------------------------------------------------------
# refusals: each a MediaError (HTTP 400) naming the problem


def test_undecodable_bytes_are_refused():
    with pytest.raises(MediaDecodeError, match="could not be decoded"):
        load_bytes(b"RIFF\x00\x00\x00\x00WAVEfmt garbage" * 10)
    with pytest.raises(MediaDecodeError):
        load_bytes(np.random.default_rng(0).bytes(4096))


def test_a_video_file_is_refused():
    with pytest.raises(MediaDecodeError, match="is a video file"):
        load_bytes(sig.encode_video())


def test_zero_length_audio_is_refused():
    empty = sig.empty_wav()
    with pytest.raises(MediaDecodeError, match="zero length|no samples|could not be decoded"):
        load_bytes(empty)
    with pytest.raises(MediaDecodeError, match="empty"):
        load_audio(b"", MediaConfig())


def test_over_long_audio_is_refused():
    data = sig.encode(sig.tones(3.0, 16000), 16000, "flac")
    with pytest.raises(MediaTooLargeError, match="max_audio_seconds"):
        load_bytes(data, config=MediaConfig(max_audio_seconds=2.0))
    with pytest.raises(MediaTooLargeError, match="max_audio_bytes"):
        load_bytes(data, config=MediaConfig(max_audio_bytes=100))
    load_bytes(data)  # now decoded and cached under the default limit ...
    with pytest.raises(MediaTooLargeError, match="MediaConfig.max_audio_seconds"):
        load_bytes(data, config=MediaConfig(max_audio_seconds=2.0))  # ... and still refused under a lower one


def test_wrong_format_is_refused():
    wav = sig.encode(sig.tones(0.5, 16000), 16000, "wav16")
    with pytest.raises(MediaDecodeError, match="format 'mp3' but is a wav file"):
        load_bytes(wav, "mp3")
    with pytest.raises(MediaDecodeError, match="format 'aac' is not supported"):
        load_bytes(wav, "aac")
    assert load_bytes(wav, "wav").samples.shape == (8000,)
    with pytest.raises(MediaDecodeError, match="format 'mp3' but is a wav file"):
        load_bytes(wav, "mp3")  # decoded before (the cache): the declared format is still checked


def test_whisper_settings_are_validated():
    assert WhisperFeatures.from_config({"feature_size": 80}).feature_size == 80
    with pytest.raises(ValueError, match="dither"):
        WhisperFeatures.from_config({"dither": 1e-4})
    with pytest.raises(ValueError, match="feature_extractor_type"):
        WhisperFeatures.from_config({"feature_extractor_type": "SeamlessM4TFeatureExtractor"})
