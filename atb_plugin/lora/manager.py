"""The engine side of multi-LoRA: adapters in device slots, an LRU of them in host memory, and
each step's row -> slot map (docs/lora.md, "Where adapters live").

    request.lora_request ──► host cache (LRU of max_cpu_loras adapters, read from disk once)
                         ──► a device slot (max_loras per wrapped layer; the least recently used
                             slot no row of this step needs is overwritten: one copy)
                         ──► LoRAStep: rows -> slots for every wrapped layer (layers.py)

Every tensor-parallel rank runs its own manager over the same steps: each loads the same files
and takes its own shard of each tensor as it writes a slot.
"""

from __future__ import annotations

import contextlib
import logging
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch
from safetensors.torch import load_file

from atb_plugin.lora.layers import LoRALinear, wrap_model
from atb_plugin.lora.peft import SLICES, TARGETS, WEIGHTS_FILE, LoRAError, inspect_adapter
from atb_plugin.lora.request import LoRARequest

logger = logging.getLogger(__name__)

# One adapter in host memory: per wrapped layer, per piece, (A, B, scale) or None.
HostAdapter = dict[tuple[int, str], list[tuple[torch.Tensor, torch.Tensor, float] | None]]


class LoRAManager:
    """``max_loras`` device slots over ``model``'s wrapped layers (``layers.wrap_model``), an LRU
    of ``max_cpu_loras`` adapters in host memory. ``slots_for(requests)`` puts the step's
    adapters in slots; ``step(row_slots, counts)`` is the context a forward runs in."""

    def __init__(self, model, hf_config: dict, max_loras: int, max_lora_rank: int, max_cpu_loras: int):
        self.model, self.hf_config = model, hf_config
        self.max_loras, self.max_lora_rank, self.max_cpu_loras = max_loras, max_lora_rank, max_cpu_loras
        self.state, self.layers = wrap_model(model, max_loras, max_lora_rank)
        self.slots: list[tuple[int, str] | None] = [None] * max_loras  # the adapter key in each slot
        self._slot_use = [0] * max_loras  # when each slot was last needed (the step counter)
        self._clock = 0
        self.host: OrderedDict[tuple[int, str], HostAdapter] = OrderedDict()
        self.loads = 0  # adapters read from disk (tests: the host cache's hits and misses)

    def slot_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for layer in self.layers.values() for t in layer.buffers(recurse=False))

    # -- host cache ------------------------------------------------------------------------------

    def _read(self, lora: LoRARequest) -> HostAdapter:
        """The adapter's tensors from disk, checked again here (the frontend checked the same
        files; they may have changed since) and laid out per wrapped layer."""
        info = inspect_adapter(lora.lora_path, self.hf_config, self.max_lora_rank)
        tensors = load_file(str(Path(lora.lora_path) / WEIGHTS_FILE))
        adapter: HostAdapter = {}
        for module in info.modules:
            leaf, piece = TARGETS[module.name]
            if (module.layer, leaf) not in self.layers:
                raise LoRAError(f"{lora.lora_path}: target module {module.name} of layer {module.layer} is not a "
                                "layer this model adapts (a mixture-of-experts layer, or another architecture)")
            pieces = adapter.setdefault((module.layer, leaf), [None] * SLICES[leaf])
            pieces[piece] = (tensors[module.key_a].to(torch.float32), tensors[module.key_b].to(torch.float32),
                             module.scale)
        self.loads += 1
        return adapter

    def _host_adapter(self, lora: LoRARequest) -> HostAdapter:
        adapter = self.host.get(lora.key)
        if adapter is None:
            adapter = self._read(lora)
            self.host[lora.key] = adapter
            while len(self.host) > self.max_cpu_loras:
                evicted, _ = self.host.popitem(last=False)
                logger.info("LoRA host cache: evicted adapter %s", evicted)
        self.host.move_to_end(lora.key)
        return adapter

    # -- device slots ----------------------------------------------------------------------------

    def _load_slot(self, slot: int, key, adapter: HostAdapter) -> None:
        for where, layer in self.layers.items():
            pieces = adapter.get(where)
            if pieces is None:
                layer.clear_slot(slot)
            else:
                layer.set_slot(slot, pieces)
        self.slots[slot] = key

    def slots_for(self, loras: Sequence[LoRARequest | None]) -> tuple[list[int], dict[int, str]]:
        """Each entry's slot (-1: the base model), loading what is missing; entries whose adapter
        fails to load get -1 and their error in the second value (index -> why). At most
        ``max_loras`` distinct adapters (the scheduler's limit)."""
        self._clock += 1
        needed = {lora.key: lora for lora in loras if lora is not None}
        if len(needed) > self.max_loras:
            raise RuntimeError(f"a step with {len(needed)} adapters; max_loras is {self.max_loras}")
        where = {key: self.slots.index(key) for key in needed if key in self.slots}
        errors: dict[tuple[int, str], str] = {}
        for key, lora in needed.items():
            if key not in where:
                try:
                    adapter = self._host_adapter(lora)
                except Exception as error:  # noqa: BLE001 - an unreadable adapter fails its requests, not the engine
                    errors[key] = f"LoRA adapter {lora.lora_name!r}: {error}"
                    continue
                free = [s for s in range(self.max_loras) if s not in where.values()]
                slot = min(free, key=lambda s: (self.slots[s] is not None, self._slot_use[s]))
                self._load_slot(slot, key, adapter)
                where[key] = slot
            self._slot_use[where[key]] = self._clock
        failed = {index: errors[lora.key] for index, lora in enumerate(loras) if lora is not None and lora.key in errors}
        return [-1 if lora is None or index in failed else where[lora.key] for index, lora in enumerate(loras)], failed

    @contextlib.contextmanager
    def step(self, row_slots: Sequence[int], counts: Sequence[int]) -> Iterator[bool]:
        """The forward's context: every wrapped layer adds each run of adapted rows' adapter
        (requests in the step's order with their slots and token counts; the runner orders
        them by slot, so each adapter is one run), the eager layers and the captured decode
        step alike (models/native_decode.py reads the same ``LoRAStep``); yields whether any
        row is adapted."""
        segments: list[tuple[int, int, int]] = []
        row = 0
        for slot, count in zip(row_slots, counts):
            if slot >= 0:
                if segments and segments[-1][0] == slot and segments[-1][2] == row:
                    segments[-1] = (slot, segments[-1][1], row + count)
                else:
                    segments.append((slot, row, row + count))
            row += count
        self.state.segments = segments
        if segments:
            self.state.row_slots = torch.tensor([slot for slot, count in zip(row_slots, counts) for _ in range(count)],
                                                dtype=torch.int32)
        try:
            yield bool(segments)
        finally:
            self.state.segments, self.state.row_slots = [], None


def attach_lora(model, hf_config: dict, max_loras: int, max_lora_rank: int, max_cpu_loras: int) -> LoRAManager:
    """Wrap a loaded ``model`` for LoRA (its slots allocated now: before the KV cache is sized)."""
    manager = LoRAManager(model, hf_config, max_loras, max_lora_rank, max_cpu_loras)
    logger.info("LoRA: %d slots of rank %d over %d layers, %.1f MiB; host cache of %d adapters", max_loras,
                max_lora_rank, len(manager.layers), manager.slot_bytes() / 2**20, max_cpu_loras)
    return manager


__all__ = ["LoRAManager", "attach_lora", "LoRALinear"]
