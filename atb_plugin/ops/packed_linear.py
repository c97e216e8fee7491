"""Linear layers with oneDNN-packed weights, for the CPU.

A ``torch.nn.Linear`` on the CPU multiplies by the weight as the checkpoint lays it out
(``(out, in)`` row-major) through MKL's GEMM, which repacks panels of the weight on every call.
oneDNN can reorder a weight once, at load, into the blocked layout its kernels stream; the
product is the same up to float32 summation order (max |diff| ~1e-6 relative). In the
measurement that chose it (a 2-vCPU EPYC), packing made SmolLM2-135M's projections (30 layers,
weights streamed from DRAM as in a real step) faster than the dense ``nn.Linear`` from one row
to a 2048-token prefill, most at a few rows (benchmarks/RESULTS.md, bench_engine "Second
round"; bench_linear.py times the two again).

This is what vLLM's CPU backend does for every unquantised linear layer and what inductor's
weight freezing does; here it is the float linear method's last step of the load
(``models/linear.py``, ``UnquantizedLinearMethod.process_weights_after_loading``, by the rule
``PackingRule``), so the models' code and parameter names stay those of the checkpoint.

Where the native CPU kernels load (``atb_plugin.ops.cpu_native``, float32), a linear layer holds
its weight in their column panels instead (``PanelLinear``): the kernel reads the next panel
from DRAM while it computes on the current one, which makes it faster than oneDNN up to 32 rows
and a little slower at prefill sizes (benchmarks/RESULTS.md, bench_engine "Fourth round",
bench_linear.py). A bfloat16 weight is held in bfloat16 panels (half the bytes; widened to float32
in registers, float32 sums: ``cpu_native.linear_bf16``). Which form each weight dtype takes on
this machine is measured at the model's first load (``ops/calibration.py``: every form checked
against float64, then timed at 1 and 32 rows; docs/architecture.md, "Chosen by measurement").
``PackingRule.current`` is the rule without a measurement, for models too small to time and
``ATB_PLUGIN_CPU_KERNELS=torch``: the panels, except bfloat16 where this CPU executes bfloat16
dot products (AVX-512 BF16 or AMX-BF16, by the kernels' probe) and oneDNN packs bfloat16
(``native_bf16_preferred``); oneDNN wherever the library is unavailable. Where neither holds
(AVX2 alone: oneDNN does not pack bfloat16 there) a bfloat16 linear used to stay dense, slower
than float32 (benchmarks/RESULTS.md, "Low precision").

The dense weight is dropped once packed (no memory grows) unless another module still reads it:
a tied LM head shares the input embedding's weight, so it gets a packed copy and the embedding
keeps the original.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

import torch
from torch import nn

from atb_plugin.ops import cpu_native

logger = logging.getLogger(__name__)


def packable_dtypes() -> tuple[torch.dtype, ...]:
    """The weight dtypes oneDNN packs on this CPU (none where PyTorch was built without it)."""
    if not torch.backends.mkldnn.is_available():
        return ()
    if torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return torch.float32, torch.bfloat16
    return (torch.float32,)


class PackedLinear(nn.Module):
    """``y = x W^T + b`` with ``W`` held only in oneDNN's packed form (an opaque tensor: no
    indexing, no ``.t()``). Takes any leading dimensions, like ``nn.Linear``."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        # A buffer (counted with the model's memory) that no state_dict holds: the opaque layout is
        # this process's CPU's, and the checkpoint's dense weight is the source of truth.
        self.register_buffer("packed_weight", torch.ops.mkldnn._reorder_linear_weight(weight.detach()),
                             persistent=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class PanelLinear(nn.Module):
    """``y = x W^T + b`` with ``W`` held only as the native kernels' column panels: float32
    (``cpu_native.weight_panels``) for a float32 weight, bfloat16 (``cpu_native.weight_panels_bf16``)
    for a bfloat16 one. Takes any leading dimensions, like ``nn.Linear``; bfloat16 panels take
    float32 or bfloat16 ``x`` and answer in ``x``'s dtype, from ``dot_rows`` rows on (0: never;
    the calibration's choice) through the bfloat16 dot-product kernel (``cpu_native.linear_bf16``).
    When the native kernels are switched off after load (``ATB_PLUGIN_CPU_KERNELS=torch``) it runs
    the same product as one batched torch matmul over the panels (float32 sums either way)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, dot_rows: int = 0):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.bf16 = weight.dtype == torch.bfloat16
        self.dot_rows = dot_rows if self.bf16 else 0
        panels = (cpu_native.weight_panels_bf16 if self.bf16 else cpu_native.weight_panels)(weight.detach())
        self.register_buffer("weight_panels", panels, persistent=False)
        # the only copy of the bias: zeros past out_features, sliced off with the padded columns
        self.register_buffer("padded_bias", cpu_native.padded_bias(None if bias is None else bias.detach(),
                                                                   self.weight_panels), persistent=False)
        if self.bf16:
            cpu_native.check_panels_bf16(self.weight_panels, self.in_features, self.out_features, self.padded_bias)
        else:
            cpu_native.check_panels(self.weight_panels, self.out_features, self.padded_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.bf16:
            if x.dtype in (torch.float32, torch.bfloat16):
                library = cpu_native.linear_library(x.device)
                if library is not None:
                    return cpu_native.linear_bf16(library, x, self.weight_panels, self.in_features,
                                                  self.out_features, self.padded_bias, self.dot_rows)
        else:
            library = cpu_native.library_for(x.dtype, x.device)
            if library is not None:
                return cpu_native.linear(library, x, self.weight_panels, self.out_features, self.padded_bias)
        return self._torch_forward(x)

    def _torch_forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).to(torch.float32)
        panels = self.weight_panels
        if self.bf16:  # (P, K/2, 64, 2) -> (P, K, 64), float32
            panels = panels.transpose(2, 3).reshape(panels.shape[0], -1, cpu_native.PANEL)[:, :self.in_features]
            panels = panels.to(torch.float32)
        out = torch.matmul(rows, panels).transpose(0, 1).reshape(rows.shape[0], -1)
        if self.padded_bias is not None:
            out = out + self.padded_bias
        return out[:, :self.out_features].reshape(*x.shape[:-1], self.out_features).to(x.dtype)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.padded_bias is not None}, dtype={'bfloat16' if self.bf16 else 'float32'}"
                + (f", dot_rows={self.dot_rows}" if self.dot_rows else ""))

    def native_operands(self) -> cpu_native.LinearOperands:
        """The panels as the captured decode step reads them (models/native_decode.py)."""
        return cpu_native.LinearOperands(cpu_native.LINEAR_BF16 if self.bf16 else cpu_native.LINEAR_F32,
                                         self.weight_panels, bias=self.padded_bias, dot_rows=self.dot_rows)


def dense_linear(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Linear:
    """``weight`` (and ``bias``) in a plain ``nn.Linear`` of their dtype (the dense form)."""
    layer = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, dtype=weight.dtype)
    with torch.no_grad():
        layer.weight.copy_(weight)
        if bias is not None:
            layer.bias.copy_(bias)
    return layer.requires_grad_(False)


class SplitLinear(PanelLinear):
    """One weight in two forms, where the calibration measured the panels fastest for decode rows
    and another form for batches (ops/calibration.py, ``choose_split``): the panels below
    ``batch_rows`` rows (and in the captured decode step, which then runs fewer requests than
    that), ``batch`` (a ``PackedLinear`` or a dense ``nn.Linear``) from there on. Holds the weight
    twice: the price of each bucket's fastest form."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, dot_rows: int, batch: nn.Module,
                 batch_rows: int):
        super().__init__(weight, bias, dot_rows)
        self.batch, self.batch_rows = batch, batch_rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() >= self.batch_rows * self.in_features:
            return self.batch(x)
        return super().forward(x)

    def native_operands(self) -> cpu_native.LinearOperands:
        return replace(super().native_operands(), batch_rows=self.batch_rows)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, batch_rows={self.batch_rows}"


