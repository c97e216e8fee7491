"""Qwen-VL (Qwen-VL-Chat): a 448px ViT, a 256-query cross-attention resampler and the QWen
(Qwen-7B style) decoder. Not in transformers; the semantics follow the published remote code
(``visual.py`` + ``modeling_qwen.py``) and the parameter names are the published checkpoint's.

Image path, one 448x448 image (pixel values ``(1, 3, 448, 448)``, CLIP-normalised)::

    conv1 (14x14 patches, no bias)      -> (1024, width)            32 x 32 patch grid, row-major
    + positional_embedding              (a 16x16 table, bicubically resized to the grid)
    ln_pre, resblocks x layers          pre-norm: x += attn(ln_1(x)); x += c_proj(gelu(c_fc(ln_2(x))))
    attn_pool (Resampler)               256 queries attend over the 1024 patches  -> (256, output_dim)
    ln_post, @ proj                     -> (256, output_dim = LM hidden)

- ViT attention: ``attn.in_proj`` is a Megatron-style fused projection laid out head by head,
  ``[q_h | k_h | v_h]`` for each head h (viewed as ``(heads, 3 * head_dim)`` and split), not
  ``[q; k; v]``; scale ``head_dim ** -0.5``; bidirectional.
- Resampler: ``kv = ln_kv(kv_proj(x))``; queries ``ln_q(query) + pos_embed``; keys ``kv + pos``
  where ``pos`` is ``pos_embed`` (2-D sin-cos of the 16x16 query grid) bicubically resized to the
  patch grid; values ``kv`` (no position). Then an ``nn.MultiheadAttention`` with ``output_dim //
  128`` heads: ``in_proj_weight`` is ``[q; k; v]``, scale ``head_dim ** -0.5``, ``out_proj``.
- The 256 feature rows replace the 256 slots between ``<img>`` and ``</img>`` (docs/wire-format.md: the
  builder writes ``<img>, NAME, SHAPE, <imgpad> x 254, </img>``; slots restored to ``<imgpad>``).

Language model, mapped onto the shared decoder (``decoder.DecoderForCausalLM``)::

    transformer.wte                     -> model.embed_tokens
    transformer.h.N.ln_1 / ln_2         -> model.layers.N.input_layernorm / post_attention_layernorm (RMSNorm)
    transformer.h.N.attn.c_attn         -> model.layers.N.self_attn.qkv_proj   ([q; k; v] with bias, as is)
    transformer.h.N.attn.c_proj         -> model.layers.N.self_attn.o_proj     (no bias)
    transformer.h.N.mlp.w2 / w1         -> model.layers.N.mlp.gate_up_proj     [w2; w1]
    transformer.h.N.mlp.c_proj          -> model.layers.N.mlp.down_proj
    transformer.ln_f, lm_head           -> model.norm, lm_head

QWen's MLP is ``c_proj(w1(x) * silu(w2(x)))``: the silu branch (the "gate") is ``w2``, so the fused
``gate_up_proj`` is ``[w2; w1]``. Rotary: rotate-half over the full head (``rotary_pct`` 1) with
base ``rotary_emb_base``; ``kv_channels`` is the head dim; ``layer_norm_epsilon`` the RMSNorm eps.

Not implemented (as in vLLM): QWen's ``use_dynamic_ntk`` and ``use_logn_attn``. Both only act on
sequences longer than ``seq_length`` (2048 for Qwen-VL-Chat): up to that length the output equals
the remote code's; beyond it, plain RoPE without log-n query scaling is used.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from types import MappingProxyType

import torch
import torch.nn.functional as F
from torch import nn

from atb_plugin import ops
from atb_plugin.models.base import MultimodalModel
from atb_plugin.models.clip import PreNormEncoderLayer
from atb_plugin.models.decoder import DecoderConfig, build_language_model
from atb_plugin.models.interfaces import MultimodalProcessingInfo
from atb_plugin.models.weights import IGNORE, STACKED_QKV_GATE_UP
from atb_plugin.multimodal.pixels import ChwImageFormat
from atb_plugin.multimodal.wire import QWEN_VL_BLOCK
from atb_plugin.utils import cdiv

# Qwen-VL's resampler: one query per image slot between <img> and </img> (config.json's visual.n_queries
# where it says; the input builder always lays out this many).
NUM_QUERIES = QWEN_VL_BLOCK.tokens_per_block


# --------------------------------------------------------------------------------------------
# config
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class QwenVisionConfig:
    image_size: int
    patch_size: int
    width: int
    layers: int
    heads: int
    mlp_ratio: float
    output_dim: int
    image_start_id: int
    num_queries: int = NUM_QUERIES
    layer_norm_eps: float = 1e-6  # visual.py: partial(nn.LayerNorm, eps=1e-6) everywhere

    def __post_init__(self):
        for name in ("image_size", "patch_size", "width", "layers", "heads", "output_dim", "num_queries"):
            if getattr(self, name) <= 0:
                raise ValueError(f"visual.{name} must be > 0, got {getattr(self, name)}")
        if self.width % self.heads:
            raise ValueError(f"visual.width ({self.width}) must be a multiple of visual.heads ({self.heads})")
        if self.output_dim % 128 or self.output_dim < 128:
            raise ValueError(f"visual.output_dim ({self.output_dim}) must be a multiple of 128 "
                             "(the resampler has output_dim // 128 heads)")
        if math.isqrt(self.num_queries) ** 2 != self.num_queries:
            raise ValueError(f"the resampler's {self.num_queries} queries must form a square grid")

    @property
    def mlp_width(self) -> int:
        return int(self.width * self.mlp_ratio)  # visual.py: int(d_model * mlp_ratio)

    @property
    def pool_heads(self) -> int:
        return self.output_dim // 128


@dataclass(frozen=True)
class QwenVLConfig:
    text: DecoderConfig
    vision: QwenVisionConfig

    @property
    def vocab_size(self) -> int:
        return self.text.vocab_size

    @property
    def hidden_size(self) -> int:
        return self.text.hidden_size


def _text_config(raw: dict) -> DecoderConfig:
    hidden, heads = raw["hidden_size"], raw["num_attention_heads"]
    head_dim = raw.get("kv_channels") or hidden // heads
    if head_dim * heads != hidden:
        # modeling_qwen.py splits c_attn's output at hidden_size, so it assumes this too.
        raise ValueError(f"kv_channels ({head_dim}) * num_attention_heads ({heads}) must equal hidden_size ({hidden})")
    if float(raw.get("rotary_pct", 1.0)) != 1.0:
        raise ValueError(f"rotary_pct {raw['rotary_pct']} is not supported (only 1.0: rotary over the whole head)")
    if not raw.get("no_bias", True):
        raise ValueError("no_bias=false (biased MLP / c_proj) is not supported; Qwen-VL checkpoints have no_bias=true")
    return DecoderConfig(
        vocab_size=raw["vocab_size"],
        hidden_size=hidden,
        intermediate_size=raw["intermediate_size"] // 2,  # QWenMLP: w1 / w2 have intermediate_size // 2 rows
        num_hidden_layers=raw["num_hidden_layers"],
        num_attention_heads=heads,
        num_key_value_heads=heads,
        head_dim=head_dim,
        rms_norm_eps=raw.get("layer_norm_epsilon", 1e-6),
        rope={"rope_type": "default", "rope_theta": float(raw.get("rotary_emb_base", 10000))},
        qkv_bias=True,  # c_attn always has a bias
        tie_word_embeddings=raw.get("tie_word_embeddings", False),
    )


def _vision_config(raw: dict, hidden_size: int) -> QwenVisionConfig:
    visual = raw.get("visual")
    if not isinstance(visual, dict):
        raise ValueError("config.json has no 'visual' section: not a Qwen-VL checkpoint")
    config = QwenVisionConfig(
        image_size=visual["image_size"],
        patch_size=visual["patch_size"],
        width=visual["width"],
        layers=visual["layers"],
        heads=visual["heads"],
        mlp_ratio=float(visual["mlp_ratio"]),
        output_dim=visual["output_dim"],
        image_start_id=visual["image_start_id"],
        num_queries=visual.get("n_queries", NUM_QUERIES),
    )
    if config.output_dim != hidden_size:
        raise ValueError(f"visual.output_dim ({config.output_dim}) must equal hidden_size ({hidden_size})")
    return config


# --------------------------------------------------------------------------------------------
# vision tower
# --------------------------------------------------------------------------------------------


def resize_abs_pos(table: torch.Tensor, grid: int) -> torch.Tensor:
    """A square ``(side * side, C)`` position table resized to ``(grid * grid, C)`` as Qwen-VL's
    ``get_abs_pos``: bicubic, ``align_corners=False``, computed in fp32; unchanged if it fits."""
    side = math.isqrt(table.shape[0])
    if side == grid:
        return table
    image = table.float().reshape(1, side, side, -1).permute(0, 3, 1, 2)
    resized = F.interpolate(image, size=(grid, grid), mode="bicubic", align_corners=False)
    return resized.permute(0, 2, 3, 1).flatten(0, 2).to(table.dtype)


def cross_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float) -> torch.Tensor:
    """Bidirectional attention of ``query`` ``(N, Q, H, D)`` over ``key``/``value`` ``(N, L, H, D)``
    (N independent items) with ``ops.varlen_attention``, whose segments have one length for queries
    and keys. Query rows never interact, so each item's queries are zero-padded to a multiple of L
    and cut into segments of L rows, each paired with (a copy of) that item's L keys; the padding
    rows are dropped. For Qwen-VL (Q = 256, L = 1024) that is one segment per image."""
    n, q_len, heads, dim = query.shape
    k_len = key.shape[1]
    copies = cdiv(q_len, k_len)
    padded = query.new_zeros(n, copies * k_len, heads, dim)
    padded[:, :q_len] = query
    if copies > 1:
        key = key.unsqueeze(1).expand(n, copies, k_len, heads, dim)
        value = value.unsqueeze(1).expand(n, copies, k_len, heads, dim)
    rows = n * copies * k_len
    cu_seqlens = torch.arange(0, rows + 1, k_len, dtype=torch.int32, device=query.device)
    out = ops.varlen_attention(padded.reshape(rows, heads, dim), key.reshape(rows, heads, dim),
                               value.reshape(rows, heads, dim), cu_seqlens, scale)
    return out.view(n, copies * k_len, heads, dim)[:, :q_len]


class VisualAttention(nn.Module):
    """ViT self-attention. ``in_proj`` rows are per head ``[q_h; k_h; v_h]`` (visual.py views its
    output as ``(heads, 3 * head_dim)`` and splits the last dim)."""

    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads, self.head_dim = heads, width // heads
        self.in_proj = nn.Linear(width, 3 * width)
        self.out_proj = nn.Linear(width, width)
        self.scale = self.head_dim**-0.5

    def forward(self, x: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
        tokens = x.shape[0]
        q, k, v = self.in_proj(x).view(tokens, self.heads, 3 * self.head_dim).split(self.head_dim, dim=-1)
        out = ops.varlen_attention(q.contiguous(), k.contiguous(), v.contiguous(), cu_seqlens, self.scale)
        return self.out_proj(out.reshape(tokens, -1))


class VisualMLP(nn.Module):
    def __init__(self, width: int, mlp_width: int):
        super().__init__()
        self.c_fc = nn.Linear(width, mlp_width)
        self.c_proj = nn.Linear(mlp_width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x)))  # nn.GELU(): exact erf


class VisualAttentionBlock(PreNormEncoderLayer):
    def __init__(self, config: QwenVisionConfig):
        super().__init__(("ln_1", "attn", "ln_2", "mlp"), config.width, config.layer_norm_eps,
                         VisualAttention(config.width, config.heads), VisualMLP(config.width, config.mlp_width))


class TransformerBlock(nn.Module):
    def __init__(self, config: QwenVisionConfig):
        super().__init__()
        self.resblocks = nn.ModuleList(VisualAttentionBlock(config) for _ in range(config.layers))

    def forward(self, x: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
        for block in self.resblocks:
            x = block(x, cu_seqlens)
        return x


class MultiheadAttentionWeights(nn.Module):
    """The parameters of the resampler's ``nn.MultiheadAttention`` under its names (its forward is
    ``Resampler.forward`` below, on ``ops.varlen_attention``)."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.in_proj_weight = nn.Parameter(torch.empty(3 * dim, dim))
        self.in_proj_bias = nn.Parameter(torch.empty(3 * dim))
        self.out_proj = nn.Linear(dim, dim)


