"""Claims (issue 35): the audio frontend's time per 30 s clip (decode + resample + log-mel features)
against transformers' ``WhisperFeatureExtractor`` on the same waveform, and the shared-memory bytes
per clip of each wire form (float32 log-mel features, what is implemented; 16-bit or float32 PCM
with the mel computed on the device, measured as the alternative).

Same output first (asserted before timing): our features within 1e-5 of the extractor's.

Clip: 30 s of speech-like bursts (atb_plugin.testing.audio_signals), 44.1 kHz stereo, as flac,
mp3 and wav (16-bit) files. Modes, interleaved round by round; medians over --reps:

  decode     PyAV decode + libswresample to 16 kHz + channel mean (input_builders.audio)
  features   our WhisperFeatures on the decoded waveform (numpy, float64 spectrum)
  reference  transformers' WhisperFeatureExtractor on the same waveform (torch.stft, float32)
  device_mel the PCM alternative's device side on the CPU: torch.stft + mel + log in float32 from
             16-bit PCM (what the model would run if PCM crossed shared memory)

Also printed: how far the 16-bit PCM alternative's features are from the float32 waveform's (the
quantisation the PCM wire would add), and shm bytes per clip for 5 s and 30 s clips.

    python benchmarks/bench_audio.py [--reps 9]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere in the repo

from transformers import WhisperFeatureExtractor  # noqa: E402

from atb_plugin.testing import audio_signals as sig  # noqa: E402
from input_builders.audio import _decode  # noqa: E402
from input_builders.audio_features import WhisperFeatures  # noqa: E402
from input_builders.media_config import MediaConfig  # noqa: E402

HEADER = 128  # the segment header (docs/wire-format.md, section 2)


def device_mel(pcm16: torch.Tensor, features: WhisperFeatures, filters: torch.Tensor) -> torch.Tensor:
    """The PCM wire's device side: what transformers' torch path computes, from int16 samples."""
    wave = torch.zeros(features.n_samples)
    wave[:pcm16.shape[0]] = pcm16.to(torch.float32) / 32768.0
    stft = torch.stft(wave, features.n_fft, features.hop_length, window=torch.hann_window(features.n_fft),
                      return_complex=True)
    power = (stft[..., :-1].abs() ** 2).contiguous()
    log_spec = torch.clamp(filters @ power, min=1e-10).log10()
    log_spec = torch.maximum(log_spec, log_spec.max() - 8.0)
    return (log_spec + 4.0) / 4.0


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--containers", default="flac,mp3,wav16")
    args = parser.parse_args()
    torch.set_num_threads(1)

    features = WhisperFeatures(feature_size=128)
    extractor = WhisperFeatureExtractor(feature_size=128)
    filters = torch.from_numpy(extractor.mel_filters.T.astype(np.float32))
    signal = sig.bursts(30.0, 44100, channels=2)
    results = {}
    for container in args.containers.split(","):
        data = sig.encode(signal, 44100, container)
        limits = MediaConfig()
        wave = _decode(data, container, None, limits)[0][:features.n_samples]
        ours, frames = features(wave)
        reference = extractor(wave, sampling_rate=16000, return_tensors="np")["input_features"][0]
        error = float(np.abs(ours - reference).max())
        assert error <= 1e-5, error
        pcm16 = torch.from_numpy(np.round(np.clip(wave, -1, 1) * 32767).astype(np.int16))
        quantised = float(np.abs(device_mel(pcm16, features, filters).numpy() - reference).max())

        modes = {
            "decode": lambda: _decode(data, container, None, limits),
            "features": lambda: features(wave),
            "reference": lambda: extractor(wave, sampling_rate=16000, return_tensors="np"),
            "device_mel": lambda: device_mel(pcm16, features, filters),
        }
        times = {mode: [] for mode in modes}
        for _ in range(args.reps):
            for mode, fn in modes.items():
                times[mode].append(timed(fn))
        ms = {mode: 1000 * statistics.median(values) for mode, values in times.items()}
        results[container] = {
            "encoded_bytes": len(data), "ms": {k: round(v, 2) for k, v in ms.items()},
            "frontend_ms": round(ms["decode"] + ms["features"], 2),
            "frontend_with_reference_ms": round(ms["decode"] + ms["reference"], 2),
            "features_speedup_vs_reference": round(ms["reference"] / ms["features"], 2),
            "max_abs_error_vs_reference": error, "pcm16_wire_max_abs_error": quantised,
        }
        print(f"{container:6s} {len(data):>9,d} B  decode {ms['decode']:7.1f} ms  features {ms['features']:6.1f} ms  "
              f"reference {ms['reference']:6.1f} ms ({ms['reference'] / ms['features']:.2f}x ours)  "
              f"frontend {ms['decode'] + ms['features']:7.1f} vs {ms['decode'] + ms['reference']:7.1f} ms  "
              f"device_mel {ms['device_mel']:6.1f} ms  |ours-ref| {error:.1e}  |pcm16-ref| {quantised:.1e}")

    wire = {}
    for seconds in (5, 30):
        samples = seconds * 16000
        wire[f"{seconds}s"] = {"float32_mel": HEADER + features.feature_size * features.nb_max_frames * 4,
                               "int16_pcm": HEADER + samples * 2, "float32_pcm": HEADER + samples * 4}
    for clip, forms in wire.items():
        print(f"shm bytes per {clip} clip: " + ", ".join(f"{k} {v:,d}" for k, v in forms.items())
              + f"  (float32 mel / int16 PCM = {forms['float32_mel'] / forms['int16_pcm']:.1f}x)")
    print(json.dumps({"machine": platform.machine(), "threads": 1, "reps": args.reps, "per_container": results,
                      "shm_bytes": wire}))


if __name__ == "__main__":
    main()
