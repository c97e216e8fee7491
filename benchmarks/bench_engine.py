"""Claims (goals, issue "engine speed against the peers"): our engine decodes one stream and 32
batched streams faster than transformers on SmolLM2-135M-Instruct fp32, same greedy tokens, one
torch thread each; the engine's time outside the model forward stays small; prefill of long
prompts keeps up with transformers' single forward over the same tokens.

Modes, all in one run (``--threads`` torch threads for everyone; medians of ``--runs``, ours and
transformers interleaved run by run):

  single     one prompt, --tokens new tokens. Ours: ``LLMEngine.add_request`` + ``step`` (TTFT =
             the first step, decode tok/s = the rest). Transformers: ``generate`` (TTFT = one
             forward over the prompt, tok/s over the whole call less TTFT).
  batch      --batch prompts x --tokens tokens (ignore_eos). Ours: ``LLM.generate`` (continuous
             batching). Transformers: ``generate`` on the prompts padded into one batch
             (left padding, attention mask), and one at a time on --hf-one-by-one of them.
  prefill    (``--prefill 512,2048,8192``) one random-token prompt of each length, max_tokens=1,
             prefix caching off. Ours: LLM.generate. Transformers: one ``model.model`` forward
             over the same ids plus the LM head on the last position.

Same tokens: ours vs transformers' greedy tokens are compared (single: all; batch: the first 16
of each prompt, as batched fp32 sums may reorder and diverge late) and mismatches reported.

``--busy-frontend N`` runs everything while N processes preprocess images non-stop with one
compute thread each, as tokenizer workers do (decode JPEG, resize 1280x720 for Qwen2-VL): does
the engine keep its speed next to a busy frontend?

``--profile`` adds a breakdown of a decode step at --batch sequences: scheduler, prepare_inputs,
model forward, LM head (compute_logits), sampler, scheduler update, output processing
(detokenise), and the aten ops one decode forward dispatches (total and per layer).

The last line is one JSON object with at least single_tok_s, batch_tok_s, hf_batched_tok_s,
speedup_vs_hf_batched and outside_forward_share.

    python benchmarks/bench_engine.py [--threads 1] [--runs 3] [--tokens 128] [--batch 32]
                                      [--prefill 512,2048] [--profile] [--enforce-eager]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere in the repo

from atb_plugin import LLM, SamplingParams  # noqa: E402
from atb_plugin.default_model import default_model_dir  # noqa: E402

TOPICS = ["the ocean", "a red bicycle", "mountains in winter", "how bread is made", "the history of maps",
          "a quiet library", "bees and flowers", "the moon landing"]


def chats(count: int) -> list[list[dict]]:
    return [[{"role": "user", "content": f"Write a short story about {TOPICS[i % len(TOPICS)]} (number {i})."}]
            for i in range(count)]


# -- ours --------------------------------------------------------------------------------------------


def ours_single(llm: LLM, ids: list[int], tokens: int) -> tuple[float, float, list[int]]:
    """(TTFT s, decode tok/s after the first token, token ids) through the engine's step API."""
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    start = time.perf_counter()
    engine.add_request("single", ids, params)
    first_at, final = None, None
    while engine.has_unfinished_requests():
        for output in engine.step():
            if first_at is None and output.outputs[0].token_ids:
                first_at = time.perf_counter()
            if output.finished:
                final = output
    end = time.perf_counter()
    return first_at - start, (tokens - 1) / (end - first_at), list(final.outputs[0].token_ids)


def ours_batch(llm: LLM, prompts: list[list[int]], tokens: int) -> tuple[float, list[list[int]]]:
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    return len(prompts) * tokens / elapsed, [list(o.outputs[0].token_ids) for o in outputs]


