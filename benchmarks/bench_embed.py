"""Claim: LLM.embed is >= 1.5x the embeddings/s of the sentence-transformers way of running
all-MiniLM-L6-v2 (length-sorted padded batches of 32 through transformers' AutoModel, masked mean
pooling, normalise), on 1,000 sentences of mixed length, CPU.

Why we can be faster: the engine batches by tokens (a step holds up to max_num_batched_tokens of
packed sequences, no padding), the reference by rows (every row padded to the longest in its
batch, attention over the padding too). sentence-transformers sorts the sentences by length
before batching, which already removes most padding; the same loop without the sort (what a
hand-written transformers loop does) is measured too, as context ("unsorted").

The outputs are checked equal first (max abs difference <= 1e-5 on every sentence). Rounds
alternate the two sides; medians of the rounds are reported. Last line: JSON with "speedup".

    python benchmarks/bench_embed.py [--sentences 1000] [--rounds 3] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import numpy as np
import torch
import torch.nn.functional as F
import transformers

from atb_plugin import LLM
from atb_plugin.default_model import embedding_model_dir

WORDS = ("the quick brown fox jumps over a lazy dog while engineers measure latency throughput memory "
         "bandwidth of serving systems on small machines with noisy neighbours and careful benchmarks").split()


def make_sentences(count: int, seed: int = 0) -> list[str]:
    """Mixed lengths as a retrieval corpus has them: mostly short (queries, titles), some
    paragraphs up to ~200 words (MiniLM's window is 256 tokens)."""
    rng = random.Random(seed)
    lengths = [rng.choice([rng.randint(3, 12), rng.randint(12, 40), rng.randint(40, 180)]) for _ in range(count)]
    return [" ".join(rng.choice(WORDS) for _ in range(n)).capitalize() + "." for n in lengths]


class SentenceTransformersStyle:
    """sentence-transformers' ``encode``: sort by length (longest first), batches of 32, padded,
    truncated at max_seq_length, masked mean, normalise; results back in input order."""

    def __init__(self, model_dir, batch_size: int = 32, max_seq_length: int = 256, sort: bool = True):
        self.tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
        self.model = transformers.AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.batch_size, self.max_seq_length, self.sort = batch_size, max_seq_length, sort

    @torch.inference_mode()
    def encode(self, sentences: list[str]) -> np.ndarray:
        order = list(range(len(sentences)))
        if self.sort:  # sentence-transformers sorts by text length, longest first
            order.sort(key=lambda i: -len(sentences[i]))
        out = np.empty((len(sentences), self.model.config.hidden_size), dtype=np.float32)
        for start in range(0, len(order), self.batch_size):
            index = order[start:start + self.batch_size]
            batch = self.tokenizer([sentences[i] for i in index], padding=True, truncation=True,
                                   max_length=self.max_seq_length, return_tensors="pt")
            hidden = self.model(**batch).last_hidden_state
            mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
            mean = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
            out[index] = F.normalize(mean, p=2, dim=1).numpy()
        return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sentences", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads for both sides")
    parser.add_argument("--max-num-batched-tokens", type=int, default=4096)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model_dir = embedding_model_dir()
    sentences = make_sentences(args.sentences)
    reference = SentenceTransformersStyle(model_dir)
    unsorted = SentenceTransformersStyle(model_dir, sort=False)
    with LLM(model_dir, max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=256) as llm:
        def ours() -> np.ndarray:
            return np.array([o.outputs.embedding for o in llm.embed(sentences, truncate_prompt_tokens=-1)],
                            dtype=np.float32)

        diff = float(np.abs(ours() - reference.encode(sentences)).max())  # also the warm-up
        if diff > 1e-5:
            raise SystemExit(f"outputs differ: max abs difference {diff:.2e} > 1e-5")
        tokens = sum(len(t) for t in reference.tokenizer(sentences, truncation=True, max_length=256)["input_ids"])
        times = {"ours": [], "reference": [], "unsorted": []}
        for round_ in range(args.rounds):
            for name, run in (("ours", ours), ("reference", lambda: reference.encode(sentences)),
                              ("unsorted", lambda: unsorted.encode(sentences))):
                start = time.perf_counter()
                run()
                times[name].append(time.perf_counter() - start)
            print(f"round {round_ + 1}: " + ", ".join(f"{k} {v[-1]:.2f} s" for k, v in times.items()), flush=True)
    ours_s, ref_s = statistics.median(times["ours"]), statistics.median(times["reference"])
    unsorted_s = statistics.median(times["unsorted"])
    result = {"sentences": len(sentences), "tokens": tokens, "threads": args.threads, "max_abs_diff": diff,
              "ours_embeddings_per_s": round(len(sentences) / ours_s, 1),
              "reference_embeddings_per_s": round(len(sentences) / ref_s, 1),
              "unsorted_embeddings_per_s": round(len(sentences) / unsorted_s, 1),
              "speedup_vs_unsorted": round(unsorted_s / ours_s, 3),
              "speedup": round(ref_s / ours_s, 3)}
    print(f"{len(sentences)} sentences ({tokens} tokens): ours {result['ours_embeddings_per_s']}/s, "
          f"sentence-transformers style {result['reference_embeddings_per_s']}/s (speedup {result['speedup']}x), "
          f"unsorted batches {result['unsorted_embeddings_per_s']}/s ({result['speedup_vs_unsorted']}x)")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
