"""The native CPU kernels' map by instruction set (atb_plugin/ops/csrc/, docs/architecture.md "Native
CPU kernels"): the structs and constants Python shares with C, the dispatch table the probe fills,
each variant against a float64 reference where its instructions execute, and the build's inputs.

Bounds (against float64, as tests/test_cpu_native_lowp.py states them): float32 sums of K products
within 1e-5 x the sum of the products' magnitudes; RMSNorm, rotary, SiLU-and-mul within 1e-6
relative (+1e-6 absolute); attention within 1e-5; W8A8's int32 sums exact, so every variant gives
the same bits.
"""

from __future__ import annotations

import ctypes
import os
import subprocess

import pytest
import torch

from atb_plugin.ops import cpu_native
from tests.test_cpu_native_lowp import _gen, _within

SLOTS = ("paged_decode", "rms_norm", "rotary", "silu_and_mul", "argmax", "linear_panels", "quantize_rows",
         "w8a16_block", "w8a8_block", "linear_bf16_dot")
FLOAT_SLOTS = SLOTS[:6]
# The variant sets a test can ask for, each the probe names it needs (isa_*.c, dispatch.c).
VARIANT_SETS = {
    "portable": (),
    "avx2": ("avx2",),
    "avx512": ("avx2", "avx512"),
    "avx_vnni": ("avx2", "avx_vnni"),
    "avx512_vnni": ("avx2", "avx512", "avx512_vnni"),
    "avx512_bf16": ("avx2", "avx512", "avx512_bf16"),
}


def _found() -> dict[str, bool]:
    """What the probe found ({} where the library does not load: every ISA test then skips)."""
    return cpu_native.features() if cpu_native.linear_library(torch.device("cpu")) is not None else {}


def _missing(names) -> list[str]:
    found = _found()
    return [n for n in names if not found.get(n)]


def _variant_params():
    params = []
    for name, needs in VARIANT_SETS.items():
        missing = _missing(needs)
        reason = (f"{', '.join(missing)} not in cpu_native.features(): this CPU does not execute it (or "
                  f"{cpu_native.ISA_ENV} leaves it out)")
        params.append(pytest.param(name, marks=pytest.mark.skipif(bool(missing), reason=reason), id=name))
    return params


@pytest.fixture(scope="module")
def library():
    lib = cpu_native.linear_library(torch.device("cpu"))
    assert lib is not None, "the native CPU kernels should build on this machine (gcc is installed)"
    return lib


@pytest.fixture
def variant(library, request):
    """Limit the table to one variant set (the test's parameter), then give the probe's back."""
    before = [n for n, ok in cpu_native.features().items() if ok]
    cpu_native.set_features(library, VARIANT_SETS[request.param])
    yield request.param
    cpu_native.set_features(library, before)


def _expected(found: dict[str, bool]) -> dict[str, str]:
    """The best variant of each slot for these features, as the table's rule says it (dispatch.c)."""
    avx2, avx512 = found.get("avx2", False), found.get("avx2", False) and found.get("avx512", False)
    base = "avx512" if avx512 else "avx2" if avx2 else "portable"
    w8a8 = ("avx512_vnni" if avx512 and found.get("avx512_vnni") else "avx_vnni" if avx2 and found.get("avx_vnni")
            else "avx2" if avx2 else "portable")
    return {**{slot: base for slot in FLOAT_SLOTS}, "quantize_rows": "avx2" if avx2 else "portable",
            "w8a16_block": "avx2" if avx2 else "portable", "w8a8_block": w8a8,
            "linear_bf16_dot": "avx512_bf16" if avx512 and found.get("avx512_bf16") else "portable"}


# -- what Python and C share --------------------------------------------------------------------

STRUCTS = {"decode_linear": cpu_native.DecodeLinear, "decode_moe": cpu_native.DecodeMoe, "decode_layer": cpu_native.DecodeLayer,
           "decode_model": cpu_native.DecodeModel, "decode_tp": cpu_native.DecodeTP}


def _constants() -> dict[str, int]:
    return {"PANEL": cpu_native.PANEL, "DOT_SPLIT_ROWS": cpu_native.DOT_SPLIT_ROWS, "LINEAR_F32": cpu_native.LINEAR_F32, "LINEAR_BF16": cpu_native.LINEAR_BF16,
            "LINEAR_W8A16": cpu_native.LINEAR_W8A16, "LINEAR_W8A8_DYNAMIC": cpu_native.LINEAR_W8A8_DYNAMIC,
            "TP_PEER_EXITED": cpu_native.TP_PEER_EXITED, "TP_TIMED_OUT": cpu_native.TP_TIMED_OUT,
            "TP_PEER_ABORTED": cpu_native.TP_PEER_ABORTED,
            **{f"FEATURE_{name.upper()}": 1 << i for i, name in enumerate(cpu_native.FEATURES)}}


