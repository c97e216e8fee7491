"""The quantized linear ops (atb_plugin/ops/quant.py, docs/quantization.md): each kernel against a
float64 reference of its own formula, on the CPU's torch kernels and on the simulated NPU
(npu_kernels over the fake torch_npu); the exact int8 product; shape errors."""

from __future__ import annotations

import pytest
import torch

from atb_plugin import ops
from atb_plugin.ops import torch_kernels

GEN = torch.Generator().manual_seed(0)


def rand(*shape, dtype=torch.float32, scale=1.0):
    return (torch.randn(*shape, generator=GEN) * scale).to(dtype)


def int8(*shape):
    return torch.randint(-127, 128, shape, generator=GEN, dtype=torch.int8)


def case(out_features=48, in_features=80, tokens=7):
    return {
        "x": rand(2, tokens, in_features),
        "weight": int8(out_features, in_features),
        "scale": rand(out_features).abs() / 100 + 1e-3,
        "offset": rand(out_features).round(),
        "bias": rand(out_features),
    }


# -- float64 references of each formula --------------------------------------------------------


def ref_w8a16(x, weight, scale, offset, bias):
    w = (weight.double() + (0 if offset is None else offset.double()[:, None])) * scale.double()[:, None]
    y = x.double() @ w.t()
    return y if bias is None else y + bias.double()


def ref_w8a8_dynamic(x, weight, weight_scale, bias):
    rows = x.double().reshape(-1, x.shape[-1])
    s = rows.abs().amax(-1) / 127
    s = torch.where(s > 0, s, torch.ones_like(s))
    q = torch.clamp(torch.round(rows / s[:, None]), -128, 127)
    y = (q @ weight.double().t()) * s[:, None] * weight_scale.double()[None, :]
    y = y if bias is None else y + bias.double()
    return y.reshape(*x.shape[:-1], -1)


def ref_w8a8_static(x, weight, input_scale, input_offset, deq_scale, quant_bias):
    q = torch.clamp(torch.round(x.double() * (1 / input_scale.double()) + input_offset.double()), -128, 127)
    return (q @ weight.double().t() + quant_bias.double()) * deq_scale.double()


def static_case(out_features=48, in_features=80):
    c = case(out_features, in_features)
    input_scale = torch.tensor([0.02])
    return c["x"], c["weight"], input_scale, torch.tensor([3.0]), (input_scale * c["scale"]).float(), \
        torch.randint(-5000, 5000, (out_features,), generator=GEN, dtype=torch.int32)


def rel_err(got, want) -> float:
    return float((got.double() - want).abs().max() / want.abs().max())


# Bounds: float32 accumulation of O(100) terms (~1e-6 relative) for W8A16; the W8A8 kernels round
# to int8 exactly like the reference and multiply exactly, so only the float32 rescale differs
# (the reference runs the same rounding in float64: a value within 1 ulp of .5 could round the
# other way, ~never with these inputs). Half precision outputs: their own rounding (2^-8, 2^-11).
BOUND = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}


