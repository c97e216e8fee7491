"""Claims: on the uint8 wire (the default) the frontend's time per image is <= 1.1x Pillow's resize
alone, the floor under bit parity with transformers; and it is faster than transformers'
``*ImageProcessorPil`` by the most any implementation keeping that parity can be. Also measured:
the float32 wire (MindIE's form), and what the uint8 wire moves to the model's device, timed on
the CPU.

Same output first (asserted before timing): the float32 wire within 1e-5 of the reference, and
the uint8 wire, normalised by the model side (``atb_plugin.multimodal.pixels``, torch on the
CPU), equal to the float32 wire bit for bit.

Cases: families x sizes, one random RGB image each (content does not change the cost).

  qwen2_vl  Qwen2VLPreprocessor with transformers' defaults (min 56*56, max 28*28*1280 pixels)
            vs Qwen2VLImageProcessorPil()
  clip      ClipPreprocessor with LLaVA-1.5's config (shortest edge 336, crop 336x336)
            vs CLIPImageProcessorPil(size={"shortest_edge": 336}, crop_size=336x336)
  qwen_vl   QwenVLPreprocessor (448x448) vs CLIPImageProcessorPil(size=448x448, no crop)

Modes, interleaved round by round so machine noise hits them alike; medians over --reps:

  uint8      preprocessor(image) on the uint8 wire: resize (+ crop) and the array
  float32    preprocessor(image) on the float32 wire: + normalise (+ patchify, temporal repeat)
  reference  processor(image, return_tensors="np")
  resize     the Pillow bicubic ``Image.resize`` alone: the step every mode makes, bit for bit
             the same call (Pillow returns a copy when the size is unchanged; ours skips it)
  device     the model side of the uint8 wire on the CPU: PixelFormat.encoder_input(uint8
             tensor) -> float32 encoder input (torch, --device-threads threads; on an NPU this
             is a few kernel launches)

The last line is one JSON object: per case ms per mode, the ratios, shm bytes per image on
each wire; ``max_uint8_over_resize`` and ``min_speedup_uint8`` over the cases run.

    python benchmarks/bench_preprocess.py [--reps 15] [--families qwen2_vl,clip,qwen_vl]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere in the repo

from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil  # noqa: E402
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil  # noqa: E402

from atb_plugin.multimodal.pixels import ChwImageFormat, Qwen2VLPatchFormat  # noqa: E402
from input_builders.preprocess import (  # noqa: E402
    ClipPreprocessor,
    Qwen2VLPreprocessor,
    QwenVLPreprocessor,
)

SIZES = ((448, 448), (1280, 720), (1920, 1080))  # (width, height)
TOL = 1e-5


def families():
    """name -> (uint8-wire preprocessor, reference, target size (w, h), the model's pixel format)."""
    qwen2 = Qwen2VLPreprocessor()
    clip = ClipPreprocessor(shortest_edge=336, crop_height=336, crop_width=336)
    qwen_vl = QwenVLPreprocessor(image_size=448)
    return {
        "qwen2_vl": (
            qwen2,
            Qwen2VLImageProcessorPil(min_pixels=qwen2.min_pixels, max_pixels=qwen2.max_pixels),
            lambda w, h: tuple(reversed(qwen2.smart_resize(h, w))),
            Qwen2VLPatchFormat(qwen2.normalization, qwen2.patch_size, qwen2.temporal_patch_size, qwen2.merge_size),
        ),
        "clip": (
            clip,
            CLIPImageProcessorPil(size={"shortest_edge": 336}, crop_size={"height": 336, "width": 336}),
            lambda w, h: tuple(reversed(clip.resized_size(h, w))),
            ChwImageFormat(clip.normalization, 336, 336),
        ),
        "qwen_vl": (
            qwen_vl,
            CLIPImageProcessorPil(size={"height": 448, "width": 448}, do_center_crop=False),
            lambda w, h: (448, 448),
            ChwImageFormat(qwen_vl.normalization, 448, 448),
        ),
    }


def check_same_output(name, wire, floats, reference, pixel_format, image) -> float:
    """float32 wire vs the reference (<= TOL), uint8 wire + device side vs float32 (bit for bit)."""
    got = floats(image)
    expected = reference(image, return_tensors="np")
    assert got.pixel_values.shape == expected["pixel_values"].shape, name
    diff = float(np.max(np.abs(got.pixel_values - expected["pixel_values"])))
    assert diff <= TOL, f"{name}: max abs diff {diff}"
    if "image_grid_thw" in expected:
        assert got.grid_thw == tuple(int(v) for v in expected["image_grid_thw"][0]), name
    small = wire(image)
    on_device = pixel_format.encoder_input(torch.tensor(small.pixel_values), small.grid_thw, torch.float32)
    assert np.array_equal(on_device.numpy().view(np.uint32), got.pixel_values.view(np.uint32)), name
    return diff


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--families", default="qwen2_vl,clip,qwen_vl")
    parser.add_argument("--device-threads", type=int, default=1,
                        help="torch threads for the device mode (1: as single-threaded as the numpy paths)")
    args = parser.parse_args()
    torch.set_num_threads(args.device_threads)

    available = families()
    chosen = [name.strip() for name in args.families.split(",") if name.strip()]
    unknown = [name for name in chosen if name not in available]
    if unknown:
        parser.error(f"unknown families {unknown}; choose from {sorted(available)}")

    rng = np.random.default_rng(0)
    cases = []  # (case name, {mode: callable}, resized size, max diff, bytes per wire)
    for family in chosen:
        wire, reference, target_size, pixel_format = available[family]
        floats = replace(wire, wire_dtype="float32")
        for width, height in SIZES:
            image = Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8), "RGB")
            name = f"{family} {width}x{height}"
            diff = check_same_output(name, wire, floats, reference, pixel_format, image)
            size = target_size(width, height)
            small = wire(image)
            wire_bytes = {"uint8": small.pixel_values.nbytes, "float32": floats(image).pixel_values.nbytes}
            device_input = torch.tensor(small.pixel_values)
            modes = {
                "uint8": lambda o=wire, i=image: o(i),
                "float32": lambda o=floats, i=image: o(i),
                "reference": lambda r=reference, i=image: r(i, return_tensors="np"),
                "resize": lambda i=image, s=size: i.resize(s, Image.Resampling.BICUBIC),
                "device": lambda f=pixel_format, x=device_input, g=small.grid_thw: f.encoder_input(x, g, torch.float32),
            }
            cases.append((name, modes, size, diff, wire_bytes))

    times = {name: {mode: [] for mode in modes} for name, modes, *_ in cases}
    for round_index in range(args.warmup + args.reps):
        for name, modes, *_ in cases:
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
        f"numpy {np.__version__}, Pillow {Image.__version__}, torch {torch.__version__} "
        f"({args.device_threads} thread(s) for device); medians of {args.reps} interleaved rounds, ms"
    )
    header = (
        f"{'case':<20} {'resized to':>10} {'uint8':>7} {'resize':>7} {'u8/resize':>9} {'reference':>9} "
        f"{'ref/u8':>7} {'float32':>8} {'ref/f32':>7} {'device':>7} {'u8+dev/f32':>10} {'shm f32/u8':>10}"
    )
    print(header)
    print("-" * len(header))
    result = {}
    for name, _, size, diff, wire_bytes in cases:
        ms = {mode: statistics.median(values) for mode, values in times[name].items()}
        row = {
            **{f"{mode}_ms": round(value, 3) for mode, value in ms.items()},
            "uint8_over_resize": round(ms["uint8"] / ms["resize"], 3),
            "speedup_uint8": round(ms["reference"] / ms["uint8"], 2),
            "speedup_float32": round(ms["reference"] / ms["float32"], 2),
            "uint8_plus_device_over_float32": round((ms["uint8"] + ms["device"]) / ms["float32"], 2),
            "shm_bytes_uint8": wire_bytes["uint8"],
            "shm_bytes_float32": wire_bytes["float32"],
            "max_diff": diff,
        }
        print(
            f"{name:<20} {f'{size[0]}x{size[1]}':>10} {ms['uint8']:7.2f} {ms['resize']:7.2f} "
            f"{row['uint8_over_resize']:8.2f}x {ms['reference']:9.2f} {row['speedup_uint8']:6.2f}x "
            f"{ms['float32']:8.2f} {row['speedup_float32']:6.2f}x {ms['device']:7.2f} "
            f"{row['uint8_plus_device_over_float32']:9.2f}x {wire_bytes['float32'] / wire_bytes['uint8']:9.1f}x"
        )
        result[name] = row
    print(json.dumps({
        "cases": result,
        "max_uint8_over_resize": max(c["uint8_over_resize"] for c in result.values()),
        "min_speedup_uint8": min(c["speedup_uint8"] for c in result.values()),
    }))


if __name__ == "__main__":
    main()
