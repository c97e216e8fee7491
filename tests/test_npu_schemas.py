"""The simulated torch_npu and the NPU kernels against the real torch_npu op schemas.

``atb_plugin/testing/npu_schemas.txt`` holds the schema strings of the real wheel (regenerate it
with ``scripts/refresh_npu_schemas.py WHEEL``). These tests check that

* every schema parses (``torch._C.parse_schema``) and the fixture's wheel version is the
  ``torch-npu==`` pin of ``setup.py``;
* every fake op's Python signature is the schema's: names, order, defaults, keyword-only markers
  (a schema's ``Tensor self`` is ``input`` in Python, as torch's binding generator names it);
* every ``<torch_npu>.<op>(...)`` call in ``atb_plugin/ops/npu_kernels.py`` (and
  ``npu_fia_kernels.py`` when present) binds to the schema: positional count, keyword names,
  required arguments (``out=`` included) supplied;
* the checkers report seeded breakages (a renamed keyword, a dropped ``out=``, a lost ``*``).
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import math
import re
from pathlib import Path

import pytest
import torch

from atb_plugin.testing import fake_torch_npu

ROOT = Path(__file__).resolve().parent.parent
FIXTURE = ROOT / "atb_plugin" / "testing" / "npu_schemas.txt"
KERNEL_FILES = [ROOT / "atb_plugin" / "ops" / "npu_kernels.py", ROOT / "atb_plugin" / "ops" / "npu_fia_kernels.py"]
FAKE_MODULES = ["atb_plugin.testing.fake_torch_npu", "atb_plugin.testing.fake_fia_ops",
                "atb_plugin.testing.fake_mla_ops"]


# --------------------------------------------------------------------------------------------
# the checkers
# --------------------------------------------------------------------------------------------


def load_schemas(path: Path = FIXTURE) -> tuple[dict[str, str], dict[str, torch._C.FunctionSchema]]:
    """(header fields such as ``wheel`` / ``version``, {op name: parsed schema}) of a fixture."""
    header, schemas = {}, {}
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        if line.startswith("#"):
            m = re.match(r"#\s*([\w .]+?):\s*(.*)$", line)  # ".": an overload, e.g. op.out
            if m:
                header[m.group(1)] = m.group(2).strip()
            continue
        schema = torch._C.parse_schema(line.strip())
        key = schema.name if not schema.overload_name else f"{schema.name}.{schema.overload_name}"
        schemas[key] = schema
    return header, schemas


def _python_name(arg) -> str:
    return "input" if arg.name == "self" else arg.name


def _same_default(schema_default, py_default) -> bool:
    if isinstance(schema_default, float) or isinstance(py_default, float):
        return (isinstance(py_default, (int, float)) and not isinstance(py_default, bool)
                and isinstance(schema_default, (int, float)) and math.isclose(schema_default, py_default))
    return schema_default == py_default and type(schema_default) is type(py_default)


def check_signature(schema: torch._C.FunctionSchema, signature: inspect.Signature) -> list[str]:
    """Problems binding a Python function with ``signature`` as the op ``schema`` (empty: none):
    argument names and order, keyword-only markers, defaults."""
    problems = []
    params = list(signature.parameters.values())
    for p in params:
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            problems.append(f"{schema.name}: takes *{p.name}/**{p.name}; the schema lists every argument")
    params = [p for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    for i, arg in enumerate(schema.arguments):
        name = _python_name(arg)
        if i >= len(params):
            problems.append(f"{schema.name}: argument {i} {name!r} is missing")
            continue
        p = params[i]
        if p.name != name:
            problems.append(f"{schema.name}: argument {i} is {p.name!r}, the schema says {name!r}")
        if arg.kwarg_only and p.kind != p.KEYWORD_ONLY:
            problems.append(f"{schema.name}: {name!r} must be keyword-only (after '*' in the schema)")
        if not arg.kwarg_only and p.kind == p.KEYWORD_ONLY:
            problems.append(f"{schema.name}: {name!r} is keyword-only, the schema lets it be positional")
        if arg.has_default_value():
            if p.default is p.empty:
                problems.append(f"{schema.name}: {name!r} has no default, the schema's is {arg.default_value!r}")
            elif not _same_default(arg.default_value, p.default):
                problems.append(f"{schema.name}: {name!r} defaults to {p.default!r}, the schema's is "
                                f"{arg.default_value!r}")
        elif p.default is not p.empty:
            problems.append(f"{schema.name}: {name!r} defaults to {p.default!r}, the schema has no default")
    for p in params[len(schema.arguments):]:
        problems.append(f"{schema.name}: extra argument {p.name!r} not in the schema")
    return problems


def _op_calls(tree: ast.AST, ops):
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in ops:
            yield node


def check_call_sites(source: str, schemas: dict[str, torch._C.FunctionSchema], filename: str = "<source>") -> list[str]:
    """Problems binding every ``<x>.<op>(...)`` call in ``source`` (``op`` a schema name) to the
    schema: too many positional arguments, unknown keywords, an argument given twice, a required
    argument (``out=`` included: dropping it loses the result) not supplied."""
    problems = []
    for call in _op_calls(ast.parse(source, filename), schemas):
        schema, where = schemas[call.func.attr], f"{filename}:{call.lineno} {call.func.attr}"
        if any(isinstance(a, ast.Starred) for a in call.args) or any(k.arg is None for k in call.keywords):
            problems.append(f"{where}: *args / **kwargs cannot be checked against the schema")
            continue
        positional = [a for a in schema.arguments if not a.kwarg_only]
        names = [_python_name(a) for a in schema.arguments]
        if len(call.args) > len(positional):
            problems.append(f"{where}: {len(call.args)} positional arguments, the schema takes {len(positional)}")
        given = {_python_name(a) for a in positional[:len(call.args)]}
        for kw in call.keywords:
            if kw.arg not in names:
                problems.append(f"{where}: unknown keyword {kw.arg!r} (schema: {', '.join(names)})")
            elif kw.arg in given:
                problems.append(f"{where}: {kw.arg!r} given positionally and by keyword")
            given.add(kw.arg)
        for arg in schema.arguments:
            if not arg.has_default_value() and _python_name(arg) not in given:
                kind = "the output tensor" if arg.alias_info is not None and arg.alias_info.is_write else "required"
                problems.append(f"{where}: {_python_name(arg)!r} ({kind}) not supplied")
    return problems


def _fake_ops():
    """{op name: function} of every fake module present."""
    found = {}
    for module_name in FAKE_MODULES:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        _, schemas = load_schemas()
        for name in schemas:
            fn = getattr(module, name, None)
            if callable(fn):
                found[(module_name, name)] = fn
    return found


# --------------------------------------------------------------------------------------------
# the fixture
# --------------------------------------------------------------------------------------------


CALLED_OPS = ["_npu_reshape_and_cache", "_npu_flash_attention", "_npu_flash_attention_unpad", "_npu_paged_attention",
              "_npu_paged_attention_splitfuse", "npu_rms_norm", "npu_rotary_mul", "npu_swiglu",
              "npu_moe_gating_top_k_softmax", "npu_moe_init_routing", "npu_moe_compute_expert_tokens",
              "npu_grouped_matmul", "npu_moe_finalize_routing", "npu_quant_matmul", "npu_dynamic_quant",
              "npu_weight_quant_batchmatmul", "npu_quantize"]
QUANT_OPS = ["npu_quant_matmul", "npu_dynamic_quant", "npu_weight_quant_batchmatmul", "npu_quantize"]


def test_fixture_parses_and_covers_the_ops_in_use():
    header, schemas = load_schemas()
    assert set(CALLED_OPS) | {"npu_fused_infer_attention_score", "npu_scatter_pa_kv_cache"} <= set(schemas)
    assert header["wheel"].startswith(f"torch_npu-{header['version']}-")
    for op in schemas:
        assert f"source {op}" in header, f"the fixture does not say where {op}'s schema came from"


def test_fixture_version_is_the_setup_py_pin():
    header, _ = load_schemas()
    pins = re.findall(r"torch-npu==([\w.+-]+)", (ROOT / "setup.py").read_text())
    assert pins, "setup.py pins no torch-npu version"
    assert set(pins) == {header["version"]}, (
        f"setup.py pins torch-npu {pins}, the schema fixture is from {header['version']}: "
        "rerun scripts/refresh_npu_schemas.py on the pinned wheel")


def test_every_kernel_call_has_a_schema():
    _, schemas = load_schemas()
    for path in KERNEL_FILES:
        if not path.exists():
            continue
        tree = ast.parse(path.read_text(), str(path))
        called = {node.func.attr for node in ast.walk(tree) if isinstance(node, ast.Call)
                  and isinstance(node.func, ast.Attribute) and re.match(r"_?npu_", node.func.attr)}
        assert called <= set(schemas), f"{path.name} calls ops without a schema in the fixture: {called - set(schemas)}"


# --------------------------------------------------------------------------------------------
# the fakes and the kernels against the fixture
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("op", [fn.__name__ for fn in fake_torch_npu.OPS])
def test_fake_signature_matches_schema(op):
    _, schemas = load_schemas()
    assert op in schemas, f"the fake implements {op}, which has no schema in the fixture"
    assert check_signature(schemas[op], inspect.signature(getattr(fake_torch_npu, op))) == []


def test_quantised_linear_fakes_are_checked_against_the_fixture():
    """The W8A8 / W8A16 ops the quantised linears call: each has a schema from the wheel, a fake in
    ``OPS`` (so the parametrised signature check above covers it) and the same signature, and the
    kernels call each of them (so the call-site check binds those calls too)."""
    _, schemas = load_schemas()
    faked = {fn.__name__ for fn in fake_torch_npu.OPS}
    called = {node.func.attr for node in ast.walk(ast.parse(KERNEL_FILES[0].read_text()))
              if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)}
    for op in QUANT_OPS:
        assert op in schemas and op in faked and op in called, op
        assert check_signature(schemas[op], inspect.signature(getattr(fake_torch_npu, op))) == [], op


def test_checker_reports_quant_signature_drift():
    """A lost keyword-only marker or a renamed argument in the quantised ops is reported."""
    _, schemas = load_schemas()

    def positional_pertoken(x1, x2, scale, offset=None, pertoken_scale=None, bias=None, output_dtype=None,
                            x1_dtype=None, x2_dtype=None, pertoken_scale_dtype=None, scale_dtype=None,
                            group_sizes=None, y_scale=None):
        pass

    def zero_point_default(input, scales, zero_points=None, dtype=1, axis=1, div_mode=True):  # noqa: A002
        pass

    assert any("'pertoken_scale' must be keyword-only" in p for p in check_signature(
        schemas["npu_quant_matmul"], inspect.signature(positional_pertoken)))
    assert any("'zero_points' defaults to None" in p for p in check_signature(
        schemas["npu_quantize"], inspect.signature(zero_point_default)))


def test_other_fake_modules_match_schemas():
    """``fake_fia_ops`` (when present): every function named like an op in the fixture."""
    _, schemas = load_schemas()
    others = {key: fn for key, fn in _fake_ops().items() if key[0] != "atb_plugin.testing.fake_torch_npu"}
    if not others:
        pytest.skip("no other fake op module present")
    for (module_name, op), fn in others.items():
        assert check_signature(schemas[op], inspect.signature(fn)) == [], module_name


def test_installed_fake_module_exposes_the_same_signatures():
    """The counting wrappers the installed module hands out keep the signatures (functools.wraps)."""
    _, schemas = load_schemas()
    module = fake_torch_npu.build_module()
    for fn in fake_torch_npu.OPS:
        assert check_signature(schemas[fn.__name__], inspect.signature(getattr(module, fn.__name__))) == []


@pytest.mark.parametrize("path", KERNEL_FILES, ids=lambda p: p.name)
def test_kernel_call_sites_bind_to_schemas(path):
    if not path.exists():
        pytest.skip(f"{path.name} not present")
    _, schemas = load_schemas()
    source = path.read_text()
    assert list(_op_calls(ast.parse(source), schemas)), f"no torch_npu op calls found in {path.name}"
    assert check_call_sites(source, schemas, path.name) == []


# --------------------------------------------------------------------------------------------
# seeded breakages: the checkers must notice
# --------------------------------------------------------------------------------------------


def _schema(text: str) -> torch._C.FunctionSchema:
    return torch._C.parse_schema(text)


def test_checker_reports_a_renamed_keyword_in_the_schema():
    _, schemas = load_schemas()
    real = str(schemas["_npu_flash_attention"])
    renamed = _schema(real.replace("Tensor seq_len", "Tensor seq_lens"))
    problems = check_signature(renamed, inspect.signature(fake_torch_npu._npu_flash_attention))
    assert any("'seq_len'" in p and "'seq_lens'" in p for p in problems), problems
    source = Path(KERNEL_FILES[0]).read_text()
    problems = check_call_sites(source, {**schemas, "_npu_flash_attention": renamed})
    assert any("unknown keyword 'seq_len'" in p for p in problems), problems
    assert any("'seq_lens' (required) not supplied" in p for p in problems), problems


def test_checker_reports_a_dropped_out_argument():
    _, schemas = load_schemas()
    source = Path(KERNEL_FILES[0]).read_text()
    broken = re.sub(r",\s*out=out\)", ")", source, count=1)
    assert broken != source
    problems = check_call_sites(broken, schemas)
    assert any("'out' (the output tensor) not supplied" in p for p in problems), problems

    def no_out(query, key_cache, value_cache, num_kv_heads, num_heads, scale_value, block_table, context_lens, *,
               workspace=None):
        pass

    problems = check_signature(schemas["_npu_paged_attention"], inspect.signature(no_out))
    assert any("'workspace'" in p or "'out'" in p for p in problems), problems


def test_checker_reports_signature_drift():
    _, schemas = load_schemas()

    def old_paged(query, key_cache, value_cache, num_kv_heads, num_heads, scale_value, block_table, context_lens, out):
        pass

    def positional_workspace(query, key_cache, value_cache, num_kv_heads, num_heads, scale_value, block_table,
                             context_lens, out, workspace=None):
        pass

    def old_rms_norm(self, gamma, epsilon=1e-6):
        pass

    def wrong_default(input, gamma, epsilon=1e-5):  # noqa: A002
        pass

    def no_rotate(input, r1, r2, rotary_mode="half"):  # noqa: A002
        pass

    assert any("argument 9 'workspace' is missing" in p for p in check_signature(schemas["_npu_paged_attention"],
                                                                                 inspect.signature(old_paged)))
    assert any("must be keyword-only" in p for p in check_signature(schemas["_npu_paged_attention"],
                                                                    inspect.signature(positional_workspace)))
    assert any("'self', the schema says 'input'" in p for p in check_signature(schemas["npu_rms_norm"],
                                                                              inspect.signature(old_rms_norm)))
    assert any("defaults to 1e-05" in p for p in check_signature(schemas["npu_rms_norm"],
                                                                 inspect.signature(wrong_default)))
    assert any("'rotate' is missing" in p for p in check_signature(schemas["npu_rotary_mul"],
                                                                   inspect.signature(no_rotate)))


def test_checker_reports_bad_call_sites():
    _, schemas = load_schemas()
    source = """
