"""Qwen2-Audio (Qwen/Qwen2-Audio-7B(-Instruct)): a Whisper-style audio encoder, a linear projector
and the shared Qwen2 decoder (``decoder.DecoderForCausalLM``).

One block = one 30 s window: its float32 log-mel features ``(num_mel_bins, 3000)`` from shared
memory and its valid frame count F (the block's FRAMES slot; docs/wire-format.md, "Audio")::

    features (128, 3000) ─► conv1 (k 3, pad 1) ─► GELU ─► conv2 (k 3, stride 2, pad 1) ─► GELU   (d, 1500)
      ─► keep the first L = (F − 1) // 2 + 1 rows  ─► + embed_positions[:L] (Whisper's sinusoids, from the checkpoint)
      ─► layers: x += attn(LN(x)); x += fc2(GELU(fc1(LN(x))))      (bidirectional, over the L rows)
      ─► average pooling of row pairs ─► n = (L − 2) // 2 + 1 rows ─► LayerNorm ─► projector (Linear)   (n, hidden)

transformers runs the layers over all 1500 rows with the rows past L masked as keys, then keeps
the first n pooled rows: the kept rows only ever attend to the first L, so running the layers
over those L rows alone gives the same rows (and costs (L/1500)² of the attention). The
convolutions do run over the whole window: the last kept rows read two padded frames.

Parameters (the model's own names; checkpoint names: the published ``audio_tower.*``,
``multi_modal_projector.*``, ``language_model.model.*``, ``language_model.lm_head.*``, and
transformers 5's ``model.audio_tower.*`` ... ``lm_head.*``)::

    audio_tower.*             conv1, conv2, embed_positions, layers.N.{self_attn.{q,k,v,out}_proj,
                              self_attn_layer_norm, fc1, fc2, final_layer_norm}, layer_norm
    multi_modal_projector.*   linear
    language_model.*          DecoderForCausalLM (qkv_proj, gate_up_proj fused on load)
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

import torch
import torch.nn.functional as F
from torch import nn

from atb_plugin import ops
from atb_plugin.models.base import MultimodalModel
from atb_plugin.models.decoder import DecoderConfig, build_language_model
from atb_plugin.models.interfaces import MultimodalProcessingInfo
from atb_plugin.models.weights import PROJECTOR_AND_LANGUAGE_MODEL_PREFIXES, STACKED_QKV_GATE_UP, prefixed_name
from atb_plugin.multimodal.pixels import PixelFormatError
from atb_plugin.multimodal.wire import QWEN2_AUDIO_BLOCK, qwen2_audio_tokens

_ACTIVATIONS = {"gelu": F.gelu, "gelu_new": lambda x: F.gelu(x, approximate="tanh"), "relu": F.relu}

# transformers' Qwen2Config defaults (Qwen2-Audio-7B's text_config gives no hidden_size, no heads ...)
_QWEN2_DEFAULTS = {
    "vocab_size": 151936,
    "hidden_size": 4096,
    "intermediate_size": 22016,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "max_position_embeddings": 32768,
    "tie_word_embeddings": False,
}

# checkpoint prefix -> the model's own prefix (first match wins)
_PREFIXES = (
    ("audio_tower.", "audio_tower."),
    ("model.audio_tower.", "audio_tower."),
    *PROJECTOR_AND_LANGUAGE_MODEL_PREFIXES,
)


@dataclass(frozen=True)
class AudioEncoderConfig:
    num_mel_bins: int = 128
    d_model: int = 1280
    encoder_layers: int = 32
    encoder_attention_heads: int = 20
    encoder_ffn_dim: int = 5120
    max_source_positions: int = 1500
    activation_function: str = "gelu"
    scale_embedding: bool = False

    def __post_init__(self):
        if self.d_model % self.encoder_attention_heads:
            raise ValueError(f"audio d_model {self.d_model} is not a multiple of encoder_attention_heads "
                             f"{self.encoder_attention_heads}")
        if self.activation_function not in _ACTIVATIONS:
            raise ValueError(f"audio activation_function {self.activation_function!r} is not supported "
                             f"({', '.join(_ACTIVATIONS)})")

    @property
    def num_frames(self) -> int:
        """Mel frames per window: two per position (conv2's stride), 3000."""
        return 2 * self.max_source_positions

    @classmethod
    def from_hf(cls, raw: dict) -> AudioEncoderConfig:
        names = ("num_mel_bins", "d_model", "encoder_layers", "encoder_attention_heads", "encoder_ffn_dim",
                 "max_source_positions", "activation_function", "scale_embedding")
        return cls(**{name: raw[name] for name in names if raw.get(name) is not None})


@dataclass(frozen=True)
class Qwen2AudioConfig:
    text: DecoderConfig
    audio: AudioEncoderConfig
    audio_token_id: int


class AudioAttention(nn.Module):
    """Whisper's: q, v and out with biases, k without; bidirectional over one window's rows."""

    def __init__(self, config: AudioEncoderConfig):
        super().__init__()
        width = config.d_model
        self.num_heads = config.encoder_attention_heads
        self.head_dim = width // self.num_heads
        self.q_proj = nn.Linear(width, width)
        self.k_proj = nn.Linear(width, width, bias=False)
        self.v_proj = nn.Linear(width, width)
        self.out_proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
        shape = (x.shape[0], self.num_heads, self.head_dim)
        q, k, v = self.q_proj(x).view(shape), self.k_proj(x).view(shape), self.v_proj(x).view(shape)
        out = ops.varlen_attention(q, k, v, cu_seqlens, self.head_dim**-0.5)
        return self.out_proj(out.reshape(x.shape[0], -1))


class AudioEncoderLayer(nn.Module):
    def __init__(self, config: AudioEncoderConfig):
        super().__init__()
        self.self_attn = AudioAttention(config)
        self.self_attn_layer_norm = nn.LayerNorm(config.d_model)
        self.fc1 = nn.Linear(config.d_model, config.encoder_ffn_dim)
        self.fc2 = nn.Linear(config.encoder_ffn_dim, config.d_model)
        self.final_layer_norm = nn.LayerNorm(config.d_model)
        self.act = _ACTIVATIONS[config.activation_function]

    def forward(self, x: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.self_attn_layer_norm(x), cu_seqlens)
        return x + self.fc2(self.act(self.fc1(self.final_layer_norm(x))))


class AudioEncoder(nn.Module):
    def __init__(self, config: AudioEncoderConfig):
        super().__init__()
        self.config = config
        width = config.d_model
        self.conv1 = nn.Conv1d(config.num_mel_bins, width, kernel_size=3, padding=1)
        self.conv2 = nn.Conv1d(width, width, kernel_size=3, stride=2, padding=1)
        self.embed_positions = nn.Embedding(config.max_source_positions, width)
        self.layers = nn.ModuleList(AudioEncoderLayer(config) for _ in range(config.encoder_layers))
        self.layer_norm = nn.LayerNorm(width)
        self.act = _ACTIVATIONS[config.activation_function]

    def forward(self, features: torch.Tensor, num_frames: int) -> torch.Tensor:
        """``(num_mel_bins, 3000)`` of one window with ``num_frames`` valid frames ->
        ``(qwen2_audio_tokens(num_frames), d_model)``."""
        x = self.act(self.conv1(features[None]))  # (scale_embedding is not applied, as in transformers)
        x = self.act(self.conv2(x))[0].t()  # (positions, d_model)
        rows = (num_frames - 1) // 2 + 1
        x = x[:rows] + self.embed_positions.weight[:rows]
        cu_seqlens = torch.tensor([0, rows], dtype=torch.int32, device=x.device)
        for layer in self.layers:
            x = layer(x, cu_seqlens)
        kept = qwen2_audio_tokens(num_frames)
        x = x[:2 * kept].view(kept, 2, -1).mean(dim=1)  # AvgPool1d(2, stride 2), the rows that are kept
        return self.layer_norm(x)


class Qwen2AudioMultiModalProjector(nn.Module):
    def __init__(self, config: Qwen2AudioConfig):
        super().__init__()
        self.linear = nn.Linear(config.audio.d_model, config.text.hidden_size)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.linear(features)


class Qwen2AudioForConditionalGeneration(MultimodalModel):
    def __init__(self, config: Qwen2AudioConfig):
        super().__init__(config, audio_tower=AudioEncoder(config.audio),
                         multi_modal_projector=Qwen2AudioMultiModalProjector(config),
                         language_model=build_language_model(config.text))

    @classmethod
    def config_from_hf(cls, config: dict) -> Qwen2AudioConfig:
        if config.get("model_type") != "qwen2_audio":
            raise ValueError(f"{cls.__name__} serves model_type qwen2_audio, not {config.get('model_type')!r}")
        # The published text_config lists only what differs from Qwen2Config's defaults.
        top = {key: config[key] for key in ("vocab_size", "tie_word_embeddings") if config.get(key) is not None}
        text = {**_QWEN2_DEFAULTS, **top, **(config.get("text_config") or {})}
        return Qwen2AudioConfig(
            text=DecoderConfig.from_hf(text, qkv_bias=True),
            audio=AudioEncoderConfig.from_hf(config.get("audio_config") or {}),
            audio_token_id=config.get("audio_token_index", config.get("audio_token_id", 151646)),
        )

    # -- multimodal (interfaces.SupportsMedia) ---------------------------------------------------

    # Clips one prompt may carry: the input builder's limit and the most EngineConfig's
    # limit_mm_per_prompt may be (one declaration, read by both).
    supported_mm_limits = MappingProxyType({"audio": 4})

    def read_checkpoint_files(self, model_dir: Path) -> None:
        """Nothing: the features arrive as the encoder takes them (no normalisation on the device)."""

    @property
    def media_layout(self):
        from atb_plugin.multimodal import MediaLayout

        return MediaLayout(placeholder_id=self.config.audio_token_id,
                           num_metadata_slots=QWEN2_AUDIO_BLOCK.metadata_slots, frames_to_tokens=qwen2_audio_tokens)

    def get_processing_info(self, model_dir) -> MultimodalProcessingInfo:
        """Every window is the same ``(num_mel_bins, 3000)`` features; the largest has all 3000
        frames valid (750 rows)."""
        audio = self.config.audio
        shape = (audio.num_mel_bins, audio.num_frames)
        return MultimodalProcessingInfo(
            modality="audio", max_items_per_prompt=self.supported_mm_limits["audio"],
            max_tokens_per_item=qwen2_audio_tokens(audio.num_frames), max_item_size=shape, pixel_shape=shape,
            grid_thw=(audio.num_frames,))

    def encoder_input(self, pixels: torch.Tensor, grid_thw=None) -> torch.Tensor:
        """A window's segment: float32 ``(num_mel_bins, 3000)`` log-mel features, and the FRAMES
        slot ``(F,)`` with 1 <= F <= 3000; cast to the model's dtype."""
        audio = self.config.audio
        expected = (audio.num_mel_bins, audio.num_frames)
        if pixels.dtype != torch.float32:
            raise PixelFormatError(f"the segment holds {str(pixels.dtype).removeprefix('torch.')} values; Qwen2-Audio "
                                   "reads float32 log-mel features (docs/wire-format.md, Audio)")
        if tuple(pixels.shape) != expected:
            raise PixelFormatError(f"the segment holds features of shape {list(pixels.shape)}; Qwen2-Audio reads "
                                   f"{list(expected)} (num_mel_bins, frames of one 30 s window)")
        self._frames(grid_thw)
        return pixels.to(next(self.parameters()).dtype)

    def _frames(self, grid_thw) -> int:
        if grid_thw is None or len(grid_thw) != 1 or not 0 < int(grid_thw[0]) <= self.config.audio.num_frames:
            raise PixelFormatError(f"FRAMES slot {grid_thw}: expected (F,) with 1 <= F <= {self.config.audio.num_frames}")
        return int(grid_thw[0])

    def get_multimodal_embeddings(self, pixel_values: torch.Tensor, grid_thw=None) -> torch.Tensor:
        """ONE window's features and its ``(F,)`` -> ``(qwen2_audio_tokens(F), hidden)`` rows."""
        frames = self._frames(grid_thw)
        return self.multi_modal_projector(self.audio_tower(pixel_values, frames))

    # -- weights ---------------------------------------------------------------------------------

    stacked_params = STACKED_QKV_GATE_UP  # the language model's qkv_proj / gate_up_proj

    def _own_name(self, name: str) -> str | None:
        """The model's name for a checkpoint tensor, ``IGNORE`` for known unused ones, else None."""
        return prefixed_name(name, _PREFIXES, tied_lm_head=self.language_model.lm_head is None)

