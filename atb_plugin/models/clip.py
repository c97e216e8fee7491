"""CLIP's vision tower (LLaVA's image encoder): patch + class embeddings with learned positions,
a pre-LayerNorm, then pre-norm encoder layers (self-attention over each image's tokens through
``ops.varlen_attention``, MLP with ``quick_gelu`` or the configured activation).

``forward`` returns the hidden state after every stage, like transformers' ``hidden_states``::

    hidden_states[0]  = pre_layrnorm(embeddings)       (the input of layer 0)
    hidden_states[i]  = output of encoder layer i - 1  (i = 1 .. num_hidden_layers)

so a ``vision_feature_layer`` of -2 (LLaVA-1.5) is the output of the second-to-last layer. Only the
layers a caller asks for are run (``up_to``); ``post_layernorm`` belongs to CLIP's pooled output,
which LLaVA does not use, but the checkpoint carries it and it is loaded.

Parameter names are CLIPVisionModel's without the ``vision_model.`` level (transformers 5's
in-memory names) except one fused projection, filled from the checkpoint's separate ones::

    encoder.layers.N.self_attn.qkv_proj = [q_proj; k_proj; v_proj]   (weights and biases)

``weights.FusedWeights`` is the loader every model shares: checkpoint names are mapped
to the model's by a ``rename`` function, stacked projections are written into their fused shard.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from atb_plugin import ops
from atb_plugin.models.base import PretrainedModel
from atb_plugin.models.weights import STACKED_QKV

# --------------------------------------------------------------------------------------------------
# Activations (plain torch: these are element-wise and fine on every platform)
# --------------------------------------------------------------------------------------------------


def _quick_gelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return nn.functional.gelu(x, approximate="tanh")


# transformers' ACT2FN names for the activations these checkpoints use.
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "quick_gelu": _quick_gelu,
    "gelu": nn.functional.gelu,  # exact (erf)
    "gelu_pytorch_tanh": _gelu_tanh,
    "gelu_new": _gelu_tanh,
    "gelu_fast": _gelu_tanh,
    "relu": nn.functional.relu,
    "silu": nn.functional.silu,
    "swish": nn.functional.silu,
}


def activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    try:
        return ACTIVATIONS[name]
    except KeyError:
        raise ValueError(f"activation {name!r} is not supported ({', '.join(sorted(ACTIVATIONS))})") from None



# --------------------------------------------------------------------------------------------------
# The tower
# --------------------------------------------------------------------------------------------------


class HeadsSplitHidden:
    """For an encoder's config whose attention heads split ``hidden_size`` evenly (CLIP, BERT)."""

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


