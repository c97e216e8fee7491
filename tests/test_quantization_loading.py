"""Quantized checkpoints (docs/quantization.md): msModelSlim descriptions read and checked, the
export tool's checkpoints loaded on every decoder family, bit-identical to the same float
checkpoint quantized on the fly, which layers are quantized, and clear errors for bad input."""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from atb_plugin.models.weights import WeightLoadingError
from atb_plugin.models.quantization import QuantizationError, read_quant_config, resolve_quantization
from atb_plugin.models.quantization.config import QuantConfig
from atb_plugin.models.quantization.export import export, main as export_main
from atb_plugin.models.quantization.layers import QuantLinear
from atb_plugin.models.quantization.w8a8_static import W8A8StaticLinear
from atb_plugin.testing.sequence import SequenceRunner
from atb_plugin.testing.tiny import tiny_checkpoint

DENSE = ["qwen2", "llama", "qwen3", "qwen_vl", "qwen2_vl", "qwen2_5_vl", "llava", "qwen2_audio"]
MOE = ["qwen3_moe", "qwen2_moe"]
ON_THE_FLY = {"w8a16": "w8a16", "w8a8_dynamic": "w8a8"}  # export method -> the engine flag


@pytest.fixture(scope="module")
def workdir():
    with tempfile.TemporaryDirectory(prefix="atb-quant-test-") as path:
        yield Path(path)


def model_class(path):
    from routers import get_router

    return get_router(path).model_cls


def load(path, **kwargs):
    return model_class(path).from_pretrained(path, **kwargs)


def exported(workdir: Path, family: str, method: str) -> Path:
    out = workdir / f"{family}-{method}"
    if not out.exists():
        export(tiny_checkpoint(family), out, method)
    return out


def text_logits(model) -> torch.Tensor:
    """Prefill, a chunk, two decodes (the paged path's three kinds of step)."""
    ids = torch.randint(0, 500, (13,), generator=torch.Generator().manual_seed(0))
    runner = SequenceRunner(model, 32, block_size=4)
    return torch.cat([runner.step(ids[a:b]) for a, b in [(0, 5), (5, 11), (11, 12), (12, 13)]]).float()


# -- the description file ----------------------------------------------------------------------


def test_description_is_read_and_validated(tmp_path):
    assert read_quant_config(tmp_path) is None
    (tmp_path / "quant_model_description_w8a8.json").write_text(json.dumps(
        {"model_quant_type": "W8A8_DYNAMIC", "a.weight": "W8A8_DYNAMIC", "b.weight": "FLOAT", "version": 1}))
    config = read_quant_config(tmp_path)
    assert config.method == "w8a8" and config.quantized_weights() == {"a.weight": "W8A8_DYNAMIC"}
    assert config.layer_scheme("b.weight") == "FLOAT" and config.layer_scheme("c.weight") == "FLOAT"
    (tmp_path / "quant_model_description.json").write_text("{}")
    with pytest.raises(QuantizationError, match="several msModelSlim descriptions"):
        read_quant_config(tmp_path)
    with pytest.raises(QuantizationError, match="model_quant_type = 'W4A8'"):
        QuantConfig("W4A8", {})
    with pytest.raises(QuantizationError, match="a.weight = 'INT4'"):
        QuantConfig("W8A16", {"a.weight": "INT4"})
    with pytest.raises(QuantizationError, match="quantization = 'int4': expected one of w8a16, w8a8"):
        resolve_quantization(tiny_checkpoint("qwen2"), "int4")


# -- every family: export == on the fly, and close to float ----------------------------------------


@pytest.mark.parametrize("method", ["w8a16", "w8a8_dynamic"])
@pytest.mark.parametrize("family", DENSE + MOE)
def test_export_and_on_the_fly_give_identical_weights(workdir, family, method):
    from_export = load(exported(workdir, family, method)).state_dict()
    on_the_fly = load(tiny_checkpoint(family), quantization=ON_THE_FLY[method]).state_dict()
    assert from_export.keys() == on_the_fly.keys()
    different = [name for name in from_export if not torch.equal(from_export[name], on_the_fly[name])]
    assert not different
    scales = [name for name in from_export if name.endswith("weight_scale")]
    assert scales and all(from_export[name].dtype == torch.float32 for name in scales)