@pytest.fixture(params=["torch", "auto"])
def cpu_kernels(request, monkeypatch):
    """Both CPU paths of the kernels: the torch formulas and (auto, where they build) the native
    int8 kernels they hand over to (ops/cpu_native.py)."""
    monkeypatch.setenv("ATB_PLUGIN_CPU_KERNELS", request.param)
    return request.param


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("with_offset_bias", [True, False])
def test_w8a16_matches_float64_reference(dtype, with_offset_bias, cpu_kernels):
    c = case()
    offset, bias = (c["offset"], c["bias"]) if with_offset_bias else (None, None)
    x = c["x"].to(dtype)
    got = ops.w8a16_linear(x, c["weight"], c["scale"], offset, bias)
    assert got.dtype == dtype and got.shape == (2, 7, 48)
    assert rel_err(got, ref_w8a16(x, c["weight"], c["scale"], offset, bias)) < BOUND[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_w8a8_dynamic_matches_float64_reference(dtype, cpu_kernels):
    c = case()
    x = c["x"].to(dtype)
    x[0, 3] = 0  # an all-zero token: guarded scale, output = bias
    got = ops.w8a8_dynamic_linear(x, c["weight"], c["scale"], c["bias"])
    want = ref_w8a8_dynamic(x, c["weight"], c["scale"], c["bias"])
    assert got.dtype == dtype and rel_err(got, want) < BOUND[dtype]
    assert torch.allclose(got[0, 3].float(), c["bias"].to(dtype).float())


def test_w8a8_static_matches_float64_reference():
    args = static_case()
    got = ops.w8a8_static_linear(*args)
    assert got.shape == (2, 7, 48) and rel_err(got, ref_w8a8_static(*args)) < BOUND[torch.float32]


def test_int8_matmul_is_exact_past_float32_integer_range():
    # All +127 x +127 over 3000 columns: 48,387,000 > 2^24, where one float32 GEMM would round.
    q = torch.full((3, 3000), 127, dtype=torch.int8)
    w = torch.full((5, 3000), 127, dtype=torch.int8)
    w[1] = -128
    out = torch_kernels.int8_matmul(q, w)
    assert out.dtype == torch.int32
    assert torch.equal(out.long(), q.long() @ w.long().t())
    q, w = int8(9, 2500), int8(17, 2500)
    assert torch.equal(torch_kernels.int8_matmul(q, w).long(), q.long() @ w.long().t())


def test_quantized_ops_check_shapes():
    c = case()
    with pytest.raises(ValueError, match="weight must be int8"):
        ops.w8a16_linear(c["x"], c["weight"].float(), c["scale"], None, None)
    with pytest.raises(ValueError, match="does not fit weight"):
        ops.w8a8_dynamic_linear(c["x"][..., :-1], c["weight"], c["scale"], None)
    with pytest.raises(ValueError, match=r"scale \(47,\) must be \(48,\)"):
        ops.w8a16_linear(c["x"], c["weight"], c["scale"][:-1], None, None)
    x, weight, _, offset, deq, qbias = static_case()
    with pytest.raises(ValueError, match="input_scale .*per-tensor"):
        ops.w8a8_static_linear(x, weight, torch.ones(2), offset, deq, qbias)


# -- the simulated NPU (npu_kernels over the fake torch_npu) -------------------------------------

def kernel_set_with_quant_ops(name: str):
    import importlib

    from atb_plugin.platform.npu import KERNEL_SETS

    module = importlib.import_module(KERNEL_SETS[name])
    missing = [op for op in ("w8a16_linear", "w8a8_dynamic_linear", "w8a8_static_linear") if not hasattr(module, op)]
    return pytest.param(name, marks=pytest.mark.skipif(bool(missing), reason=f"{module.__name__} lacks {missing}"))


NPU_KERNEL_SETS = [kernel_set_with_quant_ops(name) for name in ("atb", "fia")]


@pytest.mark.parametrize("kernel_set", NPU_KERNEL_SETS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_simulated_npu_quantized_linears_match_references(fake_npu, dtype, kernel_set, monkeypatch):
    from atb_plugin.platform import use_platform

    monkeypatch.setenv("ATB_PLUGIN_NPU_KERNELS", kernel_set)
    c = case()
    x = c["x"].to(dtype)
    static = static_case()
    with use_platform("npu"):
        w8a16 = ops.w8a16_linear(x, c["weight"], c["scale"], c["offset"], c["bias"])
        dynamic = ops.w8a8_dynamic_linear(x, c["weight"], c["scale"], c["bias"])
        static_out = ops.w8a8_static_linear(static[0].to(dtype), *static[1:])
    assert w8a16.dtype == dynamic.dtype == static_out.dtype == dtype
    assert rel_err(w8a16, ref_w8a16(x, c["weight"], c["scale"], c["offset"], c["bias"])) < BOUND[dtype]
    assert rel_err(dynamic, ref_w8a8_dynamic(x, c["weight"], c["scale"], c["bias"])) < 2 * BOUND[dtype]
    # The NPU quantizes x as given (half precision), the reference the same half values in float64.
    assert rel_err(static_out, ref_w8a8_static(static[0].to(dtype), *static[1:])) < 2 * BOUND[dtype]
    assert {"npu_weight_quant_batchmatmul", "npu_dynamic_quant", "npu_quant_matmul", "npu_quantize"} <= set(
        fake_npu.module.calls)


@pytest.mark.parametrize("kernel_set", NPU_KERNEL_SETS[:1])  # check_simulated_npu's blocks of 16: the ATB set
@pytest.mark.parametrize("method", ["w8a16", "w8a8_dynamic", "w8a8"])
def test_simulated_npu_runs_quantized_models_like_the_cpu(method, kernel_set, clean_platform, monkeypatch,
                                                          tmp_path):
    """A tiny Qwen2 exported by the tool: the CPU in float32 against the simulated NPU in
    bfloat16 (every attention path), the quantized layers on both (check_simulated_npu). The FIA
    set runs the same quantized linears (the test above)."""
    from routers import get_router

    from atb_plugin.models.quantization.export import export
    from atb_plugin.testing.sequence import check_simulated_npu
    from atb_plugin.testing.tiny import tiny_checkpoint

    monkeypatch.setenv("ATB_PLUGIN_NPU_KERNELS", kernel_set)
    path = tmp_path / method
    export(tiny_checkpoint("qwen2"), path, method)
    model = get_router(path).model_cls.from_pretrained(path)
    ids = torch.randint(0, model.config.vocab_size, (40,), generator=torch.Generator().manual_seed(2))
    calls = check_simulated_npu(model, ids, torch.bfloat16, 0.05)  # the tolerance of tests/test_qwen3.py
    matmul = "npu_weight_quant_batchmatmul" if method == "w8a16" else "npu_quant_matmul"
    assert calls[matmul] > 0
