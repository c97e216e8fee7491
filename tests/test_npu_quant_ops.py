"""The simulated NPU's quantised-linear ops and the NPU kernels that call them.

* Each fake (``npu_quant_matmul``, ``npu_dynamic_quant``, ``npu_weight_quant_batchmatmul``,
  ``npu_quantize``) against a float64 reference of the math its docs state: integer parts (int8
  codes, the int32 accumulation) exactly, float outputs within a stated bound.
* Each documented constraint the fakes enforce raises ``NpuOpError``.
* ``npu_kernels.w8a16_linear`` / ``w8a8_dynamic_linear`` / ``w8a8_static_linear`` on the simulated
  NPU against float64 references, within the stated bfloat16 / float16 tolerances.

Tolerances use ``u``, the unit roundoff of the output dtype (2^-8 for bfloat16, 2^-11 for float16).
"""

from __future__ import annotations

import pytest
import torch

from atb_plugin.testing import fake_torch_npu as fake
from atb_plugin.testing.fake_torch_npu import NpuOpError

U = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _int8(*shape, seed, low=-128, high=128) -> torch.Tensor:
    return torch.randint(low, high, shape, generator=_gen(seed), dtype=torch.int8)


def _randn(*shape, seed, dtype=torch.float32, scale=1.0) -> torch.Tensor:
    return (torch.randn(shape, generator=_gen(seed), dtype=torch.float64) * scale).to(dtype)


def _within(actual: torch.Tensor, reference: torch.Tensor, bound: torch.Tensor) -> None:
    err = (actual.double() - reference).abs()
    assert bool((err <= bound).all()), f"max excess {(err - bound).max().item():.3g}, max err {err.max().item():.3g}"


# --------------------------------------------------------------------------------------------
# npu_quant_matmul
# --------------------------------------------------------------------------------------------


def test_quant_matmul_int32_accumulation_is_exact():
    """scale 1 and |x1 @ x2 + bias| < 2048: every value is a float16 integer, so the float16 output
    must equal the integer reference exactly (batch dims broadcast, (batch, 1, n) bias)."""
    x1 = _int8(3, 5, 32, seed=1, low=-4, high=5)
    x2 = _int8(32, 16, seed=2, low=-4, high=5)
    bias = torch.randint(-100, 100, (3, 1, 16), generator=_gen(3), dtype=torch.int32)
    out = fake.npu_quant_matmul(x1, x2, torch.ones(1), bias=bias, output_dtype=torch.float16)
    reference = x1.double() @ x2.double() + bias.double()
    assert out.dtype == torch.float16 and out.shape == (3, 5, 16)
    assert reference.abs().max() < 2048
    assert torch.equal(out.double(), reference)


def test_quant_matmul_full_range_long_k_matches_float64():
    """Full int8 range, k = 4096 (sums past 2^24, where a float32 accumulation would round):
    (x1 @ x2 + int32 bias) * scale * pertoken in float32, cast to bfloat16: within
    u * |ref| + 2^-20 * |ref|."""
    m, k, n = 6, 4096, 24
    x1, w = _int8(m, k, seed=4), _int8(n, k, seed=5)
    x1[0], w[0] = 127, -128  # one sum of -66.6M, past 2^24
    x2 = w.t()  # a transposed view of the (n, k) weight
    scale = _randn(n, seed=6).abs() * 1e-4 + 1e-5
    pertoken = _randn(m, seed=7).abs() + 0.1
    bias = torch.randint(-50000, 50000, (n,), generator=_gen(8), dtype=torch.int32)
    out = fake.npu_quant_matmul(x1, x2, scale, pertoken_scale=pertoken, bias=bias, output_dtype=torch.bfloat16)
    reference = (x1.double() @ x2.double() + bias.double()) * scale.double() * pertoken.double()[:, None]
    assert (x1.double() @ x2.double()).abs().max() > 2 ** 24
    _within(out, reference, (U[torch.bfloat16] + 2.0 ** -20) * reference.abs())


