"""Claims for Qwen3-VL (issue 51):

1. One tokenizer worker turns image chats into ids (template, decode, resize, uint8 segment in
   /dev/shm, the block's handle slots) at >= 3x the images/s of transformers' ``Qwen3VLProcessor``
   doing the same chats in process (template, decode, resize, normalise, patchify to float32
   pixel values, ids). The checkpoint is the tiny Qwen3-VL with the published image processor's
   pixel bounds (``shortest_edge`` 65536, ``longest_edge`` 16777216), so a 1280x720 photo is
   resized to 1280x704 (2.7 MB uint8; 10.8 MB of float32 patches on the processor's side), a
   1920x1080 one to 1920x1088. Every image is distinct (no dedup hits); rounds alternate between the two, each --batch chats, and
   the median images/s over the rounds is reported. The processor is built from its parts as
   tests/test_models_qwen3_vl.py builds it (its video half needs torchvision, which this project
   does not install; only images are timed).
2. P5 for Qwen3-VL: a 3-turn image chat resending its image, turn 2's TTFT over turn 1's
   (goal <= 0.3), measured exactly as benchmarks/bench_multiturn_image.py measures Qwen2-VL's
   (one streaming request at a time, prefix cache on and off), on the same checkpoint as 1.: a
   448x448 image is 196 tokens, a 1280x720 one 880, as on the published checkpoints (the tiny
   checkpoint's own bounds would cap both at 64).

    python benchmarks/bench_qwen3_vl.py [--rounds 7] [--batch 8] [--reps 5] [--no-p5]
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere in the repo

from atb_plugin.engine.config import EngineConfig  # noqa: E402
from atb_plugin.frontend.tokenizer_pool import TokenizerPool, WorkerSettings  # noqa: E402
from atb_plugin.testing.tiny import tiny_checkpoint  # noqa: E402
from input_builders.media_config import MediaConfig  # noqa: E402

import bench_image_frontend as frontend  # noqa: E402  (siblings: `python benchmarks/X.py` puts benchmarks/ on sys.path)
import bench_multiturn_image as multiturn  # noqa: E402

PUBLISHED_PIXELS = {"shortest_edge": 65536, "longest_edge": 16777216}  # Qwen3-VL-*-Instruct's preprocessor_config.json


def checkpoint_with_published_pixels(root: Path) -> Path:
    model = root / "qwen3_vl"
    shutil.copytree(tiny_checkpoint("qwen3_vl"), model)
    path = model / "preprocessor_config.json"
    config = json.loads(path.read_text())
    config["size"] = dict(PUBLISHED_PIXELS)
    path.write_text(json.dumps(config))
    return model


def reference_processor(model: Path):
    """transformers' Qwen3VLProcessor with its Pil image processor (its registry check skipped:
    that check needs torchvision for the video processor)."""
    import transformers

    video_module = importlib.import_module("transformers.models.qwen3_vl.video_processing_qwen3_vl")

    class Processor(transformers.Qwen3VLProcessor):
        def check_argument_for_proper_class(self, name, arg):
            return None

    tokenizer = transformers.AutoTokenizer.from_pretrained(model)
    return Processor(image_processor=transformers.AutoImageProcessor.from_pretrained(model), tokenizer=tokenizer,
                     video_processor=video_module.Qwen3VLVideoProcessor.from_pretrained(model),
                     chat_template=tokenizer.chat_template)


def processor_rate(processor, urls: list[str]) -> float:
    """Images/s of the processor on the chats of ``urls``: what a server built on it does per request."""
    from transformers.image_utils import load_image

    start = time.perf_counter()
    for url in urls:
        chat = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is in the picture?"}]}]
        text = processor.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        out = processor(text=[text], images=[load_image(url)], return_tensors="pt")
        assert out["pixel_values"].shape[0] == out["image_grid_thw"].prod()
    return len(urls) / (time.perf_counter() - start)


SIZES = ((1280, 720), (1920, 1080))


async def worker_vs_processor(model: Path, rounds: int, batch: int, size: tuple[int, int]) -> dict:
    pool = TokenizerPool(WorkerSettings(EngineConfig(model=str(model)), MediaConfig()), 1, None,
                         on_worker_death=lambda index, reason: None)
    processor = reference_processor(model)
    rates = {"worker": [], "processor": []}
    try:
        await pool.start()
        await frontend.run_batch(pool, [frontend.photo(10_000, *size)], "warm")
        processor_rate(processor, [frontend.photo(10_001, *size)])
        for round_index in range(rounds):
            urls = [frontend.photo(round_index * batch + i, *size) for i in range(batch)]
            for key in ("worker", "processor") if round_index % 2 == 0 else ("processor", "worker"):
                if key == "worker":
                    rates[key].append(await frontend.run_batch(pool, urls, f"r{round_index}"))
                else:
                    rates[key].append(processor_rate(processor, urls))
    finally:
        await pool.shutdown()
    return rates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--batch", type=int, default=8, help="chats per round and side")
    parser.add_argument("--reps", type=int, default=5, help="repetitions of each P5 chat")
    parser.add_argument("--no-p5", action="store_true", help="only the images/s claim")
    args = parser.parse_args()
    rates, medians, speedups, p5 = {}, {}, {}, {}
    with tempfile.TemporaryDirectory() as root:
        model = checkpoint_with_published_pixels(Path(root))
        for width, height in SIZES:
            key = f"{width}x{height}"
            rates[key] = asyncio.run(worker_vs_processor(model, args.rounds, args.batch, (width, height)))
            medians[key] = {side: statistics.median(values) for side, values in rates[key].items()}
            speedups[key] = medians[key]["worker"] / medians[key]["processor"]
            print(f"{key} JPEG chats, {args.rounds} rounds x {args.batch}: one tokenizer worker "
                  f"{medians[key]['worker']:.1f} images/s, Qwen3VLProcessor {medians[key]['processor']:.1f} "
                  f"images/s: {speedups[key]:.2f}x (goal >= 3)", flush=True)
        multiturn.tiny_checkpoint = lambda family: model  # its measure() serves tiny_checkpoint(family)
        for caching in () if args.no_p5 else (True, False):
            p5[f"prefix cache {'on' if caching else 'off'}"] = multiturn.measure("qwen3_vl", caching, args.reps)
    for label, sizes in p5.items():
        for size, numbers in sizes.items():
            print(f"qwen3_vl, {label}, {size}: TTFT turns 1/2/3 {numbers['ttft_ms']} ms, turn 2 / turn 1 "
                  f"{numbers['turn2_over_turn1']:.2f} (goal <= 0.3 with the cache)", flush=True)
    print(json.dumps({"images_per_s": {k: {side: round(v, 2) for side, v in m.items()} for k, m in medians.items()},
                      "per_round": rates, "speedup_worker_vs_processor": {k: round(v, 3) for k, v in speedups.items()},
                      "p5": p5, "reps": args.reps}))


if __name__ == "__main__":
    main()
