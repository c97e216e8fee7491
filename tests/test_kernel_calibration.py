"""The CPU float linear form chosen by measurement (atb_plugin/ops/calibration.py): every candidate
checked against float64 before it is timed (a wrong one disabled, the engine still right), the
answer cached per CPU model / flags / threads / sources / shapes, ``ATB_PLUGIN_CPU_KERNELS``
pinning a form, the choice logged. Tiny shapes and a small time budget: these tests hold whichever
form wins on this machine (they check consistency, never a winner)."""

from __future__ import annotations

import json
import logging
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from torch import nn

from atb_plugin import LLM, SamplingParams
from atb_plugin.ops import calibration, cpu_native
from atb_plugin.ops.packed_linear import PackedLinear, PanelLinear, dense_linear
from atb_plugin.testing.tiny import tiny_checkpoint

SHAPES = [("float32", 200, 96, True)] * 3 + [("float32", 64, 200, False)] * 2 + [("bfloat16", 130, 64, False)] * 2
PROMPTS = ["hello world", "the quick brown fox"]


def native_available() -> bool:
    return cpu_native.library_for(torch.float32, torch.device("cpu")) is not None


needs_native = pytest.mark.skipif(not native_available(), reason="the native CPU kernels do not build here")


@pytest.fixture(autouse=True)
def quick(monkeypatch, tmp_path):
    """A cache of this test's own, every model timed (tiny ones too), a budget of milliseconds."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv(cpu_native.KERNELS_ENV, raising=False)
    monkeypatch.setattr(calibration, "MIN_TIMED_BYTES", 0)
    monkeypatch.setattr(calibration, "DEFAULT_BUDGET_S", 0.02)
    monkeypatch.setattr(calibration, "COLD_BYTES", 1 << 16)
    monkeypatch.setattr(calibration, "MAX_ROUNDS", 3)


class BrokenPanels(PanelLinear):
    """A deliberately wrong variant of the panels (one output column off), as a kernel for an
    instruction set the development machines lack could be."""

    def forward(self, x):
        out = super().forward(x).clone()
        out[..., 0] += 1.0
        return out


@pytest.fixture
def broken_panels(monkeypatch):
    monkeypatch.setitem(calibration.CANDIDATES, "panels",
                        calibration.Candidate("panels", BrokenPanels, calibration._panels_unavailable))


def _cached_files(tmp_path):
    return sorted((tmp_path / "cache" / "atb-plugin" / "kernels").glob("linear-calibration-*.json"))


@needs_native
def test_every_candidate_agrees_with_float64_and_the_choice_follows_the_timings():
    choices = calibration.calibrate(SHAPES)
    assert set(choices) == {"float32", "bfloat16"}
    for choice in choices.values():
        assert not any(why.startswith("wrong") for why in choice.disabled.values())
        assert choice.form in choice.timings and set(choice.timings) | set(choice.disabled) == set(calibration.CANDIDATES)
        assert all(set(rows) == set(calibration.ROWS) and min(rows.values()) > 0 for rows in choice.timings.values())
        assert (choice.form, choice.reason) == calibration.decide(choice.timings)


def test_the_candidates_are_the_forms_the_env_may_pin():
    assert tuple(calibration.CANDIDATES) == cpu_native.LINEAR_FORMS
    assert tuple(calibration.DTYPES) == cpu_native.LINEAR_FORM_DTYPES


def test_the_decision_rule():
    def timings(**forms):
        return {name: {1: one, 32: batch} for name, (one, batch) in forms.items()}

    # the fastest at one row wins ...
    assert calibration.decide(timings(panels=(2.0, 5.0), onednn=(1.0, 5.0), dense=(3.0, 5.0)))[0] == "onednn"
    # ... the panels (captured) within CAPTURE_MARGIN of it ...
    assert calibration.decide(timings(panels=(1.05, 5.0), onednn=(1.0, 5.0)))[0] == "panels"
    # ... unless it loses 32 rows by more than PREFILL_MARGIN: then the best of the others at one row
    chosen, why = calibration.decide(timings(panels=(1.0, 10.0), onednn=(1.5, 4.0), dense=(1.2, 5.0)))
    assert chosen == "dense" and "panels over 1.5x the best at 32 rows" in why


@needs_native
def test_a_wrong_candidate_is_disabled_with_one_warning_and_the_engine_stays_right(broken_panels, caplog):
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    with LLM(tiny_checkpoint("qwen2"), block_size=4, pack_weights=False) as llm:  # the reference: dense layers
        reference = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
    with caplog.at_level(logging.INFO, logger=calibration.__name__):
        with LLM(tiny_checkpoint("qwen2"), block_size=4) as llm:
            model = llm.engine.core.runner.model
            tokens = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "linear form 'panels' disabled for float32 weights" in warnings[0]
    assert "float64 reference" in warnings[0] and "beyond" in warnings[0]
    assert not any(isinstance(m, PanelLinear) for m in model.modules())
    assert any(isinstance(m, (PackedLinear, nn.Linear)) for m in model.modules())
    assert llm.engine.core.runner.decode_capture != "captured"  # only the panels are captured
    assert tokens == reference


@needs_native
def test_a_broken_candidate_is_never_timed(broken_panels):
    choice = calibration.calibrate(SHAPES)["float32"]
    assert choice.disabled["panels"].startswith("wrong: (200, 96) at 1 rows: max |error|")
    assert "panels" not in choice.timings and choice.form != "panels"


def test_a_lone_form_is_taken_untimed(monkeypatch):
    for name in ("panels", "onednn"):
        monkeypatch.setitem(calibration.CANDIDATES, name, calibration.Candidate(
            name, calibration.CANDIDATES[name].build, lambda dtype: "not on this machine"))
    monkeypatch.setattr(calibration, "measure", lambda *a, **k: pytest.fail("timed a lone form"))
    for choice in calibration.calibrate(SHAPES).values():
        assert choice.form == "dense" and not choice.timings
        assert choice.reason == "the only form left here (panels: not on this machine; onednn: not on this machine)"


def test_the_check_bound_holds_for_a_right_product_and_fails_a_wrong_one():
    generator = torch.Generator().manual_seed(1)
    for dtype in ("float32", "bfloat16"):
        assert calibration.check(calibration.CANDIDATES["dense"], (dtype, 70, 300, True), generator) is None
    wrong = calibration.Candidate("dense", lambda w, b: dense_linear(w * 1.01, b), lambda dtype: None)
    assert "beyond" in calibration.check(wrong, ("float32", 70, 300, False), generator)
    assert calibration.tolerance(torch.float32, 576) < 1e-4 < calibration.tolerance(torch.bfloat16, 576) < 1e-2


def test_the_cache_is_keyed_and_measured_again_on_a_flag_or_thread_change(monkeypatch, tmp_path):
    measured = []
    real = calibration.calibrate
    monkeypatch.setattr(calibration, "calibrate", lambda *a, **k: measured.append(1) or real(*a, **k))
    first, cached = calibration.cached_choices(SHAPES)
    assert not cached and len(measured) == 1 and len(_cached_files(tmp_path)) == 1
    again, cached = calibration.cached_choices(SHAPES)
    assert cached and len(measured) == 1
    assert {n: c.form for n, c in again.items()} == {n: c.form for n, c in first.items()}
    # another CPU's flags (a VM migrated, ATB_PLUGIN_CPU_ISA): measured again, in a file of its own
    flags = cpu_native.features()
    monkeypatch.setattr(cpu_native, "features", lambda: {**flags, "amx_bf16": not flags.get("amx_bf16")})
    _, cached = calibration.cached_choices(SHAPES)
    assert not cached and len(measured) == 2 and len(_cached_files(tmp_path)) == 2
    monkeypatch.setattr(cpu_native, "features", lambda: flags)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)
        _, cached = calibration.cached_choices(SHAPES)
        assert not cached and len(measured) == 3
    finally:
        torch.set_num_threads(threads)
    _, cached = calibration.cached_choices(SHAPES)
    assert cached and len(measured) == 3
    # other shapes (another model): measured again
    _, cached = calibration.cached_choices(SHAPES[:3])
    assert not cached and len(measured) == 4


def test_loads_at_once_measure_once(monkeypatch, tmp_path):
    """Two loads at once (the ranks of a tensor-parallel model): one measures, the other waits
    for the lock and reads its answer."""
    measured = []
    real = calibration.calibrate
    monkeypatch.setattr(calibration, "calibrate", lambda *a, **k: measured.append(1) or real(*a, **k))
    with ThreadPoolExecutor(2) as pool:
        answers = list(pool.map(lambda _: calibration.cached_choices(SHAPES), range(2)))
    assert len(measured) == 1 and sorted(cached for _, cached in answers) == [False, True]
    assert len(_cached_files(tmp_path)) == 1


def test_other_dtypes_are_not_measured(monkeypatch, tmp_path):
    monkeypatch.setattr(calibration, "calibrate", lambda *a, **k: pytest.fail("measured float16"))
    rule, current = calibration.packing_rule([("float16", 200, 96, False)] * 4), calibration.PackingRule.current()
    for dtype in (*calibration.DTYPES.values(), torch.float16):
        assert calibration._rule_form(rule, dtype) == calibration._rule_form(current, dtype)
    assert _cached_files(tmp_path) == []


def test_a_model_too_small_to_time_follows_the_isa_rule_and_writes_no_cache(monkeypatch, tmp_path):
    monkeypatch.setattr(calibration, "MIN_TIMED_BYTES", 1 << 30)
    choices = calibration.calibrate(SHAPES)
    rule = calibration.PackingRule.current()
    for name, choice in choices.items():
        assert choice.form == calibration._rule_form(rule, calibration.DTYPES[name]) and not choice.timings
        assert "not timed" in choice.reason
    calibration.cached_choices(SHAPES)
    assert _cached_files(tmp_path) == []


@needs_native
def test_the_env_pins_a_form_per_dtype_without_measuring(monkeypatch, tmp_path, caplog):
    monkeypatch.setattr(calibration, "calibrate", lambda *a, **k: pytest.fail("measured a pinned dtype"))
    monkeypatch.setenv(cpu_native.KERNELS_ENV, "native,float32=onednn,bfloat16=panels")
    with caplog.at_level(logging.INFO, logger=calibration.__name__):
        rule = calibration.packing_rule(SHAPES)
    assert rule.native == (torch.bfloat16,) and rule.onednn == (torch.float32,)
    assert "linear layers in float32: onednn (pinned by ATB_PLUGIN_CPU_KERNELS)" in caplog.text
    monkeypatch.setenv(cpu_native.KERNELS_ENV, "float32=dense")
    rule = calibration.packing_rule([s for s in SHAPES if s[0] == "float32"])
    assert torch.float32 not in rule.native + rule.onednn
    assert _cached_files(tmp_path) == []


@pytest.mark.parametrize("value, message", [
    ("auto,float32=fast", "'float32=fast' is neither"),
    ("auto,int8=panels", "'int8=panels' is neither"),
    ("float32=dense,float32=panels", "repeats a dtype"),
    ("torch,bfloat16=panels", "the panels form runs on the native kernels, which 'torch' switches off"),
])
def test_a_bad_pin_is_a_clear_error(monkeypatch, value, message):
    monkeypatch.setenv(cpu_native.KERNELS_ENV, value)
    with pytest.raises(ValueError, match="ATB_PLUGIN_CPU_KERNELS=.*expected one of auto, native, torch, optionally|"
                                         "ATB_PLUGIN_CPU_KERNELS=.*switches off") as raised:
        cpu_native.choice()
    assert message in str(raised.value)


def test_a_bad_pin_fails_the_engine_config(monkeypatch):
    from atb_plugin.engine.config import EngineConfig

    monkeypatch.setenv(cpu_native.KERNELS_ENV, "auto,bfloat16=amx")
    with pytest.raises(ValueError, match="ATB_PLUGIN_CPU_KERNELS='auto,bfloat16=amx'"):
        EngineConfig(model=str(tiny_checkpoint("qwen2")))


@needs_native
def test_the_choice_is_logged_at_start_up_measured_then_cached(caplog):
    for cached in (False, True):
        caplog.clear()
        with caplog.at_level(logging.INFO, logger=calibration.__name__):
            with LLM(tiny_checkpoint("qwen2"), block_size=4) as llm:
                model = llm.engine.core.runner.model
        lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("linear layers in float32: ")]
        assert len(lines) == 1 and "1 / 32 rows: panels " in lines[0]
        assert lines[0].endswith("; cached)") == cached and ("measured in" in lines[0]) != cached
        form = lines[0].removeprefix("linear layers in float32: ").split(" ")[0]
        served = {"panels": PanelLinear, "onednn": PackedLinear, "dense": nn.Linear}[form]
        assert all(type(m) is served for m in model.modules() if isinstance(m, (PanelLinear, PackedLinear, nn.Linear)))
        assert (llm.engine.core.runner.decode_capture == "captured") == (form == "panels")


def test_a_model_without_a_cpu_float_layer_to_pack_measures_nothing(monkeypatch):
    """A model on another device (the NPU's: here the meta device) or without linear layers:
    no calibration, so no CPU probe or kernel build at its load."""
    from atb_plugin.models.linear import pack_linear_layers

    monkeypatch.setattr(calibration, "packing_rule", lambda *a, **k: pytest.fail("measured"))
    model = nn.Sequential(nn.Embedding(4, 4), nn.Linear(4, 4, device="meta"))
    summary = pack_linear_layers(model)
    assert summary.packed == summary.skipped == 0 and type(model[1]) is nn.Linear


# -- the bfloat16 panels' dot-product kernel, per row bucket (issue 49) ---------------------------


def dot_available() -> bool:
    return native_available() and cpu_native.bf16_dot_variant() is not None


needs_dot = pytest.mark.skipif(not dot_available(), reason="no bfloat16 dot-product kernel executes here: "
                               "avx512_bf16 not in cpu_native.features() (or the native kernels do not build)")


class BrokenDot(PanelLinear):
    """The panels' dot-product kernel gone wrong (one output column off wherever it runs)."""

    def forward(self, x):
        out = super().forward(x)
        rows = x.reshape(-1, self.in_features).shape[0]
        if 0 < self.dot_rows <= rows:
            out = out.clone()
            out[..., 0] += 1.0
        return out


def test_the_dot_rows_rule():
    widen = {1: 10.0, 4: 11.0, 32: 40.0, 128: 150.0}
    assert calibration.choose_dot_rows(widen, {r: t * 0.9 for r, t in widen.items()})[0] == 1  # wins everywhere
    assert calibration.choose_dot_rows(widen, {r: t * 1.1 for r, t in widen.items()}) == (
        0, "no bfloat16 dot products (1 / 4 / 32 / 128 rows: widening 10000.00 / 11000.00 / 40000.00 / 150000.00 ms, "
           "dot products 11000.00 / 12100.00 / 44000.00 / 165000.00 ms)")
    # loses up to 4 rows, wins from 32: from between them (their geometric mean)
    rows, why = calibration.choose_dot_rows(widen, {1: 11.0, 4: 12.0, 32: 20.0, 128: 75.0})
    assert rows == 11 and why.startswith("bfloat16 dot products from 11 rows (1 / 4 / 32 / 128 rows: widening")
    assert calibration.choose_dot_rows(widen, {1: 9.0, 4: 9.0, 32: 50.0, 128: 75.0})[0] == 64  # the last loss rules
    assert calibration.choose_dot_rows(widen, {1: 9.0, 4: 9.0, 32: 30.0, 128: 200.0})[0] == 0


def test_the_decision_rule_over_every_bucket():
    timings = {"panels": {1: 1.0, 4: 1.1, 32: 3.0, 128: 13.0}, "onednn": {1: 1.5, 4: 1.6, 32: 2.5, 128: 8.0}}
    chosen, why = calibration.decide(timings)
    assert chosen == "onednn" and why.endswith("; panels over 1.5x the best at 128 rows")
    assert why.startswith("1 / 32 rows: panels 1000.00 / 3000.00 ms, onednn 1500.00 / 2500.00 ms; 4 / 128 rows: ")


# Each form over PREFILL_MARGIN at some batch bucket (a first start under load): the panels at 128 rows,
# oneDNN at 32, dense at both. decide() once raised "min() arg is an empty sequence" here.
EVERY_FORM_OUT = {"panels": {1: 1.0, 4: 1.1, 32: 2.0, 128: 30.0}, "onednn": {1: 1.5, 4: 1.6, 32: 9.0, 128: 8.0},
                  "dense": {1: 3.0, 4: 3.1, 32: 9.0, 128: 30.0}}


def test_the_decision_rule_answers_when_every_form_is_over_the_margin():
    chosen, why = calibration.decide(EVERY_FORM_OUT)
    assert chosen == "panels"  # the fastest at one row (and the captured form)
    assert why.endswith("every form over the margin at some bucket: the fastest at 1 row")
    assert "onednn over 1.5x the best at 32 rows" in why and "panels over 1.5x the best at 128 rows" in why
    # the panels' CAPTURE_MARGIN still holds among them all; without the panels, the fastest at one row
    slower_panels = {**EVERY_FORM_OUT, "panels": {**EVERY_FORM_OUT["panels"], 1: 1.7}}
    assert calibration.decide(slower_panels)[0] == "onednn"
    assert calibration.decide({n: t for n, t in EVERY_FORM_OUT.items() if n != "panels"})[0] == "onednn"


@needs_native
def test_calibration_picks_a_form_when_the_timings_put_every_form_out(monkeypatch):
    def injected(dtype_name, shapes, candidates, budget_s, generator):
        panels = EVERY_FORM_OUT["panels"]
        return {c.name: dict(EVERY_FORM_OUT.get(c.name, panels)) for c in candidates}

    monkeypatch.setattr(calibration, "measure", injected)
    choices = calibration.calibrate(SHAPES)
    assert set(choices) == {"float32", "bfloat16"}
    for choice in choices.values():
        assert choice.form in choice.timings and "every form over the margin" in choice.reason


@needs_dot
def test_every_bucket_is_checked_and_timed_and_the_dot_kernel_beside_the_panels():
    choice = calibration.calibrate(SHAPES)["bfloat16"]
    assert not choice.dot_disabled and set(choice.kernels) == {"widen", "dot"}
    assert all(set(rows) == set(calibration.ROWS) for rows in choice.kernels.values())
    assert (choice.dot_rows, choice.dot_reason) == calibration.choose_dot_rows(choice.kernels["widen"],
                                                                                choice.kernels["dot"]) or \
        choice.form != "panels" and choice.dot_rows == 0
    assert calibration.Choice.from_json(choice.to_json()) == choice
    assert calibration.calibrate(SHAPES)["float32"].dot_disabled == "bfloat16 weights only"


@needs_dot
def test_a_broken_dot_kernel_is_disabled_with_one_warning_and_the_engine_stays_right(monkeypatch, caplog):
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    with monkeypatch.context() as pinned:  # the reference: bfloat16 panels by the pin, nothing measured, no dot products
        pinned.setenv(cpu_native.KERNELS_ENV, "auto,bfloat16=panels")
        with LLM(tiny_checkpoint("qwen2"), block_size=4, dtype="bfloat16") as llm:
            reference = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
    monkeypatch.setattr(calibration, "DOT", calibration.Candidate(
        "panels:dot", lambda w, b: BrokenDot(w, b, dot_rows=1), calibration._dot_unavailable))
    monkeypatch.setattr(calibration, "decide", lambda timings: ("panels", "forced for this test"))
    with caplog.at_level(logging.INFO, logger=calibration.__name__):
        with LLM(tiny_checkpoint("qwen2"), block_size=4, dtype="bfloat16") as llm:
            model = llm.engine.core.runner.model
            tokens = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
            capture = llm.engine.core.runner.decode_capture
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "linear form 'panels:dot' disabled for bfloat16 weights" in warnings[0]
    assert "float64 reference" in warnings[0] and "beyond" in warnings[0]
    panels = [m for m in model.modules() if isinstance(m, PanelLinear)]
    assert panels and all(m.dot_rows == 0 for m in panels) and capture == "captured"
    assert tokens == reference


@needs_dot
def test_the_captured_step_runs_the_dot_kernel_where_chosen(monkeypatch):
    """dot_rows reaches the plan: the captured bfloat16 step with the dot products from one row
    equals the eager float32 layers' math within the kernels' bound, and its plan holds dot_rows."""
    monkeypatch.setattr(calibration, "decide", lambda timings: ("panels", "forced for this test"))
    monkeypatch.setattr(calibration, "choose_dot_rows", lambda widen, dot: (1, "forced for this test"))
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    with LLM(tiny_checkpoint("qwen2"), block_size=4, dtype="bfloat16") as llm:
        runner = llm.engine.core.runner
        assert runner.decode_capture == "captured"
        step = runner.model.get_language_model().model.captured_decode
        assert all(layer.qkv.dot_rows == layer.down.dot_rows == 1 for layer in step._layers)
        tokens = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
    monkeypatch.setattr(calibration, "choose_dot_rows", lambda widen, dot: (0, "forced for this test"))
    with LLM(tiny_checkpoint("qwen2"), block_size=4, dtype="bfloat16") as llm:
        widened = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
    # below DOT_SPLIT_ROWS rows the dot products carry float32 activations to 2^-18: the same greedy tokens
    assert tokens == widened


# -- dtype="auto" on the CPU --------------------------------------------------------------------


def _forced(bf16_over_fp32: dict[int, float]):
    """cached_choices answering that bfloat16's panels take 1 / ratio of float32's time at each bucket."""
    def answer(shapes, *args, **kwargs):
        full = {rows: 1.0 for rows in calibration.ROWS}
        times = {"float32": full, "bfloat16": {rows: 1.0 / bf16_over_fp32[rows] for rows in calibration.ROWS}}
        return {name: calibration.Choice("panels", "forced", {"panels": times[name]}, {})
                for name in {shape[0] for shape in shapes}}, False
    return answer


def _checkpoint_of(tmp_path, dtype: str):
    source = tiny_checkpoint("qwen2")
    target = tmp_path / f"qwen2-{dtype}"
    target.mkdir()
    for path in source.iterdir():
        if path.is_file():
            (target / path.name).write_bytes(path.read_bytes())
    config = json.loads((target / "config.json").read_text())
    (target / "config.json").write_text(json.dumps({**config, "torch_dtype": dtype}))
    return target


@needs_native
@pytest.mark.parametrize("ratios, checkpoint, expected", [
    ({1: 1.9, 4: 1.8, 32: 1.3, 128: 1.1}, "float32", "bfloat16"),
    ({1: 1.9, 4: 1.8, 32: 1.3, 128: 1.1}, "bfloat16", "bfloat16"),
    ({1: 1.9, 4: 1.8, 32: 1.3, 128: 1.1}, "float16", "float32"),  # the values would not survive
    ({1: 1.1, 4: 1.8, 32: 1.3, 128: 1.1}, "float32", "float32"),  # not AUTO_MARGIN faster at one row
    ({1: 1.9, 4: 1.8, 32: 1.3, 128: 0.9}, "float32", "float32"),  # slower at prefill
])
def test_dtype_auto_takes_bfloat16_where_measured_faster_and_says_so(monkeypatch, tmp_path, caplog, ratios,
                                                                     checkpoint, expected):
    from atb_plugin.engine.config import EngineConfig

    monkeypatch.setattr(calibration, "cached_choices", _forced(ratios))
    monkeypatch.setattr(calibration, "AUTO_MIN_BYTES", 0)
    model = _checkpoint_of(tmp_path, checkpoint)
    with caplog.at_level(logging.INFO, logger="atb_plugin.engine.config"):
        config = EngineConfig(model=str(model))
    assert config.dtype == expected
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("dtype auto: ")]
    assert len(lines) == 1 and lines[0].startswith(f"dtype auto: {expected} (")
    if checkpoint != "float16":
        assert "as fast as float32 (panels) at 1 / 4 / 32 / 128 rows" in lines[0]
    # an explicit dtype, a pooling model, a quantized one or unpacked weights: never measured
    monkeypatch.setattr(calibration, "cached_choices", lambda *a, **k: pytest.fail("measured"))
    assert EngineConfig(model=str(model), dtype="float32").dtype == "float32"
    assert EngineConfig(model=str(model), pack_weights=False).dtype == "float32"