@pytest.mark.parametrize("bias_dtype", [torch.float32, torch.bfloat16, None])
def test_quant_matmul_float_bias_is_added_after_scaling(bias_dtype):
    m, k, n = 4, 64, 8
    x1, x2 = _int8(m, k, seed=9), _int8(k, n, seed=10)
    scale = _randn(n, seed=11, dtype=torch.bfloat16).abs() * 0.01
    pertoken = _randn(m, seed=12).abs()
    bias = None if bias_dtype is None else _randn(n, seed=13, dtype=bias_dtype)
    out = fake.npu_quant_matmul(x1, x2, scale, pertoken_scale=pertoken, bias=bias, output_dtype=torch.bfloat16)
    reference = (x1.double() @ x2.double()) * scale.double() * pertoken.double()[:, None]
    if bias is not None:
        reference = reference + bias.double()
    _within(out, reference, (U[torch.bfloat16] + 2.0 ** -20) * reference.abs() + 1e-6)


def test_quant_matmul_float16_with_pertoken_and_float16_bias():
    m, k, n = 5, 48, 12
    x1, x2 = _int8(m, k, seed=14), _int8(k, n, seed=15)
    scale, pertoken = _randn(n, seed=16).abs() * 1e-3, _randn(m, seed=17).abs()
    bias = _randn(n, seed=18, dtype=torch.float16)
    out = fake.npu_quant_matmul(x1, x2, scale, pertoken_scale=pertoken, bias=bias, output_dtype=torch.float16)
    reference = (x1.double() @ x2.double()) * scale.double() * pertoken.double()[:, None] + bias.double()
    _within(out, reference, (U[torch.float16] + 2.0 ** -20) * reference.abs() + 1e-6)


def test_quant_matmul_int64_scale_reads_fp19():
    """An int64 scale (npu_trans_quant_param's packing: the float32's bits) is read as FP19:
    the float32 with its 13 low mantissa bits dropped."""
    x1, x2 = _int8(4, 32, seed=19), _int8(32, 8, seed=20)
    scale = torch.full((8,), 1.0 + 2.0 ** -20) * 1e-3
    packed = scale.view(torch.int32).to(torch.int64)
    truncated = (packed & 0xFFFFE000).to(torch.int32).view(torch.float32)
    assert not torch.equal(truncated, scale)
    out = fake.npu_quant_matmul(x1, x2, packed, output_dtype=torch.float16)
    assert torch.equal(out, fake.npu_quant_matmul(x1, x2, truncated, output_dtype=torch.float16))


def test_quant_matmul_accepts_both_weight_layouts_alike():
    x1, w = _int8(3, 40, seed=21), _int8(16, 40, seed=22)  # w: checkpoint layout (n, k)
    scale = torch.full((16,), 0.01)
    viewed = fake.npu_quant_matmul(x1, w.t(), scale, output_dtype=torch.bfloat16)
    copied = fake.npu_quant_matmul(x1, w.t().contiguous(), scale, output_dtype=torch.bfloat16)
    assert torch.equal(viewed, copied)


def _qmm_args(**overrides):
    m, k, n = 4, 32, 8
    args = dict(x1=_int8(m, k, seed=23), x2=_int8(k, n, seed=24), scale=torch.full((n,), 0.01),
                pertoken_scale=None, bias=None, output_dtype=torch.bfloat16)
    args.update(overrides)
    return args


