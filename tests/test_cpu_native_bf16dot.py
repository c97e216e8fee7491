"""The bfloat16 panels' dot-product kernel (csrc/isa_avx512_bf16.c: ``vdpbf16ps``; its plain-C
reference in isa_portable.c) against float64, through ``cpu_native.linear_bf16(..., dot_rows)``,
``PanelLinear.dot_rows`` and the captured decode step.

Bounds (against float64 of the bfloat16-rounded weights, relative to ``|x| @ |W|.T + |bias|``):
- bfloat16 x: the products are exact, the sums float32: 1e-5 (tests/test_cpu_native_lowp.py's
  float32 bound), plus 2^-8 of the exact value for a bfloat16 result;
- float32 x below ``DOT_SPLIT_ROWS`` rows: split into a bfloat16 part and remainder, carried to
  2^-18 of itself: 1e-5 as well;
- float32 x from ``DOT_SPLIT_ROWS`` rows on: rounded to bfloat16 (2^-9 of each product): 2^-8.
The AVX-512 BF16 tests run where the probe saw those instructions execute and skip with the reason
elsewhere; the portable reference runs everywhere the library builds.
"""

from __future__ import annotations

import pytest
import torch

from atb_plugin.ops import cpu_native
from atb_plugin.ops.packed_linear import PanelLinear
from tests.test_cpu_native_lowp import _gen, _within

SHAPES = ((100, 77), (67, 33), (576, 131), (40, 64))  # (in, out): in odd or even, out not whole panels


def _found() -> dict[str, bool]:
    return cpu_native.features() if cpu_native.linear_library(torch.device("cpu")) is not None else {}


HARDWARE = pytest.param("avx512_bf16", id="avx512_bf16", marks=pytest.mark.skipif(
    not (_found().get("avx512") and _found().get("avx512_bf16")),
    reason="avx512_bf16 not in cpu_native.features(): this CPU does not execute AVX-512 BF16 (or "
           f"{cpu_native.ISA_ENV} leaves it out)"))
PORTABLE = pytest.param("portable", id="portable", marks=pytest.mark.skipif(
    not _found(), reason="the native CPU kernels do not build here"))


@pytest.fixture(scope="module")
def library():
    lib = cpu_native.linear_library(torch.device("cpu"))
    if lib is None:
        pytest.skip("the native CPU kernels do not build here")
    return lib


@pytest.fixture(params=[HARDWARE, PORTABLE])
def dot_variant(library, request):
    """The table's dot-product slot held by one variant: the AVX-512 BF16 kernel, or (every other
    feature left out) the portable reference; the probe's answer given back after."""
    before = [n for n, ok in cpu_native.features().items() if ok]
    cpu_native.set_features(library, ["avx2", "avx512", "avx512_bf16"] if request.param == "avx512_bf16" else [])
    assert cpu_native.kernel_map()["linear_bf16_dot"] == request.param
    yield request.param
    cpu_native.set_features(library, before)


def _operands(gen, rows, in_features, out_features, x_dtype=torch.float32):
    x = torch.randn(rows, in_features, generator=gen).to(x_dtype)
    weight, bias = torch.randn(out_features, in_features, generator=gen), torch.randn(out_features, generator=gen)
    panels = cpu_native.weight_panels_bf16(weight)
    w = weight.to(torch.bfloat16).double()
    exact = x.double() @ w.T + bias.double()
    magnitude = x.double().abs() @ w.abs().T + bias.double().abs()
    return x, panels, cpu_native.padded_bias(bias, panels), exact, magnitude


@pytest.mark.parametrize("rows", (1, 2, 3, 4, 5, 6, 7, 8, 13, 32, 100))
@pytest.mark.parametrize("in_features, out_features", SHAPES)
def test_dot_products_of_float32_rows_equal_float64(library, dot_variant, rows, in_features, out_features):
    x, panels, bias, exact, magnitude = _operands(_gen(rows + in_features), rows, in_features, out_features)
    y = cpu_native.linear_bf16(library, x, panels, in_features, out_features, bias, dot_rows=1)
    assert y.dtype == torch.float32 and y.shape == (rows, out_features)
    rounds = cpu_native.dot_rounds(rows, torch.float32, 1)
    assert rounds == (rows >= cpu_native.DOT_SPLIT_ROWS)
    _within(y, exact, magnitude, 2 ** -8 if rounds else 1e-5)


