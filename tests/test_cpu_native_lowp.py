"""The native CPU kernels' low-precision linear layers (atb_plugin/ops/cpu_native.py,
csrc/cpu_kernels.c) against float64 references of their own math, and the CPU feature probe.

Bounds (stated per kernel, all against float64):
- float32 sums of K products (W8A16; float32 and bfloat16 panels): |error| <= 1e-5 x the sum of
  the products' magnitudes (|x| @ |W|.T + |bias|); K float32 roundings would allow K x 6e-8
  (3.5e-5 at K = 576) in the worst case, random-signed errors grow as sqrt(K) x 6e-8 (~1.5e-6).
- W8A8: the int32 sum is exact (checked bit for bit where the float steps are exact too), then
  acc -> float32 (exact below 2^24), two products and the bias: 4 roundings, <= 2.4e-7 relative
  to |acc * s * w_scale| + |bias|.
- bfloat16 results: the float32 bound plus the final rounding to bfloat16 (half an ulp: 2^-9
  relative).
Every variant the probe allows (AVX2, AVX-VNNI, AVX-512 VNNI) runs the W8A8 checks; on this
file's first machine (AVX2 only) that is AVX2 alone.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from torch import nn

from atb_plugin.ops import cpu_native
from atb_plugin.models.linear import pack_linear_layers
from atb_plugin.ops.packed_linear import PanelLinear, native_bf16_preferred

ROWS = (1, 3, 32, 100)
SHAPES = ((100, 77), (67, 33), (576, 131), (40, 64))  # (in, out): in not a multiple of 32, out odd


@pytest.fixture(scope="module")
def library():
    lib = cpu_native.linear_library(torch.device("cpu"))
    assert lib is not None, "the native CPU kernels should build on this machine (gcc is installed)"
    return lib


def _int8_variants():
    found = cpu_native.features() if cpu_native.linear_library(torch.device("cpu")) is not None else {}
    base = [n for n in ("avx2", "avx512") if found.get(n)]
    variants = [base]
    for extra in ("avx_vnni", "avx512_vnni"):
        if found.get(extra):
            variants.append([*base, extra])
    return variants


@pytest.fixture(params=_int8_variants(), ids=lambda v: "+".join(v) or "portable")
def int8_variant(library, request):
    before = [n for n, ok in cpu_native.features().items() if ok]
    cpu_native.set_features(library, request.param)
    yield request.param
    cpu_native.set_features(library, before)


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def _within(actual: torch.Tensor, exact: torch.Tensor, magnitude: torch.Tensor, rel: float) -> None:
    error = (actual.double() - exact).abs()
    worst = (error / (magnitude + 1e-300)).max().item()
    assert (error <= rel * magnitude + 1e-30).all(), f"worst error {worst:.3g} x magnitude, bound {rel}"


# -- the probe ----------------------------------------------------------------------------------


def test_the_probe_answers_every_feature_and_never_more_than_cpuid_claims(library):
    found = cpu_native.features()
    assert tuple(found) == cpu_native.FEATURES
    if os.uname().machine != "x86_64":
        return
    flags = set(cpu_native._cpu_flags().split())
    claims = {"avx2": "avx2", "avx512": "avx512bw", "avx512_bf16": "avx512_bf16", "avx512_vnni": "avx512_vnni",
              "avx_vnni": "avx_vnni", "amx_bf16": "amx_bf16", "amx_int8": "amx_int8"}
    for name, flag in claims.items():
        if flag not in flags:
            assert not found[name], f"{name} executed where /proc/cpuinfo has no {flag}"
    assert found["avx2"] == ("avx2" in flags and "fma" in flags)


def test_the_build_flags_are_the_probed_sets_not_march_native():
    if os.uname().machine != "x86_64":
        pytest.skip("other architectures keep -march=native")
    assert "-march=native" not in cpu_native._isa_flags({n: True for n in cpu_native.FEATURES})
    assert cpu_native._isa_flags({n: False for n in cpu_native.FEATURES}) == ["-mtune=native"]
    flags = cpu_native._isa_flags({"avx2": True, "avx512": False})
    assert "-mavx2" in flags and not any(f.startswith("-mavx512") for f in flags)


def test_a_limited_isa_builds_a_baseline_library_with_the_same_answers(tmp_path):
    """ATB_PLUGIN_CPU_ISA=none: the probe's answer is ignored, the library is built for baseline
    x86-64 (portable C int8 kernels) and gives the same W8A8 result, bit for bit (exact integer
    sums, the same float steps)."""
    code = ("import torch; from atb_plugin.ops import cpu_native as c; lib = c.linear_library(torch.device('cpu'));"
            "g = torch.Generator().manual_seed(1); x = torch.randn(5, 70, generator=g);"
            "w = torch.randint(-128, 128, (9, 70), generator=g, dtype=torch.int8); s = torch.rand(9, generator=g);"
            "print(sorted(n for n, ok in c.features().items() if ok), lib.w8a8_variant());"
            "torch.save(c.w8a8_dynamic_linear(lib, x, w, s, None), %r)")
    outputs = {}
    for isa in ("none", ""):
        env = {**os.environ, cpu_native.ISA_ENV: isa, "XDG_CACHE_HOME": str(tmp_path / (isa or "all"))}
        path = str(tmp_path / f"y-{isa or 'all'}.pt")
        done = subprocess.run([sys.executable, "-c", code % path], capture_output=True, text=True, timeout=300,
                              env=env)
        assert done.returncode == 0, done.stderr
        outputs[isa] = (done.stdout.strip(), torch.load(path))
    assert outputs["none"][0] == "[] 0"
    assert torch.equal(outputs["none"][1], outputs[""][1])


def test_an_unknown_isa_name_is_refused(monkeypatch):
    monkeypatch.setenv(cpu_native.ISA_ENV, "avx9000")
    with pytest.raises(ValueError, match="ATB_PLUGIN_CPU_ISA='avx9000': unknown"):
        cpu_native._limit({n: True for n in cpu_native.FEATURES})


# -- W8A16 --------------------------------------------------------------------------------------


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("in_features, out_features", SHAPES)
@pytest.mark.parametrize("with_offset, with_bias", [(True, True), (False, False)])
def test_w8a16_equals_float64(library, rows, in_features, out_features, with_offset, with_bias):
    gen = _gen(rows * 1000 + in_features)
    x = torch.randn(rows, in_features, generator=gen)
    weight = torch.randint(-128, 128, (out_features, in_features), generator=gen, dtype=torch.int8)
    scale = torch.rand(out_features, generator=gen) / 64
    offset = torch.randn(out_features, generator=gen) * 4 if with_offset else None
    bias = torch.randn(out_features, generator=gen) if with_bias else None
    y = cpu_native.w8a16_linear(library, x, weight, scale, offset, bias)
    w = weight.double() + (0 if offset is None else offset.double()[:, None])
    exact = x.double() @ (w * scale.double()[:, None]).T + (0 if bias is None else bias.double())
    magnitude = x.double().abs() @ ((weight.double().abs() + (0 if offset is None else offset.double().abs()[:, None]))
                                    * scale.double()[:, None]).T + (0 if bias is None else bias.double().abs())
    assert y.shape == (rows, out_features) and y.dtype == torch.float32
    _within(y, exact, magnitude, 1e-5)


def test_w8a16_takes_bf16_and_leading_dims_and_strided_rows(library):
    gen = _gen(3)
    wide = torch.randn(2, 3, 90, generator=gen)
    x = wide[..., 5:69]  # rows 90 floats apart
    weight = torch.randint(-128, 128, (21, 64), generator=gen, dtype=torch.int8)
    scale = torch.rand(21, generator=gen)
    y = cpu_native.w8a16_linear(library, x, weight, scale, None, None)
    exact = x.double() @ (weight.double() * scale.double()[:, None]).T
    assert y.shape == (2, 3, 21)
    _within(y, exact, x.double().abs() @ (weight.double().abs() * scale.double()[:, None]).T, 1e-5)
    y16 = cpu_native.w8a16_linear(library, x.to(torch.bfloat16), weight, scale, None, None)
    assert y16.dtype == torch.bfloat16
    exact16 = x.to(torch.bfloat16).double() @ (weight.double() * scale.double()[:, None]).T
    magnitude = x.to(torch.bfloat16).double().abs() @ (weight.double().abs() * scale.double()[:, None]).T
    _within(y16, exact16, magnitude, 1e-5 + 2 ** -8)


def test_int8_kernels_refuse_misfit_operands(library):
    x, weight = torch.randn(2, 8), torch.zeros(4, 8, dtype=torch.int8)
    with pytest.raises(ValueError, match="weight must be contiguous int8"):
        cpu_native.w8a16_linear(library, x, weight.float(), torch.ones(4), None, None)
    with pytest.raises(ValueError, match="does not fit weight"):
        cpu_native.w8a8_dynamic_linear(library, torch.randn(2, 9), weight, torch.ones(4), None)
    with pytest.raises(ValueError, match="scale must be contiguous float32 \\(4,\\)"):
        cpu_native.w8a16_linear(library, x, weight, torch.ones(5), None, None)


# -- W8A8 dynamic -------------------------------------------------------------------------------


def _reference_quantize(x: torch.Tensor):
    """The kernel's quantisation in torch float32 ops (division, round half to even)."""
    s = x.abs().amax(dim=-1) / 127
    safe = torch.where(s > 0, s, torch.ones_like(s))
    return torch.clamp(torch.round(x / safe[:, None]), -128, 127).to(torch.int8), s


