"""Which form a CPU float linear weight takes, chosen by measuring this machine (docs/architecture.md,
"Native CPU kernels": "Chosen by measurement").

A float linear layer on the CPU can hold its weight in three forms (``packed_linear.py``): the
native kernels' column panels (``panels``: ``PanelLinear``, the only form the captured decode step
reads), oneDNN's packed layout (``onednn``: ``PackedLinear``), or the checkpoint's dense layout
(``dense``: ``nn.Linear``, MKL / oneDNN through torch). Bfloat16 panels have two kernels: widened
to float32 in registers, or bfloat16 dot products (``DOT``: AVX-512 BF16's ``vdpbf16ps``, where it
executes). Which is fastest depends on the CPU and the row count: on a Zen 5 EPYC the dot products
win every bucket; on an AMX Xeon oneDNN (AMX tiles) wins batches by 3-6x while the panels win one
row (benchmarks/RESULTS.md, "AVX-512 BF16 panels, per-bucket forms"). So, once per machine, at the
model's load:

1. every candidate form of each weight dtype the model holds (float32, bfloat16), and the
   bfloat16 panels' dot-product kernel, is built over random weights of the model's distinct
   linear shapes and **checked against a float64 product of the same (dtype-rounded) weights and
   inputs** at each row bucket; one that disagrees beyond ``tolerance`` is disabled with one
   warning naming it (this is what makes a variant for an instruction set the development
   machines lack safe to ship: a wrong one loses, it never serves);
2. the candidates left are timed at ``ROWS`` (1 and 4: decode steps; 32: a batch of requests
   decoding or a short prefill chunk; 128: a prefill chunk's rows), weights streamed from DRAM
   up to COLD_ROWS rows as in a real step (enough copies of each shape to overflow the caches),
   in interleaved rounds, medians; each shape's time weighted by how many layers have it;
3. the bfloat16 panels run their dot-product kernel from the rows where it is faster
   (``choose_dot_rows``: ``dot_rows``), and per dtype the form fastest at one row wins (the
   captured decode step then takes it, if it is ``panels``), unless it is slower than the best at
   32 rows or more by more than ``PREFILL_MARGIN``; the panels win ties within ``CAPTURE_MARGIN``
   at one row, because only they are captured, which saves the eager layer's host time the
   measurement of one product leaves out (``decide``);
4. where another form wins a layer while the panels are within ``CAPTURE_MARGIN`` of it at one
   row, the layer keeps a second copy in panels for the rows where they are (``choose_split``:
   ``packed_linear.SplitLinear``; the captured step then runs up to that many requests): twice
   the weight's bytes, for the dtypes whose weights reach ``SPLIT_MIN_BYTES``.

The answer is cached (JSON beside the kernels, ``${XDG_CACHE_HOME:-~/.cache}/atb-plugin/kernels``)
under a name hashed from the CPU model, the probed features (``cpu_native.features()``), the thread
count, torch's version, this package's linear sources and the kernels' sources, and the shapes: any
change measures again; later starts read it (no timing). ``ATB_PLUGIN_CPU_KERNELS`` pins a form per
dtype (``cpu_native.linear_forms``: ``auto,bfloat16=onednn``; pinned panels widen, one copy), and
``=torch`` keeps the rule of ``PackingRule.current`` (no native kernels, nothing measured). A model
whose weights of a dtype are below ``MIN_TIMED_BYTES`` in all is not timed (its products measure
call overhead, not a kernel; the choice barely matters there): the rule decides among the
candidates that passed the check. ``auto_dtype`` is ``dtype="auto"`` on the CPU: bfloat16 where
these measurements say its layers run faster than float32's.
"""

from __future__ import annotations

import fcntl
import hashlib
import itertools
import json
import logging
import math
import os
import statistics
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from atb_plugin.ops import cpu_native, packed_linear
from atb_plugin.ops.packed_linear import PackedLinear, PackingRule, PanelLinear

logger = logging.getLogger(__name__)

