"""The LoRA wrapper of a linear layer: adapter slots beside the base layer, and every row of a
step through its own adapter (docs/lora.md, "How a row finds its adapter").

A wrapped layer keeps its base layer whole (float, packed, W8A16 or W8A8: whatever its method
made) and adds, per adapter slot ``s`` of ``max_loras``::

    lora_a[s]   (slices * R, in)   slice j's A in rows j*R .. j*R + r_j (zeros past its rank)
    lora_bj[s]  (R, out_j)         slice j's scale * B^T (slice j: q / k / v of qkv_proj, gate /
                                   up of gate_up_proj; the whole output of the others)

``R`` is ``max_lora_rank``, float32 always (the adapter's product accumulates in float32 whatever
the model's dtype: a bfloat16 model otherwise rounds a small delta away). The model runner orders
a step's requests by slot, so each adapter's tokens are one run of rows: the step's segments
``(slot, start, end)`` (``LoRAStep``, set by the manager once per step for every layer)::

    out = base(x)
    for slot, start, end in segments:                       Punica's sgmv: a decode row is a
        h = x[start:end] @ lora_a[slot].T                   segment of one, a prefill chunk of
        out[start:end, out_j] += h_j @ lora_bj[slot]        many; rows of the base model are in none

One shrink and one in-place expand per slice for each adapter the step holds (at most
``max_loras``), on views of the slots (no gather, no scatter, no copy of the slots), never a
Python loop per request; each row does its own adapter's work only. Measured against one dense
product over all of a step's slots with a one-hot mask, and against rows gathered per slot with
``bmm`` and ``index_add_``: benchmarks/RESULTS.md, bench_lora.py. The same ops run on the NPU
(aten matmul / addmm: no torch_npu op needed, so none in the schema fixture). On the CPU the
native kernel (csrc/lora_kernels.c) does the same per row with the row's slot (``row_slots``),
in one call, faster at every size measured; the captured decode step calls it too
(``native_lora``; docs/lora.md).

Tensor parallelism: a column-parallel layer (qkv, gate_up) holds A whole and B's rows of its own
output (like its base weight); a row-parallel one (o, down) holds A's columns of its own input and
B whole; its partial delta is summed by the all-reduce its owner already does after the layer
(the product is linear in the rank's input columns).
"""

from __future__ import annotations

import torch
from torch import nn

from atb_plugin.distributed import TPShard
from atb_plugin.models.linear import LinearMethodBase
from atb_plugin.ops import cpu_native


class LoRAStep:
    """The rows -> slots map of the current step, shared by every wrapped layer of one model (and
    the captured decode step): ``segments``, (slot, first row, end row) of each run of adapted
    rows (empty: no row is adapted, the layers add nothing), and ``row_slots``, each row's slot
    as int32 (-1: the base model; None when no row is adapted)."""

    def __init__(self):
        self.segments: list[tuple[int, int, int]] = []
        self.row_slots: torch.Tensor | None = None


class LoRAMethod(LinearMethodBase):
    """The method a wrapped layer carries: its base layer's, for what reads a layer through its
    method (the captured decode step's operands: the base weights, for steps without adapted rows)."""

    name = "LORA"

    def __init__(self, base: LinearMethodBase):
        self.base = base

    def native_operands(self, layer: nn.Module):
        return self.base.native_operands(layer.base)


