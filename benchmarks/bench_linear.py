"""Claim: the native kernels' linear layers are faster than oneDNN's packed linear (``PackedLinear``,
what the CPU used before) at decode batch sizes, in float32 (``PanelLinear``) and in the low
precisions (bfloat16 panels, int8 W8A16 and W8A8 dynamic: atb_plugin/ops/cpu_native.py), and
close to it at prefill sizes. Baselines in the same run: oneDNN packed float32 and bfloat16 (or
the dense bfloat16 ``nn.Linear`` where oneDNN does not pack bfloat16 on this CPU), MKL on the
dense float32 weight (``nn.Linear``).

Shapes (--model): SmolLM2-135M's four projections (qkv 960x576, o 576x576, gate_up 3072x576,
down 576x1536) over 30 layers, ~424 MB in float32; TinyLlama-1.1B's (qkv 2560x2048, o 2048x2048,
gate_up 11264x2048, down 2048x5632) over --tinyllama-layers layers (4 by default: ~700 MB in
float32, already more than the caches). Distinct random weights per layer, so every layer's
weight comes from DRAM as in a real step. One torch thread; for each row count the paths in turn
(interleaved), --runs rounds, medians. Every path's output is checked against a float64 product
of its own weights first.

    python benchmarks/bench_linear.py [--runs 5] [--rows 1,32] [--model smollm2,tinyllama]
        [--paths all | fp32,bf16,int8]

Last line: JSON with ms per pass over the layers and each path's speed-up over the float32 panels.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from atb_plugin.ops import cpu_native  # noqa: E402
from atb_plugin.ops.packed_linear import PackedLinear, PanelLinear, packable_dtypes  # noqa: E402

MODELS = {  # (out, in) of qkv, o, gate_up, down; layers
    "smollm2": (((960, 576), (576, 576), (3072, 576), (576, 1536)), 30),
    "tinyllama": (((2560, 2048), (2048, 2048), (11264, 2048), (2048, 5632)), 4),
}


class Int8Linear(nn.Module):
    """An int8 (out, in) weight with per-channel scales through one of the native int8 kernels."""

    def __init__(self, library, weight: torch.Tensor, mode: str):
        super().__init__()
        self.library, self.mode = library, mode
        self.scale = weight.abs().amax(dim=1) / 127
        self.weight = torch.clamp(torch.round(weight / self.scale[:, None]), -128, 127).to(torch.int8)

    def forward(self, x):
        if self.mode == "w8a16":
            return cpu_native.w8a16_linear(self.library, x, self.weight, self.scale, None, None)
        return cpu_native.w8a8_dynamic_linear(self.library, x, self.weight, self.scale, None)

    def dequantized(self) -> torch.Tensor:
        return self.weight.double() * self.scale.double()[:, None]


def build_paths(library, shapes, layers: int, groups: set[str]) -> dict:
    """name -> (layers of modules, input dtype, reference weight of a first-layer module)."""
    dense = [[nn.Linear(k, n, bias=False) for n, k in shapes] for _ in range(layers)]
    paths = {}
    if "fp32" in groups:
        paths["fp32 panels"] = ([[PanelLinear(d.weight, None) for d in layer] for layer in dense], torch.float32)
        paths["oneDNN fp32"] = ([[PackedLinear(d.weight, None) for d in layer] for layer in dense], torch.float32)
        paths["MKL fp32"] = (dense, torch.float32)
    if "bf16" in groups:
        half = [[nn.Linear(d.in_features, d.out_features, bias=False).to(torch.bfloat16) for d in layer]
                for layer in dense]
        for layer, source in zip(half, dense):
            for h, d in zip(layer, source):
                h.weight.data.copy_(d.weight.data)
        paths["bf16 panels"] = ([[PanelLinear(h.weight, None) for h in layer] for layer in half], torch.bfloat16)
        if torch.bfloat16 in packable_dtypes():
            paths["oneDNN bf16"] = ([[PackedLinear(h.weight, None) for h in layer] for layer in half], torch.bfloat16)
        else:
            paths["dense bf16"] = (half, torch.bfloat16)
    if "int8" in groups:
        int8 = [[Int8Linear(library, d.weight.detach(), "w8a16") for d in layer] for layer in dense]
        paths["W8A16"] = (int8, torch.float32)
        w8a8 = []
        for layer in int8:
            row = []
            for m in layer:
                twin = Int8Linear.__new__(Int8Linear)
                nn.Module.__init__(twin)
                twin.library, twin.mode, twin.scale, twin.weight = library, "w8a8", m.scale, m.weight
                row.append(twin)
            w8a8.append(row)
        paths["W8A8 dynamic"] = (w8a8, torch.float32)
    if not paths:
        raise SystemExit(f"no paths in {groups}")
    for name, (modules, dtype) in paths.items():
        reference = [d.weight.detach().double() for d in dense[0]]
        if name in ("bf16 panels", "oneDNN bf16", "dense bf16"):
            reference = [w.to(torch.bfloat16).double() for w in reference]
        elif name.startswith("W8A"):
            reference = [m.dequantized() for m in modules[0]]
        paths[name] = (modules, dtype, reference)
    return paths


def check(name, modules, dtype, reference, shapes, rows) -> None:
    for (n, k), module, weight in zip(shapes, modules[0], reference):
        x = torch.randn(rows, k).to(dtype)
        expected = x.double() @ weight.t()
        out = module(x).double()
        scale = (x.double().abs() @ weight.abs().t()).max().item()
        # float32 sums: ~1e-6 of the magnitudes; bfloat16 output: 2^-9 of each value; W8A8 also
        # rounds x to 8 bits per token (~1 % of the magnitudes)
        tolerance = 2e-2 if name.startswith("W8A8") else 1e-2 if dtype == torch.bfloat16 else 1e-4
        error = (out - expected).abs().max().item()
        assert error <= tolerance * scale, f"{name} ({n}x{k}, {rows} rows): error {error:.3g} of {scale:.3g}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--rows", default="1,32")
    parser.add_argument("--model", default="smollm2,tinyllama")
    parser.add_argument("--paths", default="fp32,bf16,int8")
    parser.add_argument("--tinyllama-layers", type=int, default=MODELS["tinyllama"][1])
    args = parser.parse_args()
    torch.set_num_threads(1)
    library = cpu_native.linear_library(torch.device("cpu"))
    if library is None:
        sys.exit("the native CPU kernels do not build here")
    print(f"probed: {' '.join(n for n, ok in cpu_native.features().items() if ok)}; int8 variant "
          f"{library.w8a8_variant()}; oneDNN packs {[str(d) for d in packable_dtypes()]}", flush=True)
    groups = set(args.paths.split(","))
    report = {}
    for model in args.model.split(","):
        shapes, layers = MODELS[model]
        if model == "tinyllama":
            layers = args.tinyllama_layers
        torch.manual_seed(0)
        paths = build_paths(library, shapes, layers, groups)
        for rows in (int(r) for r in args.rows.split(",")):
            with torch.inference_mode():
                for name, (modules, dtype, reference) in paths.items():
                    check(name, modules, dtype, reference, shapes, rows)
                inputs = {(k, dtype): torch.randn(rows, k).to(dtype) for _, k in shapes
                          for dtype in (torch.float32, torch.bfloat16)}

                def one_pass(modules, dtype):
                    for layer in modules:
                        for (_, k), module in zip(shapes, layer):
                            module(inputs[k, dtype])

                times = {name: [] for name in paths}
                for name, (modules, dtype, _) in paths.items():  # warm-up
                    one_pass(modules, dtype)
                for _ in range(args.runs):
                    for name, (modules, dtype, _) in paths.items():
                        start = time.perf_counter()
                        one_pass(modules, dtype)
                        times[name].append((time.perf_counter() - start) * 1000)
            medians = {name: statistics.median(t) for name, t in times.items()}
            flops = 2 * rows * layers * sum(n * k for n, k in shapes)
            base = medians.get("fp32 panels")
            entry = {"layers": layers, "ms": {name: round(ms, 2) for name, ms in medians.items()}}
            if base:
                entry["speedup_over_fp32_panels"] = {name: round(base / ms, 3) for name, ms in medians.items()}
            report[f"{model} {rows}"] = entry
            print(f"{model} {rows:4d} rows, {layers} layers: " + ", ".join(
                f"{name} {ms:.1f} ms ({flops / ms / 1e6:.0f} GFLOP/s" + (f", {base / ms:.2f}x" if base else "") + ")"
                for name, ms in medians.items()), flush=True)
        del paths
    print(json.dumps({"runs": args.runs, "threads": 1, "results": report}))


if __name__ == "__main__":
    main()
