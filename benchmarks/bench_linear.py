"""Claim: the native kernel's linear layer over column panels (``PanelLinear``,
atb_plugin/ops/cpu_native.py ``linear``) is faster than oneDNN's packed linear
(``PackedLinear``, what the CPU used before) at decode batch sizes, and close to it at prefill
sizes. Baselines in the same run: oneDNN packed, and MKL on the dense weight (``nn.Linear``).

SmolLM2-135M's four projections (qkv 960x576, o 576x576, gate_up 3072x576, down 576x1536) over
30 layers of distinct random weights (~424 MB, more than the caches: every layer's weight comes
from DRAM, as in a real step), one torch thread, for each row count: the three paths in turn,
--runs rounds, medians. Every path's output is checked against a float64 product first.

    python benchmarks/bench_linear.py [--runs 5] [--rows 1,4,32,128,2048]

Last line: JSON with ms per pass (30 layers; 4 layers at 2048 rows) and the ratios.
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
from atb_plugin.ops.packed_linear import PackedLinear, PanelLinear  # noqa: E402

SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))  # (out, in) of qkv, o, gate_up, down
LAYERS = 30


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--rows", default="1,4,32,128,2048")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if cpu_native.library_for(torch.float32, torch.device("cpu")) is None:
        sys.exit("the native CPU kernels do not build here")
    torch.manual_seed(0)
    dense = [[nn.Linear(k, n, bias=False) for n, k in SHAPES] for _ in range(LAYERS)]
    paths = {"native panels": [[PanelLinear(d.weight, None) for d in layer] for layer in dense],
             "oneDNN packed": [[PackedLinear(d.weight, None) for d in layer] for layer in dense],
             "MKL dense": dense}
    report = {}
    for rows in (int(r) for r in args.rows.split(",")):
        # Past 128 rows 4 layers already take long enough to time (RESULTS.md, bench_engine "Fourth round").
        layers = LAYERS if rows <= 128 else 4
        inputs = {k: torch.randn(rows, k) for _, k in SHAPES}
        with torch.inference_mode():
            for name, modules in paths.items():
                for (n, k), module, reference in zip(SHAPES, modules[0], dense[0]):
                    expected = inputs[k].double() @ reference.weight.double().t()
                    # float32 sums of <= 1536 terms: ~1e-6 relative
                    torch.testing.assert_close(module(inputs[k]).double(), expected, rtol=1e-5, atol=1e-4)

            def one_pass(modules):
                for layer in modules[:layers]:
                    for (_, k), module in zip(SHAPES, layer):
                        module(inputs[k])

            times = {name: [] for name in paths}
            for name, modules in paths.items():  # warm-up
                one_pass(modules)
            for _ in range(args.runs):
                for name, modules in paths.items():
                    start = time.perf_counter()
                    one_pass(modules)
                    times[name].append((time.perf_counter() - start) * 1000)
        medians = {name: statistics.median(t) for name, t in times.items()}
        flops = 2 * rows * layers * sum(n * k for n, k in SHAPES)
        report[rows] = {"layers": layers, **{name: round(ms, 2) for name, ms in medians.items()},
                        "onednn_over_native": round(medians["oneDNN packed"] / medians["native panels"], 3),
                        "mkl_over_native": round(medians["MKL dense"] / medians["native panels"], 3)}
        print(f"{rows:5d} rows, {layers} layers: " + ", ".join(
            f"{name} {ms:.1f} ms ({flops / ms / 1e6:.0f} GFLOP/s)" for name, ms in medians.items())
            + f" | oneDNN / native {report[rows]['onednn_over_native']:.2f}x", flush=True)
    print(json.dumps({"runs": args.runs, "threads": 1, "results": report}))


if __name__ == "__main__":
    main()