def f(npu, x, w, q, k, v, kc, vc, bt, cl, out):
    npu.npu_rms_norm(self=x, gamma=w)
    npu.npu_swiglu(x, -1, 3)
    npu._npu_paged_attention(q, kc, vc, 1, 1, 1.0, bt, cl, out, ws)
    npu._npu_paged_attention(q, kc, vc, 1, 1, 1.0, bt, cl, out, out=out)
    npu.npu_rotary_mul(**kwargs)
"""
    problems = check_call_sites(source, schemas)
    assert any("unknown keyword 'self'" in p for p in problems)
    assert any("3 positional arguments, the schema takes 2" in p for p in problems)
    assert any("10 positional arguments, the schema takes 9" in p for p in problems)
    assert any("'out' given positionally and by keyword" in p for p in problems)
    assert any("cannot be checked" in p for p in problems)
    assert check_call_sites("npu.npu_rms_norm(input=x, gamma=w, epsilon=1e-6)", schemas) == []


def test_refresh_script_reproduces_the_fixture(tmp_path):
    """Runs only where the wheel has been downloaded (it is not fetched here)."""
    wheels = sorted(Path("/tmp/npuwheel").glob("torch_npu-*.whl")) if Path("/tmp/npuwheel").is_dir() else []
    header, _ = load_schemas()
    wheels = [w for w in wheels if w.name == header["wheel"]]
    if not wheels:
        pytest.skip("the torch_npu wheel is not downloaded here")
    spec = importlib.util.spec_from_file_location("refresh_npu_schemas", ROOT / "scripts" / "refresh_npu_schemas.py")
    refresh = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(refresh)
    out = tmp_path / "schemas.txt"
    assert refresh.main([str(wheels[0]), "-o", str(out)]) == 0
    assert out.read_text() == FIXTURE.read_text()
