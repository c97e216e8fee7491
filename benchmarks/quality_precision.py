"""Output quality of the low-precision modes against fp32 on SmolLM2-135M-Instruct (the default
model, real weights; docs/quantization.md, "Quality")::

    python benchmarks/quality_precision.py [--model DIR] [--tokens 32] [--variants w8a8,w8a8+head]

Rows: fp32 (the reference), bf16, w8a16 and w8a8 (quantized on the fly from the fp32
checkpoint, fp32 activations), w8a16+head and w8a8+head (the LM head quantized too:
``quantize_lm_head``), w8a8-static (the checkpoint exported with
``atb_plugin.models.quantization.export --method w8a8``, calibrated on its built-in paragraph).
Columns, over ``PROMPTS``:

- agree (teacher-forced): the share of the fp32 greedy continuation's ``--tokens`` positions where
  the variant's top-1 token, given the same fp32 prefix, is fp32's token;
- agree (free-running), with ``--free-running`` (a greedy decode per variant, slow on the CPU):
  the share of positions where the variant's own greedy continuation equals fp32's (one early
  flip counts against every later position);
- |dlogp|: mean |log p_variant(t) - log p_fp32(t)| over the fp32 continuation's tokens t;
- ppl, dppl: perplexity on ``PPL_TEXT`` (written for this project) and its change against fp32.
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from atb_plugin.testing.sequence import SequenceRunner  # noqa: E402

PROMPTS = [
    "The capital of France is",
    "Write a short poem about the sea.",
    "def fibonacci(n):",
    "Explain why the sky is blue in two sentences.",
    "List three fruits that are red:",
    "Once upon a time, in a small village,",
    "The main difference between a cat and a dog is",
    "Translate to French: Good morning, how are you?",
    "Photosynthesis is the process by which",
    "The year 1969 is remembered because",
    "To make a cup of tea, first",
    "Q: What is 12 times 7?\nA:",
]

PPL_TEXT = (
    "The town sat at the edge of a wide valley, where the river slowed and spread into shallow pools. "
    "Every spring the water rose, and the farmers moved their sheep to the higher fields above the mill. "
    "The miller, an old man with a patient voice, kept a record of each flood in a thick notebook: the "
    "date, the height of the water against the stone wall, and the names of the families who had helped "
    "to carry grain to safety. Children from the school would visit him to read the older pages, some of "
    "them written by his grandfather more than a hundred years before. They learned that the worst flood "
    "had come in a dry year, after a storm in the mountains that no one in the valley had seen. In the "
    "evenings the miller walked along the bank and watched the light fade over the water. He said that a "
    "river is never the same from one day to the next, and that the only way to know it is to look at it "
    "every day, to write down what you see, and to ask the people who lived beside it before you."
)


def load(model_dir: Path, dtype: torch.dtype, quantization: str | None = None, head: bool = False):
    from routers import get_router

    return get_router(model_dir).model_cls.from_pretrained(model_dir, dtype=dtype, quantization=quantization,
                                                           quantize_lm_head=head)


def sequence_logprobs(model, ids: list[int]) -> torch.Tensor:
    """log-softmax of the logits after each position of ``ids`` (one prefill), float32."""
    runner = SequenceRunner(model, max_len=len(ids) + 1, block_size=16)
    return torch.log_softmax(runner.step(torch.tensor(ids)).float(), dim=-1)


def greedy(model, prompt: list[int], tokens: int) -> list[int]:
    runner = SequenceRunner(model, max_len=len(prompt) + tokens + 1, block_size=16)
    out = [int(runner.step(torch.tensor(prompt))[-1].argmax())]
    while len(out) < tokens:
        out.append(int(runner.step(torch.tensor(out[-1:]))[-1].argmax()))
    return out


def perplexity(model, ids: list[int]) -> float:
    logprobs = sequence_logprobs(model, ids)
    nll = -logprobs[:-1].gather(1, torch.tensor(ids[1:])[:, None]).mean()
    return math.exp(float(nll))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, help="a float checkpoint (default: SmolLM2-135M-Instruct, fp32)")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--free-running", action="store_true", help="also decode each variant greedily")
    parser.add_argument("--variants", default=None, help="comma-separated rows besides fp32 (default: all)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.model is None:
        from atb_plugin.default_model import default_model_dir

        args.model = default_model_dir()
    from tokenizers import Tokenizer

    from atb_plugin.models.quantization.export import export

    tokenizer = Tokenizer.from_file(str(args.model / "tokenizer.json"))
    prompts = [tokenizer.encode(p).ids for p in PROMPTS]
    text = tokenizer.encode(PPL_TEXT).ids

    with tempfile.TemporaryDirectory(prefix="atb-quality-") as scratch:
        static_dir = Path(scratch) / "w8a8-static"
        variants = {
            "fp32": lambda: load(args.model, torch.float32),
            "bf16": lambda: load(args.model, torch.bfloat16),
            "w8a16": lambda: load(args.model, torch.float32, "w8a16"),
            "w8a8": lambda: load(args.model, torch.float32, "w8a8"),
            "w8a16+head": lambda: load(args.model, torch.float32, "w8a16", head=True),
            "w8a8+head": lambda: load(args.model, torch.float32, "w8a8", head=True),
            "w8a8-static": lambda: load(export(args.model, static_dir, "w8a8").path.parent, torch.float32),
        }
        if args.variants:
            unknown = set(args.variants.split(",")) - set(variants)
            if unknown:
                parser.error(f"--variants: unknown {', '.join(sorted(unknown))} (choices: {', '.join(variants)})")
            variants = {name: build for name, build in variants.items()
                        if name == "fp32" or name in args.variants.split(",")}
        reference = None
        rows = []
        for name, build in variants.items():
            start = time.perf_counter()
            model = build()
            continuations = None
            if reference is None or args.free_running:
                continuations = [greedy(model, p, args.tokens) for p in prompts]
            if reference is None:
                reference = {"continuations": continuations,
                             "logprobs": [sequence_logprobs(model, p + c) for p, c in zip(prompts, continuations)]}
            forced = free = total = 0
            dlogp = []
            for index, (prompt, ref_cont, ref_lp) in enumerate(zip(prompts, reference["continuations"],
                                                                   reference["logprobs"])):
                lp = sequence_logprobs(model, prompt + ref_cont)
                positions = torch.arange(len(prompt) - 1, len(prompt) - 1 + len(ref_cont))
                targets = torch.tensor(ref_cont)
                forced += int((lp[positions].argmax(-1) == targets).sum())
                if continuations is not None:
                    free += sum(a == b for a, b in zip(continuations[index], ref_cont))
                total += len(ref_cont)
                dlogp.append((lp[positions, targets] - ref_lp[positions, targets]).abs())
            rows.append((name, forced / total, free / total if continuations is not None else None,
                         float(torch.cat(dlogp).mean()), perplexity(model, text), time.perf_counter() - start))
            print(f"  {name}: done in {rows[-1][-1]:.0f} s", file=sys.stderr, flush=True)
            del model
    base_ppl = rows[0][4]
    print(f"model: {args.model}  prompts: {len(prompts)}  tokens: {args.tokens}  ppl text: {len(text)} tokens")
    print(f"{'variant':<12} {'agree(forced)':>13} {'agree(free)':>11} {'|dlogp|':>8} {'ppl':>8} {'dppl':>7} {'s':>6}")
    for name, forced, free, dlogp, ppl, seconds in rows:
        free = "-" if free is None else f"{free:.1%}"
        print(f"{name:<12} {forced:>13.1%} {free:>11} {dlogp:>8.4f} {ppl:>8.3f} {ppl / base_ppl - 1:>+7.2%} "
              f"{seconds:>6.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
