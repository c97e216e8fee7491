"""Claim: multi-LoRA serving costs little over the base model, and far less than PEFT's one
adapter at a time. SmolLM2-135M-Instruct fp32, one torch thread, 32 prompts x 128 new tokens
(greedy, ignore_eos), through one ``LLM(enable_lora=True, max_loras=4, max_lora_rank=16)``:

  base         no adapter (decode steps run the captured native step: docs/architecture.md)
  base-eager   the same, with the captured step switched off
  1-adapter    every prompt through one rank-16 adapter on every linear layer
  4-mixed      prompt i through adapter i % 4: every step mixes the four (decode steps captured,
               the adapters inside them: csrc/lora_kernels.c)
  4-mixed-eager   4-mixed with the captured step switched off: the eager layers, each adding the
               adapters through the same native kernel
  4-mixed-torch   the same through the torch ops (per adapter one shrink, in-place expands: the
               eager form before the kernel, and the form off the CPU)

Runs alternate (order rotated each run); medians, and the median of each run's ratio to the
same run's base (steadier on a shared machine). With ``--peft-python PY`` (a Python whose
environment has PEFT: it is not a dependency of this project) the same work through PEFT:
transformers' ``generate`` per adapter (``set_adapter``, its 8 prompts as one left-padded batch),
run once. Goals (issue 47): 4-mixed >= 0.8x base; >= 5x PEFT.

    python benchmarks/bench_lora.py [--runs 3] [--tokens 128] [--batch 32] [--peft-python /tmp/peft-venv/bin/python]
                                    [--sides base,4-mixed]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_engine as a sibling module
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from bench_engine import chats  # noqa: E402

SIDES = ("base", "base-eager", "1-adapter", "4-mixed", "4-mixed-eager", "4-mixed-torch")
ADAPTERS = 4


def _adapters(root: Path, model_dir) -> list[Path]:
    from atb_plugin.testing.lora_adapters import make_adapter

    # std 0.02: a trained adapter's size; the speed does not depend on the values.
    return [make_adapter(root / f"adapter{i}", model_dir, r=16, lora_alpha=32, seed=i, std=0.02)
            for i in range(ADAPTERS)]


def _run(llm, prompts, tokens, loras) -> tuple[float, list[list[int]]]:
    from atb_plugin import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, lora_request=loras)
    return len(prompts) * tokens / (time.perf_counter() - start), [list(o.outputs[0].token_ids) for o in outputs]


def ours(args, adapters, prompts) -> dict:
    from atb_plugin import LLM, LoRARequest
    from atb_plugin.default_model import default_model_dir

    # An explicit dtype: "auto" on the CPU may pick bfloat16 where this machine measured it faster,
    # and the sides must be compared at the precision the results name.
    llm = LLM(default_model_dir(), max_num_seqs=args.batch, max_num_batched_tokens=2048, num_threads=1,
              enable_lora=True, max_loras=ADAPTERS, max_lora_rank=16, dtype=args.dtype)
    requests = [LoRARequest(f"adapter{i}", i + 1, str(path)) for i, path in enumerate(adapters)]
    mixed = [requests[i % ADAPTERS] for i in range(len(prompts))]
    loras = {"base": None, "base-eager": None, "1-adapter": requests[0], "4-mixed": mixed, "4-mixed-eager": mixed,
             "4-mixed-torch": mixed}
    decoder = llm.engine.runner.model.get_language_model().model
    captured = decoder.captured_decode
    wrapped = list(llm.engine.runner.lora.layers.values())
    native = [layer._native for layer in wrapped]  # the kernel's view of each layer's slots
    print(f"dtype: {llm.engine.config.dtype}, decode step: {llm.engine.runner.decode_capture}", flush=True)
    _run(llm, prompts[:4], 4, [requests[i] for i in range(4)])  # warm-up: every adapter in its slot
    sides = args.sides
    results, tokens = {side: [] for side in sides}, {}
    for run in range(args.runs):
        order = sides[run % len(sides):] + sides[:run % len(sides)]
        for side in order:
            decoder.captured_decode = None if side in ("base-eager", "4-mixed-eager", "4-mixed-torch") else captured
            for layer, slots in zip(wrapped, native):  # a str: the layer takes the torch ops
                layer._native = "torch ops (bench)" if side == "4-mixed-torch" else slots
            speed, tokens[side] = _run(llm, prompts, args.tokens, loras[side])
            results[side].append(speed)
            print(f"run {run} {side:>10}: {speed:.1f} tok/s", flush=True)
    decoder.captured_decode = captured
    for layer, slots in zip(wrapped, native):
        layer._native = slots
    llm.close()
    # Captured and eager forms of the same work: how many rows keep the same greedy tokens (the
    # base pair too: the captured step and the eager forward differ on this model without LoRA).
    for side, other in (("base-eager", "base"), ("4-mixed-eager", "4-mixed"), ("4-mixed-torch", "4-mixed")):
        if side in tokens and other in tokens:
            same = sum(a == b for a, b in zip(tokens[other], tokens[side]))
            print(f"{side}: {same} of {len(prompts)} rows the same tokens as {other}", flush=True)
    # Each run's ratio to the same run's base, the median of those: on a shared machine the load
    # changes between runs more than between two sides of one run.
    paired = {side: statistics.median(s / b for s, b in zip(v, results["base"])) for side, v in results.items()}
    return {side: statistics.median(v) for side, v in results.items()}, paired


def peft_side(args, adapters) -> None:
    """Run inside the PEFT environment: print one JSON line, tok/s over all adapters."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(1)
    model_dir = args.model_dir
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = PeftModel.from_pretrained(model, str(adapters[0]), adapter_name="adapter0")
    for i, path in enumerate(adapters[1:], 1):
        model.load_adapter(str(path), adapter_name=f"adapter{i}")
    model.eval()
    texts = [tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) for chat in chats(args.batch)]
    start = time.perf_counter()
    for i in range(ADAPTERS):  # vLLM-less serving: one adapter at a time, its prompts batched
        model.set_adapter(f"adapter{i}")
        batch = tokenizer(texts[i::ADAPTERS], return_tensors="pt", padding=True)
        with torch.no_grad():
            model.generate(**batch, max_new_tokens=args.tokens, min_new_tokens=args.tokens, do_sample=False,
                           pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id)
    elapsed = time.perf_counter() - start
    print(json.dumps({"peft_tok_s": args.batch * args.tokens / elapsed}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--dtype", default="float32", help="the engine's dtype (float32, bfloat16 or auto)")
    parser.add_argument("--peft-python", help="a Python with PEFT installed (its own environment)")
    parser.add_argument("--sides", type=lambda v: tuple(v.split(",")), default=SIDES,
                        help=f"comma-separated, of {','.join(SIDES)} (base first); e.g. base,4-mixed with more runs "
                             "on a busy machine")
    parser.add_argument("--peft-side", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    parser.add_argument("--adapters", nargs="*", help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.peft_side:
        peft_side(args, [Path(p) for p in args.adapters])
        return
    from atb_plugin import LLM
    from atb_plugin.default_model import default_model_dir

    with tempfile.TemporaryDirectory() as tmp:
        adapters = _adapters(Path(tmp), default_model_dir())
        with LLM(default_model_dir(), num_threads=1) as plain:  # the same chat prompts bench_engine uses
            prompts = [plain.router.input_builder.make_context(0, chat) for chat in chats(args.batch)]
        med, paired = ours(args, adapters, prompts)
        peft = None
        if args.peft_python:
            out = subprocess.run([args.peft_python, __file__, "--peft-side", "--tokens", str(args.tokens), "--batch",
                                  str(args.batch), "--model-dir", str(default_model_dir()), "--adapters",
                                  *map(str, adapters)], check=True, capture_output=True, text=True)
            peft = json.loads(out.stdout.strip().splitlines()[-1])["peft_tok_s"]
    print(f"SmolLM2-135M-Instruct fp32, 1 torch thread, {args.batch} x {args.tokens}, medians of {args.runs} runs")
    for side in med:
        print(f"{side:>10}: {med[side]:.1f} tok/s ({med[side] / med['base']:.2f}x base; run by run "
              f"{paired[side]:.2f}x)")
    pairs = (("4-mixed", "base"), ("1-adapter", "base"), ("4-mixed", "base-eager"), ("4-mixed-eager", "4-mixed-torch"))
    ratios = {f"{a}/{b}": med[a] / med[b] for a, b in pairs if a in med and b in med}
    if peft is not None and "4-mixed" in med:
        print(f"      peft: {peft:.1f} tok/s (4-mixed {med['4-mixed'] / peft:.2f}x PEFT)")
        ratios["4-mixed/peft"] = med["4-mixed"] / peft
    print(json.dumps({"medians": {k: round(v, 2) for k, v in med.items()}, "peft_tok_s": peft and round(peft, 2),
                      "ratios": {k: round(v, 3) for k, v in ratios.items()},
                      "paired_vs_base": {k: round(v, 3) for k, v in paired.items()}}))


if __name__ == "__main__":
    main()
