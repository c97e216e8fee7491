"""Model routers: ``get_router(model_dir)`` picks the family's router from ``config.json``; a
router hands out the tokenizer, the input builder and (lazily) the model class.

To add a family: subclass ``BaseRouter`` in ``routers/families.py``, decorate it with
``@register_router("<model_type>")`` and implement ``make_input_builder``.
"""

from routers.base import BaseRouter, process_shm_store
from routers.families import BertRouter, LlavaRouter, Qwen2VlRouter, QwenVlRouter, TextRouter
from routers.registry import ROUTERS, get_router, register_router

__all__ = [
    "ROUTERS",
    "BaseRouter",
    "BertRouter",
    "LlavaRouter",
    "Qwen2VlRouter",
    "QwenVlRouter",
    "TextRouter",
    "get_router",
    "process_shm_store",
    "register_router",
]
