"""Claim (issue 31): tensor parallelism over 2 CPU ranks (``LLM(..., tensor_parallel_size=2,
num_threads=2)``: one intra-op thread per rank, each rank pinned to its own core) decodes one
stream >= 1.5x as fast as TP = 1 on one thread and no slower than TP = 1 on two threads, with
the same greedy tokens, and each rank holds <= 0.6x the weights; issue 49: with the ranks'
decode steps captured (one native call per rank, the all-reduces inside it), TP = 2 single
stream >= 1.3x TP = 1 on one thread. SmolLM2-135M-Instruct fp32, greedy.

SmolLM2-135M has 9 attention heads over 3 KV heads: neither splits over 2 ranks, and
``EngineConfig`` refuses ``tensor_parallel_size=2`` for it (``check_tensor_parallel``). The TP
side therefore runs a head-padded copy, written once per run to a temporary directory: 12
query heads over 4 KV heads, the added heads' q/k/v rows and o_proj columns zero. It computes
the same function (a zero query and a zero value give a zero head output, and its o_proj
columns are zero) with 8 % more parameters (attention projections 4/3 as wide). The TP = 1
sides run the real checkpoint; "TP=1 1t padded" (single stream only) shows what the padding
alone costs.

Sides, all in one run, repetitions interleaved (the order rotates every run; this 2-core box is
shared and noisy), medians printed:

  TP=1 1t           the real checkpoint, num_threads=1 (the captured native decode step where
                    the native kernels are in use)
  TP=1 1t eager     the same, enforce_eager=True (left out when TP=1 1t captures nothing)
  TP=1 2t           the same, num_threads=2
  TP=1 1t padded    the padded copy, num_threads=1 (single stream only)
  TP=2 2t           the padded copy, tensor_parallel_size=2, num_threads=2 (decode steps
                    captured where TP=1 1t's are: models/native_decode.py)
  TP=2 2t eager     the same, enforce_eager=True: the ranks' eager decode, as before issue 49
                    (left out when TP=1 1t captures nothing)

Per side: ``single`` (one prompt, --tokens new tokens through ``LLMEngine.step``, decode tok/s
after the first token, as bench_engine.py measures it; every run) and ``batch`` (--batch
prompts x --tokens tokens through ``LLM.generate``, ``ignore_eos``; the first --batch-runs
runs). The TP = 1 sides share this process, so torch's (process-wide) thread count is set to
the side's own before each of its runs.

Kernels (``ATB_PLUGIN_CPU_KERNELS``, set for every side and inherited by the ranks): by default
``auto`` (the engine's default: the native kernels, packed column panels, the captured step) on
a CPU with AVX-512, ``torch`` (oneDNN's packed GEMMs, eager) elsewhere: on an AVX2-only CPU the
native linear kernel's 16-lane vectors and 4 x MR accumulators spill, and it runs at ~3 GFLOP/s
at every row count (oneDNN: 13-69), so 32 x 128 through it would take most of an hour here
(benchmarks/RESULTS.md, this benchmark's section). ``--kernels auto --batch 0`` measures the
captured path's single stream there.

Then, in a separate spawn of 2 processes joined by ``init_tensor_parallel`` (a gloo group on
127.0.0.1, GLOO_SOCKET_IFNAME=lo; the collectives through the shared-memory exchange, as the
ranks' are: ``shm/exchange.py``), each bound to its core as a rank binds itself
(``worker._bind_cpu_threads``) and holding its shard (``worker.load_model``, packed as a rank
packs it): the latency of the collectives one TP = 2 decode step makes (2 all-reduces of
(rows, hidden) per layer + 1 for the vocab-parallel embedding, 1 all-gather of (rows,
vocab / 2) logits), pinned as the ranks run and, alternating, unpinned; that latency times the
count against the TP = 2 step's measured time (the Python collectives' latency: a captured
step's in-layer all-reduces run the same rounds from C, csrc/tp_allreduce.c, without Python's
per-call cost, so this overstates them); and each rank's resident weight bytes
(parameters + buffers, by part) against TP = 1's. The CPU time other processes took during the
bench is printed (from /proc/stat). Last line: JSON.

    python benchmarks/bench_tp.py [--runs 3] [--batch-runs 1] [--tokens 128] [--batch 32]
                                  [--iters 500] [--kernels auto|native|torch] [--quick]
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import shutil
import socket
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path
from queue import Empty

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_engine as a sibling module
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench_engine import chats, ours_batch, ours_single  # noqa: E402

from atb_plugin import LLM, SamplingParams  # noqa: E402
from atb_plugin.default_model import default_model_dir  # noqa: E402

TP = 2
# name: (uses the padded copy, LLM keyword arguments, single stream only)
SIDES = {
    "TP=1 1t": (False, {"num_threads": 1}, False),
    "TP=1 1t eager": (False, {"num_threads": 1, "enforce_eager": True}, False),
    "TP=1 2t": (False, {"num_threads": 2}, False),
    "TP=1 1t padded": (True, {"num_threads": 1}, True),
    "TP=2 2t": (True, {"num_threads": 2, "tensor_parallel_size": TP}, False),
    "TP=2 2t eager": (True, {"num_threads": 2, "tensor_parallel_size": TP, "enforce_eager": True}, False),
}
BASE, TP_SIDE = "TP=1 1t", "TP=2 2t"
EAGER_SIDES = ("TP=1 1t eager", "TP=2 2t eager")  # only where TP=1 1t captures its decode step


# -- the head-padded checkpoint ---------------------------------------------------------------------


def padded_checkpoint(src: Path, dst: Path, tp: int) -> dict:
    """Write ``src`` to ``dst`` with its KV heads padded to a multiple of ``tp`` (and the query
    heads to the same group size): zero q/k/v rows and o_proj columns at the end. Returns the
    head counts before and after."""
    from safetensors.torch import load_file, save_file

    config = json.loads((src / "config.json").read_text())
    head_dim, heads, kv_heads = config["head_dim"], config["num_attention_heads"], config["num_key_value_heads"]
    group = heads // kv_heads
    new_kv = math.ceil(kv_heads / tp) * tp
    new_heads = new_kv * group
    weights = load_file(src / "model.safetensors")
    for name, tensor in weights.items():
        if name.endswith("q_proj.weight"):
            weights[name] = torch.cat([tensor, tensor.new_zeros((new_heads - heads) * head_dim, tensor.shape[1])])
        elif name.endswith(("k_proj.weight", "v_proj.weight")):
            weights[name] = torch.cat([tensor, tensor.new_zeros((new_kv - kv_heads) * head_dim, tensor.shape[1])])
        elif name.endswith("o_proj.weight"):
            weights[name] = torch.cat([tensor, tensor.new_zeros(tensor.shape[0], (new_heads - heads) * head_dim)], 1)
    save_file(weights, dst / "model.safetensors", metadata={"format": "pt"})
    config.update(num_attention_heads=new_heads, num_key_value_heads=new_kv)
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    for path in src.iterdir():
        if path.is_file() and path.name not in ("model.safetensors", "config.json", ".complete"):
            shutil.copy(path, dst / path.name)
    return {"heads": (heads, new_heads), "kv_heads": (kv_heads, new_kv)}


# -- weights by part --------------------------------------------------------------------------------


def weight_parts(model) -> dict[str, int]:
    """Bytes of the model's parameters and buffers (what a rank keeps resident; the same tensors
    ``memory_profile.weight_bytes`` sums), by part: the vocabulary-sharded embedding and LM
    head (tied in the checkpoint; the packed head is a second copy in panels), the sharded
    linear layers, and what every rank replicates (norms, rotary tables)."""
    parts = {"embedding + LM head": 0, "linear layers": 0, "replicated": 0}
    seen = set()
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        key = tensor.data_ptr() if tensor.layout == torch.strided else id(tensor)  # oneDNN's packed: opaque
        if key in seen:
            continue
        seen.add(key)
        part = ("embedding + LM head" if "embed_tokens" in name or "lm_head" in name
                else "linear layers" if "proj" in name else "replicated")
        parts[part] += tensor.numel() * tensor.element_size()
    return parts


# -- the collectives of one TP = 2 decode step, in a group of our own ---------------------------------


def _group_member(rank: int, port: int, model_dir: str, rows: list[int], iters: int, rounds: int, queue) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    from atb_plugin.distributed import (all_gather, all_reduce, destroy_tensor_parallel, init_tensor_parallel,
                                        native_exchange)
    from atb_plugin.engine.config import EngineConfig
    from atb_plugin.engine.worker import RankPlacement, _bind_cpu_threads, load_model
    from atb_plugin.ops import cpu_native

    config = EngineConfig(model_dir, tensor_parallel_size=TP, num_threads=TP, dtype="float32")
    free = sorted(os.sched_getaffinity(0))
    # As a rank binds itself: num_threads // TP threads, its own cores.
    _bind_cpu_threads(config, RankPlacement.on_one_node(rank, TP))
    pinned = sorted(os.sched_getaffinity(0))
    init_tensor_parallel(rank, TP, "gloo", f"tcp://127.0.0.1:{port}", 120)
    try:
        model, _ = load_model(config, torch.device("cpu"))
        parts = weight_parts(model)
        params = sum(p.numel() * p.element_size() for p in model.parameters())
        del model
        hidden = json.loads((Path(model_dir) / "config.json").read_text())["hidden_size"]
        vocab_shard = math.ceil(config.vocab_size / TP)
        ops = {}
        # The captured decode step's all-reduce (csrc/tp_allreduce.c), on the same exchange.
        library, exchange = cpu_native.linear_library(torch.device("cpu")), native_exchange()
        native = None if library is None or exchange is None else cpu_native.DecodeTP(
            exchange[0].address, rank, TP, exchange[0].slot_bytes, exchange[1])
        for n in rows:
            ops[f"all_reduce ({n}, {hidden})"] = (all_reduce, torch.randn(n, hidden))
            if native is not None:
                ops[f"native all_reduce ({n}, {hidden})"] = (
                    lambda x: cpu_native.tp_all_reduce(library, native, x), torch.randn(n, hidden))
            ops[f"all_gather ({n}, {vocab_shard})"] = (all_gather, torch.randn(n, vocab_shard))
        times = {(mode, op): [] for mode in ("pinned", "free") for op in ops}
        for rnd in range(rounds):
            for mode in (("pinned", "free") if rnd % 2 == 0 else ("free", "pinned")):
                os.sched_setaffinity(0, pinned if mode == "pinned" else free)
                for op, (fn, x) in ops.items():
                    torch.distributed.barrier()
                    for _ in range(max(10, iters // 10)):  # warm-up
                        fn(x)
                    for _ in range(iters):
                        start = time.perf_counter()
                        fn(x)
                        times[(mode, op)].append(time.perf_counter() - start)
        summary = {f"{mode} {op}": {"p10_us": sorted(t)[len(t) // 10] * 1e6, "median_us": statistics.median(t) * 1e6,
                                    "mean_us": statistics.mean(t) * 1e6}
                   for (mode, op), t in times.items()}
        queue.put((rank, {"parts": parts, "params": params, "pinned": pinned, "free": free, "times": summary}))
    except BaseException:
        queue.put((rank, {"error": traceback.format_exc()}))
        raise
    finally:
        destroy_tensor_parallel()


def collectives(model_dir: Path, rows: list[int], iters: int, rounds: int) -> dict[int, dict]:
    ctx = mp.get_context("spawn")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    queue = ctx.Queue()
    procs = [ctx.Process(target=_group_member, args=(rank, port, str(model_dir), rows, iters, rounds, queue))
             for rank in range(TP)]
    for proc in procs:
        proc.start()
    results = {}
    try:
        while len(results) < len(procs):
            try:
                rank, result = queue.get(timeout=5)
            except Empty:
                if any(proc.exitcode not in (None, 0) for proc in procs):
                    raise RuntimeError("a collective-timing process died") from None
                continue
            if "error" in result:
                raise RuntimeError(f"collective-timing rank {rank} failed:\n{result['error']}")
            results[rank] = result
    finally:
        for proc in procs:
            proc.join(30)
            if proc.is_alive():
                proc.kill()
    return results


# -- main -------------------------------------------------------------------------------------------


def busy_cpu_s() -> float:
    """CPU seconds every process on the box has used (``/proc/stat``: all but idle and iowait)."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(fields[:8]) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


