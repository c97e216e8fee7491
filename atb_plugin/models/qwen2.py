"""Qwen2 (the decoder is shared: see decoder.py)."""

from atb_plugin.models.decoder import Qwen2ForCausalLM

__all__ = ["Qwen2ForCausalLM"]