class Resampler(nn.Module):
    """``attn_pool``: ``num_queries`` learned queries cross-attend over the patch features."""

    def __init__(self, config: QwenVisionConfig):
        super().__init__()
        dim = config.output_dim
        self.query = nn.Parameter(torch.empty(config.num_queries, dim))
        self.pos_embed = nn.Parameter(torch.empty(config.num_queries, dim), requires_grad=False)
        # visual.py: nn.Identity (and no checkpoint tensor) when the ViT is already output_dim wide.
        self.kv_proj = nn.Linear(config.width, dim, bias=False) if config.width != dim else nn.Identity()
        self.attn = MultiheadAttentionWeights(dim, config.pool_heads)
        self.ln_q = nn.LayerNorm(dim, eps=config.layer_norm_eps)
        self.ln_kv = nn.LayerNorm(dim, eps=config.layer_norm_eps)

    def forward(self, x: torch.Tensor, grid: int) -> torch.Tensor:
        """``x`` ``(N, grid * grid, width)`` -> ``(N, num_queries, output_dim)``."""
        n, length, _ = x.shape
        heads = self.attn.heads
        kv = self.ln_kv(self.kv_proj(x))
        query = self.ln_q(self.query) + self.pos_embed
        key = kv + resize_abs_pos(self.pos_embed, grid)
        w_q, w_k, w_v = self.attn.in_proj_weight.chunk(3)
        b_q, b_k, b_v = self.attn.in_proj_bias.chunk(3)
        dim = query.shape[-1]
        q = F.linear(query, w_q, b_q).view(1, -1, heads, dim // heads).expand(n, -1, -1, -1)
        k = F.linear(key, w_k, b_k).view(n, length, heads, dim // heads)
        v = F.linear(kv, w_v, b_v).view(n, length, heads, dim // heads)
        out = cross_attention(q, k, v, (dim // heads) ** -0.5)
        return self.attn.out_proj(out.reshape(n, -1, dim))


class VisionTransformer(nn.Module):
    """``transformer.visual``: pixels ``(N, 3, H, W)`` -> features ``(N, num_queries, output_dim)``."""

    def __init__(self, config: QwenVisionConfig):
        super().__init__()
        self.config = config
        width, patch = config.width, config.patch_size
        self.conv1 = nn.Conv2d(3, width, kernel_size=patch, stride=patch, bias=False)
        # visual.py: randn(256, width), a 16x16 table whatever the image size (resized to the grid)
        self.positional_embedding = nn.Parameter(torch.empty(256, width))
        self.ln_pre = nn.LayerNorm(width, eps=config.layer_norm_eps)
        self.transformer = TransformerBlock(config)
        self.attn_pool = Resampler(config)
        self.ln_post = nn.LayerNorm(config.output_dim, eps=config.layer_norm_eps)
        self.proj = nn.Parameter(torch.empty(config.output_dim, config.output_dim))

    def _check(self, pixel_values: torch.Tensor) -> torch.Tensor:
        if pixel_values.dim() == 3:
            pixel_values = pixel_values.unsqueeze(0)
        if pixel_values.dim() != 4 or pixel_values.shape[1] != 3:
            raise ValueError(f"pixel_values must be (N, 3, H, W) or (3, H, W), got {tuple(pixel_values.shape)}")
        height, width = pixel_values.shape[-2:]
        patch = self.config.patch_size
        if height != width or height % patch:
            raise ValueError(
                f"Qwen-VL takes square images whose side is a multiple of {patch} "
                f"(the preprocessor resizes to {self.config.image_size}x{self.config.image_size}), got {height}x{width}"
            )
        return pixel_values

    def patch_embed(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """``(N, 3, H, W)`` -> ``(N, grid * grid, width)`` with the (resized) positional embedding."""
        weight = self.conv1.weight
        x = self.conv1(self._check(pixel_values).to(device=weight.device, dtype=weight.dtype))
        x = x.flatten(2).transpose(1, 2)  # row-major over the patch grid
        return x + resize_abs_pos(self.positional_embedding, math.isqrt(x.shape[1]))

    def encode_patches(self, x: torch.Tensor) -> torch.Tensor:
        """ln_pre + the resblocks over ``(N, L, width)``, every image attending only to itself."""
        n, length, width = x.shape
        cu_seqlens = torch.arange(0, n * length + 1, length, dtype=torch.int32, device=x.device)
        return self.transformer(self.ln_pre(x).reshape(n * length, width), cu_seqlens).view(n, length, width)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        x = self.encode_patches(self.patch_embed(pixel_values))
        x = self.attn_pool(x, math.isqrt(x.shape[1]))
        return self.ln_post(x) @ self.proj


# --------------------------------------------------------------------------------------------
# the model
# --------------------------------------------------------------------------------------------

_LM_RULES = [  # checkpoint name -> the decoder's name (gate/up_proj: shards of its gate_up_proj)
    (re.compile(r"transformer\.wte\.weight"), r"model.embed_tokens.weight"),
    (re.compile(r"transformer\.h\.(\d+)\.ln_1\.weight"), r"model.layers.\1.input_layernorm.weight"),
    (re.compile(r"transformer\.h\.(\d+)\.attn\.c_attn\.(weight|bias)"), r"model.layers.\1.self_attn.qkv_proj.\2"),
    (re.compile(r"transformer\.h\.(\d+)\.attn\.c_proj\.weight"), r"model.layers.\1.self_attn.o_proj.weight"),
    (re.compile(r"transformer\.h\.(\d+)\.ln_2\.weight"), r"model.layers.\1.post_attention_layernorm.weight"),
    # QWenMLP: c_proj(w1(x) * silu(w2(x))), so w2 is the gate: gate_up_proj = [w2; w1]
    (re.compile(r"transformer\.h\.(\d+)\.mlp\.w2\.weight"), r"model.layers.\1.mlp.gate_proj.weight"),
    (re.compile(r"transformer\.h\.(\d+)\.mlp\.w1\.weight"), r"model.layers.\1.mlp.up_proj.weight"),
    (re.compile(r"transformer\.h\.(\d+)\.mlp\.c_proj\.weight"), r"model.layers.\1.mlp.down_proj.weight"),
    (re.compile(r"transformer\.ln_f\.weight"), r"model.norm.weight"),
    (re.compile(r"lm_head\.weight"), r"lm_head.weight"),
]
_VISUAL = re.compile(r"transformer\.visual\.(.+)")
# Buffers some QWen checkpoints carry; known and unused.
_IGNORED = re.compile(r"transformer\.(h\.\d+\.attn\.)?rotary_emb\.inv_freq|transformer\.h\.\d+\.attn\.masked_bias")


class QwenVLForCausalLM(MultimodalModel):
    """Qwen-VL-Chat. Contract: ``decoder.DecoderForCausalLM`` plus ``media_layout`` and
    ``get_multimodal_embeddings`` (see ``atb_plugin.multimodal``)."""

    def __init__(self, config: QwenVLConfig):
        super().__init__(config, visual=VisionTransformer(config.vision),
                         language_model=build_language_model(config.text))
        
    @classmethod
    def config_from_hf(cls, config: dict) -> QwenVLConfig:
        text = _text_config(config)
        return QwenVLConfig(text=text, vision=_vision_config(config, text.hidden_size))

    # -- contract --------------------------------------------------------------------------------

    @property
    def media_layout(self):
        from atb_plugin.multimodal import MediaLayout

        # <img> = image_start_id, </img> = +1, <imgpad> = +2 (the public tokenizer's layout).
        return MediaLayout(placeholder_id=self.config.vision.image_start_id + 2,
                           num_metadata_slots=QWEN_VL_BLOCK.metadata_slots,
                           tokens_per_block=self.config.vision.num_queries, merge_size=1)

    # Images one prompt may carry: the input builder's limit and the most EngineConfig's
    # limit_mm_per_prompt may be (one declaration, read by both).
    supported_mm_limits = MappingProxyType({"image": 16})

    def get_processing_info(self, model_dir) -> MultimodalProcessingInfo:
        """Every image is resized to ``image_size`` square and gives one row per resampler query
        (``model_dir`` is unused: the size is in config.json's ``visual``)."""
        side = self.config.vision.image_size
        return MultimodalProcessingInfo(
            modality="image", max_items_per_prompt=self.supported_mm_limits["image"],
            max_tokens_per_item=self.config.vision.num_queries, max_item_size=(side, side),
            pixel_shape=(1, 3, side, side))

    @property
    def pixel_format(self) -> ChwImageFormat:
        side = self.config.vision.image_size
        return ChwImageFormat(self.pixel_normalization, side, side)

    def read_checkpoint_files(self, model_dir) -> None:
        """Nothing: Qwen-VL's mean, std and rescale are fixed in its code (the CLIP constants), as
        its input builder has them, whatever files sit beside the weights."""

    def get_multimodal_embeddings(self, pixel_values: torch.Tensor, grid_thw=None) -> torch.Tensor:
        """``(1, 3, H, W)`` (or ``(3, H, W)``) -> ``(256, hidden)``: the rows of the image's block in
        order. ``(N, 3, H, W)`` gives N images' rows one after the other. ``grid_thw`` is unused."""
        features = self.visual(pixel_values)
        return features.reshape(-1, features.shape[-1])

    def get_input_embeddings(self, input_ids: torch.Tensor, mm_embeds=None) -> torch.Tensor:
        """Text embeddings (ids >= 0: metadata slots restored). Image features are merged by
        ``atb_plugin.multimodal.MultimodalPrompt.embed``, not here."""
        if mm_embeds is not None:
            raise NotImplementedError("merge image features with atb_plugin.multimodal.MultimodalPrompt.embed")
        return self.language_model.get_input_embeddings(input_ids)

    # -- weights ---------------------------------------------------------------------------------

    stacked_params = STACKED_QKV_GATE_UP

    def _own_name(self, name: str) -> str | None:
        """Our name for a checkpoint tensor, ``IGNORE`` for known unused ones, None if unknown."""
        if _IGNORED.fullmatch(name) or (name == "lm_head.weight" and self.language_model.lm_head is None):
            return IGNORE  # rotary / mask buffers; tied head (the embedding serves)
        visual = _VISUAL.fullmatch(name)
        if visual:
            return f"visual.{visual.group(1)}"
        for pattern, replacement in _LM_RULES:
            if pattern.fullmatch(name):
                return "language_model." + pattern.sub(replacement, name)
        return None
