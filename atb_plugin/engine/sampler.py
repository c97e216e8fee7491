"""``Sampler``: one token per request from the step's last-position logits.

Per step, for the B requests that sample (vLLM v1's order)::

    logits (B, V) ──► raw logprobs = log_softmax(logits)          (only if a request asked for them)
          │
          ├─► allowed_token_ids: every other id -> -inf
          ├─► bad words: for each [t1..tk], tk -> -inf when the output ends with t1..t(k-1)
          ├─► logit_bias: + bias at its ids
          ├─► min_tokens: EOS and stop ids -> -inf while a request is short of min_tokens
          ├─► penalties: repetition (ids in prompt or output: / p if > 0 else * p), then
          │   - frequency x count in the output, - presence once if in the output
          │
          ├─► greedy rows (temperature 0, or below 1e-5): argmax
          │
          └─► random rows: / temperature ─► min_p (probability < min_p x the row's top -> -inf)
              ─► top_k <= 1024: its k candidates by topk ─► top-p over them ─► softmax ─►
                 exponential race over the k candidates (k draws)
              ─► else: sort once (descending) ─► top-k by rank, top-p by cumulative probability
                 ─► back to vocabulary order ─► softmax ─► exponential race over V (V draws)
              race: argmax(probs / q) with q ~ Exp(1) drawn from the request's own generator,
              else from torch's global generator

Each stage runs only on the rows that use it, and is skipped outright when none does (the
default request pays for none of them). Index lists are built per request in Python, the
masks, counts and arithmetic are one tensor operation per stage over those rows.

``argmax(p_i / q_i)`` with i.i.d. ``q_i ~ Exp(1)`` picks ``i`` with probability ``p_i`` (vLLM's
sampler uses it too): it needs no per-row ``torch.multinomial`` call, and a seeded row consumes
exactly k (its own top_k, when at most 1024) or V draws of its own generator per step whatever
else is in the batch, so the same seed and prompt give the same tokens in any batch.

Stop checks (EOS, stop ids, lengths) are the scheduler's (``scheduler.check_stop``); stop strings
are text, so the frontend's detokenizer (atb_plugin/frontend/detokenizer.py) checks them.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass
from itertools import chain

import torch

from atb_plugin.engine.messages import LogprobsEntry
from atb_plugin.engine.sampling_params import SamplingParams
from atb_plugin.ops import cpu_native

__all__ = ["LogprobsEntry", "SamplerOutput", "Sampler", "argmax", "is_greedy", "make_generator"]

# Temperatures below this are sampled greedily (vLLM's _SAMPLING_EPS): dividing by them only
# turns the distribution into a numerically fragile argmax.
_GREEDY_BELOW_TEMPERATURE = 1e-5
# When every random row's top_k is at most this, its candidates come from topk, not a full sort.
_TOPK_INSTEAD_OF_SORT = 1024


@dataclass
class SamplerOutput:
    """One entry per sampled request, in the order of the batch."""

    token_ids: list[int]
    logprobs: list[LogprobsEntry | None]

    def __post_init__(self):
        if len(self.token_ids) != len(self.logprobs):
            raise RuntimeError("token_ids and logprobs must have one entry per request")


def is_greedy(params: SamplingParams) -> bool:
    """The row takes its argmax (temperature 0 or below 1e-5) rather than a random draw."""
    return params.temperature < _GREEDY_BELOW_TEMPERATURE


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator | None:
    """The per-request generator: created once when the request arrives, then only advanced by
    sampling. ``None`` for an unseeded request (it draws from torch's global generator)."""
    if seed is None:
        return None
    return torch.Generator(device=device).manual_seed(seed)


class Sampler:
    """Contract: ``sample(logits, params, generators, num_output_tokens)`` returns one token id
    (and optionally a ``LogprobsEntry``) per row of ``logits`` (B, V), row i following
    ``params[i]``; ``generators[i]`` is request i's generator (``make_generator``) or None, and
    ``num_output_tokens[i]`` how many tokens request i has generated before this one (for
    min_tokens). ``eos_token_ids[i]``, when given, are request i's EOS ids (else the sampler's).
    ``prompt_token_ids[i]`` and ``output_token_ids[i]`` (keyword-only) are request i's prompt and
    the tokens it has generated so far: needed only when a row uses penalties (the prompt only
    for repetition_penalty) or bad words, else they may be None (``RuntimeError`` if a row needs
    them). Negative prompt ids (media handles) and ids outside the vocabulary are ignored.
    Stateless apart from the default EOS ids; never modifies ``logits``."""

    def __init__(self, eos_token_ids: Iterable[int] = ()):
        self.eos_token_ids = tuple(sorted(set(eos_token_ids)))

    def sample(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
        num_output_tokens: Sequence[int],
        eos_token_ids: Sequence[Collection[int]] | None = None,
        *,
        prompt_token_ids: Sequence[Sequence[int]] | None = None,
        output_token_ids: Sequence[Sequence[int]] | None = None,
    ) -> SamplerOutput:
        # ``process`` checks the shape and every other per-row sequence; the generators are ours.
        logits, raw_logprobs = self.process(logits, params, num_output_tokens, eos_token_ids,
                                            prompt_token_ids=prompt_token_ids, output_token_ids=output_token_ids)
        batch = logits.shape[0]
        if len(generators) != batch:
            raise RuntimeError(f"one entry per row: {batch} rows of logits, {len(generators)} generators")
        if batch == 0:
            return SamplerOutput([], [])

        token_ids = argmax(logits)  # every row (cheap); the random rows are overwritten below
        random_rows = [i for i, p in enumerate(params) if not is_greedy(p)]
        if random_rows:
            rows = torch.tensor(random_rows, device=logits.device)
            token_ids[rows] = self._sample_random(
                logits[rows], [params[i] for i in random_rows], [generators[i] for i in random_rows])

        logprobs: list[LogprobsEntry | None] = [None] * batch
        if raw_logprobs is not None:
            logprobs = self.gather_logprobs(raw_logprobs, token_ids, params)
        return SamplerOutput(token_ids.tolist(), logprobs)

    def process(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        num_output_tokens: Sequence[int],
        eos_token_ids: Sequence[Collection[int]] | None = None,
        *,
        prompt_token_ids: Sequence[Sequence[int]] | None = None,
        output_token_ids: Sequence[Sequence[int]] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The stages before the choice (allowed ids, bad words, logit_bias, min_tokens,
        penalties), row i following ``params[i]``: the processed float32 logits (never
        ``logits`` itself when a stage edits) and the raw logprobs when a row asks for logprobs
        (else None). ``sample`` chooses from them; the speculative rejection sampler runs them
        once per verified position (engine/spec_decode/rejection_sampler.py)."""
        if logits.dim() != 2:
            raise RuntimeError(f"logits must be (num_requests, vocab_size), got {tuple(logits.shape)}")
        batch = logits.shape[0]
        if not len(params) == len(num_output_tokens) == batch:
            raise RuntimeError(
                f"one entry per row: {batch} rows of logits, {len(params)} params, "
                f"{len(num_output_tokens)} output counts"
            )
        for name, value in (("prompt_token_ids", prompt_token_ids), ("output_token_ids", output_token_ids)):
            if value is not None and len(value) != batch:
                raise RuntimeError(f"one entry per row: {batch} rows of logits, {len(value)} {name}")
        if batch == 0:
            return logits, None

        # Which rows use which stage: one pass of attribute checks, all a default batch pays.
        allowed_rows, bad_word_rows, bias_rows, penalty_rows = [], [], [], []
        for i, p in enumerate(params):
            if p.allowed_token_ids is not None:
                allowed_rows.append(i)
            if p.bad_words_token_ids:
                bad_word_rows.append(i)
            if p.logit_bias:
                bias_rows.append(i)
            if p.uses_penalties:
                penalty_rows.append(i)
        if (bad_word_rows or penalty_rows) and output_token_ids is None:
            raise RuntimeError("output_token_ids is needed: a request uses penalties or bad words")
        edits = bool(allowed_rows or bad_word_rows or bias_rows or penalty_rows)

        # The stages below edit in place, so then take a copy (fp32 either way).
        logits = logits.to(torch.float32, copy=edits)
        want_logprobs = [p.logprobs is not None for p in params]
        raw_logprobs = torch.log_softmax(logits, dim=-1) if any(want_logprobs) else None

        if eos_token_ids is None:
            eos_token_ids = [self.eos_token_ids] * batch
        if allowed_rows:
            self._apply_allowed_token_ids_(logits, params, allowed_rows)
        if bad_word_rows:
            self._apply_bad_words_(logits, params, bad_word_rows, output_token_ids)
        if bias_rows:
            self._apply_logit_bias_(logits, params, bias_rows)
        logits = self._apply_min_tokens(logits, params, num_output_tokens, eos_token_ids)
        if penalty_rows:
            self._apply_penalties_(logits, params, penalty_rows, prompt_token_ids, output_token_ids)
        return logits, raw_logprobs

    # -- steps -----------------------------------------------------------------------------------
    # The ``_..._`` stages edit ``logits`` in place: ``sample`` hands them its own copy.

    @staticmethod
    def _apply_allowed_token_ids_(logits, params, rows) -> None:
        """Only allowed_token_ids may be sampled: every other id of the row gets -inf."""
        vocab = logits.shape[1]
        mask_rows, mask_cols = [], []
        for j, i in enumerate(rows):
            ids = [t for t in params[i].allowed_token_ids if t < vocab]
            mask_rows += [j] * len(ids)
            mask_cols += ids
        device = logits.device
        blocked = torch.ones(len(rows), vocab, dtype=torch.bool, device=device)
        blocked[torch.tensor(mask_rows, dtype=torch.long, device=device),
                torch.tensor(mask_cols, dtype=torch.long, device=device)] = False
        index = torch.tensor(rows, device=device)
        logits[index] = logits[index].masked_fill(blocked, float("-inf"))

    @staticmethod
    def _apply_bad_words_(logits, params, rows, output_token_ids) -> None:
        """vLLM's bad words: the last token of a bad word gets -inf when the output so far ends
        with the rest of it (a one-token bad word is always blocked)."""
        vocab = logits.shape[1]
        block_rows, block_cols = [], []
        for i in rows:
            output = output_token_ids[i]
            for word in params[i].bad_words_token_ids:
                prefix = len(word) - 1
                if word[-1] >= vocab or prefix > len(output):
                    continue
                if prefix == 0 or list(output[len(output) - prefix:]) == list(word[:-1]):
                    block_rows.append(i)
                    block_cols.append(word[-1])
        if block_rows:
            device = logits.device
            logits.index_put_((torch.tensor(block_rows, device=device), torch.tensor(block_cols, device=device)),
                              torch.tensor(float("-inf"), device=device))

    @staticmethod
    def _apply_logit_bias_(logits, params, rows) -> None:
        """logit_bias[t] is added to token t's logit (ids beyond the vocabulary are ignored: the
        engine core checks them against it first)."""
        vocab = logits.shape[1]
        bias_rows, bias_cols, values = [], [], []
        for i in rows:
            for token, bias in params[i].logit_bias.items():
                if 0 <= token < vocab:
                    bias_rows.append(i)
                    bias_cols.append(token)
                    values.append(bias)
        if bias_rows:
            device = logits.device
            logits.index_put_((torch.tensor(bias_rows, device=device), torch.tensor(bias_cols, device=device)),
                              torch.tensor(values, device=device, dtype=logits.dtype), accumulate=True)

    @staticmethod
    def _apply_min_tokens(logits, params, num_output_tokens, eos_token_ids) -> torch.Tensor:
        """EOS (unless ignore_eos) and the stop ids get -inf while a request has fewer than
        min_tokens output tokens (vLLM's MinTokensLogitsProcessor)."""
        rows, cols = [], []
        for i, (p, generated, eos) in enumerate(zip(params, num_output_tokens, eos_token_ids)):
            if generated < p.min_tokens:
                blocked = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos))
                blocked = [t for t in blocked if t < logits.shape[1]]
                rows += [i] * len(blocked)
                cols += blocked
        if not rows:
            return logits
        index = (torch.tensor(rows, device=logits.device), torch.tensor(cols, device=logits.device))
        # Out of place: ``logits`` may still be the caller's tensor.
        return logits.index_put(index, torch.tensor(float("-inf"), device=logits.device))

    @classmethod
    def _apply_penalties_(cls, logits, params, rows, prompt_token_ids, output_token_ids) -> None:
        """vLLM's apply_penalties on the rows that use one: repetition_penalty on the ids in the
        prompt or the output (logit / p if > 0, else logit * p), then - frequency_penalty x the
        id's count in the output and - presence_penalty once if it occurs there.

        Sparse: only the (row, id) entries a prompt or output holds are read and written, a few
        thousand per row, not the whole (rows, vocab) block: on the CPU the dense form cost more
        than the rest of the sampler (Qwen2 checkpoints turn repetition_penalty on by default;
        benchmarks/RESULTS.md, "Figures formerly in code comments")."""
        vocab, device = logits.shape[1], logits.device
        flat = logits.view(-1)  # ``sample``'s own contiguous copy
        penalty_of = torch.ones(logits.shape[0], dtype=logits.dtype)  # per batch row
        frequency_of, presence_of = torch.zeros_like(penalty_of), torch.zeros_like(penalty_of)
        for i in rows:
            penalty_of[i] = params[i].repetition_penalty
            frequency_of[i], presence_of[i] = params[i].frequency_penalty, params[i].presence_penalty
        repetition_rows = [i for i in rows if params[i].repetition_penalty != 1.0]
        if repetition_rows and prompt_token_ids is None:
            raise RuntimeError("prompt_token_ids is needed: a request uses repetition_penalty")
        output_at, output_counts = cls._flat_positions(rows, [output_token_ids[i] for i in rows], vocab)
        if repetition_rows:
            prompt_at, _ = cls._flat_positions(repetition_rows, [prompt_token_ids[i] for i in repetition_rows], vocab)
            seen = torch.unique(torch.cat([prompt_at, output_at]))
            values, penalty = flat[seen.to(device)], penalty_of[seen // vocab].to(device)
            flat[seen.to(device)] = torch.where(values > 0, values / penalty, values * penalty)
        if len(output_at):
            row = output_at // vocab
            scale = (frequency_of[row] * output_counts + presence_of[row]).to(device)
            flat[output_at.to(device)] -= scale

    @staticmethod
    def _flat_positions(rows, sequences, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The distinct flat positions ``row * vocab + id`` of the ids in each row's sequence, and
        how often each occurs (CPU tensors); ids outside [0, vocab) (negative media handles) are
        ignored."""
        lengths = torch.tensor([len(seq) for seq in sequences], dtype=torch.long)
        if int(lengths.sum()) == 0:
            return torch.zeros(0, dtype=torch.long), torch.zeros(0)
        ids = torch.tensor(list(chain.from_iterable(sequences)), dtype=torch.long)
        row = torch.repeat_interleave(torch.tensor(rows, dtype=torch.long), lengths)
        valid = (ids >= 0) & (ids < vocab)
        positions, counts = torch.unique(row[valid] * vocab + ids[valid], return_counts=True)
        return positions, counts.to(torch.float32)

    @staticmethod
    def _tempered(logits, params) -> tuple[torch.Tensor, list[int], list[float]]:
        """Random rows' logits / temperature with min_p applied, and each row's top-k (the
        vocabulary size for none) and top-p."""
        vocab = logits.shape[1]
        device = logits.device
        temperature = torch.tensor([p.temperature for p in params], device=device, dtype=logits.dtype)
        logits = logits / temperature[:, None]
        min_p = [p.min_p for p in params]
        if any(m > 0.0 for m in min_p):
            # vLLM's MinPLogitsProcessor, on the tempered probabilities. min_p = 0 rows: a zero
            # threshold, below every probability.
            probs = logits.softmax(dim=-1)
            threshold = probs.amax(dim=-1, keepdim=True) * torch.tensor(min_p, device=device, dtype=probs.dtype)[:, None]
            logits = logits.masked_fill(probs < threshold, float("-inf"))
        return logits, [p.top_k if 0 < p.top_k < vocab else vocab for p in params], [p.top_p for p in params]

    @classmethod
    def probabilities(cls, logits, params) -> torch.Tensor:
        """The distribution each random row of processed ``logits`` samples from (temperature,
        min_p, top-k, top-p), over the whole vocabulary: what ``sample`` draws from, written
        out (the speculative rejection sampler's target ``p``)."""
        return cls._top_k_top_p(*cls._tempered(logits, params)).softmax(dim=-1)

    @classmethod
    def _top_k_top_p(cls, logits, top_k: list[int], top_p: list[float]) -> torch.Tensor:
        """``logits`` with each row's top-k / top-p masked (-inf), in vocabulary order (so that
        noise value i always races token i); ``logits`` itself when no row limits either."""
        if all(p >= 1.0 for p in top_p) and all(k >= logits.shape[1] for k in top_k):
            return logits
        sorted_logits, sorted_ids = cls._top_k_top_p_sorted(logits, top_k, top_p)
        return torch.full_like(logits, float("-inf")).scatter_(1, sorted_ids, sorted_logits)

    def _sample_random(self, logits, params, generators) -> torch.Tensor:
        vocab = logits.shape[1]
        device = logits.device
        logits, top_k, top_p = self._tempered(logits, params)
        choice = torch.empty(len(params), dtype=torch.long, device=device)
        # A row's own top_k alone decides its path, so its draws never depend on its neighbours.
        narrow = [i for i, k in enumerate(top_k) if k <= _TOPK_INSTEAD_OF_SORT]
        wide = [i for i, k in enumerate(top_k) if k > _TOPK_INSTEAD_OF_SORT]
        for rows in (narrow, wide):
            if not rows:
                continue
            index = torch.tensor(rows, device=device)
            row_logits, row_k, row_p = logits[index], [top_k[i] for i in rows], [top_p[i] for i in rows]
            row_generators = [generators[i] for i in rows]
            if rows is narrow:
                # Race only the row's top-k candidates: k draws instead of V (drawing V
                # exponentials is most of a CPU sampler's time at V = 49k).
                candidates, candidate_ids = self._top_k_top_p_sorted(row_logits, row_k, row_p)
                picked = self._race(candidates.softmax(dim=-1), row_generators, row_k)
                choice[index] = candidate_ids.gather(1, picked[:, None]).squeeze(1)
                continue
            row_logits = self._top_k_top_p(row_logits, row_k, row_p)
            choice[index] = self._race(row_logits.softmax(dim=-1), row_generators, [vocab] * len(rows))
        return choice

    @staticmethod
    def _race(probs, generators, draws: list[int]) -> torch.Tensor:
        """The exponential race ``argmax(probs / q)``: row i's first ``draws[i]`` entries get
        q ~ Exp(1) from its own generator (exactly that many draws: its stream never depends on
        the batch), else from torch's global one; entries past ``draws[i]`` have probability 0."""
        device = probs.device
        noise = torch.ones_like(probs)
        unseeded = [i for i, g in enumerate(generators) if g is None]
        if unseeded:
            noise[torch.tensor(unseeded, device=device)] = torch.empty(
                len(unseeded), probs.shape[1], device=device, dtype=probs.dtype).exponential_()
        for i, generator in enumerate(generators):
            if generator is not None:
                noise[i, :draws[i]].exponential_(generator=generator)
        return (probs / noise).argmax(dim=-1)

    @staticmethod
    def _top_k_top_p_sorted(logits, top_k: list[int], top_p: list[float]):
        """Sort each row once, most likely first, and mask (-inf) in that order:
        top-k keeps ranks < k; top-p keeps the shortest prefix whose probability reaches p
        (a token is kept when the mass before it is < p, so the most likely one always is).
        Returns the masked sorted logits and, per position, the vocabulary id it holds: the
        whole row, or only its largest ``max(top_k)`` entries when every row has a small top-k
        (``topk`` instead of a full sort: much less work for a small top_k, such as Qwen2's
        default 20 over a 49k vocabulary, as measured in benchmarks/RESULTS.md, "Figures
        formerly in code comments"; and nothing past rank k survives anyway: top-p then
        renormalises over those, as it does over the masked full row)."""
        device = logits.device
        widest = max(top_k)
        if widest <= _TOPK_INSTEAD_OF_SORT:
            sorted_logits, sorted_ids = logits.topk(widest, dim=-1)
        else:
            sorted_logits, sorted_ids = logits.sort(dim=-1, descending=True)
        ranks = torch.arange(sorted_logits.shape[1], device=device)
        k = torch.tensor(top_k, device=device)
        sorted_logits = sorted_logits.masked_fill(ranks[None, :] >= k[:, None], float("-inf"))
        if any(p < 1.0 for p in top_p):
            # p = 1 rows: a threshold above any sum, so rounding in the cumsum can never drop a token.
            p = torch.tensor([v if v < 1.0 else 2.0 for v in top_p], device=device, dtype=logits.dtype)
            probs = sorted_logits.softmax(dim=-1)
            mass_before = probs.cumsum(dim=-1) - probs
            sorted_logits = sorted_logits.masked_fill(mass_before >= p[:, None], float("-inf"))
        return sorted_logits, sorted_ids

    @staticmethod
    def gather_logprobs(raw_logprobs, token_ids, params) -> list[LogprobsEntry | None]:
        """Row i's ``LogprobsEntry`` for ``token_ids[i]`` (its logprob, 1-based rank and the top
        ``params[i].logprobs``), None where that is None. Also the runner's prompt logprobs."""
        vocab = raw_logprobs.shape[1]
        sampled = raw_logprobs.gather(1, token_ids[:, None])  # (B, 1)
        ranks = (raw_logprobs > sampled).sum(dim=-1) + 1
        max_top = min(max(p.logprobs or 0 for p in params), vocab)
        top_values, top_ids = raw_logprobs.topk(max_top, dim=-1) if max_top else (None, None)
        # One device-to-host copy per tensor, then plain Python.
        sampled_list, ranks_list = sampled.squeeze(1).tolist(), ranks.tolist()
        top_values_list = top_values.tolist() if max_top else None
        top_ids_list = top_ids.tolist() if max_top else None
        token_list = token_ids.tolist()
        entries: list[LogprobsEntry | None] = []
        for i, p in enumerate(params):
            if p.logprobs is None:
                entries.append(None)
                continue
            n = min(p.logprobs, vocab)
            entries.append(LogprobsEntry(
                token_id=token_list[i], logprob=sampled_list[i], rank=ranks_list[i],
                top_token_ids=top_ids_list[i][:n] if n else [],
                top_logprobs=top_values_list[i][:n] if n else [],
            ))
        return entries


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """Each row's argmax (the first maximum): the native CPU kernel where it runs (several times
    faster than torch's over a 49k vocabulary: benchmarks/RESULTS.md, bench_engine "Fifth
    round"), else torch's."""
    library = cpu_native.library_for(logits.dtype, logits.device)
    return logits.argmax(dim=-1) if library is None else cpu_native.argmax(library, logits)