def test_quantize_per_token_equals_torch_bit_for_bit(library):
    gen = _gen(7)
    x = torch.randn(37, 301, generator=gen) * torch.logspace(-30, 30, 37)[:, None]
    x[5] = 0.0  # a zero row: s = 0, q = 0
    x[6, :] = torch.tensor([127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5] * 43)  # s = 1: exact halves, to even
    q, s = cpu_native.quantize_per_token(library, x)
    expected_q, expected_s = _reference_quantize(x)
    assert torch.equal(s, expected_s) and torch.equal(q, expected_q)
    assert q[6, :7].tolist() == [127, 0, 2, 2, 0, -2, -2]
    assert q.abs().max() <= 127  # a symmetric scale never makes -128 from finite x


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("in_features, out_features", SHAPES)
def test_w8a8_dynamic_equals_float64_of_the_exact_int32_sum(library, int8_variant, rows, in_features, out_features):
    gen = _gen(rows * 7 + out_features)
    x = torch.randn(rows, in_features, generator=gen) * 3
    if rows > 2:
        x[1] = 0.0
    weight = torch.randint(-128, 128, (out_features, in_features), generator=gen, dtype=torch.int8)
    weight_scale = torch.rand(out_features, generator=gen) / 100
    bias = torch.randn(out_features, generator=gen)
    y = cpu_native.w8a8_dynamic_linear(library, x, weight, weight_scale, bias)
    q, s = _reference_quantize(x)
    acc = q.to(torch.int64) @ weight.to(torch.int64).T  # exact
    scaled = acc.double() * s.double()[:, None] * weight_scale.double()
    _within(y, scaled + bias.double(), scaled.abs() + bias.double().abs(), 2.4e-7)