def _layout_program() -> str:
    """A C program printing every struct's size, every field's offset and size, and every shared
    constant, one "name value..." line each."""
    lines = ["#include <stddef.h>", "#include <stdio.h>", '#include "cpu_kernels.h"', "int main(void) {"]
    for c_name, structure in STRUCTS.items():
        lines.append(f'    printf("{c_name} %zu\\n", sizeof({c_name}));')
        for field, _ in structure._fields_:
            lines.append(f'    printf("{c_name}.{field} %zu %zu\\n", offsetof({c_name}, {field}), '
                         f'sizeof((({c_name} *)0)->{field}));')
    for name in _constants():
        lines.append(f'    printf("{name} %lld\\n", (long long){name});')
    return "\n".join([*lines, "    return 0;", "}", ""])


def test_the_ctypes_structs_and_constants_match_the_c_header(library, tmp_path):
    """Compiled with the library's own compiler and flags (cpu_native._compile, CFLAGS and the
    probed base), so the C side is the layout the library was built with."""
    source, program = tmp_path / "layout.c", tmp_path / "layout"
    source.write_text(_layout_program())
    compiler, _ = cpu_native._compiler()
    flags = [*cpu_native.CFLAGS, *cpu_native._isa_flags(cpu_native.features()), "-I", str(cpu_native.CSRC)]
    cpu_native._compile(compiler, flags, [source], program)
    printed = dict(line.split(" ", 1) for line in subprocess.run(
        [str(program)], capture_output=True, text=True, check=True, timeout=60).stdout.splitlines())
    expected = {}
    for c_name, structure in STRUCTS.items():
        expected[c_name] = str(ctypes.sizeof(structure))
        for field, _ in structure._fields_:
            descriptor = getattr(structure, field)
            expected[f"{c_name}.{field}"] = f"{descriptor.offset} {descriptor.size}"
    expected.update({name: str(value) for name, value in _constants().items()})
    assert printed == expected


# -- the dispatch table -------------------------------------------------------------------------


def test_each_slot_holds_the_best_variant_the_probe_allows(library):
    table = cpu_native.kernel_map()
    assert tuple(table) == SLOTS
    assert table == _expected(cpu_native.features())
    assert "amx" not in table.values()  # isa_amx.c holds the tile helpers and registers no kernel
    assert library.w8a8_variant() == ("portable", "avx2", "avx_vnni", "avx512_vnni").index(table["w8a8_block"])


@pytest.mark.parametrize("variant", _variant_params(), indirect=True)
def test_the_table_follows_the_features_it_is_given(variant):
    needs = VARIANT_SETS[variant]
    table = cpu_native.kernel_map()
    assert table == _expected({n: True for n in needs})
    assert variant in table.values()  # every variant set fills at least one slot


def test_the_table_never_holds_a_set_the_probe_did_not_find(library):
    absent = [n for n, ok in cpu_native.features().items() if not ok]
    if not absent:
        pytest.skip("every set the probe tries executes here")
    with pytest.raises(ValueError, match="did not execute in the probe"):
        cpu_native.set_features(library, absent[:1])
    assert cpu_native.kernel_map() == _expected(cpu_native.features())


@pytest.mark.skipif(bool(_missing(["amx_int8"])), reason="amx_int8 not in cpu_native.features(): this CPU does not "
                    "execute AMX INT8 (or the kernel denies tile data)")
def test_the_amx_tile_helper_runs_where_amx_executes(library):
    assert library.amx_try_dot(1) == 0  # AMX_DOT_INT8: permission, configuration, one tile product


def test_the_map_is_empty_without_the_library(monkeypatch):
    monkeypatch.setattr(cpu_native, "_loaded", {"error": "not built"})
    assert cpu_native.kernel_map() == {}


# -- each variant against float64 --------------------------------------------------------------


@pytest.mark.parametrize("variant", _variant_params(), indirect=True)
def test_each_variant_s_float_kernels_equal_float64(library, variant):
    gen = _gen(1)
    x = torch.randn(5, 77, generator=gen) * 3
    weight = torch.randn(77, generator=gen)
    exact = weight.double() * x.double() / torch.sqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(cpu_native.rms_norm(library, x, weight, 1e-6).double(), exact, rtol=1e-6, atol=1e-6)

    gate_up = torch.randn(4, 2 * 45, generator=gen) * 4
    gate, up = gate_up.double().chunk(2, dim=-1)
    torch.testing.assert_close(cpu_native.silu_and_mul(library, gate_up).double(), gate * torch.sigmoid(gate) * up,
                               rtol=1e-6, atol=1e-6)

    q = torch.randn(3, 2, 32, generator=gen)
    cos, sin = torch.randn(3, 32, generator=gen), torch.randn(3, 32, generator=gen)
    rotated = torch.cat([-q[..., 16:], q[..., :16]], dim=-1).double()
    exact = q.double() * cos.double()[:, None] + rotated * sin.double()[:, None]
    torch.testing.assert_close(cpu_native.apply_rotary(library, q, cos, sin).double(), exact, rtol=1e-6, atol=1e-6)

    logits = torch.randn(3, 1000, generator=gen)
    logits[1, 700] = logits[1, 900] = 50.0  # the first of equal maxima
    assert cpu_native.argmax(library, logits).tolist() == logits.argmax(dim=-1).tolist() == [
        logits[0].argmax().item(), 700, logits[2].argmax().item()]

    rows, weights = torch.randn(7, 131, generator=gen), torch.randn(70, 131, generator=gen)
    bias = torch.randn(70, generator=gen)
    panels = cpu_native.weight_panels(weights)
    magnitude = rows.double().abs() @ weights.double().abs().T + bias.double().abs()
    _within(cpu_native.linear(library, rows, panels, 70, cpu_native.padded_bias(bias, panels)),
            rows.double() @ weights.double().T + bias.double(), magnitude, 1e-5)
    half = weights.to(torch.bfloat16).double()
    _within(cpu_native.linear_bf16(library, rows, cpu_native.weight_panels_bf16(weights), 131, 70, None),
            rows.double() @ half.T, rows.double().abs() @ half.abs().T, 1e-5)


