"""Claim (issue 34, "Low precision"): on the CPU, serving in bfloat16 or with int8 weights decodes
faster than our float32 (goals on the TinyLlama shape: bfloat16 single stream >= 1.8x our
float32, W8A8 >= 3x), and >= 1.2x llama.cpp at the matching precision (BF16, Q8_0).

Models (--model):
  smollm2    SmolLM2-135M-Instruct, the real weights (atb_plugin/default_model.py), chat prompts;
  tinyllama  a TinyLlama-1.1B-shaped checkpoint with random weights (hidden 2048, 22 layers,
             32 heads of 128, 4 KV heads, intermediate 5632; --tinyllama-layers to shorten) and
             SmolLM2's tokenizer (vocabulary 49152: an untied LM head of 49152 x 2048, 8 % of the
             weights, where TinyLlama's own 32000 x 2048 is 6 %). Written once under
             ${XDG_CACHE_HOME:-~/.cache}/atb-plugin/models/.

Sides (--precisions): ours float32 (``dtype="float32"``), bfloat16 (``dtype="bfloat16"``), our default
(``auto``: ``dtype="auto"``, which on the CPU is bfloat16 where the calibration measured it faster: the
start-up's "dtype auto" line is printed), and W8A16 / W8A8
(``quantization=``, quantized on the fly at load; ``w8a8/bf16``: the rest of the model in bfloat16,
so the LM head too; ``w8a8+head``: the LM head in int8 as well, ``--quantize-lm-head``, as llama.cpp's
Q8_0 quantizes its output matrix). Each side's resident weight
bytes are reported beside its speed. One side
loaded together (a TinyLlama float32 side is 4 GB: all four sides ~9 GB), then --runs rounds over
the sides in turn, medians; one torch thread.
  single   one prompt, --tokens new tokens, greedy, decode tok/s after the first token
           (bench_engine's ``ours_single``);
  batch    --batch prompts x --batch-tokens tokens through ``LLM.generate``, prefill included
           (bench_engine's ``ours_batch``); --batch 0 skips it.
The quantized layers run the native int8 kernels where they load (torch_kernels hands CPU
tensors to cpu_native), as a served model does.
llama.cpp (--llamacpp): one run per round among ours (its medians, like ours: the machine is
shared and its speed drifts over minutes), benchmarks/peers/llamacpp_bench.py in the peers' own venv
($ATB_PEERS_DIR/llamacpp-venv, made by benchmarks/peers/setup.sh, never this project's), over
GGUFs converted by llama.cpp's vendored convert_hf_to_gguf.py (setup.sh writes SmolLM2's F32,
BF16 and Q8_0; the TinyLlama-shaped one is converted here on first use), one thread.

    python benchmarks/bench_precision.py [--model smollm2,tinyllama] [--model-dir DIR] [--runs 2] [--tokens 64]
        [--batch 32] [--batch-tokens 128] [--precisions fp32,bf16,w8a16,w8a8,w8a8/bf16,w8a8+head] [--llamacpp]

Last line: JSON with every side's medians and the ratios to our float32.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import statistics
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_engine as a sibling module
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_engine import chats, ours_batch, ours_single  # noqa: E402
from random_checkpoint import random_checkpoint  # noqa: E402

from atb_plugin import LLM  # noqa: E402
from atb_plugin.default_model import default_model_dir  # noqa: E402

TINYLLAMA = {"hidden_size": 2048, "intermediate_size": 5632, "num_attention_heads": 32, "num_key_value_heads": 4,
             "head_dim": 128, "num_hidden_layers": 22}
PEERS = Path(os.environ.get("ATB_PEERS_DIR") or Path.home() / ".cache" / "atb-plugin" / "peers")
# our side's scheme (a precision's part before "+" and "/") -> the llama.cpp precision it matches
GGUF_TYPES = {"fp32": "F32", "bf16": "BF16", "w8a8": "Q8_0"}


def tinyllama_checkpoint(layers: int) -> Path:
    """The TinyLlama-shaped random checkpoint (an untied LM head), written once; the tokenizer and
    its vocabulary (49152) are SmolLM2's, which llama.cpp's converter recognises."""
    return random_checkpoint(f"tinyllama-shape-random-{layers}-smollm2-vocab",
                             {**TINYLLAMA, "num_hidden_layers": layers, "rope_scaling": None, "rope_theta": 10000.0,
                              "max_position_embeddings": 2048, "tie_word_embeddings": False}, qkv_bias=False)


def precision_kwargs(precision: str) -> dict:
    """``LLM`` keyword arguments for ``precision``: fp32, bf16, auto (our default), or a scheme (w8a16 / w8a8) with the
    rest of the model in float32, or with ``/bf16`` in bfloat16 (embeddings, LM head, norms, KV
    cache: ``--dtype bfloat16 --quantization w8a8``, the Ascend deployment form); ``+head``: the
    LM head in the scheme too (``--quantize-lm-head``, as llama.cpp's Q8_0 quantizes its output
    matrix)."""
    if precision == "auto":
        return {}
    scheme, _, rest = precision.partition("/")
    scheme, _, extra = scheme.partition("+")
    if scheme not in ("fp32", "bf16", "w8a16", "w8a8") or rest not in ("", "bf16") or extra not in ("", "head"):
        raise ValueError(f"precision {precision!r}: expected fp32, bf16, auto, or w8a16 / w8a8 [+head] [/bf16]")
    # float32 named: dtype "auto" may be bfloat16 on the CPU (the calibration's measurement)
    kwargs = {"dtype": "bfloat16"} if "bf16" in (scheme, rest) else {"dtype": "float32"}
    if scheme in ("w8a16", "w8a8"):
        kwargs["quantization"] = scheme
    if extra == "head":
        kwargs["quantize_lm_head"] = True
    return kwargs


def load(model_dir: Path, precision: str, args) -> LLM:
    return LLM(str(model_dir), max_num_seqs=max(args.batch, 1), max_num_batched_tokens=2048, num_threads=1,
               **precision_kwargs(precision))


def ours(model: str, model_dir: Path, precisions: list[str], args, peers: dict | None = None) -> dict:
    """Every side loaded at once, then --runs rounds over the sides in turn (the order rotated
    each round), so that a busy spell on the machine falls on all of them; medians. ``peers``:
    ``{name: run()}`` measured once per round between ours (llama.cpp, one process per run)."""
    llms, load_s = {}, {}
    for precision in precisions:
        try:
            start = time.perf_counter()
            llms[precision] = load(model_dir, precision, args)
            load_s[precision] = time.perf_counter() - start  # the linear calibration included, on a first start
        except Exception as exc:  # a side that cannot load is reported, the others still run
            print(f"{model} {precision}: failed to load: {type(exc).__name__}: {exc}", flush=True)
    singles = {p: [] for p in llms}
    batches = {p: [] for p in llms}
    tokens = {}
    try:
        first = next(iter(llms.values()))
        prompts = [first.router.input_builder.make_context(0, chat) for chat in chats(max(args.batch, 1))]
        for precision, llm in llms.items():  # warm-up
            ours_single(llm, prompts[0], 4)
        peer_runs = {name: [] for name in peers or {}}
        for run in range(args.runs):
            names = [*llms, *peer_runs]
            order = names[run % len(names):] + names[:run % len(names)]
            for precision in order:
                if precision in peer_runs:
                    result = peers[precision]()
                    if result is not None:
                        peer_runs[precision].append(result)
                    continue
                _, rate, tokens[precision] = ours_single(llms[precision], prompts[0], args.tokens)
                singles[precision].append(rate)
                if args.batch:
                    batches[precision].append(ours_batch(llms[precision], prompts[:args.batch],
                                                         args.batch_tokens)[0])
        sides = {}
        for name, results in peer_runs.items():
            if not results:
                print(f"{model} {name}: not available (run benchmarks/peers/setup.sh)", flush=True)
                continue
            sides[name] = {measure: statistics.median(r[measure] for r in results) if results[0][measure] else None
                           for measure in ("single_tok_s", "batch_tok_s")}
            sides[name]["runs_single"] = [round(r["single_tok_s"], 2) for r in results]
            print(f"{model} {name}: {json.dumps(sides[name])}", flush=True)
        for precision, llm in llms.items():
            runner = llm.engine.core.runner
            capture = runner.decode_capture
            sides[precision] = {
                "weight_mib": weight_mib(runner.model),
                "single_tok_s": statistics.median(singles[precision]),
                "batch_tok_s": statistics.median(batches[precision]) if batches[precision] else None,
                "runs_single": [round(r, 2) for r in singles[precision]],
                "runs_batch": [round(r, 2) for r in batches[precision]], "decode_capture": capture,
                "linear_forms": linear_forms(runner.model), "load_s": round(load_s[precision], 2),
                "single_tokens": tokens[precision][:16]}
            print(f"{model} ours {precision}: {json.dumps(sides[precision])}", flush=True)
        return sides
    finally:
        for llm in llms.values():
            llm.close()
        llms.clear()
        gc.collect()


def linear_forms(model) -> dict[str, int]:
    """How many linear layers each module class serves: the calibration's choice of form per dtype
    (atb_plugin/ops/calibration.py; its log line is printed at load) or a quantized layer."""
    return dict(Counter(type(m).__name__ for m in model.modules() if hasattr(m, "linear_spec")))


def weight_mib(model) -> dict[str, float]:
    """MiB of the model's parameters and buffers as loaded (panels, int8 rows, scales; a tensor
    held twice counted once): ``total``, and ``linear`` for the decoder layers' projections alone
    (what quantization shrinks; the embedding, LM head and norms stay in the model's dtype)."""
    seen, total, linear = set(), 0, 0
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        key = tensor.data_ptr() if tensor.layout == torch.strided else id(tensor)  # oneDNN's packed: opaque
        if key not in seen:
            seen.add(key)
            size = tensor.numel() * tensor.element_size()
            total += size
            linear += size if "_proj." in name else 0
    return {"total": round(total / 2**20, 1), "linear": round(linear / 2**20, 1)}


def gguf_for(model: str, model_dir: Path, gguf_type: str) -> Path | None:
    """SmolLM2's GGUFs from setup.sh; the TinyLlama-shaped one converted here (the peers' venv)."""
    if model == "smollm2":
        path = PEERS / "models" / f"SmolLM2-135M-Instruct-{gguf_type}.gguf"
        return path if path.exists() else None
    path = PEERS / "models" / f"{model_dir.name}-{gguf_type}.gguf"
    if path.exists():
        return path
    converters = list((PEERS / "src").glob("llama_cpp_python-*/vendor/llama.cpp/convert_hf_to_gguf.py"))
    if not converters:
        return None
    done = subprocess.run([str(PEERS / "llamacpp-venv" / "bin" / "python"), str(converters[0]), str(model_dir),
                           "--outtype", gguf_type.lower(), "--outfile", f"{path}.partial"],
                          capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    if done.returncode != 0:
        print(f"llama.cpp conversion to {gguf_type} failed: {done.stderr[-500:]}", flush=True)
        return None
    os.replace(f"{path}.partial", path)
    return path


def llamacpp(gguf: Path, args) -> dict | None:
    python = PEERS / "llamacpp-venv" / "bin" / "python"
    if not python.exists():
        return None
    command = [str(python), str(Path(__file__).resolve().parent / "peers" / "llamacpp_bench.py"), "--gguf", str(gguf),
               "--tokens", str(args.tokens), "--batch", str(max(args.batch, 1)), "--threads", "1"]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        print(f"llama.cpp on {gguf.name} failed: {done.stderr[-500:]}", flush=True)
        return None
    result = json.loads(done.stdout.strip().splitlines()[-1])
    return {"single_tok_s": result["single_tok_s"], "batch_tok_s": result["batch_tok_s"] if args.batch else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2,tinyllama")
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--batch-tokens", type=int, default=128)
    parser.add_argument("--precisions", default="fp32,bf16,w8a16,w8a8,w8a8/bf16")
    parser.add_argument("--tinyllama-layers", type=int, default=22)
    parser.add_argument("--model-dir", help="this checkpoint for --model's sides instead of its own")
    parser.add_argument("--llamacpp", action="store_true", help="also llama.cpp at F32 / BF16 / Q8_0 (peers' venv)")
    parser.add_argument("--llamacpp-types", default="F32,BF16,Q8_0", help="the GGUF types llama.cpp runs")
    args = parser.parse_args()
    torch.set_num_threads(1)
    # The calibration's choices (form per weight dtype, and why; what dtype "auto" took) beside the ratios.
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter("calibration: %(message)s"))
    for name in ("atb_plugin.ops.calibration", "atb_plugin.engine.config"):
        chosen = logging.getLogger(name)
        chosen.setLevel(logging.INFO)
        chosen.addHandler(handler)
    report = {}
    for model in args.model.split(","):
        model_dir = (Path(args.model_dir) if args.model_dir else default_model_dir() if model == "smollm2"
                     else tinyllama_checkpoint(args.tinyllama_layers))
        peers = {}
        if args.llamacpp:
            for gguf_type in args.llamacpp_types.split(","):
                gguf = gguf_for(model, model_dir, gguf_type)
                peers[f"llama.cpp {gguf_type}"] = (lambda gguf=gguf: llamacpp(gguf, args) if gguf else None)
        sides = ours(model, model_dir, args.precisions.split(","), args, peers)
        base = sides.get("fp32")
        ratios = {}
        for name, side in sides.items():
            for measure in ("single_tok_s", "batch_tok_s"):
                if base and base.get(measure) and side.get(measure):
                    ratios[f"{name} {measure} / ours fp32"] = round(side[measure] / base[measure], 3)
            if base and base.get("weight_mib") and side.get("weight_mib"):
                for part in ("total", "linear"):
                    ratios[f"{name} {part} weight bytes / ours fp32"] = round(
                        side["weight_mib"][part] / base["weight_mib"][part], 3)
            gguf_type = GGUF_TYPES.get(name.partition("/")[0].partition("+")[0])
            peer = sides.get(f"llama.cpp {gguf_type}")
            for measure, label in (("single_tok_s", "single"), ("batch_tok_s", "batch")):
                if peer and peer.get(measure) and side.get(measure):
                    ratios[f"ours {name} {label} / llama.cpp {gguf_type}"] = round(
                        side[measure] / peer[measure], 3)
        report[model] = {"sides": sides, "ratios": ratios}
        for key, value in ratios.items():
            print(f"{model}: {key} = {value:.2f}x", flush=True)
    print(json.dumps({"runs": args.runs, "tokens": args.tokens, "batch": args.batch,
                      "batch_tokens": args.batch_tokens, "threads": 1, "results": report}))


if __name__ == "__main__":
    main()
