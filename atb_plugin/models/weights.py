"""Reading a checkpoint's safetensors (one file or a sharded index) and loading them into a model.

Models implement ``load_weights(weights) -> set[str]`` (the parameter names they filled, in
their own naming) over ``(hf_name, tensor)`` pairs; ``load_checkpoint`` checks that every
parameter was filled and every checkpoint tensor was used, and names what was not.

``FusedWeights`` is the one loader every model uses: a model maps a checkpoint name to its own
name (``rename``), and projections the model stores fused (``qkv_proj = [q; k; v]``,
``gate_up_proj = [gate; up]``) are filled shard by shard from their separate checkpoint tensors.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

IGNORE = ""  # what a rename function returns for a known checkpoint tensor the model does not use
OLD_ROTARY_BUFFER = re.compile(r".*rotary_emb\.inv_freq$")  # some old checkpoints still carry it

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


def iter_weights(model_dir, dtype: torch.dtype | None = None, progress: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` over every shard, cast to ``dtype`` (floating tensors only)."""
    files = checkpoint_files(model_dir)
    if progress and len(files) > 1:
        from tqdm import tqdm

        files = tqdm(files, desc=f"Loading {Path(model_dir).name}", unit="shard")
    for path in files:
        with safe_open(str(path), framework="pt") as shard:
            for name in shard.keys():
                tensor = shard.get_tensor(name)
                if dtype is not None and tensor.is_floating_point():
                    tensor = tensor.to(dtype)
                yield name, tensor


def copy_param(param: torch.Tensor, tensor: torch.Tensor, name: str) -> None:
    if param.shape != tensor.shape:
        raise WeightLoadingError(f"{name}: checkpoint shape {tuple(tensor.shape)}, model expects {tuple(param.shape)}")
    with torch.no_grad():
        param.copy_(tensor)


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
        self.pattern = re.compile(rf"(.*)\.({leaves})\.(weight|bias)$") if stacked else None

    def target(self, name: str) -> tuple[str, str | None, int] | None:
        """``(parameter name, module prefix or None, shard index)`` that ``name`` fills, or None."""
        match = self.pattern.match(name) if self.pattern else None
        if match:
            prefix, leaf, kind = match.groups()
            fused, shard = self.stacked[leaf]
            target = f"{prefix}.{fused}.{kind}"
            return (target, prefix, shard) if target in self.names else None
        return (name, None, 0) if name in self.names else None

    def accepts(self, own_name: str | None) -> bool:
        return own_name == IGNORE or (own_name is not None and self.target(own_name) is not None)

    def load(self, weights: Iterable[tuple[str, torch.Tensor]], rename: Callable[[str], str | None]) -> set[str]:
        """Copy ``(checkpoint name, tensor)`` pairs in; returns the parameters completely filled."""
        params = dict(self.model.named_parameters())  # the current objects (to_empty replaces them)
        modules = dict(self.model.named_modules())
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
            if prefix is None:
                copy_param(params[target], tensor, name)
                loaded.add(target)
                continue
            sizes = modules[prefix].shard_sizes(target.rsplit(".", 2)[-2])
            copy_param(params[target].narrow(0, sum(sizes[:shard]), sizes[shard]), tensor, name)
            shards_seen.setdefault(target, set()).add(shard)
            if len(shards_seen[target]) == len(sizes):  # filled only once every shard came
                loaded.add(target)
        return loaded


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
