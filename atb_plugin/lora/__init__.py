"""Multi-LoRA serving (docs/lora.md): PEFT adapters over one base model, mixed in every batch.

    request.py  LoRARequest (torch-free: it crosses the process boundary)
    peft.py     adapter files read and checked against the base model (torch-free: the frontends
                refuse a bad adapter before any request uses it)
    layers.py   the LoRA wrapper of a linear layer: its adapter slots and the grouped
                shrink / expand of every row through its own slot
    manager.py  the engine side: adapters loaded into device slots, an LRU of them in host memory,
                each step's row -> slot map

``from atb_plugin.lora import LoRARequest, LoRAError`` stays torch-free; ``layers`` and ``manager``
are imported by the engine's worker and runner only."""

from atb_plugin.lora.peft import LoRAError
from atb_plugin.lora.request import LoRARequest

__all__ = ["LoRAError", "LoRARequest"]
