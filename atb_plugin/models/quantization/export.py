"""Write a float checkpoint out in msModelSlim's layout (docs/quantization.md, "Exporting")::

    python -m atb_plugin.models.quantization.export MODEL_DIR OUT_DIR --method w8a16|w8a8_dynamic|w8a8 \
        [--keep-float down_proj ...] [--calibration-file TEXT]

OUT_DIR gets ``model.safetensors`` (the language model's decoder projections quantized, every
other tensor as it was), ``quant_model_description.json`` and MODEL_DIR's other files
(config.json, tokenizer, templates) copied. The layers and the weight quantization are the
on-the-fly config's (``quantize.language_model_linears``, ``layers.quantize_weight``), so loading
the export gives the same int8 weights and scales as ``--quantization`` on MODEL_DIR (with float32 weights).

Static W8A8 (``--method w8a8``) also needs each layer's activation range: the float model runs
the calibration text below (``CALIBRATION_TEXT``, a few sentences of plain English written for
this project, or ``--calibration-file``) and each quantized projection records the minimum and
maximum of its inputs; asymmetric per-tensor int8 over that range (``input_scale =
(max - min) / 255``, ``input_offset = round(-128 - min / input_scale)``), ``deq_scale =
input_scale * weight_scale``, ``quant_bias = round(bias / deq_scale) - input_offset * sum_k W_q``.
The projections fused in the model (q/k/v, gate/up) read the same input, so they share one input
scale, which the loader requires. Static W8A8 leaves ``down_proj`` float by default (``--keep-float``):
its input, the SwiGLU product, has outliers that one per-tensor int8 range cannot hold (SmolLM2:
perplexity +59% with it quantized, +0% without; docs/quantization.md, "Quality"), the layer
msModelSlim users roll back too.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors.torch import save_file

from atb_plugin.models.quantization.config import FLOAT, W8A8, W8A8_DYNAMIC, W8A16, QuantConfig, QuantizationError

EXPORT_METHODS = {"w8a16": W8A16, "w8a8_dynamic": W8A8_DYNAMIC, "w8a8": W8A8}
PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")  # the model's names (quantize.py)
DEFAULT_KEEP_FLOAT = {W8A8: ("down_proj",)}
DESCRIPTION_NAME = "quant_model_description.json"

CALIBRATION_TEXT = (
    "The harbour was quiet in the early morning, and the fishing boats rocked gently against the pier. "
    "A baker opened the shutters of her shop and set out loaves of warm bread for the first customers. "
    "Children walked to school along the river, counting the ducks and arguing about numbers: seven, "
    "twelve, one hundred and three. In the library, an old clerk sorted letters by date, from 1887 to 1923, "
    "and wrote short notes in a careful hand. def add(a, b): return a + b  # a small function, for variety. "
    "Question: what is the capital of France? Answer: Paris. The weather turned cold by evening, and the "
    "lamps along the street were lit one by one."
)


def _load_float_model(model_dir: Path):
    from atb_plugin.models import registry  # loaded on use: models import this package

    hf_config = registry.read_checkpoint_config(model_dir)
    model_cls = registry.import_model_class(registry.model_class_path(hf_config, "generate"))
    return model_cls.from_pretrained(model_dir, dtype=torch.float32)


def _calibration_ids(model_dir: Path, text: str, vocab_size: int) -> list[torch.Tensor]:
    """The text's token ids (the checkpoint's tokenizer; ids past the model's vocabulary, which
    only a test checkpoint has, wrapped into it), in chunks of up to 128 tokens."""
    from tokenizers import Tokenizer

    ids = torch.tensor(Tokenizer.from_file(str(model_dir / "tokenizer.json")).encode(text).ids) % vocab_size
    return [chunk for chunk in ids.split(128) if len(chunk) > 1]


def calibrate(model, slots, prompts: list[torch.Tensor]) -> dict[str, tuple[float, float]]:
    """``{module path: (min, max)}`` of each slot's inputs over ``prompts``."""
    from atb_plugin.testing.sequence import SequenceRunner

    ranges: dict[str, tuple[float, float]] = {}
    hooks = []
    for slot in slots:
        def record(module, args, path=slot.path):
            x = args[0].detach()
            low, high = ranges.get(path, (0.0, 0.0))  # 0 always representable: zero stays exact
            ranges[path] = (min(low, float(x.min())), max(high, float(x.max())))
        hooks.append(getattr(slot.parent, slot.name).register_forward_pre_hook(record))
    try:
        for ids in prompts:
            SequenceRunner(model, max_len=len(ids) + 1, block_size=16).step(ids)
    finally:
        for hook in hooks:
            hook.remove()
    return ranges


