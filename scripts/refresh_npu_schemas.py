#!/usr/bin/env python3
"""Regenerate ``atb_plugin/testing/npu_schemas.txt`` from a downloaded torch_npu wheel.

    python scripts/refresh_npu_schemas.py /path/to/torch_npu-X.Y.Z-...whl [-o FIXTURE]

The wheel is read as a zip (stdlib only: ``zipfile`` + ``re``); nothing is imported or installed.
Where each schema comes from:

* aclnn ops (``npu_rms_norm``, ``npu_rotary_mul``, ``npu_swiglu``, ``npu_scatter_pa_kv_cache``,
  ``npu_fused_infer_attention_score``, the MoE ops ``npu_moe_gating_top_k_softmax``,
  ``npu_moe_init_routing``, ``npu_moe_compute_expert_tokens``, ``npu_grouped_matmul``,
  ``npu_moe_finalize_routing``, the quantised-linear ops ``npu_quant_matmul``, ``npu_dynamic_quant``,
  ``npu_weight_quant_batchmatmul``, ``npu_quantize``, DeepSeek's ``npu_kv_rmsnorm_rope_cache`` and
  ``npu_moe_gating_top_k``): the Python-binding signature strings compiled into
  ``torch_npu/lib/libtorch_npu.so`` (these name the first tensor ``input`` where the yaml says
  ``self``: that is what Python callers bind to). When a binding string is not parseable as a
  schema (C++ types such as ``SymIntArrayRef``), the ``func:`` line of
  ``torch_npu/csrc/aten/npu_native_functions_by_codegen.yaml`` is used instead.
* ATB ops (``_npu_*``): the wheel ships no schema text for them. ``libop_plugin_atb.so`` holds
  each ``m.def`` string, but the compiler stores it as 16-byte pieces scattered through
  ``.rodata``. So a candidate schema is built from the generated C++ declaration in
  ``torch_npu/include/third_party/op-plugin/op_plugin/include/AtbOpsInterface.h`` (types mapped
  to schema types; ``Tensor&`` -> ``Tensor(a!)``, ``(b!)``...; trailing ``optional`` parameters
  after the out tensor as keyword-only ``=None``, spelled ``*, `` or ``*,``) and accepted only if
  every 16-byte piece of it occurs in the library, so the written string is the library's own.
"""

from __future__ import annotations

import argparse
import re
import sys
import zipfile
from pathlib import Path

ATB_OPS = (
    "_npu_reshape_and_cache",
    "_npu_flash_attention",
    "_npu_flash_attention_unpad",
    "_npu_paged_attention",
    "_npu_paged_attention_splitfuse",
)
ACLNN_OPS = (
    "npu_rms_norm",
    "npu_rotary_mul",
    "npu_swiglu",
    "npu_fused_infer_attention_score",
    "npu_scatter_pa_kv_cache",
    "npu_moe_gating_top_k_softmax",
    "npu_moe_init_routing",
    "npu_moe_compute_expert_tokens",
    "npu_grouped_matmul",
    "npu_moe_finalize_routing",
    "npu_quant_matmul",
    "npu_dynamic_quant",
    "npu_weight_quant_batchmatmul",
    "npu_quantize",
    # DeepSeek's MLA and grouped gating (models/deepseek.py)
    "npu_kv_rmsnorm_rope_cache",
    "npu_moe_gating_top_k",
)
# Graph mode (ACL graph capture and its task update, atb_plugin/engine/graph_runner.py): written as
# a section of their own at the end of the fixture.
GRAPH_ATB_OPS = ("_npu_paged_attention_get_workspace",)
GRAPH_ACLNN_OPS = ("npu_fused_infer_attention_score.out", "_npu_fused_infer_attention_score_get_max_workspace")
GRAPH_SECTION = "# --- graph mode (ACL graph capture and task update; docs/graph-mode.md) ---"
ATB_HEADER = "torch_npu/include/third_party/op-plugin/op_plugin/include/AtbOpsInterface.h"
ATB_LIB = "torch_npu/lib/libop_plugin_atb.so"
BINDING_LIB = "torch_npu/lib/libtorch_npu.so"
NATIVE_YAML = "torch_npu/csrc/aten/npu_native_functions_by_codegen.yaml"
DEFAULT_OUT = Path(__file__).resolve().parent.parent / "atb_plugin" / "testing" / "npu_schemas.txt"