def native_bf16_preferred() -> bool:
    """Whether a bfloat16 linear layer goes to the native bfloat16 panels rather than oneDNN
    (module docstring: oneDNN where the CPU runs bfloat16 dot products and oneDNN packs bfloat16;
    the native panels everywhere else the library loads)."""
    if cpu_native.linear_library(torch.device("cpu")) is None:
        return False
    found = cpu_native.features()
    dot_products = found.get("avx512_bf16") or found.get("amx_bf16")
    return not (dot_products and torch.bfloat16 in packable_dtypes())


@dataclass(frozen=True)
class PackingRule:
    """Which packed form a CPU linear weight takes here (module docstring): ``native``, the dtypes
    going to the native kernels' panels; ``onednn``, those oneDNN packs; the rest stay dense;
    ``bf16_dot_rows``, bfloat16 panels' ``PanelLinear.dot_rows``; ``batch``, per dtype of
    ``native`` that also takes another form from some rows on, ``(dtype, form, rows)``
    (``SplitLinear``; form ``onednn`` or ``dense``). Made once per load by the calibration
    (``ops/calibration.py``), or ``current()``, the ISA rule."""

    native: tuple[torch.dtype, ...]
    onednn: tuple[torch.dtype, ...]
    bf16_dot_rows: int = 0
    batch: tuple[tuple[torch.dtype, str, int], ...] = ()

    @classmethod
    def current(cls) -> "PackingRule":
        if cpu_native.library_for(torch.float32, torch.device("cpu")) is None:
            return cls((), packable_dtypes())
        return cls((torch.float32, torch.bfloat16) if native_bf16_preferred() else (torch.float32,), packable_dtypes())

    def pack(self, weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Module | None:
        """``weight`` (and ``bias``) packed: a ``PanelLinear``, a ``PackedLinear``, or None where
        neither takes its dtype (the layer stays dense)."""
        if weight.dtype in self.native:
            for dtype, form, rows in self.batch:
                if dtype == weight.dtype:
                    batch = PackedLinear(weight, bias) if form == "onednn" else dense_linear(weight, bias)
                    return SplitLinear(weight, bias, self.bf16_dot_rows, batch, rows)
            return PanelLinear(weight, bias, self.bf16_dot_rows)
        if weight.dtype in self.onednn:
            return PackedLinear(weight, bias)
        return None


@dataclass
class PackingSummary:
    packed: int = 0  # layers now running on packed weights (oneDNN's or the native kernels' panels)
    native: int = 0  # of those, the ones in the native kernels' panels
    copied_bytes: int = 0  # packed copies of weights another module still reads (tied heads)
    skipped: int = 0  # layers left dense (a dtype oneDNN does not pack here)

    def record(self, dense: nn.Module, served: nn.Module, shared: bool) -> None:
        """One CPU float layer ``dense`` now served by ``served`` (itself when left dense);
        ``shared``: another module still holds its weight."""
        if served is dense:
            self.skipped += 1
            return
        self.packed += 1
        self.native += isinstance(served, PanelLinear)
        if shared:
            self.copied_bytes += dense.weight.numel() * dense.weight.element_size()

    def log(self) -> None:
        logger.info("packed weights: %d linear layers, %d of them in native panels (%.1f MiB copied for shared "
                    "weights, %d left dense)", self.packed, self.native, self.copied_bytes / 2**20, self.skipped)
