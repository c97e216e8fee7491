"""Claim (issue 34, "Low precision"): serving in bfloat16 or with int8 weights through the engine,
whose decode steps run the captured native step (float32 activations over bfloat16 / int8
weights), stays as close to float32 as the eager path does. quality_precision.py measures the
models' own forward (teacher-forced, no engine); this measures what a user of ``LLM.generate``
gets: free-running greedy continuations of quality_precision's prompts, through the engine, each
variant captured and ``enforce_eager``, against the float32 engine's.

    python benchmarks/quality_captured.py [--model DIR] [--tokens 32] [--variants bf16,w8a16,w8a8,w8a8+head]

Variants are spelled as bench_precision.py's --precisions.

Per variant and path: agree = the share of the --tokens positions of every prompt where the
variant's greedy token equals float32's (an early flip counts against every later position: the
continuations then differ), and first = the mean index of the first difference. Last line: JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from bench_precision import precision_kwargs  # noqa: E402
from quality_precision import PROMPTS  # noqa: E402

from atb_plugin import LLM, SamplingParams  # noqa: E402
from atb_plugin.default_model import default_model_dir  # noqa: E402


def continuations(model: Path, tokens: int, enforce_eager: bool, variant: str | None) -> tuple[list[list[int]], str]:
    kwargs = precision_kwargs(variant or "fp32")  # the reference in float32 (dtype "auto" may be bfloat16)
    with LLM(str(model), enforce_eager=enforce_eager, num_threads=torch.get_num_threads(), **kwargs) as llm:
        params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
        outputs = llm.generate(PROMPTS, params)
        return [list(o.outputs[0].token_ids) for o in outputs], llm.engine.core.runner.decode_capture


def agreement(reference: list[list[int]], other: list[list[int]]) -> tuple[float, float]:
    same, firsts = 0, []
    for ref, out in zip(reference, other, strict=True):
        first = next((i for i, (a, b) in enumerate(zip(ref, out)) if a != b), len(ref))
        same += sum(a == b for a, b in zip(ref, out))
        firsts.append(first)
    return same / sum(len(r) for r in reference), sum(firsts) / len(firsts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--variants", default="bf16,w8a16,w8a8")
    args = parser.parse_args()
    torch.set_num_threads(1)
    model = args.model or default_model_dir()
    reference, capture = continuations(model, args.tokens, False, None)
    print(f"fp32 ({capture}): reference, {len(PROMPTS)} prompts x {args.tokens} tokens", flush=True)
    report = {}
    for variant in args.variants.split(","):
        for eager in (False, True):
            tokens, capture = continuations(model, args.tokens, eager, variant)
            agree, first = agreement(reference, tokens)
            key = f"{variant} {'eager' if eager else 'captured'}"
            report[key] = {"agree": round(agree, 4), "first_difference": round(first, 2), "decode_step": capture}
            print(f"{key:<16} agree {agree:6.1%}  first difference at {first:5.1f}  ({capture})", flush=True)
    print(json.dumps({"model": str(model), "tokens": args.tokens, "prompts": len(PROMPTS), "results": report}))


if __name__ == "__main__":
    main()