# Schema argument types a parseable schema may use (binding strings with C++ types are skipped).
_SCHEMA_TYPE = re.compile(r"^(Tensor(\([a-z]!?\))?\??|int\??|float\??|bool\??|str\??|SymInt(\[\d*\])?\??|"
                          r"int\[\d*\]\??|float\[\]\??|Tensor\[\]\??|Scalar\??|\*)$")


def _wheel_version(names: list[str], wheel: Path) -> str:
    for name in names:
        m = re.match(r"torch_npu-([^/]+)\.dist-info/METADATA$", name)
        if m:
            return m.group(1)
    m = re.match(r"torch_npu-([^-]+)-", wheel.name)
    if not m:
        raise SystemExit(f"cannot tell the torch_npu version of {wheel}")
    return m.group(1)


def _parseable(schema: str) -> bool:
    m = re.match(r"^[A-Za-z_][\w.]*\((.*)\)\s*->\s*.+$", schema)
    if not m:
        return False
    for arg in _split_args(m.group(1)):
        arg = arg.strip()
        if arg == "*":
            continue
        arg_type = arg.split("=", 1)[0].split()[0] if arg else ""
        if not _SCHEMA_TYPE.match(arg_type):
            return False
    return True


def _split_args(text: str) -> list[str]:
    out, depth, cur = [], 0, ""
    for ch in text:
        if ch in "([<":
            depth += 1
        elif ch in ")]>":
            depth -= 1
        if ch == "," and depth == 0:
            out.append(cur)
            cur = ""
        else:
            cur += ch
    if cur.strip():
        out.append(cur)
    return out


def _binding_schema(op: str, lib: bytes, yaml_text: str) -> tuple[str, str]:
    candidates = [m.group(0).decode() for m in re.finditer(rb"(?<![\w:.])" + re.escape(op.encode()) +
                                                             rb"\([\x20-\x7e]*?\) -> [\x20-\x7e]+", lib)]
    for schema in candidates:
        if _parseable(schema):
            return schema, BINDING_LIB
    m = re.search(r"func:\s*(" + re.escape(op) + r"\(.*\)\s*->\s*.+)$", yaml_text, re.M)
    if m and _parseable(m.group(1).strip()):
        return m.group(1).strip(), NATIVE_YAML
    raise SystemExit(f"no parseable schema for {op} in {BINDING_LIB} or {NATIVE_YAML}")


_CPP_TYPES = (
    (re.compile(r"^(const\s+)?(c10::|std::)optional<\s*at::Tensor\s*>\s*&?$"), "Tensor?"),
    (re.compile(r"^const\s+at::Tensor\s*&$"), "Tensor"),
    (re.compile(r"^at::Tensor\s*&$"), "Tensor(!)"),
    (re.compile(r"^(const\s+)?int64_t$"), "int"),
    (re.compile(r"^(const\s+)?double$"), "float"),
    (re.compile(r"^(const\s+)?bool$"), "bool"),
)