@pytest.mark.parametrize("variant", _variant_params(), indirect=True)
def test_each_variant_s_decode_attention_equals_float64(library, variant):
    gen = _gen(2)
    heads, kv_heads, head_dim, block_size, lens = 4, 2, 32, 4, [9, 3]
    key_cache, value_cache = (torch.randn(6, block_size, kv_heads, head_dim, generator=gen) for _ in range(2))
    tables = torch.tensor([[1, 2, 3], [4, 0, 0]], dtype=torch.int32)
    query = torch.randn(2, heads, head_dim, generator=gen)
    out = cpu_native.paged_decode(library, query, key_cache, value_cache, tables, torch.tensor(lens, dtype=torch.int32),
                                  4, 0.2)
    for b, length in enumerate(lens):
        blocks = tables[b, :-(-length // block_size)].long()
        keys = key_cache[blocks].reshape(-1, kv_heads, head_dim)[:length].double().repeat_interleave(2, dim=1)
        values = value_cache[blocks].reshape(-1, kv_heads, head_dim)[:length].double().repeat_interleave(2, dim=1)
        p = torch.softmax(torch.einsum("hd,thd->ht", query[b].double(), keys) * 0.2, dim=-1)
        torch.testing.assert_close(out[b].double(), torch.einsum("ht,thd->hd", p, values), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("variant", _variant_params(), indirect=True)
def test_each_variant_s_int8_kernels(library, variant):
    """W8A16 within the float32 bound; W8A8 exact int32 sums, so its result is the same bits in
    every variant (the driver scales them all alike): checked against the portable one."""
    gen = _gen(3)
    x = torch.randn(5, 100, generator=gen)
    weight = torch.randint(-128, 128, (19, 100), generator=gen, dtype=torch.int8)
    scale, offset = torch.rand(19, generator=gen) / 64, torch.randn(19, generator=gen)
    w = (weight.double() + offset.double()[:, None]) * scale.double()[:, None]
    _within(cpu_native.w8a16_linear(library, x, weight, scale, offset, None), x.double() @ w.T,
            x.double().abs() @ ((weight.double().abs() + offset.double().abs()[:, None]) * scale.double()[:, None]).T,
            1e-5)
    integral = torch.randint(-127, 128, (5, 100), generator=gen).float()
    integral[:, 0] = 127.0  # s = 1, q = x: the result is float(acc)
    exact = integral.to(torch.int64) @ weight.to(torch.int64).T
    assert torch.equal(cpu_native.w8a8_dynamic_linear(library, integral, weight, torch.ones(19), None), exact.float())
    y = cpu_native.w8a8_dynamic_linear(library, x, weight, scale, offset)
    cpu_native.set_features(library, [])
    assert torch.equal(y, cpu_native.w8a8_dynamic_linear(library, x, weight, scale, offset))


# -- the build ----------------------------------------------------------------------------------


def test_every_library_source_is_built_with_its_flags():
    on_disk = {p.name for p in cpu_native.CSRC.glob("*.c")} - {"cpu_probe.c"}
    assert set(cpu_native.UNITS) == on_disk  # a new isa_*.c must be listed, with its flags
    if os.uname().machine not in ("x86_64", "amd64"):
        return
    units = cpu_native._unit_flags({n: False for n in cpu_native.FEATURES})
    assert units["cpu_kernels.c"] == ["-mtune=native"]  # the base follows the probe ...
    assert "-mavx512f" in units["isa_avx512.c"] and "-mavx512vnni" in units["isa_avx512_vnni.c"]  # ... a variant never
    assert not any(f.startswith("-march") for flags in units.values() for f in flags)


def test_the_cache_key_covers_every_source_and_header(tmp_path, monkeypatch):
    copy = tmp_path / "csrc"
    copy.mkdir()
    for path in cpu_native.CSRC.iterdir():
        (copy / path.name).write_bytes(path.read_bytes())
    monkeypatch.setattr(cpu_native, "CSRC", copy)
    before = cpu_native._source_digest()
    for name in ("cpu_kernels.h", "int8_tiles.h", "isa_amx.c"):
        path = copy / name
        path.write_bytes(path.read_bytes() + b"\n")
        assert cpu_native._source_digest() != before, name
        before = cpu_native._source_digest()