@pytest.mark.parametrize("overrides, message", [
    (dict(x1=torch.zeros(4, 32, dtype=torch.int32)), "x1 must be int8"),
    (dict(x2=torch.zeros(32, 8, dtype=torch.float16)), "x2 dtype"),
    (dict(x2=torch.zeros(8, 32, dtype=torch.int8)), "k dim of x1"),
    (dict(x1=torch.zeros(32, dtype=torch.int8)), "2-6 dims"),
    (dict(x2=torch.zeros(32, 16, dtype=torch.int8)[:, ::2]), "transposed view"),
    (dict(scale=torch.full((8,), 0.01, dtype=torch.float16)), "scale dtype"),
    (dict(scale=torch.full((9,), 0.01)), "scale must be 1-D"),
    (dict(scale=torch.full((8,), 0.01, dtype=torch.bfloat16), output_dtype=torch.float16), "bfloat16"),
    (dict(scale=torch.ones(8, dtype=torch.int64)), "not int64"),
    (dict(scale=torch.ones(8, dtype=torch.int64), output_dtype=torch.float16, pertoken_scale=torch.ones(4)),
     "int64 scale"),
    (dict(pertoken_scale=torch.ones(4, dtype=torch.bfloat16)), "pertoken_scale must be a float32"),
    (dict(pertoken_scale=torch.ones(5)), "pertoken_scale must be 1-D"),
    (dict(pertoken_scale=torch.ones(4), output_dtype=torch.float16, scale=torch.full((8,), 0.01,
                                                                                     dtype=torch.bfloat16)),
     "bfloat16"),
    (dict(bias=torch.zeros(8, dtype=torch.float16)), "float16"),
    (dict(bias=torch.zeros(8, dtype=torch.bfloat16), output_dtype=torch.float16), "bias dtype is bfloat16"),
    (dict(bias=torch.zeros(8), output_dtype=torch.float16), "float32 bias without pertoken"),
    (dict(bias=torch.zeros(8, dtype=torch.int64)), "bias dtype"),
    (dict(bias=torch.zeros(7, dtype=torch.int32)), "1-D bias"),
    (dict(bias=torch.zeros(1, 8, dtype=torch.int32)), r"bias must be \(n,\)"),
    (dict(output_dtype=None), "output_dtype"),
    (dict(output_dtype=torch.int32), "output_dtype"),
    (dict(offset=torch.zeros(8)), "offset"),
    (dict(group_sizes=[1, 128, 128]), "group_sizes"),
])
def test_quant_matmul_refuses_what_the_real_op_refuses(overrides, message):
    with pytest.raises(NpuOpError, match=message):
        fake.npu_quant_matmul(**_qmm_args(**overrides))


def test_quant_matmul_takes_dtype_enums_like_the_binding():
    """The schema's ``int? output_dtype``: the binding turns torch.bfloat16 into 15."""
    args = _qmm_args()
    assert torch.equal(fake.npu_quant_matmul(**{**args, "output_dtype": 15}), fake.npu_quant_matmul(**args))


# --------------------------------------------------------------------------------------------
# npu_dynamic_quant
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("smooth", [False, True])
def test_dynamic_quant_matches_float64(dtype, smooth):
    """scale = rowMax|x * smooth| / 127 (float32 of the float64 value, 1 ulp), and every code is
    the nearest integer to x * smooth / scale: |q - x * smooth / scale| <= 1/2 (+ float32 slop)."""
    x = _randn(3, 5, 64, seed=30, dtype=dtype, scale=3.0)
    smooth_scales = (_randn(64, seed=31).abs() + 0.5).to(dtype) if smooth else None
    q, scale = fake.npu_dynamic_quant(x, smooth_scales=smooth_scales)
    xs = x.double() * (smooth_scales.double() if smooth else 1.0)
    ref_scale = xs.abs().amax(dim=-1) / 127
    assert q.dtype == torch.int8 and q.shape == x.shape
    assert scale.dtype == torch.float32 and scale.shape == x.shape[:-1]
    _within(scale, ref_scale, 2.0 ** -23 * ref_scale)
    _within(q, xs / ref_scale[..., None], torch.full_like(xs, 0.5 + 1e-4))
    assert torch.equal(q.abs().amax(dim=-1), torch.full(x.shape[:-1], 127, dtype=torch.int8))