def ab_arguments(doc: str) -> argparse.Namespace:
    """The flags of an A/B benchmark of two engine settings (--runs, --tokens, --batch), parsed;
    torch set to one thread, as every engine-speed claim here is measured."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--batch", type=int, default=32)
    args = parser.parse_args()
    torch.set_num_threads(1)
    return args


def ab_summary(runs: int, med: dict, ratios: dict, tokens_a: tuple, tokens_b: tuple, batch: int) -> None:
    """The closing lines of an A/B benchmark of two engine settings (bench_cpu_kernels.py,
    bench_decode_capture.py): whether the sides' greedy tokens agree ((single, batch) token
    lists each), then the JSON line with the medians, the ratios and that agreement."""
    same_single = tokens_a[0] == tokens_b[0]
    same_batch = sum(a == b for a, b in zip(tokens_a[1], tokens_b[1]))
    print(f"greedy tokens equal: single {same_single}, batch {same_batch} of {batch}")
    print(json.dumps({"runs": runs, "medians": {s: {k: round(v, 2) for k, v in m.items()} for s, m in med.items()},
                      "ratios": {k: round(v, 3) for k, v in ratios.items()}, "same_single": same_single,
                      "same_batch": same_batch}))


def ours_prefill(llm: LLM, ids: list[int]) -> float:
    start = time.perf_counter()
    llm.generate([ids], SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    return time.perf_counter() - start


# -- transformers -------------------------------------------------------------------------------------


@torch.inference_mode()
def hf_single(model, ids: list[int], tokens: int, pad_id: int = 0) -> tuple[float, float, list[int]]:
    """``pad_id``: a token the prompt does not hold (generate masks it out of an unpadded prompt)."""
    inputs = torch.tensor([ids])
    start = time.perf_counter()
    model(inputs)  # TTFT: one forward over the prompt
    ttft = time.perf_counter() - start
    start = time.perf_counter()
    out = model.generate(inputs, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False, pad_token_id=pad_id)
    elapsed = time.perf_counter() - start
    return ttft, (tokens - 1) / max(elapsed - ttft, 1e-9), out[0, len(ids):].tolist()


@torch.inference_mode()
def hf_batch(model, prompts: list[list[int]], tokens: int, pad_id: int) -> tuple[float, list[list[int]]]:
    width = max(map(len, prompts))
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    start = time.perf_counter()
    out = model.generate(ids, attention_mask=mask, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False,
                         pad_token_id=pad_id)
    elapsed = time.perf_counter() - start
    return len(prompts) * tokens / elapsed, out[:, width:].tolist()


@torch.inference_mode()
def hf_prefill(model, ids: list[int]) -> float:
    inputs = torch.tensor([ids])
    start = time.perf_counter()
    hidden = model.model(inputs).last_hidden_state
    model.lm_head(hidden[:, -1])
    return time.perf_counter() - start


# -- the step breakdown ---------------------------------------------------------------------------------


class _Timer:
    """Wraps callables in place and sums their wall time per label."""

    def __init__(self):
        self.seconds = defaultdict(float)
        self.calls = Counter()
        self._undo = []

    def wrap(self, owner, name: str, label: str) -> None:
        original = getattr(owner, name)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.seconds[label] += time.perf_counter() - start
                self.calls[label] += 1

        setattr(owner, name, timed)
        self._undo.append((owner, name, original))

    def restore(self) -> None:
        for owner, name, original in reversed(self._undo):
            setattr(owner, name, original)


def count_ops(llm: LLM, prompts: list[list[int]]) -> tuple[int, int]:
    """aten ops of one decode forward over len(prompts) sequences: (total, per layer)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops += 1
            return func(*args, **(kwargs or {}))

    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    for i, ids in enumerate(prompts):
        engine.add_request(f"count-{i}", ids, params)
    engine.step()  # prefill
    runner = engine.runner
    counter = Count()
    original = runner.model.forward

    def counted(*args, **kwargs):
        with counter:
            return original(*args, **kwargs)

    runner.model.forward = counted
    try:
        engine.step()  # one decode step
    finally:
        runner.model.forward = original
    while engine.has_unfinished_requests():
        engine.step()
    layers = len(runner.model.model.layers)
    return counter.ops, counter.ops // layers


def profile_decode(llm: LLM, prompts: list[list[int]], tokens: int) -> dict:
    """Seconds per phase over the decode steps of a --batch x --tokens run (prefill steps left out)."""
    import atb_plugin.engine.model_runner as model_runner

    engine = llm.engine
    core, runner = engine.core, engine.runner
    timer = _Timer()
    timer.wrap(core.scheduler, "schedule", "scheduler.schedule")
    timer.wrap(model_runner, "prepare_inputs", "prepare_inputs")
    timer.wrap(runner.model, "forward", "model forward (30 layers)")
    timer.wrap(runner.model, "compute_logits", "LM head (compute_logits)")
    timer.wrap(runner.sampler, "sample", "sampler")
    timer.wrap(core.scheduler, "update_from_output", "scheduler.update_from_output")
    timer.wrap(engine.output_processor, "process", "output processing (detokenise)")
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    for i, ids in enumerate(prompts):
        engine.add_request(f"profile-{i}", ids, params)
    engine.step()  # the prefill step: not a decode step
    timer.seconds.clear()
    timer.calls.clear()
    steps, start = 0, time.perf_counter()
    try:
        while engine.has_unfinished_requests():
            engine.step()
            steps += 1
    finally:
        total = time.perf_counter() - start
        timer.restore()
    phases = {label: seconds / steps * 1e3 for label, seconds in timer.seconds.items()}
    # prepare_inputs runs inside execute; the rest of execute (batch bookkeeping) is what is left.
    phases["rest (bookkeeping, Python)"] = total / steps * 1e3 - sum(phases.values())
    return {"steps": steps, "step_ms": total / steps * 1e3, "phases_ms": phases}


