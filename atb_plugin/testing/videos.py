"""Test and benchmark videos, encoded on the fly with PyAV (no files in the repository).

Each frame is a smooth colour field that shifts with the frame index (so neighbouring frames
differ, and a wrong frame shows), plus noise from ``seed``. ``gop`` sets the keyframe interval,
which decides how far a seek lands before the frame it wants.
"""

from __future__ import annotations

import io
from fractions import Fraction
from pathlib import Path

import numpy as np

__all__ = ["many_frames_video_bytes", "video_bytes", "write_video"]


def _frame(index: int, height: int, width: int, rng: np.random.Generator) -> np.ndarray:
    rows = np.linspace(0, 255, height, dtype=np.float32)[:, None]
    cols = np.linspace(0, 255, width, dtype=np.float32)[None, :]
    shift = 7.0 * index
    red = np.broadcast_to((rows + shift) % 256, (height, width))
    green = np.broadcast_to((cols + 2 * shift) % 256, (height, width))
    image = np.stack([red, green, (rows + cols + 3 * shift) % 256], axis=-1)
    image += rng.normal(0, 12, image.shape).astype(np.float32)
    return np.clip(image, 0, 255).astype(np.uint8)


def video_bytes(frames: int, fps: float | Fraction, size: tuple[int, int] = (64, 96), *, codec: str = "mpeg4",
                container: str = "mp4", gop: int = 12, seed: int = 0, audio: bool = False,
                b_frames: int = 0) -> bytes:
    """An encoded video of ``frames`` frames of ``size`` ``(height, width)`` at ``fps``. ``audio``:
    add a silent audio stream too. ``frames=0`` with ``audio`` gives an audio-only file. ``b_frames``:
    frames may be stored out of presentation order (H.264's B-frames), which a seek must handle."""
    import av

    height, width = size
    rng = np.random.default_rng(seed)
    buffer = io.BytesIO()
    with av.open(buffer, mode="w", format=container) as output:
        stream = None
        if frames:
            rate = fps if isinstance(fps, Fraction) else Fraction(fps).limit_denominator(1001)
            stream = output.add_stream(codec, rate=rate)
            stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
            stream.codec_context.gop_size = gop
            stream.codec_context.max_b_frames = b_frames
        sound = output.add_stream("aac", rate=16000) if audio else None
        for index in range(frames):
            frame = av.VideoFrame.from_ndarray(_frame(index, height, width, rng), format="rgb24")
            for packet in stream.encode(frame):
                output.mux(packet)
        if stream is not None:
            for packet in stream.encode():
                output.mux(packet)
        if sound is not None:
            samples = int(16000 * max(frames / float(fps), 1.0))
            layout = "mono"
            chunk = sound.codec_context.frame_size or 1024
            for start in range(0, samples, chunk):
                block = av.AudioFrame.from_ndarray(np.zeros((1, min(chunk, samples - start)), dtype=np.float32),
                                                   format="fltp", layout=layout)
                block.sample_rate = 16000
                for packet in sound.encode(block):
                    output.mux(packet)
            for packet in sound.encode():
                output.mux(packet)
    return buffer.getvalue()


def many_frames_video_bytes(frames: int, fps: int = 5000, size: tuple[int, int] = (16, 16)) -> bytes:
    """The shape of a decode bomb (issue #45: 16x16 frames at 5,000 fps, one keyframe): an H.264
    MP4 of ``frames`` identical tiny frames, only the first a keyframe, so sampling any late frame
    means decoding every frame before it. Made in milliseconds: one keyframe and one empty P-frame
    are encoded, and that P-frame's packet is muxed again for every later frame (a few bytes each).
    The stream header states the frame count and duration, as the real one's did."""
    import av

    height, width = size
    buffer = io.BytesIO()
    with av.open(buffer, mode="w", format="mp4") as output:
        stream = output.add_stream("libx264", rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.codec_context.options = {"preset": "ultrafast", "x264-params": "keyint=infinite:scenecut=0:bframes=0"}
        still = np.full((height, width, 3), 128, dtype=np.uint8)
        packets = []
        for index in range(2):
            frame = av.VideoFrame.from_ndarray(still, format="rgb24")
            frame.pts = index
            packets += stream.encode(frame)
        packets += stream.encode()
        keyframe, repeat = packets[0], bytes(packets[1])
        time_base = keyframe.time_base
        output.mux(keyframe)
        for index in range(1, frames):
            packet = av.Packet(repeat)
            packet.stream, packet.time_base = stream, time_base
            packet.pts = packet.dts = index
            output.mux(packet)
    return buffer.getvalue()


def write_video(path, frames: int, fps: float | Fraction, size: tuple[int, int] = (64, 96), **kwargs) -> Path:
    path = Path(path)
    path.write_bytes(video_bytes(frames, fps, size, container=kwargs.pop("container", None) or _format(path),
                                 **kwargs))
    return path


def _format(path: Path) -> str:
    return {".mp4": "mp4", ".mkv": "matroska", ".webm": "webm", ".avi": "avi", ".mov": "mov"}.get(path.suffix, "mp4")
