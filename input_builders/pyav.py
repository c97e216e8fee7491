"""PyAV, the one decoding library of video (input_builders.video) and audio (input_builders.audio)."""

from __future__ import annotations

__all__ = ["pyav"]


def pyav():
    """PyAV, the one decoding library of video and audio, imported on first use (a text-only
    service never loads FFmpeg), with FFmpeg's own logging off: its lines about a client's broken
    file are noise beside the error the client gets."""
    import av

    av.logging.set_level(None)
    return av

