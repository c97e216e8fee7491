"""Llama (the decoder is shared: see decoder.py)."""

from atb_plugin.models.decoder import LlamaForCausalLM

__all__ = ["LlamaForCausalLM"]
