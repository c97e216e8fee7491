"""llama.cpp (through llama-cpp-python's low-level API) measured the way bench_engine measures ours.

Run it with the llama.cpp venv's python (setup.sh makes it):

    $ATB_PEERS_DIR/llamacpp-venv/bin/python benchmarks/peers/llamacpp_bench.py \
        --gguf $ATB_PEERS_DIR/models/SmolLM2-135M-Instruct-F32.gguf --tokens 128 --batch 32 --threads 1

single  one prompt, --tokens new tokens, greedy, EOS ignored. TTFT = the prompt's llama_decode and
        the first token's sampling; decode tok/s = the other tokens over the time after the first
        (bench_engine's ``ours_single``).
batch   --batch prompts x --tokens tokens, all in ONE context (n_seq_max = --batch): the prompts go
        in as llama_batch chunks of up to --n-batch tokens (ours: max_num_batched_tokens=2048), then
        every step decodes one token of every sequence in a single llama_decode. tok/s = all new
        tokens over the whole call, prefill included (bench_engine's ``ours_batch``).

Why the low-level API and not ``Llama.__call__``: the high-level API serves one sequence per
context, stops at EOS, and spends Python time per token on things we do not measure for ours
(detokenising, stop strings). Here the only Python per step is filling the batch arrays, and
greedy sampling is llama.cpp's own (``llama_sampler_init_greedy``, argmax in C).

The KV cache is F16, llama.cpp's own default (``--kv-type f32`` for an all-fp32 run like ours and
vLLM's): F16 is faster in batch here (benchmarks/RESULTS.md, "Figures formerly in code comments"),
and a peer is measured as it is normally run, at its faster setting.

The last stdout line is one JSON object (see common.py); ``single_tokens`` are the greedy ids.
"""

from __future__ import annotations

import ctypes
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

ENGINE = "llama.cpp"
KV_TYPES = {"f32": 0, "f16": 1}  # enum ggml_type: GGML_TYPE_F32, GGML_TYPE_F16


def parse_args():
    parser = common.runner_parser(__doc__.splitlines()[0])
    parser.add_argument("--gguf", required=True, help="the GGUF model file")
    parser.add_argument("--n-batch", type=int, default=2048,
                        help="most tokens per llama_decode call (ours: max_num_batched_tokens=2048)")
    parser.add_argument("--kv-type", choices=sorted(KV_TYPES), default="f16",
                        help="KV cache type (llama.cpp's default: f16)")
    return parser.parse_args()