# -- a busy frontend ------------------------------------------------------------------------------------


def _busy_worker(stop) -> None:
    """A tokenizer worker's image work in a loop, one compute thread (as the service sets it)."""
    from atb_plugin.utils import limit_compute_threads

    limit_compute_threads(1)
    import io

    import numpy as np
    from PIL import Image

    from input_builders.preprocess import Qwen2VLPreprocessor

    rng = np.random.default_rng(0)
    buffer = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (720, 1280, 3), dtype=np.uint8)).save(buffer, "JPEG")
    data, preprocess = buffer.getvalue(), Qwen2VLPreprocessor()
    while not stop.is_set():
        preprocess(Image.open(io.BytesIO(data)).convert("RGB"))


@contextlib.contextmanager
def busy_frontend(processes: int):
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    stop = ctx.Event()
    workers = [ctx.Process(target=_busy_worker, args=(stop,), daemon=True) for _ in range(processes)]
    for worker in workers:
        worker.start()
    try:
        yield
    finally:
        stop.set()
        for worker in workers:
            worker.join(timeout=10)


# -- main ---------------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--hf-one-by-one", type=int, default=2, choices=range(1, 33), metavar="1..32",
                        help="prompts transformers runs one at a time")
    parser.add_argument("--prefill", default="", help="comma-separated prompt lengths, e.g. 512,2048,8192")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--enforce-eager", action="store_true",
                        help="ours without the captured decode step (EngineConfig.enforce_eager)")
    parser.add_argument("--busy-frontend", type=int, default=0, metavar="N",
                        help="N processes preprocessing images all along, one thread each")
    args = parser.parse_args()
    with busy_frontend(args.busy_frontend):
        run(args)


