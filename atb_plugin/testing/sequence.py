"""Drive one sequence through a model's paged path, chunk by chunk (tests and examples; the
engine's model runner does this for many requests at once)."""

from __future__ import annotations

import torch

from atb_plugin.ops import AttentionMetadata
from atb_plugin.utils import cdiv


class SequenceRunner:
    """Feeds a sequence in chunks of any size through the KV cache, as prefill / chunked prefill /
    decode steps, with blocks taken in a deliberately scrambled order (not 1, 2, 3 ...)."""

    def __init__(self, model, max_len: int, block_size: int = 4):
        self.model = model
        self.block_size = block_size
        num_blocks = cdiv(max_len, block_size)
        self.kv_caches = model.make_kv_caches(num_blocks + 1, block_size)  # + the null block 0
        self.block_table = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(0)) + 1
        self.num_computed = 0

    def metadata(self, num_new: int) -> AttentionMetadata:
        positions = torch.arange(self.num_computed, self.num_computed + num_new)
        slots = self.block_table[positions // self.block_size] * self.block_size + positions % self.block_size
        seq_len = self.num_computed + num_new
        return AttentionMetadata(
            query_start_loc=torch.tensor([0, num_new], dtype=torch.int32),
            seq_lens=torch.tensor([seq_len], dtype=torch.int32),
            block_tables=self.block_table[None, :].to(torch.int32),
            slot_mapping=slots.to(torch.int64),
            max_query_len=num_new,
            max_seq_len=seq_len,
        )

    @torch.no_grad()
    def step(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None,
             inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """Run the next ``len(input_ids)`` tokens; returns their logits ``(n, vocab)``."""
        num_new = input_ids.shape[0]
        if positions is None:
            positions = torch.arange(self.num_computed, self.num_computed + num_new)
        hidden = self.model(input_ids, positions, self.kv_caches, self.metadata(num_new), inputs_embeds=inputs_embeds)
        self.num_computed += num_new
        return self.model.compute_logits(hidden)


def chunked_logits(model, ids: torch.Tensor, chunk_ends=(20, 33), block_size: int = 16) -> torch.Tensor:
    """``ids``' logits (float32) through ``model``'s paged path: prefill up to ``chunk_ends[0]``,
    chunked-prefill steps up to each later end, then one token a step. Block size 16: ATB's rule."""
    runner = SequenceRunner(model, max_len=len(ids) + 8, block_size=block_size)
    bounds = (0, *chunk_ends)
    steps = [runner.step(ids[start:end]) for start, end in zip(bounds, bounds[1:])]
    steps += [runner.step(ids[i:i + 1]) for i in range(chunk_ends[-1], len(ids))]
    return torch.cat(steps).float()


def check_simulated_npu(model, ids: torch.Tensor, dtype: torch.dtype, rel_tol: float) -> dict:
    """Run ``ids`` through ``model`` on the CPU and through a ``dtype`` copy of it on the simulated
    NPU (``chunked_logits``: every attention path the NPU has), check that the logits agree within
    ``rel_tol`` x the largest |logit| and that the greedy token agrees wherever the CPU's top two
    are further apart than twice that; the fake torch_npu's op call counts."""
    import copy

    from atb_plugin.platform import use_platform
    from atb_plugin.testing import fake_torch_npu

    cpu = chunked_logits(model, ids)
    with fake_torch_npu.install() as fake, use_platform("npu"):
        npu = chunked_logits(copy.deepcopy(model).to(dtype), ids)
        calls = dict(fake.module.calls)
    tol = rel_tol * cpu.abs().max()
    assert (npu - cpu).abs().max() <= tol, ((npu - cpu).abs().max(), tol)
    top2 = cpu.topk(2, dim=-1).values
    stable = (top2[:, 0] - top2[:, 1]) > 2 * tol
    assert stable.any() and torch.equal(npu.argmax(-1)[stable], cpu.argmax(-1)[stable])
    return calls
