"""The LoRA wrapper of a linear layer: adapter slots beside the base layer, and every row of a
step through its own adapter in a fixed handful of torch ops (docs/lora.md, "Kernels").

A wrapped layer keeps its base layer whole (float, packed, W8A16 or W8A8: whatever its method
made) and adds, per adapter slot ``s`` of ``max_loras``::

    lora_a[s]   (slices * R, in)   slice j's A in rows j*R .. j*R + r_j (zeros past its rank)
    lora_bj[s]  (R, out_j)         slice j's scale * B^T (slice j: q / k / v of qkv_proj, gate /
                                   up of gate_up_proj; the whole output of the others)

``R`` is ``max_lora_rank``, float32 always (the adapter's product accumulates in float32 whatever
the model's dtype: a bfloat16 model otherwise rounds a small delta away). A step's rows use slots
``first .. first + width - 1`` (``LoRAStep``, set by the manager once per step for every layer)::

    out    = base(x)
    h      = x @ lora_a[first:first+width].T                (T, slices * width * R)   shrink
    h      = h * mask                                       row t keeps only its own slot's columns
    out_j += h_j @ lora_bj[first:first+width]               (T, out_j)                expand, per slice

(``h_j``: slice j's column block; the step's operands are laid out once per slot range and
reused by every step until a slot is rewritten, ``LoRALinear._step_operands``.)

Rows of the base model have an all-zero mask row; a step whose rows all use one adapter needs no
mask. So a batch mixing adapters and the base model costs one shrink and one expand per slice
whatever its size and mix (Punica's bgmv / sgmv as one dense product over the step's slots),
never a Python loop per request. The expand is per slice rather than one block-diagonal product:
a third of qkv_proj's expand work and bytes (benchmarks/RESULTS.md, bench_lora.py). The same ops
run on the NPU (aten matmul and mul: no torch_npu op needed, so none in the schema fixture).

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


class LoRAStep:
    """The row -> slot map of the current step, shared by every wrapped layer of one model.
    ``width`` 0: no row is adapted (the layers add nothing); else rows use slots ``first`` ..
    ``first + width - 1``, and ``mask`` (T, 1, width, 1) float32 says which (None: every row uses
    slot ``first``)."""

    def __init__(self):
        self.first, self.width, self.mask = 0, 0, None
        self.version = 0  # bumped whenever a slot is written: the layers' operand views are remade

    def set(self, first: int, width: int, mask: torch.Tensor | None) -> None:
        self.first, self.width, self.mask = first, width, mask

    def clear(self) -> None:
        self.set(0, 0, None)


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
        self._operands: tuple | None = None  # (first, width, version, A^T, [B_j]) of the last step's slots
        self.register_buffer("lora_a", torch.zeros(max_loras, rows, in_features, device=device), persistent=False)
        for index, width in enumerate(out_slices):
            self.register_buffer(f"lora_b{index}", torch.zeros(max_loras, max_rank, width, device=device),
                                 persistent=False)

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

    def _step_operands(self, step: LoRAStep) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The step's slots as the products read them, made once per slot range and slot
        contents (every step of a steady batch reuses them): ``A^T`` (in, slices * width * R)
        with its columns slice-major, so each slice's shrink output is one column block, and
        each slice's ``B`` (width * R, out_j), a view."""
        key = (step.first, step.width, step.version)
        if self._operands is None or self._operands[0] != key:
            slots, slices = slice(step.first, step.first + step.width), len(self.out_slices)
            a = self.lora_a[slots]
            if slices > 1:  # (width, slices, R, in) -> (slices, width, R, in): a copy of these slots
                a = a.view(step.width, slices, self.max_rank, -1).transpose(0, 1).contiguous()
            self._operands = (key, a.reshape(-1, self.in_features).T,
                              [b[slots].reshape(step.width * self.max_rank, -1) for b in self.lora_b])
        return self._operands[1], self._operands[2]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base(x)
        step = self.step
        if not step.width:
            return out
        a_t, bs = self._step_operands(step)
        block = step.width * self.max_rank  # one slice's columns of the shrink output
        h = x.reshape(-1, self.in_features).to(torch.float32) @ a_t  # shrink: (T, slices * width * R)
        if step.mask is not None:
            h = (h.view(-1, len(bs), step.width, self.max_rank) * step.mask).view(h.shape)
        # expand, per slice: (T, width * R) @ (width * R, out_j)
        pieces = [(h[:, j * block:(j + 1) * block], b) for j, b in enumerate(bs)]
        if out.dtype == torch.float32 and out.dim() == 2:
            # Added in place into each slice's columns (the base output is this call's own tensor):
            # no concatenation, no second output (host time counts at 4 layers x every layer).
            column = 0
            for piece, width_j in zip(pieces, self.out_slices):
                out[:, column:column + width_j].addmm_(*piece)
                column += width_j
            return out
        delta = torch.cat([a @ b for a, b in pieces], dim=-1)
        return (out.to(torch.float32) + delta.view(out.shape)).to(out.dtype)


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
