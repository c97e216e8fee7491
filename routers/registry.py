"""``get_router(model_dir)``: the explicit registry from ``model_type`` to router class."""

from __future__ import annotations

from pathlib import Path

from atb_plugin.models.registry import registry_key
from routers.base import BaseRouter, read_json

ROUTERS: dict[str, type[BaseRouter]] = {}


def register_router(*model_types: str):
    """Class decorator: serve checkpoints whose registry key is one of ``model_types``."""

    def register(cls: type[BaseRouter]) -> type[BaseRouter]:
        for model_type in model_types:
            if model_type in ROUTERS:
                raise ValueError(f"model_type {model_type!r} is already served by {ROUTERS[model_type].__name__}")
            ROUTERS[model_type] = cls
        return cls

    return register


def get_router(model_dir, **kwargs) -> BaseRouter:
    """The router for the checkpoint in ``model_dir`` (kwargs go to the router)."""
    config_path = Path(model_dir) / "config.json"
    raw_config = read_json(config_path)
    if not raw_config:
        raise FileNotFoundError(f"{config_path} does not exist: is {model_dir} a checkpoint directory?")
    key = registry_key(raw_config)
    router_cls = ROUTERS.get(key)
    if router_cls is None:
        raise ValueError(
            f"unsupported model_type {raw_config.get('model_type')!r} in {config_path}; "
            f"supported: {', '.join(sorted(ROUTERS))}"
        )
    return router_cls(model_dir, raw_config=raw_config, **kwargs)