def _atb_candidates(op: str, header: str) -> list[str]:
    m = re.search(r"TORCH_NPU_API\s+(void|at::Tensor)\s+" + re.escape(op) + r"\((.*?)\);", header)
    if not m:
        raise SystemExit(f"{op}: no declaration in {ATB_HEADER}")
    returns = "()" if m.group(1) == "void" else "Tensor"
    params = []
    for decl in _split_args(m.group(2)):
        decl = " ".join(decl.replace("&", " & ").split())
        cpp_type, name = decl.rsplit(" ", 1)
        cpp_type = cpp_type.replace(" &", "&").replace("< ", "<").replace(" >", ">")
        for pattern, schema_type in _CPP_TYPES:
            if pattern.match(cpp_type):
                params.append((schema_type, name))
                break
        else:
            raise SystemExit(f"{op}: unmapped C++ type {cpp_type!r}")
    alias = iter("abcdefgh")
    typed = [(f"Tensor({next(alias)}!)" if t == "Tensor(!)" else t, n) for t, n in params]
    last_out = max((i for i, (t, _) in enumerate(typed) if t.endswith("!)")), default=-1)
    trailing = [i for i in range(last_out + 1, len(typed)) if typed[i][0] == "Tensor?"]
    head = [f"{t} {n}" for t, n in typed[: len(typed) - len(trailing)]]
    if not trailing:
        return [f"{op}({', '.join(head)}) -> {returns}"]
    tail = [f"{typed[i][0]} {typed[i][1]}=None" for i in trailing]
    return [f"{op}({', '.join(head)}, *{sep}{', '.join(tail)}) -> {returns}" for sep in (", ", ",")] + \
           [f"{op}({', '.join(head + tail)}) -> {returns}"]


def _in_library(schema: str, lib: bytes) -> bool:
    data = schema.encode()
    if data in lib:
        return True
    return all(data[i:i + 16] in lib for i in range(0, len(data), 16))


def extract(wheel: Path, atb_ops=ATB_OPS, aclnn_ops=ACLNN_OPS) -> tuple[str, list[tuple[str, str, str]]]:
    """(version, [(op, source file in the wheel, schema)]) read from ``wheel``."""
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        version = _wheel_version(names, wheel)
        header = zf.read(ATB_HEADER).decode()
        atb_lib = zf.read(ATB_LIB)
        binding_lib = zf.read(BINDING_LIB)
        yaml_text = zf.read(NATIVE_YAML).decode()
    rows = []
    for op in atb_ops:
        found = [c for c in _atb_candidates(op, header) if _in_library(c, atb_lib)]
        if not found:
            raise SystemExit(f"{op}: no candidate built from {ATB_HEADER} matches {ATB_LIB}")
        rows.append((op, f"{ATB_LIB} (declared in {ATB_HEADER})", found[0]))
    for op in aclnn_ops:
        schema, source = _binding_schema(op, binding_lib, yaml_text)
        rows.append((op, source, schema))
    return version, rows


def render_section(title: str, rows: list[tuple[str, str, str]]) -> str:
    """A trailing section: its title, then its rows' sources and schemas."""
    lines = [title] + [f"# source {op}: {source}" for op, source, _ in rows] + [schema for _, _, schema in rows]
    return "\n".join(lines) + "\n"


def render(wheel_name: str, version: str, rows: list[tuple[str, str, str]]) -> str:
    lines = [
        "# Real torch_npu op schemas for the ops atb_plugin calls (and the fakes it ships).",
        "# Generated by scripts/refresh_npu_schemas.py from the wheel named below; do not edit by hand.",
        "# Every non-comment line is one schema, parseable by torch._C.parse_schema.",
        f"# wheel: {wheel_name}",
        f"# version: {version}",
    ]
    lines += [f"# source {op}: {source}" for op, source, _ in rows]
    lines += [schema for _, _, schema in rows]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("wheel", type=Path)
    parser.add_argument("-o", "--output", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    version, rows = extract(args.wheel)
    _, graph_rows = extract(args.wheel, GRAPH_ATB_OPS, GRAPH_ACLNN_OPS)
    args.output.write_text(render(args.wheel.name, version, rows) + render_section(GRAPH_SECTION, graph_rows))
    print(f"wrote {len(rows) + len(graph_rows)} schemas (torch_npu {version}) to {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