class LoRALinear(nn.Module):
    """``base`` with ``max_loras`` adapter slots of rank up to ``max_rank`` (module docstring).
    ``out_slices``: this rank's output features of each piece; ``shards``: per piece, the part of
    the adapter's checkpoint tensor this rank holds (``TPShard`` of B for a column-parallel
    layer, of A for a row-parallel one; None: whole)."""

    def __init__(self, base: nn.Module, in_features: int, out_slices: list[int], shards: list[TPShard | None],
                 row_parallel: bool, max_loras: int, max_rank: int, step: LoRAStep, device):
        super().__init__()
        self.base = base
        self.quant_method, self.linear_spec = LoRAMethod(base.quant_method), base.linear_spec
        self.in_features, self.out_slices, self.shards = in_features, list(out_slices), shards
        self.row_parallel, self.max_rank, self.step = row_parallel, max_rank, step
        rows = len(out_slices) * max_rank
        self.register_buffer("lora_a", torch.zeros(max_loras, rows, in_features, device=device), persistent=False)
        for index, width in enumerate(out_slices):
            self.register_buffer(f"lora_b{index}", torch.zeros(max_loras, max_rank, width, device=device),
                                 persistent=False)

        # Each slot as the products read it, made once (aten's select costs ~6 us a call, 4 layers
        # x every layer x every step): views of the buffers, which are never reallocated, so a
        # rewritten slot reads through them as it is.
        self._slot_views = [(self.lora_a[slot].T, [b[slot] for b in self.lora_b]) for slot in range(max_loras)]
        # The slots as the native kernel reads them in place (csrc/lora_kernels.c), or why not (off
        # the CPU): made once, the buffers never move.
        self._native = cpu_native.lora_slots(self.lora_a, self.lora_b)

    def native_lora(self) -> tuple[cpu_native.LoRASlots | str, int, LoRAStep]:
        """What the captured decode step needs to add this layer's adapters (models/native_decode.py):
        its slots for the native kernel (or why they cannot be), their rank, and the step's rows."""
        return self._native, self.max_rank, self.step

    @property
    def lora_b(self) -> list[torch.Tensor]:
        return [getattr(self, f"lora_b{index}") for index in range(len(self.out_slices))]

    def set_slot(self, slot: int, pieces: list[tuple[torch.Tensor, torch.Tensor, float] | None]) -> None:
        """Write one adapter into ``slot``: per piece, its checkpoint ``A`` (r, in) and ``B``
        (out, r) and scale, or None (the piece not adapted). A copy into the slot's rows."""
        self.clear_slot(slot)
        a = self.lora_a[slot]
        for index, (piece, b, shard) in enumerate(zip(pieces, self.lora_b, self.shards)):
            if piece is not None:
                lora_a, lora_b, scale = piece
                if shard is not None:  # this rank's part (module docstring)
                    if self.row_parallel:
                        lora_a = lora_a.narrow(shard.dim, shard.start, shard.length)
                    else:
                        lora_b = lora_b.narrow(shard.dim, shard.start, shard.length)
                rank, first = lora_a.shape[0], index * self.max_rank
                a[first:first + rank] = lora_a.to(a.device, torch.float32)
                b[slot, :rank] = (lora_b.to(b.device, torch.float32) * scale).T

    def clear_slot(self, slot: int) -> None:
        for buffer in (self.lora_a, *self.lora_b):
            buffer[slot].zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base(x)
        segments = self.step.segments
        if not segments:
            return out
        flat = x.reshape(-1, self.in_features).to(torch.float32)
        # Added in place into a float32 output (the base output is this call's own tensor); a
        # lower-precision one gets a float32 delta and one rounding of the sum.
        in_place = out.dtype == torch.float32 and out.dim() == 2 and out.stride(1) == 1
        target = out if in_place else torch.zeros(flat.shape[0], sum(self.out_slices), dtype=torch.float32,
                                                  device=out.device)
        library = None if isinstance(self._native, str) else cpu_native.linear_library(flat.device)
        if library is not None:  # every row with its own slot in one call (faster at every size measured)
            cpu_native.lora_apply(library, self._native, self.max_rank, flat.contiguous(), self.step.row_slots,
                                  target)
            segments = ()
        rank = self.max_rank
        for slot, start, end in segments:
            a_t, bs = self._slot_views[slot]  # A^T (in, slices * R), each slice's B (R, out_j)
            h = flat[start:end] @ a_t  # shrink: (rows, slices * R)
            column = 0
            for j, (b, width) in enumerate(zip(bs, self.out_slices)):  # expand, per slice
                target[start:end, column:column + width].addmm_(h[:, j * rank:(j + 1) * rank], b)
                column += width
        if in_place:
            return out
        return (out.to(torch.float32) + target.view(out.shape)).to(out.dtype)


# The layers wrapped in each decoder layer: (owner attribute, layer attribute, row-parallel).
WRAPPED = (("self_attn", "qkv_proj", False), ("self_attn", "o_proj", True), ("mlp", "gate_up_proj", False),
           ("mlp", "down_proj", True))


def _wrap(owner: nn.Module, leaf: str, row_parallel: bool, max_loras: int, max_rank: int, step: LoRAStep):
    base = getattr(owner, leaf)
    spec = base.linear_spec
    if row_parallel:
        out_slices, shards = [spec.out_features], [owner.tp_shard(leaf, "weight", None)]
    else:
        out_slices = owner.shard_sizes(leaf)
        shards = [owner.tp_shard(leaf, "weight", j) for j in range(len(out_slices))]
    device = next(iter(base.parameters()), None)
    device = device.device if device is not None else next(iter(base.buffers())).device
    layer = LoRALinear(base, spec.in_features, out_slices, shards, row_parallel, max_loras, max_rank, step, device)
    setattr(owner, leaf, layer)
    return layer


def wrap_model(model: nn.Module, max_loras: int, max_rank: int) -> tuple[LoRAStep, dict[tuple[int, str], LoRALinear]]:
    """Wrap the decoder layers' projections of ``model``'s language model (a loaded model: its
    layers are the ones that serve). Returns the shared ``LoRAStep`` and the wrapped layers by
    (layer index, layer name). A layer without them (a mixture-of-experts MLP) stays as it is."""
    step = LoRAStep()
    wrapped = {}
    for index, decoder_layer in enumerate(model.get_language_model().model.layers):
        for owner_name, leaf, row_parallel in WRAPPED:
            owner = getattr(decoder_layer, owner_name, None)
            if owner is not None and hasattr(owner, leaf) and hasattr(owner, "tp_shard"):
                wrapped[index, leaf] = _wrap(owner, leaf, row_parallel, max_loras, max_rank, step)
    return step, wrapped