@pytest.mark.parametrize("rows", (1, 6, 32))
@pytest.mark.parametrize("in_features", (130, 131))  # even: x read in place; odd: padded into a copy
def test_dot_products_of_bfloat16_rows_round_once(library, dot_variant, rows, in_features):
    gen = _gen(rows)
    x = torch.randn(rows, 3, in_features, generator=gen).to(torch.bfloat16)  # leading dims
    weight = torch.randn(97, in_features, generator=gen).to(torch.bfloat16)
    y = cpu_native.linear_bf16(library, x, cpu_native.weight_panels_bf16(weight), in_features, 97, None, dot_rows=1)
    assert y.dtype == torch.bfloat16 and y.shape == (rows, 3, 97)
    exact = x.double() @ weight.double().T
    _within(y, exact, (x.double().abs() @ weight.double().abs().T) * 1e-5 + exact.abs() * 2 ** -8, 1.0)
    strided = torch.randn(rows, 2 * in_features, generator=gen).to(torch.bfloat16)[:, ::2]  # rows apart, not pairs
    got = cpu_native.linear_bf16(library, strided, cpu_native.weight_panels_bf16(weight), in_features, 97, None,
                                 dot_rows=1)
    exact = strided.double() @ weight.double().T
    _within(got, exact, (strided.double().abs() @ weight.double().abs().T) * 1e-5 + exact.abs() * 2 ** -8, 1.0)


@pytest.mark.parametrize("rows", (1, 5, 32))
def test_the_hardware_kernel_agrees_with_the_portable_reference(library, rows):
    if not (_found().get("avx512") and _found().get("avx512_bf16")):
        pytest.skip("avx512_bf16 not in cpu_native.features(): this CPU does not execute AVX-512 BF16")
    x, panels, bias, exact, magnitude = _operands(_gen(rows), rows, 576, 200, torch.bfloat16)
    before = [n for n, ok in cpu_native.features().items() if ok]
    try:
        cpu_native.set_features(library, ["avx2", "avx512", "avx512_bf16"])
        hardware = cpu_native.linear_bf16(library, x.float(), panels, 576, 200, bias, dot_rows=1)
        cpu_native.set_features(library, [])
        portable = cpu_native.linear_bf16(library, x.float(), panels, 576, 200, bias, dot_rows=1)
    finally:
        cpu_native.set_features(library, before)
    _within(hardware, portable.double(), magnitude, 1e-5)  # the same exact products, float32 sums


def test_dot_rows_is_where_the_kernel_changes(library, dot_variant):
    """Below ``dot_rows`` rows the widening kernel's bits, from there on the dot products' bits."""
    for rows in (3, 4, 9):
        x, panels, bias, _, _ = _operands(_gen(rows), rows, 100, 70)
        widen = cpu_native.linear_bf16(library, x, panels, 100, 70, bias)
        dot = cpu_native.linear_bf16(library, x, panels, 100, 70, bias, dot_rows=1)
        assert torch.equal(cpu_native.linear_bf16(library, x, panels, 100, 70, bias, dot_rows=4),
                           widen if rows < 4 else dot)
    assert not torch.equal(widen, dot)  # 9 rows: rounded to bfloat16 on the way in


def test_panel_linear_carries_dot_rows_to_the_kernel_and_the_captured_step(library, dot_variant):
    weight = torch.randn(70, 100, generator=_gen(4)).to(torch.bfloat16)
    module = PanelLinear(weight, None, dot_rows=2)
    assert module.dot_rows == 2 and "dot_rows=2" in repr(module)
    assert PanelLinear(weight.float(), None, dot_rows=2).dot_rows == 0  # float32 panels have one kernel
    x = torch.randn(5, 100, generator=_gen(5))
    assert torch.equal(module(x), cpu_native.linear_bf16(library, x, module.weight_panels, 100, 70, None, dot_rows=2))
    operands = module.native_operands()
    assert operands.format == cpu_native.LINEAR_BF16 and operands.dot_rows == 2
    assert cpu_native.DecodeLinear(operands.format, operands.weight.data_ptr(), None, None, None,
                                   operands.dot_rows).dot_rows == 2
