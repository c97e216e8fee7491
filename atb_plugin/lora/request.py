"""``LoRARequest``: which adapter a request runs through (vLLM's class and spelling).

Torch-free: it rides on ``EngineCoreRequest`` across the process boundary (msgspec encodes the
dataclass) and on the engine's ``Request`` to every tensor-parallel rank."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """``LoRARequest(lora_name, lora_int_id, lora_path)``: ``lora_int_id`` (>= 1) names the
    adapter inside the engine (its device slot, its host cache entry, its prefix-cache blocks);
    two requests with the same id and path share them. ``base_model_name``: the served model the
    adapter was made for (the server's ``/v1/models`` lists it as the adapter's ``parent``)."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None

    def __post_init__(self):
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"LoRARequest.lora_name must be a non-empty string, got {self.lora_name!r}")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"LoRARequest.lora_int_id must be an integer >= 1, got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(f"LoRARequest {self.lora_name!r}: lora_path must name the adapter's directory")

    # vLLM's short names.
    name = property(lambda self: self.lora_name)
    int_id = property(lambda self: self.lora_int_id)
    path = property(lambda self: self.lora_path)

    @property
    def key(self) -> tuple[int, str]:
        """What the engine caches an adapter under: its id and where its weights are."""
        return self.lora_int_id, self.lora_path
