"""Claim: on the uint8 wire one tokenizer worker turns more image requests per second into ids
than on the float32 wire, and puts 8x fewer bytes per Qwen2-VL image into /dev/shm.

What runs is the service's own frontend: a ``TokenizerPool`` with ONE worker process per wire
(``WorkerSettings.mm_wire_dtype`` uint8 and float32), each given chat requests with one JPEG
image as a base64 data URL, the way ``/v1/chat/completions`` hands them over: decode, resize,
(normalise + patchify on float32), write the segment, build the ids. The model is a tiny Qwen2-VL
checkpoint with transformers' default ``max_pixels`` (28*28*1280), so a 1280x720 photo becomes a
1288x728 image: 2.8 MB uint8 or 22.5 MB float32 in shared memory. Every image is distinct (no
dedup hits) and each request's lease is released when its ids arrive, as the server does once
the engine is done with them.

Rounds alternate between the two workers (same images, same order), so machine noise hits them
alike; per round: --batch requests submitted at once to one worker (it runs them one by one).
Reported: median images/s over the rounds, and the ratio. The last line is one JSON object.

    python benchmarks/bench_image_frontend.py [--rounds 7] [--batch 8]
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere in the repo

from atb_plugin.engine.config import EngineConfig  # noqa: E402
from atb_plugin.frontend.tokenizer_pool import ChatJob, StatsJob, TokenizerPool, WorkerSettings  # noqa: E402
from atb_plugin.testing.tiny import tiny_checkpoint  # noqa: E402
from input_builders.media_config import MediaConfig  # noqa: E402

WIRES = ("uint8", "float32")


def photo(seed: int, width: int = 1280, height: int = 720) -> str:
    """A photo-like JPEG (smooth shapes plus grain) as a data URL: decodes like a real one."""
    rng = np.random.default_rng(seed)
    coarse = Image.fromarray(rng.integers(0, 256, (9, 16, 3), dtype=np.uint8)).resize((width, height),
                                                                                    Image.Resampling.BICUBIC)
    pixels = np.asarray(coarse).astype(np.int16) + rng.integers(-12, 13, (height, width, 3), dtype=np.int16)
    buffer = io.BytesIO()
    Image.fromarray(pixels.clip(0, 255).astype(np.uint8)).save(buffer, "JPEG", quality=90)
    return "data:image/jpeg;base64," + base64.b64encode(buffer.getvalue()).decode()


def chat(url: str) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": "What is in the picture?"}]}]


def checkpoint_with_default_pixels(root: Path) -> str:
    """The tiny Qwen2-VL checkpoint with transformers' default pixel bounds (photo-sized inputs)."""
    model = root / "qwen2_vl"
    shutil.copytree(tiny_checkpoint("qwen2_vl"), model)
    path = model / "preprocessor_config.json"
    config = json.loads(path.read_text())
    config.update(min_pixels=56 * 56, max_pixels=28 * 28 * 1280, size={"shortest_edge": 56 * 56,
                                                                      "longest_edge": 28 * 28 * 1280})
    path.write_text(json.dumps(config))
    return str(model)


async def run_batch(pool: TokenizerPool, urls: list[str], tag: str) -> float:
    async def one(i: int, url: str):
        request_id = f"{tag}-{i}"
        index, _, ids = await pool.call(ChatJob(request_id, chat(url)))
        assert min(ids) < 0  # the block's handle slots: the image went through shm
        pool.release(index, request_id)

    start = time.perf_counter()
    await asyncio.gather(*(one(i, url) for i, url in enumerate(urls)))
    return len(urls) / (time.perf_counter() - start)


async def interleaved_rates(pools: dict, rounds: int, batch: int) -> dict[object, list[float]]:
    """Images/s of each pool, round by round: every round ``batch`` new photos (distinct: no dedup
    hits) through each pool in turn, the order reversed every other round so that neither pool
    always goes first."""
    keys = list(pools)
    rates: dict[object, list[float]] = {key: [] for key in keys}
    for round_index in range(rounds):
        urls = [photo(round_index * batch + i) for i in range(batch)]
        for key in keys if round_index % 2 == 0 else keys[::-1]:
            rates[key].append(await run_batch(pools[key], urls, f"{key}-{round_index}"))
    return rates


async def measure(model: str, rounds: int, batch: int) -> dict:
    pools = {}
    for wire in WIRES:
        settings = WorkerSettings(EngineConfig(model=model, mm_wire_dtype=wire), MediaConfig())
        pools[wire] = TokenizerPool(settings, 1, None, on_worker_death=lambda index, reason: None)
    try:
        await asyncio.gather(*(pool.start() for pool in pools.values()))
        shm_bytes = {}
        for wire, pool in pools.items():  # warm-up, and the bytes one image takes
            index, _, _ = await pool.call(ChatJob("warm", chat(photo(10_000))))
            _, _, stats = await pool.call(StatsJob())
            shm_bytes[wire] = stats["leased_bytes"]
            pool.release(index, "warm")
        return {"rates": await interleaved_rates(pools, rounds, batch), "shm_bytes": shm_bytes}
    finally:
        await asyncio.gather(*(pool.shutdown() for pool in pools.values()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--batch", type=int, default=8, help="requests per round and wire")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as root:
        result = asyncio.run(measure(checkpoint_with_default_pixels(Path(root)), args.rounds, args.batch))
    rates = {wire: statistics.median(values) for wire, values in result["rates"].items()}
    print(f"one tokenizer worker, 1280x720 JPEG -> Qwen2-VL 1288x728, {args.rounds} rounds x {args.batch} requests")
    print(f"{'wire':>8} {'images/s (median)':>18} {'per round':>40} {'shm bytes / image':>18}")
    for wire in WIRES:
        per_round = " ".join(f"{rate:.1f}" for rate in result["rates"][wire])
        print(f"{wire:>8} {rates[wire]:18.1f} {per_round:>40} {result['shm_bytes'][wire]:18d}")
    speedup = rates["uint8"] / rates["float32"]
    bytes_ratio = result["shm_bytes"]["float32"] / result["shm_bytes"]["uint8"]
    print(f"uint8 / float32: {speedup:.2f}x images/s, {bytes_ratio:.1f}x fewer shm bytes")
    print(json.dumps({"images_per_s": {w: round(r, 2) for w, r in rates.items()},
                      "per_round": result["rates"], "shm_bytes_per_image": result["shm_bytes"],
                      "speedup_uint8_vs_float32": round(speedup, 3), "shm_bytes_ratio": round(bytes_ratio, 2)}))


if __name__ == "__main__":
    main()