@pytest.mark.parametrize("method", ["w8a16", "w8a8_dynamic", "w8a8"])
@pytest.mark.parametrize("family", DENSE)
def test_quantized_checkpoint_logits_stay_close_to_float(workdir, family, method):
    reference = text_logits(load(tiny_checkpoint(family)))
    quantized = load(exported(workdir, family, method))
    got = text_logits(quantized)
    # Random tiny weights, int8 per channel: the largest logit error seen is ~7% of the largest
    # logit (static W8A8 with its calibrated per-tensor activations the worst).
    assert float((got - reference).abs().max() / reference.abs().max()) < 0.15
    layers = quantized.get_language_model().config.num_hidden_layers
    per_layer = 3 if method == "w8a8" else 4  # static W8A8 keeps down_proj float (export.py)
    assert sum(isinstance(m, QuantLinear) for m in quantized.modules()) == per_layer * layers


@pytest.mark.parametrize("family", DENSE + MOE)
def test_only_language_model_projections_are_quantized(family):
    model = load(tiny_checkpoint(family), quantization="w8a16")
    quantized = {name for name, module in model.named_modules() if isinstance(module, QuantLinear)}
    assert quantized and all(".layers." in name and name.rpartition(".")[2] in
                             ("qkv_proj", "o_proj", "gate_up_proj", "down_proj") for name in quantized)
    language_model = model.get_language_model()
    assert not any(isinstance(m, QuantLinear) for m in language_model.model.embed_tokens.modules())
    assert language_model.lm_head is None or type(language_model.lm_head) is torch.nn.Linear
    # vision / audio towers, projectors and MoE blocks keep float linears
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            assert name not in quantized


def test_scales_stay_float32_in_a_bfloat16_model(workdir):
    path = exported(workdir, "qwen2", "w8a16")
    model = load(path, dtype=torch.bfloat16)
    layer = model.model.layers[0].self_attn.qkv_proj
    tensors = load_file(str(path / "model.safetensors"))
    assert layer.weight.dtype == torch.int8 and layer.bias.dtype == torch.bfloat16
    assert layer.weight_scale.dtype == torch.float32
    q_rows = tensors["model.layers.0.self_attn.q_proj.weight_scale"]
    assert torch.equal(layer.weight_scale[:q_rows.shape[0]], q_rows)  # not rounded through bfloat16


def test_static_checkpoint_fp16_layout_int64_deq_scale(workdir, tmp_path):
    """msModelSlim writes deq_scale as int64 (float32 bits) for float16 models: same results."""
    path = exported(workdir, "qwen2", "w8a8")
    copy = tmp_path / "int64"
    shutil.copytree(path, copy)
    tensors = load_file(str(copy / "model.safetensors"))
    for name in [n for n in tensors if n.endswith(".deq_scale")]:
        tensors[name] = tensors[name].view(torch.int32).to(torch.int64)
    save_file(tensors, str(copy / "model.safetensors"))
    as_int64 = load(copy)
    assert as_int64.model.layers[0].mlp.gate_up_proj.deq_scale.dtype == torch.int64
    assert torch.equal(text_logits(as_int64), text_logits(load(path)))


def test_static_layers_share_one_input_scale_per_fused_projection(workdir):
    model = load(exported(workdir, "qwen2", "w8a8"))
    layer = model.model.layers[0].self_attn.qkv_proj
    assert isinstance(layer, W8A8StaticLinear) and layer.input_scale.shape == (1,) and layer.bias is None
    assert type(model.model.layers[0].mlp.down_proj) is torch.nn.Linear  # the export's default rollback


# -- bad input ---------------------------------------------------------------------------------


