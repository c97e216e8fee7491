"""Rotary position embeddings: cos/sin tables (with the rope scalings checkpoints name, and
Qwen2-VL's multimodal M-RoPE) and their application (rotate-half convention, as transformers).

M-RoPE: positions are ``(3, num_tokens)`` (temporal, height, width); the head dimension's
frequency bands are split by ``mrope_section`` (e.g. [16, 24, 24] of 64) and band i takes its
angle from position row i. For text tokens the three rows are equal, which is plain RoPE.
Qwen3-VL interleaves instead (``mrope_interleaved`` in the rope parameters): frequency j takes
row 1 (height) when ``j % 3 == 1`` and ``j < 3 * mrope_section[1]``, row 2 (width) when
``j % 3 == 2`` and ``j < 3 * mrope_section[2]``, else row 0 (time), so every axis gets high and
low frequencies alike.
"""

from __future__ import annotations

import math

import torch

from atb_plugin.platform import current_platform


def _rope_type(rope: dict) -> str:
    """The rope parameters' type (``rope_type``, or the older ``type``)."""
    return rope.get("rope_type", rope.get("type", "default"))


def _inverse_frequencies(head_dim: int, rope: dict) -> torch.Tensor:
    base = float(rope.get("rope_theta", 10000.0))
    # device="cpu" explicitly: models are built under torch.device("meta"), tables must be real.
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim))
    rope_type = _rope_type(rope)
    if rope_type in ("default", "mrope"):
        return inv_freq
    if rope_type == "linear":
        return inv_freq / float(rope["factor"])
    if rope_type == "llama3":
        factor = float(rope["factor"])
        low, high = float(rope["low_freq_factor"]), float(rope["high_freq_factor"])
        old_context = float(rope["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        # Long wavelengths are scaled down by factor, short ones kept, the band between blended.
        scaled = torch.where(wavelen > old_context / low, inv_freq / factor, inv_freq)
        smooth = (old_context / wavelen - low) / (high - low)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_context / high) & (wavelen <= old_context / low)
        return torch.where(medium, blended, scaled)
    if rope_type == "yarn":
        return _yarn_inverse_frequencies(inv_freq, head_dim, base, rope)
    raise ValueError(f"rope type {rope_type!r} is not supported (default, linear, llama3, mrope, yarn)")


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn_inverse_frequencies(inv_freq: torch.Tensor, head_dim: int, base: float, rope: dict) -> torch.Tensor:
    """YaRN (DeepSeek-V2/V3's long-context rope, transformers' ``_compute_yarn_parameters``): the
    frequencies above ``beta_fast`` rotations over the original context are kept, those below
    ``beta_slow`` divided by ``factor``, a linear ramp between."""
    factor = float(rope["factor"])
    old_context = float(rope["original_max_position_embeddings"])
    beta_fast, beta_slow = float(rope.get("beta_fast") or 32), float(rope.get("beta_slow") or 1)

    def correction_dim(rotations: float) -> float:
        return head_dim * math.log(old_context / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rope.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32, device="cpu") - low) / ((high - low) or 0.001)).clamp(0, 1)
    keep = 1 - ramp  # 1: extrapolate (the original frequency), 0: interpolate (divided by factor)
    return inv_freq / factor * (1 - keep) + inv_freq * keep


def attention_factor(rope: dict) -> float:
    """The factor YaRN multiplies cos / sin by (1 for every other rope type): ``attention_factor``
    when given, else ``mscale(factor, mscale) / mscale(factor, mscale_all_dim)`` (1 for DeepSeek-V3,
    whose two are equal), else ``mscale(factor)``."""
    if _rope_type(rope) != "yarn":
        return 1.0
    if rope.get("attention_factor") is not None:
        return float(rope["attention_factor"])
    factor, mscale, mscale_all_dim = float(rope["factor"]), rope.get("mscale"), rope.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
    return _yarn_mscale(factor)


def yarn_softmax_scale(rope: dict, scale: float) -> float:
    """DeepSeek's softmax scale under YaRN: ``scale * mscale(factor, mscale_all_dim) ** 2``
    (transformers' ``yarn_apply_mscale``); ``scale`` unchanged otherwise."""
    if _rope_type(rope) == "default" or not rope.get("mscale_all_dim"):
        return scale
    return scale * _yarn_mscale(float(rope["factor"]), float(rope["mscale_all_dim"])) ** 2


class RotaryEmbedding:
    """cos/sin for given positions. ``rope`` is the config's ``rope_parameters`` (transformers 5)
    or ``rope_scaling`` merged with ``rope_theta``; ``mrope_section`` switches on M-RoPE."""

    def __init__(self, head_dim: int, rope: dict | None = None, mrope_section: list[int] | None = None):
        self.head_dim = head_dim
        self.inv_freq = _inverse_frequencies(head_dim, rope or {})
        self.attention_factor = attention_factor(rope or {})  # YaRN's cos / sin scale; 1 otherwise
        self.mrope_section = list(mrope_section) if mrope_section else None
        if self.mrope_section and sum(self.mrope_section) != head_dim // 2:
            raise ValueError(f"mrope_section {self.mrope_section} must sum to head_dim / 2 = {head_dim // 2}")
        # Interleaved M-RoPE: the position row each frequency takes (module docstring).
        self.mrope_rows = None
        if self.mrope_section and (rope or {}).get("mrope_interleaved"):
            rows = torch.zeros(head_dim // 2, dtype=torch.int64, device="cpu")
            for row in (1, 2):
                rows[row:3 * self.mrope_section[row]:3] = row
            self.mrope_rows = rows
        # The tables per device, copied once: a copy from host memory on every step costs a
        # transfer, and inside a CUDA / ACL graph capture it is illegal (the eager warm-up before
        # each capture fills this).
        self._on_device: dict[torch.device, tuple[torch.Tensor, torch.Tensor | None]] = {}

    def _tables(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
        tables = self._on_device.get(device)
        if tables is None:
            rows = self.mrope_rows.to(device) if self.mrope_rows is not None else None
            tables = self._on_device[device] = (self.inv_freq.to(device), rows)
        return tables

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``positions`` ``(T,)``, or ``(3, T)`` with M-RoPE. Returns cos, sin ``(T, head_dim)``."""
        inv_freq, rows = self._tables(positions.device)
        freqs = positions.float().unsqueeze(-1) * inv_freq  # (..., T, head_dim / 2)
        if self.mrope_section is not None:
            if positions.dim() == 1:
                freqs = freqs.expand(3, *freqs.shape)
            if rows is not None:
                freqs = freqs.gather(0, rows.expand(1, *freqs.shape[1:])).squeeze(0)
            else:
                bands = freqs.split(self.mrope_section, dim=-1)
                freqs = torch.cat([band[i % 3] for i, band in enumerate(bands)], dim=-1)
        emb = torch.cat((freqs, freqs), dim=-1)
        if self.attention_factor != 1.0:
            return (emb.cos() * self.attention_factor).to(dtype), (emb.sin() * self.attention_factor).to(dtype)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x`` ``(T, num_heads, head_dim)``, cos/sin ``(T, head_dim)``: ``x·cos + rotate_half(x)·sin``."""
    return current_platform().kernels.apply_rotary(x, cos, sin)