def test_dynamic_quant_rounds_half_to_even_and_zero_rows_give_zero():
    # row max 127 -> scale 1: the codes are round(x) with ties to even
    x = torch.tensor([[127.0, 2.5, 3.5, -2.5, 0.5], [0.0] * 5], dtype=torch.bfloat16)
    q, scale = fake.npu_dynamic_quant(x)
    assert q.tolist() == [[127, 2, 4, -2, 0], [0] * 5]
    assert scale.tolist() == [1.0, 0.0]


@pytest.mark.parametrize("call, message", [
    (lambda x: fake.npu_dynamic_quant(x.float()), "float16 / bfloat16"),
    (lambda x: fake.npu_dynamic_quant(x[0]), "more than 1 dim"),
    (lambda x: fake.npu_dynamic_quant(x, smooth_scales=torch.ones(16)), "smooth_scales must be a tensor"),
    (lambda x: fake.npu_dynamic_quant(x, smooth_scales=torch.ones(8, dtype=x.dtype)), "smooth_scales must be 1-D"),
    (lambda x: fake.npu_dynamic_quant(x, group_index=torch.tensor([4], dtype=torch.int32)), "group_index"),
    (lambda x: fake.npu_dynamic_quant(x, dst_type=torch.quint4x2), "dst_type"),
    (lambda x: fake.npu_dynamic_quant(x, quant_mode="pertensor"), "quant_mode"),
])
def test_dynamic_quant_refuses_what_the_real_op_refuses(call, message):
    with pytest.raises(NpuOpError, match=message):
        call(_randn(4, 16, seed=32, dtype=torch.bfloat16))


# --------------------------------------------------------------------------------------------
# npu_weight_quant_batchmatmul
# --------------------------------------------------------------------------------------------