def edited_copy(source: Path, target: Path, edit_tensors=None, edit_description=None) -> Path:
    shutil.copytree(source, target)
    if edit_tensors:
        tensors = load_file(str(target / "model.safetensors"))
        edit_tensors(tensors)
        save_file(tensors, str(target / "model.safetensors"))
    if edit_description:
        path = target / "quant_model_description.json"
        description = json.loads(path.read_text())
        edit_description(description)
        path.write_text(json.dumps(description))
    return target


def test_description_naming_a_missing_tensor_is_a_clear_error(workdir, tmp_path):
    path = edited_copy(exported(workdir, "qwen2", "w8a16"), tmp_path / "c",
                       edit_description=lambda d: d.update({"model.layers.9.mlp.up_proj.weight": "W8A16"}))
    with pytest.raises(QuantizationError, match="names tensors the checkpoint does not have: "
                                                "model.layers.9.mlp.up_proj.weight"):
        load(path)


def test_quantized_layer_without_its_scales_is_a_clear_error(workdir, tmp_path):
    path = edited_copy(exported(workdir, "qwen2", "w8a16"), tmp_path / "c",
                       edit_tensors=lambda t: t.pop("model.layers.0.mlp.up_proj.weight_scale"),
                       edit_description=lambda d: d.pop("model.layers.0.mlp.up_proj.weight_scale"))
    with pytest.raises(QuantizationError, match="up_proj.weight is marked W8A16 but the checkpoint lacks "
                                                "model.layers.0.mlp.up_proj.weight_scale"):
        load(path)


def test_fused_pieces_with_different_schemes_or_input_scales_are_refused(workdir, tmp_path):
    def float_k(d):
        d["model.layers.0.self_attn.k_proj.weight"] = "FLOAT"

    with pytest.raises(QuantizationError, match="k_proj.weight is FLOAT but the other pieces of its fused layer model.layers.0.self_attn.qkv_proj"):
        load(edited_copy(exported(workdir, "qwen2", "w8a16"), tmp_path / "a", edit_description=float_k))

    def other_scale(t):
        t["model.layers.1.self_attn.v_proj.input_scale"] = t["model.layers.1.self_attn.v_proj.input_scale"] * 2

    with pytest.raises(WeightLoadingError, match="v_proj.input_scale .* differs from the other pieces"):
        load(edited_copy(exported(workdir, "qwen2", "w8a8"), tmp_path / "b", edit_tensors=other_scale))


def test_flag_that_contradicts_the_checkpoint_is_a_clear_error(workdir):
    path = exported(workdir, "qwen2", "w8a16")
    with pytest.raises(QuantizationError, match="quantization = 'w8a8' but quant_model_description.json "
                                                "describes an msModelSlim W8A16 checkpoint"):
        load(path, quantization="w8a8")
    assert resolve_quantization(path, None)[0] == resolve_quantization(path, "w8a16")[0] == "w8a16"
    assert resolve_quantization(exported(workdir, "qwen2", "w8a8"), "w8a8")[0] == "w8a8"


def test_export_tool_command_line(tmp_path, capsys):
    assert export_main([str(tiny_checkpoint("llama")), str(tmp_path / "out"), "--method", "w8a8_dynamic"]) == 0
    assert "W8A8_DYNAMIC, 14 checkpoint weights quantized" in capsys.readouterr().out
    names = {p.name for p in (tmp_path / "out").iterdir()}
    assert {"config.json", "tokenizer.json", "model.safetensors", "quant_model_description.json"} <= names
    assert export_main([str(tiny_checkpoint("llama")), str(tmp_path / "out"), "--method", "w8a8_dynamic"]) == 2
    assert "is not empty" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        export_main([str(tiny_checkpoint("llama")), str(tmp_path / "x"), "--method", "int4"])
    assert export_main([str(tiny_checkpoint("llama")), str(tmp_path / "all"), "--method", "w8a8",
                        "--keep-float"]) == 0  # nothing kept float: q, k, v, o, gate, up, down of 2 layers
    assert "W8A8, 14 checkpoint weights quantized" in capsys.readouterr().out