class Runner:
    """One loaded model; a fresh context per mode, sized for that mode's sequences."""

    def __init__(self, lib, gguf: str, threads: int, n_batch: int, kv_type: str):
        self.lib = lib
        self.threads = threads
        self.n_batch = n_batch
        self.kv_type = KV_TYPES[kv_type]
        lib.llama_backend_init()
        params = lib.llama_model_default_params()
        params.n_gpu_layers = 0
        self.model = lib.llama_model_load_from_file(gguf.encode(), params)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {gguf}")
        self.vocab = lib.llama_model_get_vocab(self.model)
        self.sampler = lib.llama_sampler_chain_init(lib.llama_sampler_chain_default_params())
        lib.llama_sampler_chain_add(self.sampler, lib.llama_sampler_init_greedy())

    def context(self, n_seq: int, per_seq: int):
        """A context with room for ``n_seq`` sequences of ``per_seq`` tokens each."""
        lib = self.lib
        params = lib.llama_context_default_params()
        # llama.cpp gives each sequence n_ctx / n_seq_max cells (non-unified KV): size the total so
        # each gets what it needs, rounded up to llama.cpp's 256-cell padding.
        params.n_ctx = n_seq * (-(-per_seq // 256) * 256)
        params.n_batch = self.n_batch
        params.n_seq_max = n_seq
        params.n_threads = self.threads
        params.n_threads_batch = self.threads
        params.type_k = params.type_v = self.kv_type
        params.no_perf = True
        ctx = lib.llama_init_from_model(self.model, params)
        if not ctx:
            raise RuntimeError(f"llama.cpp could not create a context (n_ctx={params.n_ctx}, n_seq_max={n_seq})")
        return ctx

    def generate(self, ctx, prompts: list[list[int]], tokens: int) -> tuple[float, float, list[list[int]]]:
        """Greedy, EOS ignored: (time of the first token of every sequence, end time, new ids per
        sequence); times are ``common.clock`` readings taken from the call's start."""
        lib = self.lib
        lib.llama_memory_clear(lib.llama_get_memory(ctx), True)
        capacity = max(self.n_batch, len(prompts))
        batch = lib.llama_batch_init(capacity, 0, 1)
        try:
            # Prefill: every prompt token, in chunks of at most n_batch, logits only for each
            # prompt's last token (the one its first new token is sampled from).
            entries = [(seq, pos, token, pos == len(ids) - 1)
                       for seq, ids in enumerate(prompts) for pos, token in enumerate(ids)]
            out = [[] for _ in prompts]
            for start in range(0, len(entries), self.n_batch):
                chunk = entries[start:start + self.n_batch]
                self._fill(batch, chunk)
                self._decode(ctx, batch)
                for index, (seq, _, _, wants_logits) in enumerate(chunk):
                    if wants_logits:
                        out[seq].append(lib.llama_sampler_sample(self.sampler, ctx, index))
            first_at = common.clock()
            # Decode: one token per sequence per llama_decode, every one producing logits.
            lengths = [len(ids) for ids in prompts]
            for step in range(tokens - 1):
                self._fill(batch, [(seq, lengths[seq] + step, out[seq][-1], True) for seq in range(len(prompts))])
                self._decode(ctx, batch)
                for seq in range(len(prompts)):
                    out[seq].append(lib.llama_sampler_sample(self.sampler, ctx, seq))
            return first_at, common.clock(), out
        finally:
            lib.llama_batch_free(batch)

    @staticmethod
    def _fill(batch, entries) -> None:
        for i, (seq, pos, token, wants_logits) in enumerate(entries):
            batch.token[i] = token
            batch.pos[i] = pos
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = seq
            batch.logits[i] = wants_logits
        batch.n_tokens = len(entries)

    def _decode(self, ctx, batch) -> None:
        status = self.lib.llama_decode(ctx, batch)
        if status != 0:
            raise RuntimeError(f"llama_decode returned {status} for a batch of {batch.n_tokens} tokens")

    def chat_prompt_ids(self, chat: list[dict]) -> list[int]:
        """A chat rendered with the GGUF's own template and tokenizer (used only without --prompts)."""
        from llama_cpp.llama_chat_format import Jinja2ChatFormatter

        lib = self.lib
        template = lib.llama_model_chat_template(self.model, None)
        if not template:
            raise RuntimeError("the GGUF has no chat template; pass --prompts")
        piece = lambda token: lib.llama_vocab_get_text(self.vocab, token).decode()  # noqa: E731
        text = Jinja2ChatFormatter(template=template.decode(), eos_token=piece(lib.llama_vocab_eos(self.vocab)),
                                   bos_token=piece(lib.llama_vocab_bos(self.vocab)))(messages=chat).prompt
        raw = text.encode()
        ids = (lib.llama_token * (len(raw) + 8))()
        count = lib.llama_tokenize(self.vocab, raw, len(raw), ids, len(ids), False, True)
        if count < 0:
            raise RuntimeError("llama_tokenize: buffer too small")
        return list(ids[:count])

    def close(self) -> None:
        self.lib.llama_sampler_free(self.sampler)
        self.lib.llama_model_free(self.model)


_log_callback = None  # llama.cpp keeps a raw pointer to it: it must live as long as the process


def silence_llama_logs(lib) -> None:
    """Drop llama.cpp's info/debug chatter (model loading prints hundreds of lines to stderr);
    warnings and errors still reach stderr."""
    global _log_callback
    shown = {"last": False}

    @lib.llama_log_callback
    def callback(level, text, _user):
        # enum ggml_log_level: WARN = 3, ERROR = 4; CONT = 5 continues the previous message.
        show = shown["last"] if level == 5 else level in (3, 4)
        shown["last"] = show
        if show:
            sys.stderr.write(text.decode(errors="replace"))

    _log_callback = callback
    lib.llama_log_set(callback, ctypes.c_void_p())


def main(args) -> dict:
    try:
        import llama_cpp as lib
    except ImportError as error:
        common.unavailable(ENGINE, f"llama-cpp-python is not importable here ({error}); run benchmarks/peers/setup.sh")
    if not Path(args.gguf).is_file():
        common.unavailable(ENGINE, f"no GGUF file at {args.gguf}; run benchmarks/peers/setup.sh")
    silence_llama_logs(lib)
    runner = Runner(lib, args.gguf, args.threads, args.n_batch, args.kv_type)
    if args.prompts:
        single, prompts, source = common.load_prompts(args.prompts, args.batch)
    else:
        chats = common.bench_chats(max(args.batch, 1))
        prompts = [runner.chat_prompt_ids(chat) for chat in chats]
        single, source = prompts[0], "the GGUF's chat template and tokenizer"
        prompts = prompts[:args.batch]

    ctx = runner.context(1, len(single) + args.tokens)
    runner.generate(ctx, [single], args.warmup_tokens)  # warm-up, as bench_engine does
    start = common.clock()
    first_at, end, (single_tokens,) = runner.generate(ctx, [single], args.tokens)
    ttft, single_tok_s = first_at - start, common.decode_rate(args.tokens, first_at, end)
    lib.llama_free(ctx)

    batch_tok_s, batch_tokens = None, []
    if args.batch:
        ctx = runner.context(len(prompts), max(map(len, prompts)) + args.tokens)
        runner.generate(ctx, prompts[:1], args.warmup_tokens)  # first use of this context's buffers
        start = common.clock()
        _, end, batch_tokens = runner.generate(ctx, prompts, args.tokens)
        batch_tok_s = len(prompts) * args.tokens / (end - start)
        lib.llama_free(ctx)
    runner.close()

    model_name = Path(args.gguf).name
    return common.measurement(
        version=f"llama-cpp-python {lib.__version__}",
        model=model_name,
        config=f"{model_name}, n_threads={args.threads}, n_threads_batch={args.threads}, "
               f"n_batch={args.n_batch}, KV {args.kv_type}, batch: one context, n_seq_max={args.batch}",
        system_info=lib.llama_print_system_info().decode().strip(),
        prompt_source=source, ttft_s=ttft, single_tok_s=single_tok_s, batch_tok_s=batch_tok_s,
        single_tokens=single_tokens, batch_tokens=batch_tokens,
    )


if __name__ == "__main__":
    arguments = parse_args()
    common.run_guarded(ENGINE, lambda: main(arguments))