def test_dtype_auto_is_measured_as_one_tensor_parallel_rank_runs(monkeypatch):
    # Each of TP ranks runs its shard on num_threads // TP threads (engine/worker.py): measuring the
    # whole model on every thread could pick a dtype no rank measured faster.
    from atb_plugin.engine.config import EngineConfig, decoder_linear_layers
    from atb_plugin.platform.cpu import CpuPlatform

    asked = []
    monkeypatch.setattr(CpuPlatform, "measured_dtype", lambda self, dtype, layers, declared, threads: (
        asked.append((layers, threads)) or (dtype, "recorded")))
    model = tiny_checkpoint("qwen2")
    config = json.loads((model / "config.json").read_text())
    for tp in (1, 2):
        EngineConfig(model=str(model), num_threads=2, tensor_parallel_size=tp)
    (whole, whole_threads), (shard, shard_threads) = asked
    assert (whole_threads, shard_threads) == (2, 1)
    assert whole == decoder_linear_layers(config) and len(shard) == len(whole)
    qkv, o, gate_up, down = whole[:4]
    assert shard[:4] == [(qkv[0] // 2, qkv[1]), (o[0], o[1] // 2), (gate_up[0] // 2, gate_up[1]), (down[0], down[1] // 2)]


def test_dtype_auto_does_not_time_a_small_model(monkeypatch, caplog):
    from atb_plugin.engine.config import EngineConfig

    monkeypatch.setattr(calibration, "cached_choices", lambda *a, **k: pytest.fail("measured"))
    with caplog.at_level(logging.INFO, logger="atb_plugin.engine.config"):
        assert EngineConfig(model=str(tiny_checkpoint("qwen2"))).dtype == "float32"
    assert "MiB of float32 linear weights, under 32: its steps are bound by host time" in caplog.text


@needs_native
def test_dtype_auto_loads_the_engine_in_bfloat16_where_forced(monkeypatch):
    monkeypatch.setattr(calibration, "cached_choices", _forced({rows: 1.9 for rows in calibration.ROWS}))
    monkeypatch.setattr(calibration, "AUTO_MIN_BYTES", 0)
    with LLM(tiny_checkpoint("qwen2"), block_size=4) as llm:
        assert llm.engine.config.dtype == "bfloat16"
        assert next(llm.engine.core.runner.model.parameters()).dtype == torch.bfloat16
        assert llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=2))[0].outputs[0].token_ids


