"""The adapters a server serves by name (vLLM's ``--lora-modules`` and runtime loading): each
name maps to a ``LoRARequest`` with an id of its own, checked against the base model when it is
added (``peft.inspect_adapter``). Torch-free: the API process holds it."""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass

from atb_plugin.lora.peft import LoRAError, check_allowed, inspect_adapter
from atb_plugin.lora.request import LoRARequest


@dataclass(frozen=True)
class LoRAModule:
    """One ``--lora-modules`` entry: ``name=path``, or vLLM's JSON form
    ``{"name": ..., "path": ..., "base_model_name": ...}`` (MindIE's ``LoraModules`` map here too)."""

    name: str
    path: str
    base_model_name: str | None = None

    @classmethod
    def parse(cls, text: str) -> "LoRAModule":
        text = text.strip()
        if text.startswith("{"):
            try:
                fields = json.loads(text)
                return cls(str(fields["name"]), str(fields["path"]), fields.get("base_model_name"))
            except (ValueError, KeyError, TypeError):
                raise ValueError(f"--lora-modules {text!r}: expected JSON with \"name\" and \"path\" (and optional "
                                 "\"base_model_name\")") from None
        name, sep, path = text.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora-modules {text!r}: expected name=path or JSON")
        return cls(name, path)


class ServedAdapters:
    """Name -> ``LoRARequest``. ``add`` checks the adapter (``LoRAError`` naming the problem: a
    400), refuses a taken name and, with ``allowed_dirs`` (runtime loading), a path outside them;
    ``remove`` forgets a name (``KeyError``: a 404). Ids grow and are never reused, so an adapter
    loaded again under a name is new to the engine (its slots, its prefix-cache blocks)."""

    def __init__(self, hf_config: dict, max_lora_rank: int, base_model_name: str, reserved: tuple[str, ...] = ()):
        self.hf_config, self.max_lora_rank, self.base_model_name = hf_config, max_lora_rank, base_model_name
        self.reserved = set(reserved) | {base_model_name}
        self._by_name: dict[str, LoRARequest] = {}
        self._ids = itertools.count(1)

    def add(self, module: LoRAModule, allowed_dirs: tuple[str, ...] | None = None) -> LoRARequest:
        if module.name in self._by_name:
            raise LoRAError(f"The lora adapter '{module.name}' has already been loaded.")
        if module.name in self.reserved:
            raise LoRAError(f"LoRA adapter name {module.name!r} is the base model's name")
        path = module.path if allowed_dirs is None else check_allowed(module.path, allowed_dirs)
        inspect_adapter(path, self.hf_config, self.max_lora_rank)
        lora = LoRARequest(module.name, next(self._ids), str(path), module.base_model_name or self.base_model_name)
        self._by_name[module.name] = lora
        return lora

    def remove(self, name: str) -> LoRARequest:
        try:
            return self._by_name.pop(name)
        except KeyError:
            raise KeyError(f"The lora adapter '{name}' cannot be found.") from None

    def get(self, name: str | None) -> LoRARequest | None:
        return self._by_name.get(name) if name is not None else None

    def __contains__(self, name) -> bool:
        return name in self._by_name

    def __iter__(self):
        return iter(list(self._by_name.values()))