def _w8a16_reference(x, weight_kn, scale_kn, offset_kn, bias):
    deq = (weight_kn.double() + (0 if offset_kn is None else offset_kn)) * scale_kn
    ref = x.double() @ deq
    absprod = x.double().abs() @ deq.abs()
    if bias is not None:
        ref = ref + bias.double().reshape(-1)
        absprod = absprod + bias.double().abs().reshape(-1)
    return ref, absprod


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("mode", ["channel", "tensor", "group"])
def test_weight_quant_batchmatmul_matches_float64(dtype, mode):
    """y = x @ ((w + offset) * scale) + bias. Bound: the antiquantised weight and the result are
    rounded to x's dtype, products sum in float32: |y - ref| <= 2u (|x| @ |W'| + |bias|) + u |ref|."""
    m, k, n, group = 5, 128, 24, 64
    x = _randn(m, k, seed=40, dtype=dtype)
    weight = _int8(n, k, seed=41).t()  # (k, n) transposed view of the checkpoint's (n, k)
    shape = {"channel": (n,), "tensor": (1,), "group": (k // group, n)}[mode]
    scale = (_randn(*shape, seed=42).abs() * 0.01 + 1e-3).to(dtype)
    offset = torch.randint(-8, 8, shape, generator=_gen(43)).to(dtype)  # integer zero points: exact in dtype
    bias = _randn(n, seed=44, dtype=torch.float32 if dtype == torch.bfloat16 else torch.float16)
    out = fake.npu_weight_quant_batchmatmul(x, weight, scale, offset, bias=bias,
                                            antiquant_group_size=group if mode == "group" else 0)
    expand = (lambda t: t.double().repeat_interleave(group, dim=0)) if mode == "group" else \
        (lambda t: t.double().reshape(1, -1))
    ref, absprod = _w8a16_reference(x, weight, expand(scale), expand(offset), bias)
    assert out.dtype == dtype and out.shape == (m, n)
    _within(out, ref, 2 * U[dtype] * absprod + U[dtype] * ref.abs())


def _wqbmm_args(**overrides):
    m, k, n = 4, 64, 8
    args = dict(x=_randn(m, k, seed=45, dtype=torch.bfloat16), weight=_int8(k, n, seed=46),
                antiquant_scale=torch.full((n,), 0.01, dtype=torch.bfloat16),
                antiquant_offset=torch.zeros(n, dtype=torch.bfloat16), bias=torch.zeros(n))
    args.update(overrides)
    return args


@pytest.mark.parametrize("overrides, message", [
    (dict(x=torch.zeros(4, 64)), "float16 / bfloat16"),
    (dict(x=torch.zeros(2, 4, 64, dtype=torch.bfloat16)), r"x must be \(M, K\)"),
    (dict(weight=torch.zeros(64, 8, dtype=torch.float16)), "weight must be int8"),
    (dict(weight=torch.zeros(8, 64, dtype=torch.int8)), "x's K and weight's K differ"),
    (dict(weight=torch.zeros(64, 16, dtype=torch.int8)[:, ::2]), "transposed view"),
    (dict(antiquant_scale=torch.full((8,), 0.01)), "antiquant_scale must be in x's dtype"),
    (dict(antiquant_scale=torch.full((7,), 0.01, dtype=torch.bfloat16)), "per channel"),
    (dict(antiquant_offset=torch.zeros(8, dtype=torch.float16)), "antiquant_offset must be in"),
    (dict(antiquant_offset=torch.zeros(1, 8, dtype=torch.bfloat16)), "antiquant_offset must have"),
    (dict(bias=torch.zeros(8, dtype=torch.bfloat16)), "bias must be torch.float32"),
    (dict(bias=torch.zeros(9)), r"bias must be \(8,\)"),
    (dict(bias=torch.zeros(8, 2)[:, 0]), "contiguous"),
    (dict(antiquant_group_size=48, antiquant_scale=torch.ones(2, 8, dtype=torch.bfloat16), antiquant_offset=None),
     "multiple of 32"),
    (dict(antiquant_group_size=32, antiquant_offset=None), "per-group antiquant_scale"),
    (dict(quant_scale=torch.ones(8)), "quant_scale"),
    (dict(inner_precise=2), "inner_precise"),
])
def test_weight_quant_batchmatmul_refuses_what_the_real_op_refuses(overrides, message):
    with pytest.raises(NpuOpError, match=message):
        fake.npu_weight_quant_batchmatmul(**_wqbmm_args(**overrides))


# --------------------------------------------------------------------------------------------
# npu_quantize
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("div_mode", [False, True])
def test_quantize_matches_float64_exactly(div_mode):
    """Power-of-two scales and bfloat16 input: x * s (or x / s) + zero point is exact in float32
    and float64, so the int8 codes must equal the float64 reference exactly (saturated)."""
    x = _randn(6, 32, seed=50, dtype=torch.bfloat16, scale=4.0)
    scales = torch.full((32,), 16.0 if not div_mode else 1 / 16)
    if div_mode:
        zero = torch.full((32,), -3, dtype=torch.int8)
    else:
        zero = torch.full((32,), -3.0)
    out = fake.npu_quantize(x, scales, zero, torch.qint8, -1, div_mode)
    ref = (x.double() * 16 - 3).round().clamp(-128, 127)
    assert out.dtype == torch.int8 and torch.equal(out.double(), ref)
    assert (ref == 127).any() or (ref == -128).any()  # the saturation is exercised


def test_quantize_rounds_half_to_even_and_takes_axis_minus_two():
    x = torch.tensor([[0.5, 1.5], [2.5, -2.5], [300.0, -300.0]], dtype=torch.bfloat16)
    out = fake.npu_quantize(x, torch.ones(3, dtype=torch.bfloat16), None, torch.qint8, -2, False)
    assert out.tolist() == [[0, 2], [2, -2], [127, -128]]
    per_row = fake.npu_quantize(x, torch.tensor([2.0, 1.0, 0.0]), torch.tensor([0.0, 1.0, 5.0]), torch.qint8, -2,
                                False)
    assert per_row.tolist() == [[1, 3], [4, -2], [5, 5]]


@pytest.mark.parametrize("args, message", [
    (dict(input=torch.zeros(4, 8, dtype=torch.int8)), "input must be"),
    (dict(dtype=torch.quint8), "not simulated"),
    (dict(dtype=torch.quint4x2), "not simulated"),
    (dict(axis=-3), "axis must be in"),
    (dict(axis=2), "axis must be in"),
    (dict(scales=torch.ones(5)), "1-D scales"),
    (dict(scales=torch.ones(2, 8)), "must be 1-D or input's rank"),
    (dict(zero_points=torch.zeros(8, dtype=torch.bfloat16)), "zero_points must have scales' shape and dtype"),
    (dict(zero_points=torch.zeros(1)), "zero_points must have scales' shape and dtype"),
    (dict(div_mode=True, scales=torch.ones(8, dtype=torch.float16), zero_points=None, axis=1), "scales dtype"),
    (dict(div_mode=True, zero_points=torch.zeros(8, dtype=torch.float16), axis=1), "zero_points dtype"),
])
def test_quantize_refuses_what_the_real_op_refuses(args, message):
    call = dict(input=torch.zeros(4, 8, dtype=torch.bfloat16), scales=torch.ones(8), zero_points=torch.zeros(8),
                dtype=torch.qint8, axis=-1, div_mode=False)
    call.update(args)
    with pytest.raises(NpuOpError, match=message):
        fake.npu_quantize(**call)


# --------------------------------------------------------------------------------------------
# the NPU kernels on the simulated NPU
# --------------------------------------------------------------------------------------------


@pytest.fixture
def npu():
    from atb_plugin.platform import use_platform

    with fake.install() as handle, use_platform("npu"):
        yield handle


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("with_offset_and_bias", [True, False])
def test_w8a16_linear(npu, dtype, with_offset_and_bias):
    """y = x @ ((weight + offset) * scale).T + bias; bound: scale rounded to x's dtype and the
    antiquantised weight too (2u), the result (u): |y - ref| <= 3u (|x| @ |W'|.T + |bias|) + u |ref|
    (integer offsets, as zero points are, are exact in x's dtype)."""
    from atb_plugin.ops import npu_kernels

    out_f, in_f = 40, 96
    x = _randn(2, 3, in_f, seed=60, dtype=dtype)
    weight = _int8(out_f, in_f, seed=61)
    scale = _randn(out_f, seed=62).abs() * 0.01 + 1e-3
    offset = torch.randint(-8, 8, (out_f,), generator=_gen(63)).float() if with_offset_and_bias else None
    bias = _randn(out_f, seed=64) if with_offset_and_bias else None
    y = npu_kernels.w8a16_linear(x, weight, scale, offset, bias)
    deq = (weight.double() + (0 if offset is None else offset.double()[:, None])) * scale.double()[:, None]
    ref = x.double() @ deq.t() + (0 if bias is None else bias.double())
    absprod = x.double().abs() @ deq.abs().t() + (0 if bias is None else bias.double().abs())
    assert y.dtype == dtype and y.shape == (2, 3, out_f)
    _within(y, ref, 3 * U[dtype] * absprod + U[dtype] * ref.abs())
    assert npu.module.calls["npu_weight_quant_batchmatmul"] == 1
    # the converted scale / bias are cached on the parameters: a second call converts nothing new
    assert torch.equal(npu_kernels.w8a16_linear(x, weight, scale, offset, bias), y)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("with_bias", [True, False])
def test_w8a8_dynamic_linear(npu, dtype, with_bias):
    """Two references. (1) The documented math in float64: s_t = max_k |x_tk| / 127,
    q = round(x / s_t), y = (q @ W.T) * weight_scale * s_t + bias; bound (u + 2^-20) |ref|, plus
    one code step s_t |W'_nk| wherever x / s_t lies within 10^-3 of a rounding tie (float32 may
    round those the other way). (2) The unquantised activation, x @ (W * weight_scale).T + bias:
    each code is within half a step of x, so |dy| <= s_t / 2 * sum_k |W'_nk| (x 1.001), plus the
    output rounding u |ref| (the bias, in x's dtype, is exact)."""
    from atb_plugin.ops import npu_kernels

    out_f, in_f = 32, 80
    x = _randn(3, 4, in_f, seed=70, dtype=dtype, scale=2.0)
    weight = _int8(out_f, in_f, seed=71)
    weight_scale = _randn(out_f, seed=72).abs() * 0.01 + 1e-3
    bias = _randn(out_f, seed=73, dtype=dtype) if with_bias else None
    y = npu_kernels.w8a8_dynamic_linear(x, weight, weight_scale, bias)
    deq = weight.double() * weight_scale.double()[:, None]
    step = x.double().abs().amax(dim=-1, keepdim=True) / 127
    codes = x.double() / step
    near_tie = ((codes - codes.floor() - 0.5).abs() < 1e-3).double()
    documented = (codes.round() @ weight.double().t()) * weight_scale.double() * step \
        + (0 if bias is None else bias.double())
    _within(y, documented, (U[dtype] + 2.0 ** -20) * documented.abs() + step * (near_tie @ deq.abs().t()))
    ref = x.double() @ deq.t() + (0 if bias is None else bias.double())
    act_err = 0.5 * step * deq.abs().sum(dim=1) * 1.001
    assert y.dtype == dtype and y.shape == (3, 4, out_f)
    _within(y, ref, act_err + U[dtype] * (ref.abs() + act_err))
    assert npu.module.calls["npu_dynamic_quant"] == 1 and npu.module.calls["npu_quant_matmul"] == 1


def _modelslim_w8a8(out_f, in_f, dtype, seed):
    """msModelSlim-style static W8A8 parameters: per-tensor input_scale (a power of two here, so
    x / input_scale is exact) / int8 input_offset, per-channel weight_scale, deq_scale =
    input_scale * weight_scale, quant_bias = round(bias / deq_scale) - input_offset * sum_k W."""
    weight = _int8(out_f, in_f, seed=seed)
    input_scale = torch.tensor([2.0 ** -5], dtype=dtype)
    input_offset = torch.tensor([3], dtype=torch.int8)
    weight_scale = _randn(out_f, seed=seed + 1).abs() * 0.01 + 1e-3
    deq_scale = (input_scale.float() * weight_scale).float()
    bias = _randn(out_f, seed=seed + 2)
    quant_bias = ((bias.double() / deq_scale.double()).round()
                  - 3 * weight.double().sum(dim=1)).to(torch.int32)
    return weight, input_scale, input_offset, weight_scale, deq_scale, bias, quant_bias


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_w8a8_static_linear(npu, dtype):
    """Two references. (1) The documented math in float64, exact up to the float scaling:
    q = clamp(round(x / input_scale + input_offset)), y = (q @ W.T + quant_bias) * deq_scale;
    bound u |ref| + 2^-20 |ref|. (2) The float layer it quantises, x @ (W * weight_scale).T +
    bias: off by at most half an activation step and half a bias step per output,
    |dy| <= input_scale / 2 * sum_k |W'_nk| + deq_scale / 2, plus u |ref|. float16 models store
    deq_scale as int64 (the float32's bits), as msModelSlim writes it."""
    from atb_plugin.ops import npu_kernels

    out_f, in_f = 24, 64
    weight, input_scale, input_offset, weight_scale, deq_scale, bias, quant_bias = \
        _modelslim_w8a8(out_f, in_f, dtype, seed=80)
    x = _randn(2, 5, in_f, seed=83, dtype=dtype).clamp(-3.5, 3.5)  # |x / input_scale + 3| <= 115: no saturation
    stored_deq = deq_scale.view(torch.int32).to(torch.int64) if dtype == torch.float16 else deq_scale
    y = npu_kernels.w8a8_static_linear(x, weight, input_scale, input_offset, stored_deq, quant_bias)
    q = (x.double() / input_scale.double() + 3).round().clamp(-128, 127)
    ref = (q @ weight.double().t() + quant_bias.double()) * deq_scale.double()
    assert y.dtype == dtype and y.shape == (2, 5, out_f)
    _within(y, ref, (U[dtype] + 2.0 ** -20) * ref.abs())
    deq_w = weight.double() * weight_scale.double()[:, None]
    layer = x.double() @ deq_w.t() + bias.double()
    slack = input_scale.double() / 2 * deq_w.abs().sum(dim=1) + deq_scale.double() / 2
    _within(y, layer, slack * 1.001 + U[dtype] * (layer.abs() + slack))
    assert npu.module.calls["npu_quantize"] == 1 and npu.module.calls["npu_quant_matmul"] == 1


def test_w8a8_static_linear_without_quant_bias(npu):
    """Tensor-parallel ranks other than 0 pass no quant_bias (vllm-ascend): y = (q @ W.T) * deq."""
    from atb_plugin.ops import npu_kernels

    weight, input_scale, input_offset, _, deq_scale, _, _ = _modelslim_w8a8(16, 32, torch.bfloat16, seed=90)
    x = _randn(7, 32, seed=93, dtype=torch.bfloat16).clamp(-3.5, 3.5)
    y = npu_kernels.w8a8_static_linear(x, weight, input_scale, input_offset, deq_scale, None)
    q = (x.double() / input_scale.double() + 3).round().clamp(-128, 127)
    ref = (q @ weight.double().t()) * deq_scale.double()
    _within(y, ref, (U[torch.bfloat16] + 2.0 ** -20) * ref.abs())


def test_quant_kernels_take_empty_batches(npu):
    from atb_plugin.ops import npu_kernels

    weight = _int8(8, 16, seed=95)
    x = torch.zeros(0, 16, dtype=torch.bfloat16)
    assert npu_kernels.w8a16_linear(x, weight, torch.ones(8), None, None).shape == (0, 8)
    assert npu_kernels.w8a8_dynamic_linear(x, weight, torch.ones(8), None).shape == (0, 8)
    assert npu_kernels.w8a8_static_linear(x, weight, torch.ones(1), torch.zeros(1, dtype=torch.int8),
                                          torch.ones(8), None).shape == (0, 8)
    assert sum(npu.module.calls.values()) == 0


CONTRACT = {
    "w8a16_linear": ["x", "weight", "scale", "offset", "bias"],
    "w8a8_dynamic_linear": ["x", "weight", "weight_scale", "bias"],
    "w8a8_static_linear": ["x", "weight", "input_scale", "input_offset", "deq_scale", "quant_bias"],
}


def test_quant_kernels_have_the_contract_signatures():
    """The NPU kernels take what the torch reference kernels take (the platform swaps them)."""
    import inspect

    from atb_plugin.ops import npu_kernels, torch_kernels

    for name, params in CONTRACT.items():
        assert list(inspect.signature(getattr(npu_kernels, name)).parameters) == params, name
        reference = getattr(torch_kernels, name, None)
        if reference is not None:
            assert list(inspect.signature(reference).parameters) == params, name


def test_quant_kernels_through_the_platform(monkeypatch):
    """The ATB kernel set, picked by the NPU platform, runs the quantised linears on the fakes."""
    from atb_plugin.ops import npu_kernels
    from atb_plugin.platform import use_platform

    monkeypatch.setenv("ATB_PLUGIN_NPU_KERNELS", "atb")
    weight = _int8(8, 16, seed=96)
    x = _randn(3, 16, seed=97, dtype=torch.bfloat16)
    with fake.install() as handle, use_platform("npu") as platform:
        kernels = platform.kernels
        assert kernels is npu_kernels
        y = kernels.w8a8_dynamic_linear(x, weight, torch.full((8,), 0.01), None)
        assert y.shape == (3, 8) and handle.module.calls["npu_quant_matmul"] == 1