def static_activation_params(low: float, high: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_scale (1,), input_offset (1,))`` float32 for inputs in ``[low, high]`` (module
    docstring)."""
    scale = max(high - low, 1e-8) / 255.0
    offset = round(-128.0 - low / scale)
    return torch.tensor([scale], dtype=torch.float32), torch.tensor([float(max(-128, min(127, offset)))])


def export(model_dir, out_dir, method: str, calibration_text: str = CALIBRATION_TEXT,
           keep_float: Sequence[str] | None = None) -> QuantConfig:
    """Write ``model_dir`` quantized by ``method`` (``EXPORT_METHODS``) to ``out_dir``;
    ``keep_float``: projections (``PROJECTIONS``) left float, default ``DEFAULT_KEEP_FLOAT``."""
    from atb_plugin.models.weights import iter_weights
    from atb_plugin.models.quantization.layers import quantize_weight
    from atb_plugin.models.quantization.quantize import language_model_linears

    if method not in EXPORT_METHODS:
        raise QuantizationError(f"--method {method!r}: expected one of {', '.join(EXPORT_METHODS)}")
    scheme = EXPORT_METHODS[method]
    keep_float = tuple(DEFAULT_KEEP_FLOAT.get(scheme, ()) if keep_float is None else keep_float)
    unknown = sorted(set(keep_float) - set(PROJECTIONS))
    if unknown:
        raise QuantizationError(f"--keep-float {' '.join(unknown)}: expected some of {', '.join(PROJECTIONS)}")
    model_dir, out_dir = Path(model_dir), Path(out_dir)
    if out_dir.exists() and any(out_dir.iterdir()):
        raise QuantizationError(f"{out_dir} is not empty: give a new directory")
    model = _load_float_model(model_dir)
    slots = [slot for slot in language_model_linears(model) if slot.name not in keep_float]
    paths = {slot.path for slot in slots}
    ranges = {}
    if scheme == W8A8:
        ranges = calibrate(model, slots, _calibration_ids(model_dir, calibration_text,
                                                          model.get_language_model().config.vocab_size))
    def layer_of(name: str) -> tuple[str | None, str]:
        """(quantized module path or None, tensor kind) of checkpoint tensor ``name``."""
        found = model.checkpoint_target(name)
        module, _, kind = (found[0] if found else name).rpartition(".")
        return (module if module in paths else None), kind

    tensors: dict[str, torch.Tensor] = {}
    description: dict[str, str] = {}
    biases: dict[str, torch.Tensor] = {}
    for name, tensor in iter_weights(model_dir, progress=False):
        value = tensor.materialize()
        module, kind = layer_of(name)
        if module is None or kind not in ("weight", "bias"):
            tensors[name], description[name] = value.contiguous(), FLOAT
            continue
        if kind == "bias":
            biases[name] = value
            continue
        base = name[:-len("weight")]
        q, scale = quantize_weight(value)
        entries = {"weight": q, "weight_scale": scale, "weight_offset": torch.zeros_like(scale)}
        if scheme == W8A8:
            input_scale, input_offset = static_activation_params(*ranges[module])
            deq_scale = (input_scale * scale.view(-1)).to(torch.float32)
            entries.update(input_scale=input_scale, input_offset=input_offset, deq_scale=deq_scale,
                           quant_bias=-(input_offset * q.to(torch.float64).sum(dim=1)).to(torch.int64))
        for kind_name, entry in entries.items():
            tensors[base + kind_name], description[base + kind_name] = entry.contiguous(), scheme
    for name, bias in biases.items():
        base = name[:-len("bias")]
        if scheme == W8A8:  # folded into quant_bias (no float bias in a static W8A8 layer)
            folded = torch.round(bias.to(torch.float64) / tensors[base + "deq_scale"].to(torch.float64))
            tensors[base + "quant_bias"] = tensors[base + "quant_bias"] + folded.to(torch.int64)
        else:
            tensors[name], description[name] = bias.contiguous(), scheme
    for name, value in tensors.items():
        if name.endswith(".quant_bias"):
            tensors[name] = value.clamp(-2**31, 2**31 - 1).to(torch.int32)
    out_dir.mkdir(parents=True, exist_ok=True)
    for source in sorted(model_dir.iterdir()):
        # not the weights, their index, another description, nor hidden files (a cache's markers)
        skipped = (source.suffix == ".safetensors" or source.name == "model.safetensors.index.json"
                   or source.name.startswith(("quant_model_description", ".")))
        if source.is_file() and not skipped:
            shutil.copy2(source, out_dir / source.name)
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    config = QuantConfig(scheme, description, out_dir / DESCRIPTION_NAME)
    (out_dir / DESCRIPTION_NAME).write_text(json.dumps(config.to_dict(), indent=2) + "\n")
    return config


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m atb_plugin.models.quantization.export",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("model_dir", type=Path, help="a float safetensors checkpoint")
    parser.add_argument("out_dir", type=Path, help="a new (or empty) directory for the quantized checkpoint")
    parser.add_argument("--method", required=True, choices=tuple(EXPORT_METHODS))
    parser.add_argument("--keep-float", nargs="*", choices=PROJECTIONS, default=None, metavar="PROJECTION",
                        help=f"projections left float ({', '.join(PROJECTIONS)}; default: down_proj for w8a8, "
                             "none otherwise)")
    parser.add_argument("--calibration-file", type=Path,
                        help="w8a8: a UTF-8 text to calibrate the activation scales on (default: a built-in paragraph)")
    args = parser.parse_args(argv)
    text = args.calibration_file.read_text(encoding="utf-8") if args.calibration_file else CALIBRATION_TEXT
    try:
        config = export(args.model_dir, args.out_dir, args.method, text, args.keep_float)
    except (QuantizationError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    quantized = len(config.quantized_weights())
    print(f"{args.out_dir}: {config.model_quant_type}, {quantized} checkpoint weights quantized")
    return 0


if __name__ == "__main__":
    sys.exit(main())