# The row buckets checked and timed: decode of one request, of 4, of 32 (or a short prefill chunk), and a
# prefill chunk's rows (compute-bound like the engine's 2048-token chunks, at a sixteenth of their time).
ROWS = (1, 4, 32, 128)
DECODE_ROWS, PREFILL_ROWS = 1, 32  # the buckets deciding the form: a decode step; a batch or prefill chunk
COLD_ROWS = 32  # up to this many rows the weights are timed streamed from DRAM; past it one copy per shape
PREFILL_MARGIN = 1.5  # the decode winner keeps the layer unless this much slower than the best at 32 rows
CAPTURE_MARGIN = 1.10  # the panels win decode unless another form is this much faster (only they are captured)
# Where another form wins the layer (over PREFILL_MARGIN faster at a batch bucket) but the panels are within
# CAPTURE_MARGIN of it at one row, the layer keeps a second copy in panels for decode rows (choose_split), if
# the dtype's weights reach SPLIT_MIN_BYTES (below, the two forms' difference is call overhead).
SPLIT_MIN_BYTES = 32 << 20
MIN_TIMED_BYTES = 8 << 20  # a dtype's weights below this in all are checked, not timed (module docstring)
COLD_BYTES = 64 << 20  # the copies timed per candidate: past the last-level cache, as a real step reads them
# A layer wider than this is checked at this width less one PANEL_GROUP plus its own remainder (an
# LM head's 49152 outputs would take a second in float64): its last panel's tail and the blocking
# along ``in`` stay its own.
CHECK_MAX_OUT, PANEL_GROUP = 2048, 512
DEFAULT_BUDGET_S = 3.0  # the timing's share of a first start (the checks and builds come on top)
MAX_ROUNDS = 7
DTYPES = {name: getattr(torch, name) for name in cpu_native.LINEAR_FORM_DTYPES}

Shape = tuple[str, int, int, bool]  # (dtype name, out_features, in_features, bias)


@dataclass(frozen=True)
class Candidate:
    """One form: ``build(weight, bias)`` the module serving the layer; ``unavailable(dtype)`` why
    it cannot take that weight dtype here (None: it can)."""

    name: str
    build: Callable[[torch.Tensor, torch.Tensor | None], nn.Module]
    unavailable: Callable[[torch.dtype], str | None]


def _weight_bytes(shape: Shape, count: int = 1) -> int:
    dtype_name, out_features, in_features, _ = shape
    return count * out_features * in_features * DTYPES[dtype_name].itemsize


def _panels_unavailable(dtype: torch.dtype) -> str | None:
    if cpu_native.linear_library(torch.device("cpu")) is None:
        return "the native CPU kernels are not in use"
    return None


def _onednn_unavailable(dtype: torch.dtype) -> str | None:
    return None if dtype in packed_linear.packable_dtypes() else f"oneDNN does not pack {dtype} here"


def _dot_unavailable(dtype: torch.dtype) -> str | None:
    if dtype != torch.bfloat16:
        return "bfloat16 weights only"
    if _panels_unavailable(dtype) is not None or cpu_native.bf16_dot_variant() is None:
        return "no bfloat16 dot-product kernel executes here (AVX-512 BF16)"
    return None


# One per name of cpu_native.LINEAR_FORMS (what ATB_PLUGIN_CPU_KERNELS may pin), in this order.
CANDIDATES: dict[str, Candidate] = {
    "panels": Candidate("panels", PanelLinear, _panels_unavailable),
    "onednn": Candidate("onednn", PackedLinear, _onednn_unavailable),
    "dense": Candidate("dense", packed_linear.dense_linear, lambda dtype: None),
}
# The panels' other kernel for bfloat16 weights: the same panels through bfloat16 dot products
# (cpu_native.linear_bf16 with dot_rows). Checked and timed beside the forms at every bucket; the
# panels form then runs it from the rows where it is faster (``dot_rows``), its times per bucket
# being the better of its two kernels'.
DOT = Candidate("panels:dot", lambda weight, bias: PanelLinear(weight, bias, dot_rows=1), _dot_unavailable)


def _rows_json(timings: dict[str, dict[int, float]]) -> dict:
    return {name: {str(rows): t for rows, t in by_rows.items()} for name, by_rows in timings.items()}


def _rows_from_json(data: dict) -> dict[str, dict[int, float]]:
    return {name: {int(rows): t for rows, t in by_rows.items()} for name, by_rows in data.items()}


