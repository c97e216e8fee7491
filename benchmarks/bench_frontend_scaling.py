"""Claim P1b (frontend scaling): image requests per second through the service's frontend grow
with its tokenizer workers: N workers reach >= 0.85 x N times one worker's rate.

What runs is the service's own frontend with no engine behind it (the engine side is stubbed
out: nothing consumes the ids): a ``TokenizerPool`` of 1 and of 2 worker processes, each request
a chat with one distinct 1280x720 JPEG as a base64 data URL, the way ``/v1/chat/completions``
hands it over: load, decode, resize (the uint8 wire), write the segment, build the ids; the lease
is released when the ids arrive. The images are made before the clock starts; rounds alternate
between the pools (same images), and the ratio is of the medians. The workers are the only busy
processes, so on this 2-core box 2 workers is the most that can scale.

    python benchmarks/bench_frontend_scaling.py [--rounds 5] [--batch 16]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
from pathlib import Path

from atb_plugin.engine.config import EngineConfig
from atb_plugin.frontend.tokenizer_pool import TokenizerPool, WorkerSettings
from input_builders.media_config import MediaConfig

import bench_image_frontend as frontend  # a sibling script: `python benchmarks/X.py` puts benchmarks/ on sys.path

WORKERS = (1, 2)


async def measure(model: str, rounds: int, batch: int) -> dict[int, list[float]]:
    pools = {n: TokenizerPool(WorkerSettings(EngineConfig(model=model), MediaConfig()), n, None,
                              on_worker_death=lambda index, reason: None) for n in WORKERS}
    try:
        await asyncio.gather(*(pool.start() for pool in pools.values()))
        for n, pool in pools.items():  # warm-up: every worker of the pool once
            await frontend.run_batch(pool, [frontend.photo(20_000 + i) for i in range(n)], f"warm-{n}")
        return await frontend.interleaved_rates(pools, rounds, batch)
    finally:
        await asyncio.gather(*(pool.shutdown() for pool in pools.values()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--batch", type=int, default=16, help="requests per round, submitted at once")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as root:
        rates = asyncio.run(measure(frontend.checkpoint_with_default_pixels(Path(root)), args.rounds, args.batch))
    medians = {n: statistics.median(values) for n, values in rates.items()}
    scaling = medians[2] / medians[1]
    for n in WORKERS:
        print(f"{n} worker(s): {medians[n]:.1f} images/s (rounds: {' '.join(f'{r:.1f}' for r in rates[n])})")
    print(f"2 workers / 1 worker: {scaling:.2f}x (goal >= {0.85 * 2:.2f}x)")
    print(json.dumps({"images_per_s": {str(n): round(m, 2) for n, m in medians.items()}, "per_round": rates,
                      "scaling_2_over_1": round(scaling, 3), "rounds": args.rounds, "batch": args.batch}))


if __name__ == "__main__":
    main()
