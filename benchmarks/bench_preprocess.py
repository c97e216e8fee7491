"""Claim: ``input_builders.preprocess`` is >= 3x faster than transformers' ``*ImageProcessorPil``
on photo-sized images, with the same output (max abs diff <= 1e-5, asserted here first).

Cases: families x sizes, one random RGB image each (content does not change the cost).

  qwen2_vl  Qwen2VLPreprocessor with transformers' defaults (min 56*56, max 28*28*1280 pixels)
            vs Qwen2VLImageProcessorPil()
  clip      ClipPreprocessor with LLaVA-1.5's config (shortest edge 336, crop 336x336)
            vs CLIPImageProcessorPil(size={"shortest_edge": 336}, crop_size=336x336)
  qwen_vl   QwenVLPreprocessor (448x448) vs CLIPImageProcessorPil(size=448x448, no crop)

Modes, interleaved round by round so machine noise hits them alike; medians over --reps:

  ours       preprocessor(image)
  reference  processor(image, return_tensors="np")
  resize     the Pillow bicubic ``Image.resize`` alone: the step both make, bit for bit the
             same call. It bounds what any post-resize work can win: reference / resize is the
             speedup ours would have if everything after the resize were free.

The last line is one JSON object: per case ms (ours, reference, resize) and speedup, and
``min_speedup`` over the cases run.

    python benchmarks/bench_preprocess.py [--reps 15] [--families qwen2_vl,clip,qwen_vl]
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
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere in the repo

from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil  # noqa: E402
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil  # noqa: E402

from input_builders.preprocess import (  # noqa: E402
    ClipPreprocessor,
    Qwen2VLPreprocessor,
    QwenVLPreprocessor,
)

SIZES = ((448, 448), (1280, 720), (1920, 1080))  # (width, height)
TOL = 1e-5


def families():
    qwen2 = Qwen2VLPreprocessor()
    clip = ClipPreprocessor(shortest_edge=336, crop_height=336, crop_width=336)
    qwen_vl = QwenVLPreprocessor(image_size=448)
    return {
        "qwen2_vl": (
            qwen2,
            Qwen2VLImageProcessorPil(min_pixels=qwen2.min_pixels, max_pixels=qwen2.max_pixels),
            lambda w, h: tuple(reversed(qwen2.smart_resize(h, w))),
        ),
        "clip": (
            clip,
            CLIPImageProcessorPil(size={"shortest_edge": 336}, crop_size={"height": 336, "width": 336}),
            lambda w, h: tuple(reversed(clip.resized_size(h, w))),
        ),
        "qwen_vl": (
            qwen_vl,
            CLIPImageProcessorPil(size={"height": 448, "width": 448}, do_center_crop=False),
            lambda w, h: (448, 448),
        ),
    }


def check_same_output(name, ours, reference, image) -> float:
    got = ours(image)
    expected = reference(image, return_tensors="np")
    assert got.pixel_values.shape == expected["pixel_values"].shape, name
    diff = float(np.max(np.abs(got.pixel_values - expected["pixel_values"])))
    assert diff <= TOL, f"{name}: max abs diff {diff}"
    if "image_grid_thw" in expected:
        assert got.grid_thw == tuple(int(v) for v in expected["image_grid_thw"][0]), name
    return diff


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--families", default="qwen2_vl,clip,qwen_vl")
    args = parser.parse_args()

    available = families()
    chosen = [name.strip() for name in args.families.split(",") if name.strip()]
    unknown = [name for name in chosen if name not in available]
    if unknown:
        parser.error(f"unknown families {unknown}; choose from {sorted(available)}")

    rng = np.random.default_rng(0)
    cases = []  # (case name, {mode: callable})
    for family in chosen:
        ours, reference, target_size = available[family]
        for width, height in SIZES:
            image = Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8), "RGB")
            name = f"{family} {width}x{height}"
            diff = check_same_output(name, ours, reference, image)
            size = target_size(width, height)
            modes = {
                "ours": lambda o=ours, i=image: o(i),
                "reference": lambda r=reference, i=image: r(i, return_tensors="np"),
                # Pillow returns a copy when the size is unchanged; ours skips that call.
                "resize": lambda i=image, s=size: i.resize(s, Image.Resampling.BICUBIC),
            }
            cases.append((name, modes, size, diff))

    times = {name: {mode: [] for mode in modes} for name, modes, _, _ in cases}
    for round_index in range(args.warmup + args.reps):
        for name, modes, _, _ in cases:
            order = list(modes)
            order = order[round_index % len(order) :] + order[: round_index % len(order)]
            for mode in order:
                start = time.perf_counter()
                modes[mode]()
                elapsed = time.perf_counter() - start
                if round_index >= args.warmup:
                    times[name][mode].append(elapsed * 1e3)

    print(
        f"# {platform.machine()} {platform.python_implementation()} {platform.python_version()}, "
        f"numpy {np.__version__}, Pillow {Image.__version__}; medians of {args.reps} interleaved rounds, ms"
    )
    header = (
        f"{'case':<22} {'resized to':>11} {'ours':>8} {'reference':>10} {'speedup':>8} "
        f"{'resize':>8} {'ours-resize':>12} {'ref-resize':>11} {'ref/resize':>11} {'max diff':>9}"
    )
    print(header)
    print("-" * len(header))
    result = {}
    for name, _, size, diff in cases:
        ours_ms = statistics.median(times[name]["ours"])
        ref_ms = statistics.median(times[name]["reference"])
        resize_ms = statistics.median(times[name]["resize"])
        speedup = ref_ms / ours_ms
        print(
            f"{name:<22} {f'{size[0]}x{size[1]}':>11} {ours_ms:8.2f} {ref_ms:10.2f} {speedup:7.2f}x "
            f"{resize_ms:8.2f} {ours_ms - resize_ms:12.2f} {ref_ms - resize_ms:11.2f} "
            f"{ref_ms / resize_ms:10.2f}x {diff:9.1e}"
        )
        result[name] = {
            "ours_ms": round(ours_ms, 3),
            "reference_ms": round(ref_ms, 3),
            "speedup": round(speedup, 2),
            "resize_ms": round(resize_ms, 3),
        }
    print(json.dumps({"cases": result, "min_speedup": min(c["speedup"] for c in result.values())}))


if __name__ == "__main__":
    main()
