"""Reading a checkpoint's safetensors (one file or a sharded index) and loading them into a model.

Models implement ``load_weights(weights) -> set[str]`` (the parameter names they filled, in
their own naming) over ``(hf_name, tensor)`` pairs; ``load_checkpoint`` checks that every
parameter was filled and every checkpoint tensor was used, and names what was not.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open


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