@pytest.mark.parametrize("in_features", [31, 32, 1000, 4099])
def test_w8a8_int32_sums_are_exact_at_the_extremes(library, int8_variant, in_features):
    """x integer-valued with max |x| = 127 (so s = 1 and q = x), weight_scale 1, no bias: the
    result is float(acc) (rounded as torch rounds int64 -> float32: exact below 2^24, to the
    nearest 8 at K = 4099's 6.7e7), so any lost or saturated product (>= 1 below 2^24, here
    ~16000: a saturated int16 pair in maddubs, a sign slip at -128) shows. Weights at -128 against
    q at +-127 are the worst case."""
    gen = _gen(in_features)
    x = torch.randint(-127, 128, (5, in_features), generator=gen).float()
    x[:, 0] = 127.0
    x[0] = 127.0
    x[1] = -127.0
    x[1, 0] = 127.0
    weight = torch.randint(-128, 128, (7, in_features), generator=gen, dtype=torch.int8)
    weight[0] = -128
    weight[1] = 127
    weight[2, ::2] = -128
    y = cpu_native.w8a8_dynamic_linear(library, x, weight, torch.ones(7), None)
    acc = x.to(torch.int64) @ weight.to(torch.int64).T
    assert torch.equal(y, acc.float())


@pytest.mark.parametrize("rows, in_features", [(1, 576), (3, 5000), (64, 256), (65, 256), (40, 1000)])
def test_w8a8_one_thread_and_a_team_give_the_same_bits(library, rows, in_features):
    """One thread runs without an OpenMP team and, for few rows, with its scratch on the stack
    (rows x in within 64 x 16 KiB); more threads split the blocks. Same sums, same order each."""
    gen = _gen(rows + in_features)
    x = torch.randn(rows, in_features, generator=gen)
    weight = torch.randint(-128, 128, (77, in_features), generator=gen, dtype=torch.int8)
    weight_scale, bias = torch.rand(77, generator=gen) / 50, torch.randn(77, generator=gen)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single = cpu_native.w8a8_dynamic_linear(library, x, weight, weight_scale, bias)
        torch.set_num_threads(2)
        team = cpu_native.w8a8_dynamic_linear(library, x, weight, weight_scale, bias)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(single, team)
    q, s = _reference_quantize(x)
    acc = (q.to(torch.int64) @ weight.to(torch.int64).T).double() * s.double()[:, None] * weight_scale.double()
    _within(single, acc + bias.double(), acc.abs() + bias.double().abs(), 2.4e-7)