@dataclass
class Choice:
    """One dtype's answer: ``form`` and ``reason``; per form its seconds per pass over the model's
    linear layers at each of ``ROWS`` (``timings``, empty where not timed; the panels' at their
    better kernel) or why it was out (``disabled``: wrong against the reference, or unavailable
    here). For bfloat16 panels: the rows from which their dot-product kernel runs (``dot_rows``, 0:
    never), each kernel's own timings (``kernels``: ``widen``, ``dot``) and why (``dot_reason``),
    or why that kernel was out (``dot_disabled``, as ``disabled``). ``split_rows``: below this many
    rows a second copy in panels serves (0: none; ``choose_split``), and why (``split_reason``)."""

    form: str
    reason: str
    timings: dict[str, dict[int, float]] = field(default_factory=dict)
    disabled: dict[str, str] = field(default_factory=dict)
    dot_rows: int = 0
    kernels: dict[str, dict[int, float]] = field(default_factory=dict)
    dot_reason: str = ""
    dot_disabled: str = ""
    split_rows: int = 0
    split_reason: str = ""

    def served(self) -> dict[int, float]:
        """Seconds per pass at each timed bucket of the form serving it (the panels below
        ``split_rows``); empty where not timed."""
        if not self.timings:
            return {}
        return {rows: self.timings["panels" if rows < self.split_rows else self.form][rows] for rows in ROWS}

    def to_json(self) -> dict:
        return {"form": self.form, "reason": self.reason, "disabled": self.disabled,
                "timings": _rows_json(self.timings), "dot_rows": self.dot_rows, "kernels": _rows_json(self.kernels),
                "dot_reason": self.dot_reason, "dot_disabled": self.dot_disabled, "split_rows": self.split_rows,
                "split_reason": self.split_reason}

    @classmethod
    def from_json(cls, data: dict) -> "Choice":
        return cls(data["form"], data["reason"], _rows_from_json(data["timings"]), dict(data["disabled"]),
                   int(data["dot_rows"]), _rows_from_json(data["kernels"]), data["dot_reason"], data["dot_disabled"],
                   int(data["split_rows"]), data["split_reason"])


def tolerance(dtype: torch.dtype, in_features: int) -> float:
    """The error bound of one output of ``dtype``, relative to ``sum_k |x_k w_k| + |b|`` (the float64 product of
    the same rounded weights and inputs is the reference, so only the kernel's arithmetic counts):
    float32 sums of ``in_features`` products, bounded by ``in_features * 2^-23`` (twice the
    worst-case ``n u`` with u = 2^-24, a margin for blocked sums and fused multiply-adds; a real
    error is ~sqrt(n) u), plus the output's rounding, 2^-8 for a bfloat16 result (relative to the
    output, so no more than relative to the absolute sum), or as much for inputs rounded to
    bfloat16 on the way in (2^-9 of each product: the dot-product kernel's float32 rows from
    ``cpu_native.DOT_SPLIT_ROWS`` on). A wrong kernel (a misplaced panel, a lost tail, a wrong
    instruction) errs by the order of the output itself."""
    rounding = 2.0 ** -8 if dtype == torch.bfloat16 else 2.0 ** -23
    return in_features * 2.0 ** -23 + rounding