def own_cpu_s() -> float:
    """CPU seconds of this process and its waited-for children (the ranks once closed)."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def has_avx512() -> bool:
    try:
        return " avx512f" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3, help="interleaved repetitions of every side's single stream")
    parser.add_argument("--batch-runs", type=int, default=1, help="how many of those runs also run the batch")
    parser.add_argument("--tokens", type=int, default=128, help="output tokens per request")
    parser.add_argument("--batch", type=int, default=32, help="prompts of the throughput run (0: none)")
    parser.add_argument("--iters", type=int, default=500, help="timed collectives per shape, mode and round")
    parser.add_argument("--kernels", choices=("auto", "native", "torch"), default=None,
                        help="ATB_PLUGIN_CPU_KERNELS for every side and rank; default: auto on an AVX-512 CPU, "
                             "torch elsewhere (the native panels are slow at > 1 row there, see the docstring)")
    parser.add_argument("--quick", action="store_true",
                        help="a smoke run: 1 run, 32 tokens, 8 prompts, 200 collectives per shape")
    args = parser.parse_args()
    if args.quick:
        args.runs, args.batch_runs, args.tokens, args.batch, args.iters = 1, 1, 32, 8, 200
    if args.kernels is None:
        args.kernels = "auto" if has_avx512() else "torch"
    return args


def main() -> None:
    args = arguments()
    os.environ["ATB_PLUGIN_CPU_KERNELS"] = args.kernels  # before any engine: the ranks inherit it
    wall, busy0, own0 = time.perf_counter(), busy_cpu_s(), own_cpu_s()
    src = Path(default_model_dir())
    hf = json.loads((src / "config.json").read_text())
    scratch = Path(tempfile.mkdtemp(prefix="bench_tp_"))
    print(f"kernels {args.kernels} (AVX-512: {has_avx512()}), {os.cpu_count()} CPUs, "
          f"load avg {os.getloadavg()[0]:.2f}", flush=True)
    sides = dict(SIDES)
    llms: dict[str, LLM] = {}
    try:
        padding = padded_checkpoint(src, scratch, TP)
        print(f"padded copy for TP={TP}: heads {padding['heads'][0]} -> {padding['heads'][1]}, "
              f"KV heads {padding['kv_heads'][0]} -> {padding['kv_heads'][1]}", flush=True)
        for side in list(sides):
            padded, kwargs, _ = sides[side]
            if side in EAGER_SIDES and llms[BASE].engine.core.executor.decode_capture != "captured":
                del sides[side]  # nothing captured to compare with: the same engine as TP=1 1t
                continue
            # float32 on every side: dtype "auto" is chosen per engine by measurement at the engine's
            # thread count (TP=1 1t may get bfloat16 where TP=2's num_threads=2 gets float32).
            llms[side] = LLM(scratch if padded else src, max_num_seqs=max(1, args.batch),
                             max_num_batched_tokens=2048, dtype="float32", **kwargs)
        prompts = [llms[BASE].router.input_builder.make_context(0, chat) for chat in chats(max(1, args.batch))]
        threads = {side: kwargs["num_threads"] if kwargs.get("tensor_parallel_size", 1) == 1 else 1
                   for side, (_, kwargs, _) in sides.items()}
        executors = {side: llm.engine.core.executor for side, llm in llms.items()}
        print("decode step: " + ", ".join(f"{side} {ex.decode_capture}" for side, ex in executors.items()), flush=True)
        for side, llm in llms.items():  # warm-up
            torch.set_num_threads(threads[side])
            llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=4))

        results = {side: {"single_tok_s": [], "batch_tok_s": []} for side in sides}
        tokens: dict[str, dict] = {side: {} for side in sides}
        names = list(sides)
        for run in range(args.runs):
            order = names[run % len(names):] + names[:run % len(names)]
            for side in order:
                torch.set_num_threads(threads[side])  # process-wide: the TP = 1 engines share it
                _, single, single_tokens = ours_single(llms[side], prompts[0], args.tokens)
                results[side]["single_tok_s"].append(single)
                tokens[side]["single"] = single_tokens
                line = f"run {run} {side:>15}: single {single:6.2f} tok/s"
                if args.batch and run < args.batch_runs and not sides[side][2]:
                    batch, batch_tokens = ours_batch(llms[side], prompts, args.tokens)
                    results[side]["batch_tok_s"].append(batch)
                    tokens[side]["batch"] = batch_tokens
                    line += f", {args.batch} x {args.tokens} {batch:6.1f} tok/s"
                line += f"  (load avg {os.getloadavg()[0]:.2f})"
                print(line, flush=True)
        weight_bytes = {side: list(ex.weight_bytes) for side, ex in executors.items()}
        tp1_parts = weight_parts(executors[BASE].worker.model)
        tp1_padded_parts = weight_parts(executors["TP=1 1t padded"].worker.model)
        rank_pids = [rank.process.pid for rank in executors[TP_SIDE].ranks]
        tp_captured = executors[TP_SIDE].decode_capture == "captured"
    finally:
        for llm in llms.values():
            llm.close()
    try:
        group = collectives(scratch, sorted({1, args.batch} - {0}), args.iters, rounds=2)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    left = [pid for pid in rank_pids if Path(f"/proc/{pid}").exists()]
    elapsed = time.perf_counter() - wall
    others = max(0.0, (busy_cpu_s() - busy0) - (own_cpu_s() - own0))
    cores = len(os.sched_getaffinity(0))

    # -- report ------------------------------------------------------------------------------------
    med = {side: {k: statistics.median(v) for k, v in r.items() if v} for side, r in results.items()}
    # TP = 2's eager decode and TP = 1's eager decode: like for like (TP=1 1t itself when nothing is
    # captured, e.g. with the torch kernels)
    eager = "TP=1 1t eager" if "TP=1 1t eager" in sides else BASE
    keys = (("single", "single stream", 1),) + ((("batch", f"{args.batch} x {args.tokens}", args.batch),)
                                                 if args.batch else ())
    print(f"\nSmolLM2-135M-Instruct fp32, greedy, {args.tokens} tokens, kernels {args.kernels}; medians of "
          f"{args.runs} interleaved runs (batch: {min(args.runs, args.batch_runs)})")
    print(f"{'side':>15} | single tok/s | {args.batch} x {args.tokens} tok/s")
    for side in sides:
        batch = f"{med[side]['batch_tok_s']:8.1f}" if "batch_tok_s" in med[side] else "       -"
        print(f"{side:>15} | {med[side]['single_tok_s']:12.2f} | {batch}")
    ratios = {}
    for key, label, _ in keys:
        k = f"{key}_tok_s"
        r = {f"{TP_SIDE} / {other}": med[TP_SIDE][k] / med[other][k] for other in dict.fromkeys((BASE, "TP=1 2t", eager))}
        if eager != BASE:
            r[f"{BASE} / {eager}"] = med[BASE][k] / med[eager][k]
            r["TP=2 2t eager / TP=1 1t eager"] = med["TP=2 2t eager"][k] / med[eager][k]
            r[f"{TP_SIDE} / TP=2 2t eager"] = med[TP_SIDE][k] / med["TP=2 2t eager"][k]
        if key == "single":
            r["TP=1 1t padded / TP=1 1t"] = med["TP=1 1t padded"][k] / med[BASE][k]
        ratios[key] = r
        print(f"{label}: " + ", ".join(f"{name} {value:.2f}x" for name, value in r.items()))
    goals = {"single >= 1.3x TP=1 1t (issue 49)": ratios["single"][f"{TP_SIDE} / TP=1 1t"] >= 1.3,
             "single >= 1.5x TP=1 1t (issue 31)": ratios["single"][f"{TP_SIDE} / TP=1 1t"] >= 1.5,
             "single >= 1.0x TP=1 2t": ratios["single"][f"{TP_SIDE} / TP=1 2t"] >= 1.0}

    same = {}
    for other in ("TP=1 1t", "TP=1 2t", "TP=1 1t padded", "TP=2 2t eager"):
        if other not in tokens:
            continue
        same[f"single vs {other}"] = tokens[TP_SIDE]["single"] == tokens[other]["single"]
        if "batch" in tokens[other]:
            same[f"batch vs {other}"] = sum(a == b for a, b in zip(tokens[TP_SIDE]["batch"], tokens[other]["batch"]))
    print(f"greedy tokens of {TP_SIDE} equal: " + ", ".join(
        f"{k} {v if isinstance(v, bool) else f'{v} of {args.batch}'}" for k, v in same.items()))

    # collectives: rank 0's view (every collective waits for both ranks)
    times = group[0]["times"]
    hidden, vocab_shard = hf["hidden_size"], math.ceil(hf["vocab_size"] / TP)
    reduces = 2 * hf["num_hidden_layers"] + 1
    print(f"\ncollectives per decode step at TP={TP}: {reduces} all_reduce ({reduces - 1} in the layers + 1 for the "
          f"embedding) + 1 all_gather of the logits; rank cores pinned {group[0]['pinned']} / {group[1]['pinned']}, "
          f"unpinned {group[0]['free']}")
    for op in sorted({key.split(" ", 1)[1] for key in times}):
        print(f"  {op:>29}: " + "; ".join(
            f"{mode} p10 {times[f'{mode} {op}']['p10_us']:.0f} / median {times[f'{mode} {op}']['median_us']:.0f} / "
            f"mean {times[f'{mode} {op}']['mean_us']:.0f} us" for mode in ("pinned", "free")))
    share = {}
    for key, label, n in keys:
        step_s = 1 / med[TP_SIDE]["single_tok_s"] if key == "single" else n / med[TP_SIDE]["batch_tok_s"]
        for mode in ("pinned", "free"):
            for stat in ("median_us", "mean_us"):
                # A captured step's in-layer all-reduces are the native ones; the embedding's is Python's.
                python = times[f"{mode} all_reduce ({n}, {hidden})"][stat]
                layer = times.get(f"{mode} native all_reduce ({n}, {hidden})", {}).get(stat, python) \
                    if tp_captured else python
                comm = (python + (reduces - 1) * layer + times[f"{mode} all_gather ({n}, {vocab_shard})"][stat]) / 1e6
                share[f"{key} {mode} {stat[:-3]}"] = {"comm_ms": comm * 1e3, "step_ms": step_s * 1e3,
                                                      "share": comm / step_s}
        share[f"{key} half of {eager}"] = {"ms": n / med[eager][f"{key}_tok_s"] / 2 * 1e3}
        what = "per token" if key == "single" else f"per step (~{n} / its tok/s, prefill amortised)"
        pm, pa, fm = (share[f"{key} {m}"] for m in ("pinned median", "pinned mean", "free median"))
        print(f"TP={TP} {label}, {what}: {pm['step_ms']:.1f} ms; {reduces} x all_reduce + all_gather at the pinned "
              f"median {pm['comm_ms']:.1f} ms ({pm['share']:.0%}), pinned mean {pa['comm_ms']:.1f} ms "
              f"({pa['share']:.0%}), unpinned median {fm['comm_ms']:.1f} ms ({fm['share']:.0%}); "
              f"half of {eager}'s step: {share[f'{key} half of {eager}']['ms']:.1f} ms")

    # weights
    mib = 2**20
    print(f"\nweights per rank (parameters + buffers; TP=1: the engine's model, TP={TP}: each shard as a rank loads it)")
    rank_parts = [group[r]["parts"] for r in range(TP)]
    for part in tp1_parts:
        print(f"  {part:>20}: TP=1 {tp1_parts[part] / mib:7.1f} MiB, TP=1 padded {tp1_padded_parts[part] / mib:7.1f} "
              f"MiB, TP={TP} ranks " + " / ".join(f"{p[part] / mib:.1f}" for p in rank_parts) + " MiB")
    total1, total1p = sum(tp1_parts.values()), sum(tp1_padded_parts.values())
    totals = [sum(p.values()) for p in rank_parts]
    sharded1 = total1 - tp1_parts["replicated"]
    sharded1p = total1p - tp1_padded_parts["replicated"]
    sharded = [t - p["replicated"] for t, p in zip(totals, rank_parts)]
    weights = {"tp1_bytes": total1, "tp1_padded_bytes": total1p, "rank_bytes": totals,
               "rank_over_tp1": max(totals) / total1, "sharded_rank_over_tp1": max(sharded) / sharded1,
               "sharded_rank_over_tp1_padded": max(sharded) / sharded1p,
               "executor_weight_bytes": weight_bytes}
    print(f"  {'total':>20}: TP=1 {total1 / mib:7.1f} MiB, TP=1 padded {total1p / mib:7.1f} MiB, TP={TP} ranks "
          + " / ".join(f"{t / mib:.1f}" for t in totals) + " MiB")
    print(f"  per rank / TP=1: total {weights['rank_over_tp1']:.3f}x, sharded part {weights['sharded_rank_over_tp1']:.3f}x"
          f" (vs the padded TP=1: {weights['sharded_rank_over_tp1_padded']:.3f}x)")
    goals["sharded weights per rank <= 0.6x"] = weights["sharded_rank_over_tp1"] <= 0.6
    print("  executor.weight_bytes as reported: " + ", ".join(
        f"{side} {[round(b / mib, 1) for b in v]} MiB" for side, v in weight_bytes.items()
        if side in (BASE, "TP=1 1t padded", TP_SIDE)))
    print("goals: " + ", ".join(f"{k}: {'met' if v else 'MISSED'}" for k, v in goals.items()))
    print(f"other processes' CPU during the bench: {others:.0f} core-s of {cores} x {elapsed:.0f} s "
          f"({others / (cores * elapsed):.0%} of the box)")
    print(f"rank processes left running: {left or 'none'}; wall {elapsed:.0f} s")
    print(json.dumps({"runs": args.runs, "batch_runs": min(args.runs, args.batch_runs), "tokens": args.tokens,
                      "batch": args.batch, "kernels": args.kernels,
                      "medians": {s: {k: round(v, 2) for k, v in m.items()} for s, m in med.items()},
                      "ratios": {k: {n: round(v, 3) for n, v in r.items()} for k, r in ratios.items()},
                      "same_tokens": same, "padding": padding,
                      "collectives_us": {k: {s: round(v, 1) for s, v in t.items()} for k, t in times.items()},
                      "comm_share": {k: {s: round(v, 3) for s, v in d.items()} for k, d in share.items()},
                      "weights": weights, "goals": goals,
                      "other_load": round(others / (cores * elapsed), 3), "wall_s": round(elapsed)}))


if __name__ == "__main__":
    main()
