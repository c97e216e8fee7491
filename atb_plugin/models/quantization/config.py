"""What a checkpoint (or the ``--quantization`` flag) says about low-precision linear layers.

msModelSlim, Ascend's quantization tool, writes its checkpoints as ordinary safetensors plus a
description file beside them, ``quant_model_description*.json``: ``"model_quant_type"`` (the
method of the whole model) and one entry per tensor name, the scheme of the layer that tensor
belongs to (``"W8A16"``, ``"W8A8_DYNAMIC"``, ``"W8A8"``) or ``"FLOAT"`` for a tensor left in
floating point (norms, embeddings, the LM head, layers excluded from quantization). The tensors
each scheme stores, their dtypes and shapes, are in docs/quantization.md.

``QuantConfig`` is that file read and checked; ``resolve_quantization`` reconciles it with the
engine's ``quantization`` flag (an msModelSlim checkpoint is detected, a float checkpoint is
quantized on the fly, a flag that contradicts the checkpoint is an error).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

# Schemes of one layer, msModelSlim's spelling.
W8A16 = "W8A16"
W8A8_DYNAMIC = "W8A8_DYNAMIC"
W8A8 = "W8A8"  # static: calibrated per-tensor activation scale and offset
FLOAT = "FLOAT"
SCHEMES = (W8A16, W8A8_DYNAMIC, W8A8)

# The engine flag (--quantization) and the schemes each value accepts from a checkpoint: "w8a8"
# means int8 activations, dynamic when quantizing on the fly, static or dynamic when the
# checkpoint was calibrated by msModelSlim.
METHODS = ("w8a16", "w8a8")
METHOD_SCHEMES = {"w8a16": (W8A16,), "w8a8": (W8A8_DYNAMIC, W8A8)}
ON_THE_FLY_SCHEME = {"w8a16": W8A16, "w8a8": W8A8_DYNAMIC}

DESCRIPTION_GLOB = "quant_model_description*.json"


class QuantizationError(ValueError):
    """A quantization setting or checkpoint that cannot be served, with the reason."""


def check_method(method: str | None, what: str = "quantization") -> None:
    if method is not None and method not in METHODS:
        raise QuantizationError(f"{what} = {method!r}: expected one of {', '.join(METHODS)} (or None: float)")


def method_of_scheme(scheme: str) -> str:
    return next(method for method, schemes in METHOD_SCHEMES.items() if scheme in schemes)


@dataclass(frozen=True)
class QuantConfig:
    """One msModelSlim description: ``model_quant_type`` and the scheme of every tensor named
    (``tensors``: checkpoint name -> scheme, FLOAT included). ``path``: the file it came from."""

    model_quant_type: str
    tensors: dict[str, str]
    path: Path | None = None

    def __post_init__(self):
        where = self.path or "quant_model_description"
        if self.model_quant_type not in SCHEMES:
            raise QuantizationError(f"{where}: model_quant_type = {self.model_quant_type!r}: expected one of "
                                    f"{', '.join(SCHEMES)} (other msModelSlim types are not supported)")
        for name, scheme in self.tensors.items():
            if scheme not in (*SCHEMES, FLOAT):
                raise QuantizationError(f"{where}: {name} = {scheme!r}: expected one of "
                                        f"{', '.join((*SCHEMES, FLOAT))}")

    @property
    def method(self) -> str:
        """The engine flag this checkpoint corresponds to (``METHODS``)."""
        return method_of_scheme(self.model_quant_type)

    def layer_scheme(self, weight_name: str) -> str:
        """The scheme of the linear layer whose weight is ``weight_name`` (``...q_proj.weight``):
        FLOAT when the description says so or does not name it."""
        return self.tensors.get(weight_name, FLOAT)

    def quantized_weights(self) -> dict[str, str]:
        """``{weight name: scheme}`` of every layer the description marks quantized."""
        return {name: scheme for name, scheme in self.tensors.items()
                if scheme != FLOAT and name.endswith(".weight")}

    @classmethod
    def from_dict(cls, raw: dict, path: Path | None = None) -> "QuantConfig":
        if not isinstance(raw, dict) or "model_quant_type" not in raw:
            raise QuantizationError(f"{path}: not an msModelSlim description (no model_quant_type)")
        tensors = {name: value for name, value in raw.items()
                   if name != "model_quant_type" and isinstance(value, str)}
        return cls(raw["model_quant_type"], tensors, path)

    def to_dict(self) -> dict:
        return {"model_quant_type": self.model_quant_type, **dict(sorted(self.tensors.items()))}


def description_file(model_dir) -> Path | None:
    """The checkpoint's ``quant_model_description*.json``, None when it has none (a float
    checkpoint); two of them is an error (which one applies would be a guess)."""
    found = sorted(Path(model_dir).glob(DESCRIPTION_GLOB))
    if len(found) > 1:
        raise QuantizationError(f"{model_dir}: several msModelSlim descriptions ({', '.join(p.name for p in found)}): "
                                "keep the one that matches the safetensors")
    return found[0] if found else None


def read_quant_config(model_dir) -> QuantConfig | None:
    path = description_file(model_dir)
    if path is None:
        return None
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise QuantizationError(f"{path}: cannot read the msModelSlim description: {exc}") from exc
    return QuantConfig.from_dict(raw, path)


def resolve_quantization(model_dir, method: str | None,
                         quantize_lm_head: bool = False) -> tuple[str | None, QuantConfig | None]:
    """``(method, checkpoint description)`` for ``--quantization method`` on ``model_dir``: the
    checkpoint's method when it is an msModelSlim one (the flag may be omitted, or must agree),
    else the flag (None: float; otherwise the float weights are quantized on the fly).
    ``quantize_lm_head`` (``--quantize-lm-head``) needs the latter: a method and a float checkpoint."""
    check_method(method)
    config = read_quant_config(model_dir)
    if quantize_lm_head and (method is None or config is not None):
        raise QuantizationError(
            "quantize_lm_head quantizes a float checkpoint's LM head on the fly: it needs quantization = 'w8a16' "
            "or 'w8a8'" + (f" and a float checkpoint ({config.path.name} already says which layers are int8)"
                           if config is not None else ""))
    if config is None:
        return method, None
    if method is not None and method != config.method:
        raise QuantizationError(
            f"quantization = {method!r} but {config.path.name} describes an msModelSlim {config.model_quant_type} "
            f"checkpoint ({config.method}): drop --quantization or pass --quantization {config.method}")
    return config.method, config
