"""The exact rejection sampler: which of a request's drafts the target model keeps.

One verify step gives the target's logits at the k + 1 positions ``[last token, d1 .. dk]``;
position i predicts the token after ``d1 .. di``. Each position is processed as the plain
sampler processes a row (``Sampler.process``: allowed ids, bad words, logit_bias, min_tokens,
penalties) with the request's output extended by the drafts before it, so every rule sees the
history it would have seen in plain decoding. Then:

- greedy (temperature 0): ``t_i = argmax`` of position i; drafts are accepted while ``d_i ==
  t_i``; the first mismatch emits ``t_i``, and when all k match the bonus ``t_k`` follows. The
  output is token-identical to plain greedy decoding.
- random: the target ``p_i`` (``Sampler.probabilities``: temperature, min_p, top-k, top-p) and
  the draft distribution ``q_i``, one-hot at ``d_i`` for a deterministic proposer (n-gram), so
  ``min(1, p_i(d_i) / q_i(d_i)) = p_i(d_i)``: ``d_i`` is accepted when ``u_i < p_i(d_i)``; at the
  first rejection a token is drawn from the recovered distribution ``max(0, p_i - q_i)``
  normalised (``p_i`` without ``d_i``); when all k are accepted the bonus is drawn from
  ``p_k``. Each emitted token is then distributed exactly as ``p`` (Leviathan et al. 2023).
  A seeded request draws k uniforms and one categorical from its own generator per step.

Logprobs of each emitted token are the raw ones of its position, as in plain decoding.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

import torch

from atb_plugin.engine.messages import LogprobsEntry
from atb_plugin.engine.sampler import Sampler, argmax, is_greedy
from atb_plugin.engine.sampling_params import SamplingParams


@dataclass
class VerifyRequest:
    """One request verified this step: its drafts and the sampler's per-request inputs."""

    drafts: list[int]
    params: SamplingParams
    generator: torch.Generator | None
    num_output_tokens: int
    eos_token_ids: Collection[int]
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]


@dataclass
class Verified:
    """The tokens a request emits this step (accepted drafts, then one target token), and their
    logprobs when it asked for them."""

    token_ids: list[int]
    logprobs: list[LogprobsEntry | None]

    @property
    def num_accepted(self) -> int:
        return len(self.token_ids) - 1


class RejectionSampler:
    def __init__(self, sampler: Sampler):
        self.sampler = sampler

    def verify(self, logits: torch.Tensor, requests: Sequence[VerifyRequest]) -> list[Verified]:
        """``logits``: ``len(drafts) + 1`` rows per request, requests one after another."""
        rows = [len(r.drafts) + 1 for r in requests]
        if logits.dim() != 2 or logits.shape[0] != sum(rows):
            raise RuntimeError(f"verify needs {sum(rows)} rows of logits (drafts + 1 per request), "
                               f"got {tuple(logits.shape)}")
        params, counts, eos, prompts, outputs = [], [], [], [], []
        for request, n in zip(requests, rows):
            for i in range(n):
                params.append(request.params)
                counts.append(request.num_output_tokens + i)
                eos.append(request.eos_token_ids)
                prompts.append(request.prompt_token_ids)
                outputs.append(list(request.output_token_ids) + request.drafts[:i])
        processed, raw_logprobs = self.sampler.process(logits, params, counts, eos, prompt_token_ids=prompts,
                                                       output_token_ids=outputs)
        targets = argmax(processed)
        results, start = [], 0
        for request, n in zip(requests, rows):
            block = slice(start, start + n)
            if is_greedy(request.params):
                tokens = self._greedy(targets[block].tolist(), request.drafts)
            else:
                probs = Sampler.probabilities(processed[block], [request.params] * n)
                tokens = self.accept_or_recover(probs, request.drafts, request.generator)
            logprobs: list[LogprobsEntry | None] = [None] * len(tokens)
            if raw_logprobs is not None and request.params.logprobs is not None:
                logprobs = Sampler.gather_logprobs(raw_logprobs[start:start + len(tokens)],
                                                   torch.tensor(tokens, device=logits.device),
                                                   [request.params] * len(tokens))
            results.append(Verified(tokens, logprobs))
            start += n
        return results

    @staticmethod
    def _greedy(targets: list[int], drafts: list[int]) -> list[int]:
        accepted = 0
        while accepted < len(drafts) and drafts[accepted] == targets[accepted]:
            accepted += 1
        return targets[:accepted + 1]

    @staticmethod
    def accept_or_recover(probs: torch.Tensor, drafts: Sequence[int], generator: torch.Generator | None) -> list[int]:
        """The random rule for one request: ``probs`` (k + 1, V), the target at each position;
        the draft distribution is one-hot at each draft. Draws k uniforms and one categorical."""
        k = len(drafts)
        device = probs.device
        draft_ids = torch.tensor(list(drafts), dtype=torch.long, device=device)
        uniforms = torch.rand(k, generator=generator, device=device, dtype=torch.float64)
        p_draft = probs[torch.arange(k, device=device), draft_ids].double()
        rejected = torch.nonzero(uniforms >= p_draft)
        accepted = int(rejected[0, 0]) if rejected.numel() else k
        final = probs[accepted].clone()
        if accepted < k:
            final[draft_ids[accepted]] = 0.0  # max(0, p - q) with q one-hot at the draft
        token = int(torch.multinomial(final / final.sum(), 1, generator=generator))
        return [*list(drafts[:accepted]), token]
