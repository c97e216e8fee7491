"""``Sampler``: one token per request from the step's last-position logits, and ``check_stop``.

Per step, for the B requests that sample (vLLM v1's order)::

    logits (B, V) ──► raw logprobs = log_softmax(logits)          (only if a request asked for them)
          │
          ├─► min_tokens: EOS and stop ids -> -inf while a request is short of min_tokens
          │
          ├─► greedy rows (temperature 0, or below 1e-5): argmax
          │
          └─► random rows: / temperature ─► sort once (descending) ─► top-k by rank, top-p by
              cumulative probability, per-row k and p as tensors ─► softmax ─► exponential race:
              argmax(probs / q) with q ~ Exp(1) drawn from the request's own generator
              (one draw of V values per row per step), else from torch's global generator

``argmax(p_i / q_i)`` with i.i.d. ``q_i ~ Exp(1)`` picks ``i`` with probability ``p_i`` (vLLM's
sampler uses it too): it needs no per-row ``torch.multinomial`` call, and a seeded row consumes
exactly V draws of its own generator per step whatever else is in the batch, so the same seed
and prompt give the same tokens in any batch.

Stop checks (EOS, stop ids, lengths) are the scheduler's (``scheduler.check_stop``); stop strings
are text, so the frontend's detokenizer checks them (``detokenizer.IncrementalDetokenizer``).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass

import torch

from atb_plugin.engine.messages import LogprobsEntry
from atb_plugin.engine.sampling_params import SamplingParams

__all__ = ["LogprobsEntry", "SamplerOutput", "Sampler", "make_generator"]

# Temperatures below this are sampled greedily (vLLM's _SAMPLING_EPS): dividing by them only
# turns the distribution into a numerically fragile argmax.
_GREEDY_BELOW_TEMPERATURE = 1e-5


@dataclass
class SamplerOutput:
    """One entry per sampled request, in the order of the batch."""

    token_ids: list[int]
    logprobs: list[LogprobsEntry | None]

    def __post_init__(self):
        if len(self.token_ids) != len(self.logprobs):
            raise RuntimeError("token_ids and logprobs must have one entry per request")


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
    ) -> SamplerOutput:
        if logits.dim() != 2:
            raise RuntimeError(f"logits must be (num_requests, vocab_size), got {tuple(logits.shape)}")
        batch = logits.shape[0]
        if not len(params) == len(generators) == len(num_output_tokens) == batch:
            raise RuntimeError(
                f"one entry per row: {batch} rows of logits, {len(params)} params, "
                f"{len(generators)} generators, {len(num_output_tokens)} output counts"
            )
        if batch == 0:
            return SamplerOutput([], [])
        logits = logits.float()  # a copy for half inputs; fp32 softmax either way
        want_logprobs = [p.logprobs is not None for p in params]
        raw_logprobs = torch.log_softmax(logits, dim=-1) if any(want_logprobs) else None

        if eos_token_ids is None:
            eos_token_ids = [self.eos_token_ids] * batch
        logits = self._apply_min_tokens(logits, params, num_output_tokens, eos_token_ids)
        token_ids = logits.argmax(dim=-1)  # every row (cheap); the random rows are overwritten below
        random_rows = [i for i, p in enumerate(params) if p.temperature >= _GREEDY_BELOW_TEMPERATURE]
        if random_rows:
            rows = torch.tensor(random_rows, device=logits.device)
            token_ids[rows] = self._sample_random(
                logits[rows], [params[i] for i in random_rows], [generators[i] for i in random_rows])

        logprobs: list[LogprobsEntry | None] = [None] * batch
        if raw_logprobs is not None:
            logprobs = self._gather_logprobs(raw_logprobs, token_ids, params)
        return SamplerOutput(token_ids.tolist(), logprobs)

    # -- steps -----------------------------------------------------------------------------------

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

    def _sample_random(self, logits, params, generators) -> torch.Tensor:
        vocab = logits.shape[1]
        device = logits.device
        temperature = torch.tensor([p.temperature for p in params], device=device, dtype=logits.dtype)
        logits = logits / temperature[:, None]
        top_k = [p.top_k if p.top_k > 0 else vocab for p in params]
        top_p = [p.top_p for p in params]
        sorted_ids = None
        if any(k < vocab for k in top_k) or any(p < 1.0 for p in top_p):
            logits, sorted_ids = self._top_k_top_p_sorted(logits, top_k, top_p)
        probs = logits.softmax(dim=-1)

        noise = torch.empty_like(probs)
        unseeded = [i for i, g in enumerate(generators) if g is None]
        if unseeded:
            noise[torch.tensor(unseeded, device=device)] = torch.empty(
                len(unseeded), vocab, device=device, dtype=probs.dtype).exponential_()
        for i, generator in enumerate(generators):
            if generator is not None:
                noise[i].exponential_(generator=generator)
        choice = (probs / noise).argmax(dim=-1)
        if sorted_ids is not None:
            choice = sorted_ids.gather(1, choice[:, None]).squeeze(1)
        return choice

    @staticmethod
    def _top_k_top_p_sorted(logits, top_k: list[int], top_p: list[float]):
        """Sort each row once, most likely first, and mask (-inf) in that order:
        top-k keeps ranks < k; top-p keeps the shortest prefix whose probability reaches p
        (a token is kept when the mass before it is < p, so the most likely one always is).
        Returns the masked sorted logits and, per position, the vocabulary id it holds."""
        device = logits.device
        sorted_logits, sorted_ids = logits.sort(dim=-1, descending=True)
        ranks = torch.arange(logits.shape[1], device=device)
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
    def _gather_logprobs(raw_logprobs, token_ids, params) -> list[LogprobsEntry | None]:
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
