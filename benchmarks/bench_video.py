"""Issue 32 (video input): the frontend's time per video, and what crosses shared memory.

1. Frontend time per video: probe + plan + seeking decode of the kept frames + resize to the
   plan's size (``input_builders.video``, what a tokenizer worker does on a segment miss) against
   the baseline with the same library: decode EVERY frame with PyAV, then take Qwen's sampled
   indices and resize those. Clips generated with PyAV (MPEG-4 Part 2, 640x360, 30 fps, a
   keyframe every 30 frames): 10 s and 120 s. Medians over --reps, the two ways interleaved.
   Goal: >= 5x on the 120 s clip.
2. Bytes in /dev/shm per video: uint8 frames ``(t, 3, H, W)`` vs float32 patches
   ``(t/2·h·w, 1176)`` (MindIE's form), for both clips under Qwen's default budget.
3. (--ttft) Multi-turn resend: a 2-turn chat through the service (tiny Qwen2.5-VL), turn 2
   resending turn 1's video: TTFT ratio turn 2 / turn 1 (goal <= 0.3, as for images).

    python benchmarks/bench_video.py [--reps 5] [--ttft]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from atb_plugin.testing.videos import video_bytes
from input_builders.media_config import MediaConfig
from input_builders.preprocess import Qwen2VLPreprocessor
from input_builders.video import decode_all_frames, load_video, resize_frames

CLIPS = {"10 s": 10, "120 s": 120}
FPS, SIZE, GOP = 30, (360, 640), 30


def ours(data: bytes, config: MediaConfig) -> np.ndarray:
    return load_video(data, config).resized_frames()


def baseline(data: bytes, config: MediaConfig) -> np.ndarray:
    video = load_video(data, config)  # the same probe and plan: only the decoding differs
    everything = decode_all_frames(data)
    return resize_frames([everything[i] for i in video.plan.indices], video.plan.size)


def frontend(reps: int) -> None:
    config = MediaConfig()
    print("frontend time per video (decode + sample + resize), median of", reps)
    print(f"{'clip':>6} {'frames':>7} {'kept':>5} {'size':>9} {'ours ms':>9} {'decode-all ms':>14} {'ratio':>7}")
    for name, seconds in CLIPS.items():
        data = video_bytes(seconds * FPS, FPS, SIZE, gop=GOP, seed=seconds)
        video = load_video(data, config)
        assert np.array_equal(ours(data, config), baseline(data, config))  # the same frames, bit for bit
        times = {"ours": [], "baseline": []}
        for _ in range(reps):
            for label, function in (("ours", ours), ("baseline", baseline)):
                start = time.perf_counter()
                function(data, config)
                times[label].append(time.perf_counter() - start)
        mine, theirs = statistics.median(times["ours"]) * 1e3, statistics.median(times["baseline"]) * 1e3
        decoded = video.frames().decoded
        print(f"{name:>6} {video.stream.total_frames:>7} {video.plan.num_frames:>5} "
              f"{video.plan.size[1]}x{video.plan.size[0]:<5} {mine:>9.1f} {theirs:>14.1f} {theirs / mine:>6.1f}x"
              f"   (decoded {decoded} frames, {len(data) / 1e6:.1f} MB file)")


def shm_bytes() -> None:
    print("\nbytes in /dev/shm per video (header excluded)")
    for name, seconds in CLIPS.items():
        data = video_bytes(seconds * FPS, FPS, SIZE, gop=GOP, seed=seconds)
        video = load_video(data, MediaConfig())
        frames = resize_frames(video.frames().frames, video.plan.size)
        uint8 = Qwen2VLPreprocessor(wire_dtype="uint8").preprocess_video(frames).pixel_values
        float32 = Qwen2VLPreprocessor(wire_dtype="float32").preprocess_video(frames).pixel_values
        print(f"{name:>6}: uint8 {tuple(uint8.shape)} {uint8.nbytes / 1e6:.1f} MB, float32 {tuple(float32.shape)} "
              f"{float32.nbytes / 1e6:.1f} MB: {float32.nbytes / uint8.nbytes:.0f}x")


def resend_ttft(reps: int) -> None:
    import asyncio
    import base64
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    import bench_serving as serving
    from bench_multiturn_image import chat_turns

    from atb_plugin.testing.tiny import tiny_checkpoint

    port = serving.free_port()
    command = [sys.executable, "-m", "atb_plugin.server", "--model", str(tiny_checkpoint("qwen2_5_vl")), "--port",
               str(port), "--served-model-name", "m", "--tokenizer-workers", "1", "--block-size", "16",
               "--kv-cache-memory", "256M"]
    log = Path(f"/tmp/bench-video-{port}.log")
    with serving.ManagedServer(command, port, log, ready_timeout=300, stop_timeout=30,
                               env=serving.our_server_env()) as server:
        turns = []
        for rep in range(reps):  # a new clip each repetition: nothing cached across them
            data = video_bytes(10 * FPS, FPS, SIZE, gop=GOP, seed=100 + rep)
            url = "data:video/mp4;base64," + base64.b64encode(data).decode()
            turns.append(asyncio.run(chat_turns(server.base_url, "", turns=2,
                                                part={"type": "video_url", "video_url": {"url": url}})))
        first, second = (statistics.median(t[i] for t in turns) for i in (0, 1))
        print(f"\nresend TTFT (10 s clip, tiny Qwen2.5-VL, median of {reps}): turn 1 {first:.0f} ms, "
              f"turn 2 {second:.0f} ms, ratio {second / first:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--ttft", action="store_true", help="also the multi-turn resend TTFT through the service")
    parser.add_argument("--ttft-only", action="store_true", help="only the resend TTFT")
    args = parser.parse_args()
    if not args.ttft_only:
        frontend(args.reps)
        shm_bytes()
    if args.ttft or args.ttft_only:
        resend_ttft(args.reps)


if __name__ == "__main__":
    main()