def run(args) -> None:
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model_dir = default_model_dir()

    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    lengths = [int(x) for x in args.prefill.split(",") if x.strip()]
    llm = LLM(model_dir, max_num_seqs=max(args.batch, 1), max_num_batched_tokens=2048, num_threads=args.threads,
              enable_prefix_caching=not lengths, enforce_eager=args.enforce_eager,  # prefill timing must not hit the cache
              dtype="float32")  # as the reference (dtype "auto" may be bfloat16 on the CPU)
    builder = llm.router.input_builder
    prompts = [builder.make_context(0, chat) for chat in chats(args.batch)]
    tokenizer = llm.router.tokenizer
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    llm.generate([prompts[0]], SamplingParams(temperature=0, max_tokens=4))  # warm-up
    hf_single(reference, prompts[0], 4)

    results = defaultdict(list)
    mismatches = {"single": 0, "batch": 0}
    for run in range(args.runs):
        order = ("ours", "hf") if run % 2 == 0 else ("hf", "ours")
        for side in order:
            if side == "ours":
                ttft, tok_s, single_tokens = ours_single(llm, prompts[0], args.tokens)
                results["single_ttft_ms"].append(ttft * 1e3)
                results["single_tok_s"].append(tok_s)
                batch_tok_s, batch_tokens = ours_batch(llm, prompts, args.tokens)
                results["batch_tok_s"].append(batch_tok_s)
            else:
                ttft, tok_s, hf_single_tokens = hf_single(reference, prompts[0], args.tokens)
                results["hf_single_ttft_ms"].append(ttft * 1e3)
                results["hf_single_tok_s"].append(tok_s)
                hf_batch_tok_s, hf_batch_tokens = hf_batch(reference, prompts, args.tokens, pad_id)
                results["hf_batched_tok_s"].append(hf_batch_tok_s)
                rates = [hf_single(reference, p, args.tokens)[1] for p in prompts[:args.hf_one_by_one]]
                results["hf_one_by_one_tok_s"].append(statistics.mean(rates))
        if run == 0:
            mismatches["single"] = int(single_tokens != hf_single_tokens)
            mismatches["batch"] = sum(a[:16] != b[:16] for a, b in zip(batch_tokens, hf_batch_tokens))

    prefill = {}
    for length in lengths:
        ids = torch.randint(100, tokenizer.vocab_size - 100, (length,),
                            generator=torch.Generator().manual_seed(length)).tolist()
        ours_s, hf_s = [], []
        for run in range(args.runs):
            for side in (("ours", "hf") if run % 2 == 0 else ("hf", "ours")):
                (ours_s if side == "ours" else hf_s).append(ours_prefill(llm, ids) if side == "ours"
                                                            else hf_prefill(reference, ids))
        prefill[length] = {"ours_tok_s": length / statistics.median(ours_s),
                           "hf_tok_s": length / statistics.median(hf_s)}

    profile = count = None
    if args.profile:
        profile = profile_decode(llm, prompts, min(args.tokens, 64))
        count = count_ops(llm, prompts)
    llm.close()

    med = {key: statistics.median(values) for key, values in results.items()}
    outside = None
    if profile is not None:
        phases = profile["phases_ms"]
        model_ms = phases["model forward (30 layers)"] + phases["LM head (compute_logits)"]
        outside = 1 - model_ms / profile["step_ms"]

    busy = f", {args.busy_frontend} busy frontend process(es)" if args.busy_frontend else ""
    print(f"SmolLM2-135M-Instruct fp32, {args.threads} torch thread(s){busy}, medians of {args.runs} interleaved runs")
    print(f"single stream ({args.tokens} tokens): ours {med['single_tok_s']:.1f} tok/s, TTFT "
          f"{med['single_ttft_ms']:.0f} ms | transformers {med['hf_single_tok_s']:.1f} tok/s, TTFT "
          f"{med['hf_single_ttft_ms']:.0f} ms | ratio {med['single_tok_s'] / med['hf_single_tok_s']:.2f}x")
    print(f"{args.batch} x {args.tokens}: ours {med['batch_tok_s']:.1f} tok/s | transformers padded batch "
          f"{med['hf_batched_tok_s']:.1f} tok/s ({med['batch_tok_s'] / med['hf_batched_tok_s']:.2f}x), one by one "
          f"{med['hf_one_by_one_tok_s']:.1f} tok/s ({med['batch_tok_s'] / med['hf_one_by_one_tok_s']:.2f}x)")
    print(f"greedy token mismatches vs transformers: single {mismatches['single']}, batch (first 16 tokens) "
          f"{mismatches['batch']} of {args.batch}")
    for length, rates in prefill.items():
        print(f"prefill {length:>5} tokens: ours {rates['ours_tok_s']:.0f} tok/s, transformers forward "
              f"{rates['hf_tok_s']:.0f} tok/s ({rates['ours_tok_s'] / rates['hf_tok_s']:.2f}x)")
    if profile is not None:
        print(f"decode step at {args.batch} sequences: {profile['step_ms']:.1f} ms over {profile['steps']} steps; "
              f"outside the forward + LM head: {outside:.1%}")
        for label, ms in sorted(profile["phases_ms"].items(), key=lambda item: -item[1]):
            print(f"  {label:<34} {ms:8.2f} ms  {ms / profile['step_ms']:6.1%}")
        print(f"  aten ops per decode forward: {count[0]} ({count[1]} per layer)")
    print(json.dumps({
        "threads": args.threads,
        "busy_frontend": args.busy_frontend,
        "single_tok_s": round(med["single_tok_s"], 2),
        "single_ttft_ms": round(med["single_ttft_ms"], 1),
        "hf_single_tok_s": round(med["hf_single_tok_s"], 2),
        "batch_tok_s": round(med["batch_tok_s"], 2),
        "hf_batched_tok_s": round(med["hf_batched_tok_s"], 2),
        "hf_one_by_one_tok_s": round(med["hf_one_by_one_tok_s"], 2),
        "speedup_vs_hf_batched": round(med["batch_tok_s"] / med["hf_batched_tok_s"], 3),
        "outside_forward_share": None if outside is None else round(outside, 3),
        "mismatches": mismatches,
        "prefill": {str(k): {n: round(v, 1) for n, v in r.items()} for k, r in prefill.items()},
        "profile": profile,
        "ops_per_decode_forward": None if count is None else {"total": count[0], "per_layer": count[1]},
    }))


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