class PreNormEncoderLayer(nn.Module):
    """A pre-LayerNorm transformer encoder layer (CLIP's, Qwen-VL's tower's):
    ``x + attn(norm1(x))``, then ``+ mlp(norm2(x))``. ``names``: the family's names of
    ``(norm1, attn, norm2, mlp)``, its checkpoint's; ``attn`` takes ``(x, cu_seqlens)``."""

    def __init__(self, names: tuple[str, str, str, str], width: int, eps: float, attn: nn.Module, mlp: nn.Module):
        super().__init__()
        self._names = names
        for name, module in zip(names, (nn.LayerNorm(width, eps=eps), attn, nn.LayerNorm(width, eps=eps), mlp)):
            self.add_module(name, module)

    def forward(self, hidden: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
        norm1, attn, norm2, mlp = (getattr(self, name) for name in self._names)
        hidden = hidden + attn(norm1(hidden), cu_seqlens)
        return hidden + mlp(norm2(hidden))


@dataclass(frozen=True)
class CLIPVisionConfig(HeadsSplitHidden):
    hidden_size: int = 1024  # defaults: transformers' CLIPVisionConfig as LLaVA-1.5 uses it
    intermediate_size: int = 4096  # (ViT-L/14 at 336 px), for published configs that omit keys
    num_hidden_layers: int = 24
    num_attention_heads: int = 16
    image_size: int = 336
    patch_size: int = 14
    num_channels: int = 3
    layer_norm_eps: float = 1e-5
    hidden_act: str = "quick_gelu"

    def __post_init__(self):
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(f"CLIP hidden_size {self.hidden_size} is not a multiple of "
                             f"num_attention_heads {self.num_attention_heads}")
        if self.image_size % self.patch_size:
            raise ValueError(f"CLIP image_size {self.image_size} is not a multiple of patch_size {self.patch_size}")
        activation(self.hidden_act)  # fail at config time, not at the first image

    @classmethod
    def from_hf(cls, config: dict) -> "CLIPVisionConfig":
        """From a ``vision_config`` dict (missing keys take transformers' CLIPVisionConfig defaults)."""
        fields = cls.__dataclass_fields__
        return cls(**{key: config[key] for key in fields if key in config})

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2


class CLIPVisionEmbeddings(nn.Module):
    def __init__(self, config: CLIPVisionConfig):
        super().__init__()
        self.config = config
        self.class_embedding = nn.Parameter(torch.empty(config.hidden_size))
        self.patch_embedding = nn.Conv2d(config.num_channels, config.hidden_size, kernel_size=config.patch_size,
                                         stride=config.patch_size, bias=False)
        self.position_embedding = nn.Embedding(config.num_patches + 1, config.hidden_size)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """``(B, C, H, W)`` -> ``(B, 1 + num_patches, hidden)``: [CLS, patches row-major] + positions."""
        size = self.config.image_size
        if pixel_values.dim() != 4 or tuple(pixel_values.shape[1:]) != (self.config.num_channels, size, size):
            raise ValueError(f"CLIP expects pixel values (B, {self.config.num_channels}, {size}, {size}), "
                             f"got {tuple(pixel_values.shape)}")
        weight = self.patch_embedding.weight
        patches = self.patch_embedding(pixel_values.to(weight.dtype)).flatten(2).transpose(1, 2)
        cls = self.class_embedding.to(patches.dtype).expand(patches.shape[0], 1, -1)
        return torch.cat([cls, patches], dim=1) + self.position_embedding.weight


class CLIPAttention(nn.Module):
    def __init__(self, config: CLIPVisionConfig):
        super().__init__()
        self.num_heads, self.head_dim = config.num_attention_heads, config.head_dim
        self.hidden_size = config.hidden_size
        self.qkv_proj = nn.Linear(config.hidden_size, 3 * config.hidden_size)
        self.out_proj = nn.Linear(config.hidden_size, config.hidden_size)
        self.scale = self.head_dim**-0.5

    def shard_sizes(self, fused: str) -> list[int]:
        return [self.hidden_size] * 3

    def forward(self, hidden: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj(hidden).view(-1, 3, self.num_heads, self.head_dim).unbind(1)
        out = ops.varlen_attention(q, k, v, cu_seqlens, self.scale)
        return self.out_proj(out.reshape(-1, self.hidden_size))


class CLIPMLP(nn.Module):
    def __init__(self, config: CLIPVisionConfig):
        super().__init__()
        self.act = activation(config.hidden_act)
        self.fc1 = nn.Linear(config.hidden_size, config.intermediate_size)
        self.fc2 = nn.Linear(config.intermediate_size, config.hidden_size)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(hidden)))


class CLIPEncoderLayer(PreNormEncoderLayer):
    def __init__(self, config: CLIPVisionConfig):
        super().__init__(("layer_norm1", "self_attn", "layer_norm2", "mlp"), config.hidden_size, config.layer_norm_eps,
                         CLIPAttention(config), CLIPMLP(config))


class CLIPEncoder(nn.Module):
    def __init__(self, config: CLIPVisionConfig):
        super().__init__()
        self.layers = nn.ModuleList(CLIPEncoderLayer(config) for _ in range(config.num_hidden_layers))


class CLIPVisionModel(PretrainedModel):
    """CLIP's vision transformer. LLaVA owns and loads it; it is a ``PretrainedModel`` for the
    shared weight-loading hooks (its q/k/v load into one fused projection)."""

    stacked_params = STACKED_QKV

    def __init__(self, config: CLIPVisionConfig):
        super().__init__()
        self.config = config
        self.embeddings = CLIPVisionEmbeddings(config)
        self.pre_layrnorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)  # sic, as CLIP names it
        self.encoder = CLIPEncoder(config)
        self.post_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def layer_index(self, feature_layer: int) -> int:
        """A ``hidden_states`` index (negative counts from the end) as a non-negative one."""
        count = self.config.num_hidden_layers + 1
        if not -count <= feature_layer < count:
            raise ValueError(f"vision feature layer {feature_layer} is out of range for "
                             f"{count} hidden states ({self.config.num_hidden_layers} layers)")
        return feature_layer % count

    def forward(self, pixel_values: torch.Tensor, up_to: int | None = None) -> list[torch.Tensor]:
        """``hidden_states[0 .. up_to]`` (all by default; ``up_to`` may be negative), each
        ``(B, 1 + num_patches, hidden)``; layers after ``up_to`` are not run."""
        last = self.config.num_hidden_layers if up_to is None else self.layer_index(up_to)
        hidden = self.pre_layrnorm(self.embeddings(pixel_values))
        batch, tokens, width = hidden.shape
        cu_seqlens = torch.arange(0, (batch + 1) * tokens, tokens, dtype=torch.int32, device=hidden.device)
        flat = hidden.reshape(batch * tokens, width)
        states = [hidden]
        for layer in self.encoder.layers[:last]:
            flat = layer(flat, cu_seqlens)
            states.append(flat.view(batch, tokens, width))
        return states

    # -- weights (names relative to the tower: "embeddings.…", "encoder.layers.N.…") -------------


