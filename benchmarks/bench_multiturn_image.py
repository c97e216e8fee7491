"""Claim P5 (multi-turn image chat): in a 3-turn chat that resends the same image every turn
(the whole history, image included, as OpenAI clients send it), turn 2's time to first token is
<= 0.3x turn 1's: the image's segment is reused (dedup by content), its KV comes from the prefix
cache, and the encoder does not run for it again. Also measured: each question attaching the
image once more (``every_turn``: a new block to encode and prefill per turn).

Our service, tiny Qwen2-VL and Qwen-VL checkpoints (random weights: what is timed is the
pipeline, not the language model), images 448x448 and 1280x720, one streaming request at a
time. Each repetition uses a new image (seeded), so nothing is cached across repetitions; the
medians over --reps repetitions are reported per turn. What the prefix cache (and with it the
skipped encoder pass) contributes: the same run with ``--no-enable-prefix-caching``. Segment
dedup cannot be switched off by a flag; it is what lets the resent image hash to the same
blocks at all (a new segment name would change the block hashes).

    python benchmarks/bench_multiturn_image.py [--reps 5]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
from pathlib import Path

import httpx

from atb_plugin.testing.tiny import tiny_checkpoint

import bench_serving as serving  # a sibling script: `python benchmarks/X.py` puts benchmarks/ on sys.path

FAMILIES = ("qwen2_vl", "qwen_vl")
SIZES = ((448, 448), (1280, 720))
QUESTIONS = ("What is in this picture?", "What colours are there?", "Describe it in one word.")


async def chat_turns(base_url: str, image_url: str, turns: int = 3, every_turn: bool = False,
                     part: dict | None = None) -> list[float]:
    """TTFT (ms) of each turn. Every turn resends the whole history (the image in its first
    message, as OpenAI clients resend a conversation); with ``every_turn`` each new question
    attaches the image again (a new block at a new position: it must be encoded and prefilled).
    ``part``: another media content part instead of the image (bench_video.py sends a video)."""
    media = part or {"type": "image_url", "image_url": {"url": image_url}}
    history, ttfts = [], []
    async with httpx.AsyncClient(base_url=base_url, timeout=300) as client:
        for turn, question in enumerate(QUESTIONS[:turns]):
            content = [{"type": "text", "text": question}]
            if turn == 0 or every_turn:
                content.insert(0, media)
            history.append({"role": "user", "content": content})
            body = {"model": "m", "messages": history, "max_tokens": 4, "temperature": 0, "stream": True,
                    "stream_options": {"include_usage": True}}
            record = await serving.send_request(client, "/v1/chat/completions", body, 300, 0)
            if not record.ok:
                raise RuntimeError(f"turn failed: {record.error} {record.error_detail}")
            ttfts.append(record.ttft * 1000)
            history.append({"role": "assistant", "content": "It is a picture."})
    return ttfts


def measure(family: str, prefix_caching: bool, reps: int) -> dict:
    port = serving.free_port()
    command = [sys.executable, "-m", "atb_plugin.server", "--model", str(tiny_checkpoint(family)), "--port", str(port),
               "--served-model-name", "m", "--tokenizer-workers", "1", "--block-size", "16",
               "--kv-cache-memory", "256M", "--enable-prefix-caching" if prefix_caching else "--no-enable-prefix-caching"]
    log = Path(f"/tmp/bench-multiturn-{port}.log")
    results = {}
    with serving.ManagedServer(command, port, log, ready_timeout=300, stop_timeout=30,
                               env=serving.our_server_env()) as server:
        asyncio.run(chat_turns(server.base_url, serving.random_png_data_url(64, 64, serving.random.Random(99)), 2))
        for width, height in SIZES:
            for every_turn in (False, True):
                runs = [asyncio.run(chat_turns(
                    server.base_url, serving.random_png_data_url(width, height, serving.random.Random(rep + 100 * every_turn)),
                    every_turn=every_turn)) for rep in range(reps)]
                medians = [statistics.median(run[turn] for run in runs) for turn in range(3)]
                results[f"{width}x{height}{', image every turn' if every_turn else ''}"] = {
                    "ttft_ms": [round(m, 1) for m in medians], "turn2_over_turn1": round(medians[1] / medians[0], 3),
                    "turn3_over_turn1": round(medians[2] / medians[0], 3)}
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    report = {}
    for family in FAMILIES:
        for caching in (True, False):
            label = f"{family}, prefix cache {'on' if caching else 'off'}"
            report[label] = measure(family, caching, args.reps)
            for size, numbers in report[label].items():
                print(f"{label}, {size}: TTFT turns 1/2/3 {numbers['ttft_ms']} ms, turn 2 / turn 1 "
                      f"{numbers['turn2_over_turn1']:.2f} (goal <= 0.3 with the cache)", flush=True)
    print(json.dumps({"reps": args.reps, "results": report}))


if __name__ == "__main__":
    main()