# -- a second copy in panels for decode rows (SplitLinear) ---------------------------------------


def test_the_split_rule():
    onednn = {1: 2.0, 4: 2.2, 32: 3.0, 128: 8.0}
    # the panels twice as fast at one and four rows, slower from 32: panels below round(sqrt(4 * 32)) = 11 rows
    rows, why = calibration.choose_split({"panels": {1: 1.0, 4: 1.1, 32: 4.6, 128: 20.0}, "onednn": onednn}, "onednn")
    assert rows == 11 and why == "a second copy in panels below 11 rows (0.50x onednn's time at 1 row, 1.53x at 32)"
    # within CAPTURE_MARGIN at one row (captured: no eager host time) and four, not from 32: below 11 rows
    assert calibration.choose_split({"panels": {1: 2.1, 4: 2.4, 32: 4.6, 128: 20.0}, "onednn": onednn}, "onednn")[0] == 11
    # over CAPTURE_MARGIN slower at one row, or the panels already the form: no copy
    assert calibration.choose_split({"panels": {1: 2.3, 4: 1.1, 32: 4.6, 128: 20.0}, "onednn": onednn}, "onednn")[0] == 0
    assert calibration.choose_split({"panels": onednn, "onednn": onednn}, "panels") == (0, "")


@needs_native
def test_a_split_layer_serves_each_bucket_from_its_form_and_caps_the_captured_step(monkeypatch):
    from atb_plugin.ops.packed_linear import SplitLinear

    weight, bias = torch.randn(70, 100), torch.randn(70)
    layer = SplitLinear(weight, bias, 0, PackedLinear(weight, bias), 3)
    assert layer.native_operands().batch_rows == 3 and "batch_rows=3" in repr(layer)
    for rows, served in ((1, PanelLinear(weight, bias)), (2, PanelLinear(weight, bias)), (3, layer.batch)):
        x = torch.randn(rows, 100)
        assert torch.equal(layer(x), served(x))
    # the calibration's answer forced: oneDNN the form, panels below 3 rows
    monkeypatch.setattr(calibration, "decide", lambda timings: ("onednn", "forced for this test"))
    monkeypatch.setattr(calibration, "choose_split", lambda timings, form: (3, "forced for this test"))
    monkeypatch.setattr(calibration, "SPLIT_MIN_BYTES", 0)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    with LLM(tiny_checkpoint("qwen2"), block_size=4, pack_weights=False) as llm:  # the reference: dense layers
        reference = [o.outputs[0].token_ids for o in llm.generate(PROMPTS * 2, params)]
    with LLM(tiny_checkpoint("qwen2"), block_size=4) as llm:
        runner = llm.engine.core.runner
        model = runner.model.get_language_model().model
        assert all(type(m) is SplitLinear and m.batch_rows == 3 for m in model.modules() if isinstance(m, PanelLinear))
        # steps of up to 2 requests run captured, larger ones eager through oneDNN
        assert runner.decode_capture == "captured" and model.captured_decode.max_rows == 2
        tokens = [o.outputs[0].token_ids for o in llm.generate(PROMPTS * 2, params)]
        assert tokens == reference
        assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:1], params)] == reference[:1]


@needs_native
def test_dtype_auto_measures_with_the_engine_s_threads(monkeypatch, tmp_path):
    """The thread count is in the cache key: measured with the engine's, the load reads it again."""
    from atb_plugin.engine.config import EngineConfig

    seen = []
    forced = _forced({rows: 1.9 for rows in calibration.ROWS})
    monkeypatch.setattr(calibration, "cached_choices", lambda *a, **k: seen.append(torch.get_num_threads()) or
                        forced(*a, **k))
    monkeypatch.setattr(calibration, "AUTO_MIN_BYTES", 0)
    before = torch.get_num_threads()
    threads = before + 2
    assert EngineConfig(model=str(_checkpoint_of(tmp_path, "float32")), num_threads=threads).dtype == "bfloat16"
    assert seen == [threads, threads] and torch.get_num_threads() == before