def test_w8a8_equals_the_torch_reference_kernel(library, int8_variant, monkeypatch):
    """The same formula as torch_kernels.w8a8_dynamic_linear (the reference every platform matches)."""
    from atb_plugin.ops import torch_kernels

    if not hasattr(torch_kernels, "w8a8_dynamic_linear"):
        pytest.skip("no torch reference here")
    gen = _gen(11)
    x = torch.randn(32, 200, generator=gen)
    weight = torch.randint(-128, 128, (45, 200), generator=gen, dtype=torch.int8)
    weight_scale, bias = torch.rand(45, generator=gen) / 50, torch.randn(45, generator=gen)
    native = cpu_native.w8a8_dynamic_linear(library, x, weight, weight_scale, bias)
    monkeypatch.setenv("ATB_PLUGIN_CPU_KERNELS", "torch")  # the torch formula, not the native kernel it hands over to
    reference = torch_kernels.w8a8_dynamic_linear(x, weight, weight_scale, bias)
    torch.testing.assert_close(native, reference, rtol=1e-6, atol=1e-6)


# -- bfloat16 panels ----------------------------------------------------------------------------


def test_bf16_panels_layout():
    weight = (torch.arange(70 * 5, dtype=torch.float32) % 251 + 1).reshape(70, 5)  # exact in bfloat16, never 0
    panels = cpu_native.weight_panels_bf16(weight)
    assert panels.shape == (2, 3, cpu_native.PANEL, 2) and panels.dtype == torch.bfloat16
    for n, k in [(0, 0), (3, 1), (63, 4), (64, 2), (69, 3)]:
        assert panels[n // 64, k // 2, n % 64, k % 2] == weight[n, k]
    assert panels[1, :, 6:].abs().sum() == 0 and panels[:, 2, :, 1].abs().sum() == 0  # padding


@pytest.mark.parametrize("rows", (1, 2, 3, 4, 5, 6, 7, 32, 100))
@pytest.mark.parametrize("in_features, out_features", SHAPES)
def test_bf16_linear_float32_io_equals_float64(library, rows, in_features, out_features):
    gen = _gen(rows + in_features)
    x = torch.randn(rows, in_features, generator=gen)
    weight = torch.randn(out_features, in_features, generator=gen)
    bias = torch.randn(out_features, generator=gen)
    panels = cpu_native.weight_panels_bf16(weight)
    padded = cpu_native.padded_bias(bias, panels)
    cpu_native.check_panels_bf16(panels, in_features, out_features, padded)
    y = cpu_native.linear_bf16(library, x, panels, in_features, out_features, padded)
    w = weight.to(torch.bfloat16).double()
    assert y.dtype == torch.float32 and y.shape == (rows, out_features)
    _within(y, x.double() @ w.T + bias.double(), x.double().abs() @ w.abs().T + bias.double().abs(), 1e-5)


@pytest.mark.parametrize("rows", (1, 6, 32))
def test_bf16_linear_bf16_io_rounds_once(library, rows):
    gen = _gen(rows)
    x = torch.randn(rows, 3, 130, generator=gen).to(torch.bfloat16)  # leading dims
    weight = torch.randn(97, 130, generator=gen).to(torch.bfloat16)
    panels = cpu_native.weight_panels_bf16(weight)
    y = cpu_native.linear_bf16(library, x, panels, 130, 97, None)
    assert y.dtype == torch.bfloat16 and y.shape == (rows, 3, 97)
    exact = x.double() @ weight.double().T
    magnitude = x.double().abs() @ weight.double().abs().T
    _within(y, exact, magnitude * 1e-5 + exact.abs() * 2 ** -8, 1.0)


@pytest.mark.parametrize("rows", (1, 2, 3, 4, 5, 6, 7, 13, 32))
def test_float32_panels_every_tile_height(library, rows):
    """Each row count has its own tile (and, without AVX-512, its own number of passes over the panel)."""
    gen = _gen(rows)
    x = torch.randn(rows, 77, generator=gen)
    weight, bias = torch.randn(131, 77, generator=gen), torch.randn(131, generator=gen)
    panels = cpu_native.weight_panels(weight)
    y = cpu_native.linear(library, x, panels, 131, cpu_native.padded_bias(bias, panels))
    _within(y, x.double() @ weight.double().T + bias.double(),
            x.double().abs() @ weight.double().abs().T + bias.double().abs(), 1e-5)


def test_bf16_panel_linear_native_and_torch_paths_agree(library, monkeypatch):
    gen = _gen(5)
    dense = nn.Linear(90, 70).to(torch.bfloat16)
    with torch.no_grad():
        dense.weight.copy_(torch.randn(70, 90, generator=gen))
    module = PanelLinear(dense.weight, dense.bias)
    x = torch.randn(4, 90, generator=gen).to(torch.bfloat16)
    native = module(x)
    monkeypatch.setenv(cpu_native.KERNELS_ENV, "torch")
    assert cpu_native.linear_library(torch.device("cpu")) is None
    reference = module(x)
    assert native.dtype == reference.dtype == torch.bfloat16
    torch.testing.assert_close(native.float(), reference.float(), rtol=2 ** -7, atol=1e-2)
    torch.testing.assert_close(reference.float(), dense(x).float(), rtol=2 ** -7, atol=2e-2)


def test_pack_linear_layers_puts_bf16_weights_in_native_panels_by_the_isa_rule(library):
    model = nn.Sequential(nn.Linear(64, 48), nn.Linear(48, 16, bias=False)).to(torch.bfloat16)
    x = torch.randn(3, 64).to(torch.bfloat16)
    expected = model(x)
    summary = pack_linear_layers(model)
    if native_bf16_preferred():
        assert summary.native == 2 and all(isinstance(m, PanelLinear) and m.bf16 for m in model)
    else:  # this CPU runs bfloat16 dot products and oneDNN packs bfloat16: oneDNN keeps it
        assert summary.native == 0
    torch.testing.assert_close(model(x).float(), expected.float(), rtol=2 ** -7, atol=2e-2)


def test_the_torch_choice_leaves_low_precision_to_torch(monkeypatch):
    monkeypatch.setenv(cpu_native.KERNELS_ENV, "torch")
    assert cpu_native.linear_library(torch.device("cpu")) is None
    assert cpu_native.library_for(torch.bfloat16, torch.device("cpu")) is None
    assert not native_bf16_preferred()
    model = nn.Sequential(nn.Linear(32, 16)).to(torch.bfloat16)
    summary = pack_linear_layers(model)
    assert summary.native == 0 and not isinstance(model[0], PanelLinear)