class Reference:
    """One shape's check data, shared by every candidate of its dtype: random weights (and bias)
    rounded to the dtype, and per row count and input dtype the inputs with their float64 product
    and the product of magnitudes (made on first use). The float64 products are most of a check's
    time: made once per shape, not once per candidate."""

    def __init__(self, shape: Shape, generator: torch.Generator):
        dtype_name, out_features, in_features, has_bias = shape
        if out_features > CHECK_MAX_OUT:  # outputs are independent along out: the same tail of a panel, fewer of them
            out_features = CHECK_MAX_OUT - PANEL_GROUP + out_features % PANEL_GROUP
        dtype = DTYPES[dtype_name]
        self.out_features, self.in_features, self.generator = out_features, in_features, generator
        self.weight = (torch.randn(out_features, in_features, generator=generator) / math.sqrt(in_features)).to(dtype)
        self.bias = torch.randn(out_features, generator=generator).to(dtype) if has_bias else None
        self._weight64 = self.weight.double()
        self._products: dict[tuple[int, torch.dtype], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def product(self, rows: int, x_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(x, x @ W.T + b, |x| @ |W|.T + |b|)``, the last two in float64, for ``rows`` inputs of ``x_dtype``."""
        key = (rows, x_dtype)
        if key not in self._products:
            x = torch.randn(rows, self.in_features, generator=self.generator).to(x_dtype)
            reference = x.double() @ self._weight64.T
            scale = x.double().abs() @ self._weight64.abs().T
            if self.bias is not None:
                reference, scale = reference + self.bias.double(), scale + self.bias.double().abs()
            self._products[key] = (x, reference, scale)
        return self._products[key]


def check(candidate: Candidate, shape: Shape, generator: torch.Generator,
          reference: Reference | None = None) -> str | None:
    """Why ``candidate`` disagrees with the float64 reference on ``shape`` (None: it agrees), at
    every row count of ROWS, inputs in the weight's dtype as the eager model runs them (and float32
    ones for bfloat16 panels, as the captured step runs them: bound as bfloat16 ones where the
    dot-product kernel rounds them, ``cpu_native.dot_rounds``). ``reference``: the shape's data
    other candidates are checked against too (default: new, from ``generator``)."""
    reference = reference or Reference(shape, generator)
    out_features, in_features = reference.out_features, reference.in_features
    dtype = DTYPES[shape[0]]
    try:
        module = candidate.build(reference.weight, reference.bias)
        # bfloat16 panels also take float32 rows: the captured decode step's activations
        activations = (dtype, torch.float32) if isinstance(module, PanelLinear) and module.bf16 else (dtype,)
        for rows, x_dtype in itertools.product(ROWS, activations):
            x, expected, scale = reference.product(rows, x_dtype)
            with torch.inference_mode():
                got = module(x)
            if got.shape != expected.shape:
                return f"({out_features}, {in_features}) at {rows} rows: shape {tuple(got.shape)}"
            rounded = isinstance(module, PanelLinear) and cpu_native.dot_rounds(rows, x_dtype, module.dot_rows)
            bound = tolerance(torch.bfloat16 if rounded else x_dtype, in_features)  # the result has x's dtype
            excess = ((got.double() - expected).abs() - bound * scale).max().item()
            if not excess <= 0:  # NaN fails too
                error = (got.double() - expected).abs().max().item()
                return (f"({out_features}, {in_features}) at {rows} rows: max |error| {error:.3g} beyond "
                        f"{bound:.2g} x |x| |w|")
    except Exception as exc:  # noqa: BLE001 -- a candidate that raises is as disabled as a wrong one
        return f"({out_features}, {in_features}): {type(exc).__name__}: {exc}"
    return None


def _time_pass(modules: list[tuple[nn.Module, float]], inputs: dict[int, torch.Tensor]) -> float:
    """Seconds for one weighted pass: each module called once, its time times its weight."""
    total = 0.0
    with torch.inference_mode():
        for module, weight in modules:
            x = inputs[module.in_features]
            start = time.perf_counter()
            module(x)
            total += (time.perf_counter() - start) * weight
    return total


def measure(dtype_name: str, shapes: Counter, candidates: list[Candidate], budget_s: float,
            generator: torch.Generator) -> dict[str, dict[int, float]]:
    """Per candidate, seconds per pass over the layers ``shapes`` counts at each of ROWS: medians
    of rounds that interleave the candidates (a shared machine's drift hits them alike). Up to
    COLD_ROWS rows the weights come from DRAM, as in a real step (copies past the caches); past it
    the product is bound by the arithmetic, and one copy of each shape stands for its layers."""
    dtype = DTYPES[dtype_name]
    total_bytes = sum(_weight_bytes(shape, count) for shape, count in shapes.items())
    cold: dict[str, list[tuple[nn.Module, float]]] = {candidate.name: [] for candidate in candidates}
    warm: dict[str, list[tuple[nn.Module, float]]] = {candidate.name: [] for candidate in candidates}
    for (_, out, inp, has_bias), count in shapes.items():
        copies = max(1, min(count, math.ceil(count * COLD_BYTES / total_bytes)))
        # one random weight per shape (drawing it is a large share of the build), every module a copy of it
        weight = (torch.randn(out, inp, generator=generator) / math.sqrt(inp)).to(dtype)
        bias = torch.zeros(out, dtype=dtype) if has_bias else None
        for candidate in candidates:
            modules = [candidate.build(weight, bias) for _ in range(copies)]
            cold[candidate.name] += [(module, count / copies) for module in modules]
            warm[candidate.name].append((modules[0], count))
    widths = {inp for (_, _, inp, _) in shapes}
    inputs = {rows: {w: torch.randn(rows, w, generator=generator).to(dtype) for w in widths} for rows in ROWS}
    passes = {rows: cold if rows <= COLD_ROWS else warm for rows in ROWS}
    samples: dict[str, dict[int, list[float]]] = {c.name: {r: [] for r in ROWS} for c in candidates}
    for rows in ROWS:  # warm up: first-call allocations, page faults of the copies
        for modules in passes[rows].values():
            _time_pass(modules, inputs[rows])
    deadline = time.perf_counter() + budget_s
    for round_ in range(MAX_ROUNDS):
        for rows in ROWS:
            for name, modules in passes[rows].items():
                samples[name][rows].append(_time_pass(modules, inputs[rows]))
        if time.perf_counter() >= deadline and round_ >= 2:
            break
    return {name: {rows: statistics.median(times) for rows, times in by_rows.items()}
            for name, by_rows in samples.items()}


def _listed(timings: dict[str, dict[int, float]], buckets: Iterable[int]) -> str:
    """``"1 / 32 rows: panels 10.00 / 38.80 ms, ..."``: each timing at ``buckets``."""
    buckets = list(buckets)
    return f"{' / '.join(map(str, buckets))} rows: " + ", ".join(
        f"{name} {' / '.join(f'{by_rows[r] * 1e3:.2f}' for r in buckets)} ms" for name, by_rows in timings.items())


def decide(timings: dict[str, dict[int, float]]) -> tuple[str, str]:
    """The form (of ``timings``' keys, in CANDIDATES' order) a dtype's layers take, and why
    (module docstring, step 3): timings at DECODE_ROWS, PREFILL_ROWS and any other buckets; each
    bucket from PREFILL_ROWS on may put a form out by PREFILL_MARGIN, unless that would put out
    every form (then the rule picks among them all: there is always an answer)."""
    buckets = sorted(next(iter(timings.values())))
    batch = [rows for rows in buckets if rows >= PREFILL_ROWS]
    left: dict[str, int] = {}  # a form over the margin -> the first bucket where it is
    for rows in batch:
        best = min(t[rows] for t in timings.values())
        for name, t in timings.items():
            if t[rows] > PREFILL_MARGIN * best:
                left.setdefault(name, rows)
    # Each form can be over the margin at another bucket (the panels at 32 rows, oneDNN at 128; noise
    # on a busy first start): then none is safe for batches, and the margin rules nobody out.
    fit = {name: t for name, t in timings.items() if name not in left} or timings
    fastest = min(fit, key=lambda name: fit[name][DECODE_ROWS])
    chosen = fastest
    if "panels" in fit and fit["panels"][DECODE_ROWS] <= CAPTURE_MARGIN * fit[fastest][DECODE_ROWS]:
        chosen = "panels"
    why = _listed(timings, (DECODE_ROWS, PREFILL_ROWS))
    others = [rows for rows in buckets if rows not in (DECODE_ROWS, PREFILL_ROWS)]
    if others:
        why += f"; {_listed(timings, others)}"
    if chosen != fastest:
        why += f"; panels within {CAPTURE_MARGIN:.2f}x of the fastest at 1 row, and only they are captured"
    for rows in sorted(set(left.values())):
        names = sorted(name for name, at in left.items() if at == rows)
        why += f"; {', '.join(names)} over {PREFILL_MARGIN}x the best at {rows} rows"
    if fit is timings:
        why += "; every form over the margin at some bucket: the fastest at 1 row"
    return chosen, why


def choose_split(timings: dict[str, dict[int, float]], form: str) -> tuple[int, str]:
    """Below how many rows a layer whose form is ``form`` (``decide``'s) keeps a second copy in
    the panels (0: none), and why: where ``form`` is not the panels, though the panels are within
    CAPTURE_MARGIN of it at DECODE_ROWS (as ``decide`` prefers them: only they are captured, which
    saves the eager layer's host time): up to the first bucket where they are not (between it and
    the bucket before, from their geometric mean)."""
    if form == "panels" or "panels" not in timings:
        return 0, ""
    panels, chosen = timings["panels"], timings[form]
    buckets = sorted(panels)
    losing = [rows for rows in buckets if panels[rows] > CAPTURE_MARGIN * chosen[rows]]
    if not losing or losing[0] == buckets[0]:
        return 0, ""
    before = buckets[buckets.index(losing[0]) - 1]
    rows = max(before + 1, round(math.sqrt(before * losing[0])))
    return rows, (f"a second copy in panels below {rows} rows ({panels[DECODE_ROWS] / chosen[DECODE_ROWS]:.2f}x "
                  f"{form}'s time at {DECODE_ROWS} row, {panels[losing[0]] / chosen[losing[0]]:.2f}x at {losing[0]})")


def choose_dot_rows(widen: dict[int, float], dot: dict[int, float]) -> tuple[int, str]:
    """From how many rows bfloat16 panels run their dot-product kernel (0: never), given each
    kernel's timings per bucket, and why: from the first bucket past the last where the widening
    kernel is as fast (between that bucket and the next, from their geometric mean: the timings do
    not say where between them the lead changes)."""
    buckets = sorted(widen)
    losing = [rows for rows in buckets if dot[rows] >= widen[rows]]
    if not losing:
        rows = buckets[0]
    elif losing[-1] == buckets[-1]:
        rows = 0
    else:
        after = buckets[buckets.index(losing[-1]) + 1]
        rows = max(losing[-1] + 1, round(math.sqrt(losing[-1] * after)))
    why = _listed({"widening": widen, "dot products": dot}, buckets)
    return rows, (f"bfloat16 dot products from {rows} rows" if rows else "no bfloat16 dot products") + f" ({why})"


def _rule_form(rule: PackingRule, dtype: torch.dtype) -> str:
    return "panels" if dtype in rule.native else "onednn" if dtype in rule.onednn else "dense"


def calibrate(shapes: Iterable[Shape], budget_s: float | None = None,
              min_timed_bytes: int | None = None) -> dict[str, Choice]:
    """A ``Choice`` per weight dtype of ``shapes`` (one entry per layer, of DTYPES): check every
    available candidate, time those left (when the dtype's weights reach ``min_timed_bytes``),
    decide (None: DEFAULT_BUDGET_S, MIN_TIMED_BYTES). Uncached; ``packing_rule`` caches."""
    budget_s = DEFAULT_BUDGET_S if budget_s is None else budget_s
    min_timed_bytes = MIN_TIMED_BYTES if min_timed_bytes is None else min_timed_bytes
    counted = Counter(shape for shape in shapes if shape[0] in DTYPES)
    rule = PackingRule.current()
    generator = torch.Generator().manual_seed(0)
    choices = {}
    dtype_names = sorted({shape[0] for shape in counted})
    for dtype_name in dtype_names:
        dtype = DTYPES[dtype_name]
        mine = Counter({shape: count for shape, count in counted.items() if shape[0] == dtype_name})
        everyone = [*CANDIDATES.values(), DOT]
        unavailable = {c.name: c.unavailable(dtype) for c in everyone}
        wrong: dict[str, str] = {}  # each candidate's first shape that fails, in the order of ``mine``
        for shape in mine:  # one shape's reference at a time, shared by the candidates still in
            reference = Reference(shape, generator)
            for candidate in everyone:
                if unavailable[candidate.name] is None and candidate.name not in wrong:
                    why = check(candidate, shape, generator, reference)
                    if why is not None:
                        wrong[candidate.name] = why
        disabled, passed = {}, []
        for candidate in everyone:
            why = unavailable[candidate.name]
            if why is None and candidate.name in wrong:
                logger.warning("linear form %r disabled for %s weights: its check against a float64 reference "
                               "failed, %s", candidate.name, dtype_name, wrong[candidate.name])
                why = f"wrong: {wrong[candidate.name]}"
            if why is None:
                passed.append(candidate)
            else:
                disabled[candidate.name] = why
        # the panels' dot-product kernel: beside the forms, never one of them
        dot = DOT in passed and any(c.name == "panels" for c in passed)
        dot_disabled = disabled.pop(DOT.name, "")
        passed = [c for c in passed if c is not DOT]
        bytes_ = sum(_weight_bytes(shape, count) for shape, count in mine.items())
        if len(passed) > 1 and bytes_ >= min_timed_bytes:
            timings = measure(dtype_name, mine, passed + [DOT] * dot, budget_s / len(dtype_names), generator)
            kernels, dot_rows, dot_reason = {}, 0, ""
            if dot:
                kernels = {"widen": timings["panels"], "dot": timings.pop(DOT.name)}
                dot_rows, dot_reason = choose_dot_rows(kernels["widen"], kernels["dot"])
                timings["panels"] = {rows: kernels["dot" if 0 < dot_rows <= rows else "widen"][rows]
                                     for rows in ROWS}
            form, reason = decide(timings)
            split_rows, split_reason = choose_split(timings, form) if bytes_ >= SPLIT_MIN_BYTES else (0, "")
            panels = form == "panels" or split_rows > 0
            choices[dtype_name] = Choice(form, reason, timings, disabled, dot_rows if panels else 0, kernels,
                                         dot_reason, dot_disabled, split_rows, split_reason)
            continue
        preferred = _rule_form(rule, dtype)
        if len(passed) <= 1:  # nothing to compare (dense is always there, unless it failed too)
            form = passed[0].name if passed else "dense"
            reason = f"the only form left here ({'; '.join(f'{n}: {w}' for n, w in disabled.items())})"
        else:
            form = preferred if any(c.name == preferred for c in passed) else passed[0].name
            reason = (f"not timed ({bytes_ / 2**20:.2f} MiB of weights, under {min_timed_bytes / 2**20:.0f}: call "
                      f"overhead, not the kernels); the ISA rule" + ("" if form == preferred else
                                                                     f" ({preferred} disabled)"))
        choices[dtype_name] = Choice(form, reason, {}, disabled, dot_disabled=dot_disabled)
    return choices


def _cpu_model() -> str:
    line = cpu_native.cpuinfo_line(("model name", "Hardware", "cpu model"))
    return line.split(":", 1)[1].strip() if line else os.uname().machine


def cache_key(shapes: Iterable[Shape]) -> dict:
    """What a cached answer depends on (module docstring); a change to any of it measures again."""
    sources = hashlib.sha256()
    for path in (Path(__file__), Path(packed_linear.__file__)):
        sources.update(path.read_bytes())
    sources.update(cpu_native._source_digest())
    return {"cpu": _cpu_model(), "features": cpu_native.features(), "threads": torch.get_num_threads(),
            "torch": torch.__version__, "sources": sources.hexdigest()[:16], "rows": list(ROWS),
            "shapes": sorted(f"{d}:{o}x{i}{'+b' if b else ''}:{n}" for (d, o, i, b), n in Counter(shapes).items())}


def _cache_path(key: dict) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return cpu_native._cache_dir() / f"linear-calibration-{digest}.json"


def _read_cache(path: Path, key: dict) -> dict[str, Choice] | None:
    try:
        stored = json.loads(path.read_text())
        if stored["key"] != key:
            return None
        choices = {name: Choice.from_json(data) for name, data in stored["choices"].items()}
    except (OSError, ValueError, KeyError, TypeError):
        return None
    for name, choice in choices.items():
        for form, why in [*choice.disabled.items(), (DOT.name, choice.dot_disabled)]:
            if why.startswith("wrong"):
                logger.warning("linear form %r disabled for %s weights (cached): %s", form, name, why)
    return choices


def cached_choices(shapes: list[Shape], budget_s: float | None = None,
                   min_timed_bytes: int | None = None) -> tuple[dict[str, Choice], bool]:
    """``calibrate``'s answer for ``shapes``, from the cache where this key was measured (True)
    or measured now and cached (False). A model too small to time is only checked, at every load
    (milliseconds), and writes nothing. Processes that start at once (the ranks of a tensor-parallel
    model hold the same shapes) measure one at a time: the first writes, the others read it."""
    min_timed_bytes = MIN_TIMED_BYTES if min_timed_bytes is None else min_timed_bytes
    by_dtype = Counter()
    for shape in shapes:
        by_dtype[shape[0]] += _weight_bytes(shape)
    if all(total < min_timed_bytes for total in by_dtype.values()):
        return calibrate(shapes, budget_s, min_timed_bytes), False
    key = cache_key(shapes)
    path = _cache_path(key)
    choices = _read_cache(path, key)
    if choices is not None:
        return choices, True
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when closed
        choices = _read_cache(path, key)  # measured by a process that held the lock before
        if choices is not None:
            return choices, True
        choices = calibrate(shapes, budget_s, min_timed_bytes)
        fd, partial = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
        with os.fdopen(fd, "w") as out:
            json.dump({"key": key, "choices": {n: c.to_json() for n, c in choices.items()}}, out, indent=1)
        os.replace(partial, path)  # a reader without the lock never sees half a file
    return choices, False


# dtype="auto" on the CPU (Platform.measured_dtype): bfloat16 where its linear layers measured at least
# AUTO_MARGIN times as fast as float32's at one row (decode, where the step streams the weights) and no
# slower at any bucket, for checkpoints whose bfloat16 form keeps the quality goals: bfloat16 ones (no
# weight changes) and float32 ones (docs/quantization.md, "Quality": SmolLM2 in bfloat16, +0.02 %
# perplexity, 99 % top-1 agreement; a float16 checkpoint's range would not survive the rounding kept).
# A model with fewer float32 linear weight bytes than AUTO_MIN_BYTES stays float32 unmeasured: its step
# is bound by host time, not by streaming its weights, so bfloat16 would gain it little.
AUTO_MARGIN = 1.2
AUTO_CHECKPOINT_DTYPES = ("float32", "bfloat16")
AUTO_MIN_BYTES = 32 << 20


def auto_dtype(layers: list[tuple[int, int]], checkpoint_dtype: str | None, threads: int | None = None) -> tuple[str, str]:
    """``dtype="auto"``'s answer for a model whose linear layers are ``layers`` (``(out, in)`` each)
    and whose checkpoint declares ``checkpoint_dtype`` (None: float32, transformers' default), and
    why: the two dtypes' forms measured as at a load (``cached_choices``, over the same shapes in
    each dtype, with the engine's ``threads``: the cache entries its load reads; later starts time
    nothing), compared at each of ROWS."""
    declared = checkpoint_dtype or "float32"
    if declared not in AUTO_CHECKPOINT_DTYPES:
        return "float32", f"the checkpoint holds {declared}, whose values bfloat16 does not keep"
    shapes = [(dtype, out, inp, False) for dtype in DTYPES for out, inp in layers]
    per_dtype = sum(_weight_bytes(shape) for shape in shapes if shape[0] == "float32")
    if per_dtype < AUTO_MIN_BYTES:
        return "float32", (f"{per_dtype / 2**20:.2f} MiB of float32 linear weights, under {AUTO_MIN_BYTES / 2**20:.0f}: "
                           f"its steps are bound by host time, not by the weights")
    if cpu_native.linear_library(torch.device("cpu")) is None:
        return "float32", "the native CPU kernels are not in use"
    # one dtype at a time: the cache entries a load of the model in that dtype reads again, where its
    # layers are these (a decoder without biases: the Llama family's)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads or before)
        answers = {name: cached_choices([shape for shape in shapes if shape[0] == name])
                   for name in ("float32", "bfloat16")}
    finally:
        torch.set_num_threads(before)
    (full, full_cached), (half, half_cached) = ((choices[name], cached) for name, (choices, cached) in answers.items())
    cached = full_cached and half_cached
    if not (full.timings and half.timings):
        return "float32", "the linear forms were not timed"
    ratios = {rows: full.served()[rows] / half.served()[rows] for rows in ROWS}
    measured = (f"bfloat16 ({half.form}) {' / '.join(f'{r:.2f}x' for r in ratios.values())} as fast as float32 "
                f"({full.form}) at {' / '.join(map(str, ROWS))} rows{', cached' if cached else ''}")
    if ratios[DECODE_ROWS] >= AUTO_MARGIN and min(ratios.values()) >= 1:
        return "bfloat16", measured
    return "float32", f"{measured}: under {AUTO_MARGIN}x at {DECODE_ROWS} row or 1x at another"


def packing_rule(shapes: Iterable[Shape], budget_s: float | None = None,
                 min_timed_bytes: int | None = None) -> PackingRule:
    """The rule packing the model whose CPU float linear layers ``shapes`` lists (one entry per
    layer: dtype name, out, in, bias): measured (``cached_choices``), each dtype pinned by
    ``ATB_PLUGIN_CPU_KERNELS`` taken as pinned, and the ISA rule alone under ``=torch``. Logs the
    form of each dtype and why."""
    shapes = list(shapes)
    pinned = cpu_native.linear_forms()
    rule = PackingRule.current()
    forms = {dtype: _rule_form(rule, DTYPES[dtype]) for dtype in DTYPES}
    dot_rows, batch = rule.bf16_dot_rows, []
    torch_ops = cpu_native.choice() == "torch"  # the torch path as it was: the rule, nothing timed
    measured = [] if torch_ops else [shape for shape in shapes if shape[0] in DTYPES and shape[0] not in pinned]
    if measured:
        start = time.perf_counter()
        choices, cached = cached_choices(measured, budget_s, min_timed_bytes)
        spent = time.perf_counter() - start
        for dtype_name, choice in choices.items():
            forms[dtype_name] = choice.form
            if choice.split_rows:  # the panels first (the captured step reads them), the form from split_rows
                forms[dtype_name] = "panels"
                batch.append((DTYPES[dtype_name], choice.form, choice.split_rows))
            if dtype_name == "bfloat16":
                dot_rows = choice.dot_rows
            notes = "".join(f"; {note}" for note in (choice.split_reason, choice.dot_rows and choice.dot_reason) if note)
            logger.info("linear layers in %s: %s (%s%s%s)", dtype_name, choice.form, choice.reason, notes,
                        "; cached" if cached else f"; measured in {spent:.1f} s")
    for dtype_name, form in pinned.items():
        why = CANDIDATES[form].unavailable(DTYPES[dtype_name])
        if why is not None:
            raise ValueError(f"{cpu_native.KERNELS_ENV} pins {dtype_name}={form}, but {why}")
        forms[dtype_name] = form
        batch = [entry for entry in batch if entry[0] != DTYPES[dtype_name]]
        if dtype_name == "bfloat16":
            dot_rows = rule.bf16_dot_rows
        if any(shape[0] == dtype_name for shape in shapes):
            logger.info("linear layers in %s: %s (pinned by %s)", dtype_name, form, cpu_native.KERNELS_ENV)
    return PackingRule(tuple(DTYPES[d] for d, f in forms.items() if f == "panels"),
                       tuple(DTYPES[d] for d, f in forms.items() if f == "onednn"), dot_rows, tuple(batch))
