"""Reading a checkpoint's safetensors (one file or a sharded index) and loading them into a model.

Models implement ``load_weights(weights) -> set[str]`` (the parameter names they filled, in
their own naming) over ``(hf_name, tensor)`` pairs; ``load_checkpoint`` checks that every
parameter was filled and every checkpoint tensor was used, and names what was not.

``FusedWeights`` is the one loader every model uses: a model maps a checkpoint name to its own
name (``rename``), and projections the model stores fused (``qkv_proj = [q; k; v]``,
``gate_up_proj = [gate; up]``) are filled shard by shard from their separate checkpoint tensors.

Tensor parallelism: a module whose parameters are sharded across ranks says which part of each
checkpoint tensor this rank holds (``ShardedWeights.tp_shard``), and only that part is read from
the file (``CheckpointTensor.narrow``: safetensors reads the slice, never the whole tensor).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Protocol, runtime_checkable

import torch
from safetensors import safe_open
from torch import nn

from atb_plugin.distributed import TPShard, tp_size
from atb_plugin.models.quantization.layers import FLOAT32_KINDS, PER_TENSOR_KINDS, QUANT_KINDS, quant_tp_shard

IGNORE = ""  # what a rename function returns for a known checkpoint tensor the model does not use
OLD_ROTARY_BUFFER = re.compile(r".*rotary_emb\.inv_freq$")  # some old checkpoints still carry it

# The rows of a LLaVA-style checkpoint's prefix table after its tower's (LLaVA, Qwen2-Audio): the
# projector and the language model, as published and as transformers 5 re-saves them (under ``model.``).
PROJECTOR_AND_LANGUAGE_MODEL_PREFIXES = (
    ("multi_modal_projector.", "multi_modal_projector."),
    ("model.multi_modal_projector.", "multi_modal_projector."),
    ("language_model.model.", "language_model.model."),
    ("model.language_model.", "language_model.model."),
    ("language_model.lm_head.", "language_model.lm_head."),
    ("lm_head.", "language_model.lm_head."),
)


def prefixed_name(name: str, prefixes, tied_lm_head: bool) -> str | None:
    """A multimodal model's own name for checkpoint tensor ``name``: the first ``(checkpoint
    prefix, own prefix)`` of ``prefixes`` it starts with, renamed; ``IGNORE`` for the language
    model's rotary buffers of old checkpoints and, when ``tied_lm_head``, its LM head; None when no
    prefix matches."""
    for prefix, own in prefixes:
        if name.startswith(prefix):
            full = own + name[len(prefix):]
            if full.startswith("language_model.") and (
                    OLD_ROTARY_BUFFER.match(full) or (full == "language_model.lm_head.weight" and tied_lm_head)):
                return IGNORE
            return full
    return None


# Checkpoint projection leaf -> (fused parameter leaf, shard index): decoders and encoders alike.
STACKED_QKV = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2)}
STACKED_QKV_GATE_UP = {**STACKED_QKV, "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}


class WeightLoadingError(ValueError):
    """The checkpoint and the model disagree: missing or unexpected parameters, wrong shapes."""


def checkpoint_files(model_dir) -> list[Path]:
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [model_dir / name for name in sorted(set(weight_map.values()))]
    single = model_dir / "model.safetensors"
    if single.exists():
        return [single]
    raise FileNotFoundError(f"{model_dir} has no model.safetensors or model.safetensors.index.json")


class CheckpointTensor:
    """One tensor of a safetensors file, not read yet: ``narrow`` reads only a slice (a
    tensor-parallel rank's part), ``materialize`` the whole; both cast floating tensors to
    ``dtype``. Valid while ``iter_weights`` is at it (the file is open then)."""

    def __init__(self, name: str, source, dtype: torch.dtype | None):
        self.name, self._source, self._dtype = name, source, dtype
        self.shape = torch.Size(source.get_shape())

    def _cast(self, tensor: torch.Tensor) -> torch.Tensor:
        # Quantization scales keep their precision (float32 parameters: docs/quantization.md).
        if self._dtype is None or not tensor.is_floating_point() or self.name.rpartition(".")[2] in FLOAT32_KINDS:
            return tensor
        return tensor.to(self._dtype)

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        index = tuple([slice(None)] * dim + [slice(start, start + length)])
        return self._cast(self._source[index])

    def materialize(self) -> torch.Tensor:
        return self._cast(self._source[:]) if self.shape else self._cast(self._source[()])

    def __getitem__(self, index) -> torch.Tensor:
        return self.materialize()[index]


def materialize(tensor) -> torch.Tensor:
    """A checkpoint tensor read whole (a ``CheckpointTensor``), or ``tensor`` as it is."""
    return tensor.materialize() if isinstance(tensor, CheckpointTensor) else tensor


@runtime_checkable
class ShardedWeights(Protocol):
    """A module holding tensor-parallel shards of its parameters (or of its child linears').

    ``tp_shard(leaf, kind, shard)``: the part of checkpoint tensor ``<leaf>.<kind>`` (the
    ``shard``-th piece of a fused leaf such as ``qkv_proj``, else None) this rank holds; None
    when it holds the whole tensor (replicated). A module that owns a fused leaf also answers
    ``checkpoint_shard_sizes(fused)``: the rows of each piece in the checkpoint (all ranks
    together), for checkpoints that store the fused tensor whole (Qwen-VL's ``c_attn``)."""

    def tp_shard(self, leaf: str, kind: str, shard: int | None) -> TPShard | None: ...


def iter_weights(model_dir, dtype: torch.dtype | None = None, progress: bool = True) -> Iterator[tuple[str, CheckpointTensor]]:
    """``(name, tensor)`` over every shard, lazily (``CheckpointTensor``): floating tensors are
    cast to ``dtype`` as they are read."""
    files = checkpoint_files(model_dir)
    if progress and len(files) > 1:
        from tqdm import tqdm

        files = tqdm(files, desc=f"Loading {Path(model_dir).name}", unit="shard")
    for path in files:
        with safe_open(str(path), framework="pt") as shard:
            for name in shard.keys():
                yield name, CheckpointTensor(name, shard.get_slice(name), dtype)


def copy_param(param: torch.Tensor, tensor, name: str, shard: TPShard | None = None) -> None:
    """Fill ``param`` from a checkpoint tensor, or with this rank's ``shard`` of it."""
    if shard is None:
        tensor = materialize(tensor)
        if param.shape != tensor.shape:
            raise WeightLoadingError(f"{name}: checkpoint shape {tuple(tensor.shape)}, model expects {tuple(param.shape)}")
        with torch.no_grad():
            param.copy_(tensor)
        return
    with torch.no_grad():
        if shard.zero:
            param.zero_()
            return
        if shard.start + shard.length > tensor.shape[shard.dim]:
            raise WeightLoadingError(f"{name}: checkpoint shape {tuple(tensor.shape)} is too small for rows "
                                     f"[{shard.start}, {shard.start + shard.length}) of dimension {shard.dim}")
        copy_param(param.narrow(shard.dim, 0, shard.length), tensor.narrow(shard.dim, shard.start, shard.length), name)
        padding = param.shape[shard.dim] - shard.length
        if padding:  # the padded tail of the last vocabulary shard
            param.narrow(shard.dim, shard.length, padding).zero_()


class FusedWeights:
    """Maps a model-side name to the parameter (or shard of a fused parameter) it fills.

    ``stacked`` maps a projection's leaf name to ``(fused leaf name, shard index)``, e.g.
    ``{"q_proj": ("qkv_proj", 0), ...}``; the module holding the fused parameter answers
    ``shard_sizes(fused)`` (rows per shard, in shard order)."""

    def __init__(self, model: nn.Module, stacked: dict[str, tuple[str, int]]):
        self.model = model
        self.names = {name for name, _ in model.named_parameters()}  # stable across to_empty()
        self.stacked = stacked
        leaves = "|".join(re.escape(leaf) for leaf in stacked)
        kinds = "|".join(("weight", "bias", *QUANT_KINDS))  # quantized layers' tensors: docs/quantization.md
        self.pattern = re.compile(rf"(.*)\.({leaves})\.({kinds})$") if stacked else None

    def target(self, name: str) -> tuple[str, str | None, int] | None:
        """``(parameter name, module prefix or None, shard index)`` that ``name`` fills, or None."""
        match = self.pattern.match(name) if self.pattern else None
        if match:
            prefix, leaf, kind = match.groups()
            fused, shard = self.stacked[leaf]
            target = f"{prefix}.{fused}.{kind}"
            if target in self.names:
                return target, prefix, shard
            # A module that keeps the projection unfused (Qwen2-Audio's encoder: k without a
            # bias) holds it under its own name.
        return (name, None, 0) if name in self.names else None

    def accepts(self, own_name: str | None) -> bool:
        return own_name == IGNORE or (own_name is not None and self.target(own_name) is not None)

    def load(self, weights: Iterable[tuple[str, torch.Tensor]], rename: Callable[[str], str | None]) -> set[str]:
        """Copy ``(checkpoint name, tensor)`` pairs in; returns the parameters completely filled."""
        params = dict(self.model.named_parameters())  # the current objects (to_empty replaces them)
        modules = dict(self.model.named_modules())
        fused_leaves = {fused for fused, _ in self.stacked.values()}
        sharded = tp_size() > 1
        loaded: set[str] = set()
        shards_seen: dict[str, set[int]] = {}
        for name, tensor in weights:
            own = rename(name)
            if own == IGNORE:
                continue
            found = self.target(own) if own is not None else None
            if found is None:
                raise WeightLoadingError(f"{name}: no such parameter in {type(self.model).__name__}")
            target, prefix, shard = found
            owner_name, _, leaf_kind = target.rpartition(".")
            owner_name, _, leaf = owner_name.rpartition(".")
            owner = modules[owner_name]
            owner = owner if sharded and isinstance(owner, ShardedWeights) else None
            if prefix is None and owner is not None and leaf in fused_leaves:
                # A fused projection stored whole (Qwen-VL's c_attn): this rank's part of each piece.
                sizes, offset = owner.checkpoint_shard_sizes(leaf), 0
                for index, size in enumerate(sizes):
                    piece = tensor if leaf_kind in PER_TENSOR_KINDS else tensor.narrow(0, offset, size)
                    self._copy_piece(params[target], modules[owner_name], leaf, leaf_kind, index, piece, owner, name,
                                     first=index == 0)
                    offset += size
                loaded.add(target)
            elif prefix is None:
                copy_param(params[target], tensor, name,
                           quant_tp_shard(owner.tp_shard, leaf, leaf_kind, None) if owner else None)
                loaded.add(target)
            else:
                self._copy_piece(params[target], modules[prefix], leaf, leaf_kind, shard, tensor, owner, name,
                                 first=not shards_seen.get(target))
                shards_seen.setdefault(target, set()).add(shard)
                if len(shards_seen[target]) == len(modules[prefix].shard_sizes(leaf)):  # once every shard came
                    loaded.add(target)
        return loaded

    @staticmethod
    def _copy_piece(param, module, leaf: str, kind: str, index: int, tensor, owner, name: str,
                    first: bool = True) -> None:
        """Fill piece ``index`` of fused parameter ``param`` (rows ``shard_sizes`` of this rank).
        A per-tensor quantization scale is one value for the fused layer: the first piece to come
        sets it, the others must hold the same (docs/quantization.md)."""
        if kind in PER_TENSOR_KINDS:
            value = materialize(tensor)
            if first:
                copy_param(param, value, name)
            elif not torch.equal(param.detach().cpu(), value.reshape(param.shape).to(param.dtype).cpu()):
                raise WeightLoadingError(f"{name} = {value.flatten().tolist()} differs from the other pieces of the "
                                         f"fused {leaf} ({param.flatten().tolist()}): static W8A8 needs one "
                                         "input scale and offset per fused layer")
            return
        sizes = module.shard_sizes(leaf)
        piece = param.narrow(0, sum(sizes[:index]), sizes[index])
        copy_param(piece, tensor, name, quant_tp_shard(owner.tp_shard, leaf, kind, index) if owner is not None else None)


def load_checkpoint(model: torch.nn.Module, model_dir, dtype: torch.dtype | None = None) -> None:
    """Fill ``model`` from ``model_dir``; raise ``WeightLoadingError`` naming missing/unexpected names."""
    unexpected: list[str] = []

    def tracked() -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in iter_weights(model_dir, dtype):
            if model.accepts_weight(name):
                yield name, tensor
            else:
                unexpected.append(name)

    loaded = model.load_weights(tracked())
    missing = sorted(set(dict(model.named_parameters())) - loaded)
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing from the checkpoint: {', '.join(missing[:10])}" + (" ..." if len(missing) > 10 else ""))
        if unexpected:
            parts.append(f"not used by the model: {', '.join(sorted(unexpected)[:10])}" + (" ..." if len(unexpected) > 10 else ""))
        raise WeightLoadingError(f"{model_dir}: " + "; ".join(parts))
