"""``BaseRouter``: everything the service needs to know about one checkpoint directory.

A router is cheap to create: the config, tokenizer, input builder and model class are built on
first use, so picking a router (``routers.get_router``) only reads ``config.json``.
"""

from __future__ import annotations

import dataclasses
import json
import threading
from functools import cached_property
from pathlib import Path

from atb_plugin.models.registry import config_value, declared_max_model_len, import_model_class, model_class_path
from input_builders.base import InputBuilder
from atb_plugin.multimodal.wire import DEFAULT_WIRE_DTYPE, check_wire_dtype
from input_builders.media_config import MediaConfig
from input_builders.preprocess import ImagePreprocessor
from shm import ShmStore

_process_store: ShmStore | None = None
_process_store_lock = threading.Lock()


def process_shm_store() -> ShmStore:
    """The store of this process, created on first use (unlinks what it owns at exit)."""
    global _process_store
    with _process_store_lock:
        if _process_store is None:
            _process_store = ShmStore()
        return _process_store


def read_json(path: Path) -> dict:
    try:
        with open(path, encoding="utf-8") as file:
            return json.load(file)
    except FileNotFoundError:
        return {}
    except json.JSONDecodeError as error:
        raise ValueError(f"{path} is not valid JSON: {error}") from error


class BaseRouter:
    """Contract: one router per model directory, for one model family.

    Exposes lazily-built ``config``, ``generation_config`` (dict), ``tokenizer``,
    ``input_builder`` and ``model_cls``, plus ``tokenize(inputs)`` and ``shm_store`` (the
    store the builder writes images to: the one passed in, else this process's).
    Subclasses implement ``make_input_builder``; the model class comes from the one table in
    ``atb_plugin.models.registry`` (``model_cls_path``, imported only when ``model_cls`` is read).
    """

    def __init__(self, model_dir, *, raw_config: dict | None = None, shm_store: ShmStore | None = None,
                 media_config: MediaConfig | None = None, max_images_per_prompt: int | None = None,
                 mm_wire_dtype: str = DEFAULT_WIRE_DTYPE):
        self.model_dir = Path(model_dir)
        self.raw_config = raw_config if raw_config is not None else read_json(self.model_dir / "config.json")
        self._shm_store = shm_store
        self.media_config = media_config or MediaConfig()
        self.max_images_per_prompt = max_images_per_prompt
        self.mm_wire_dtype = check_wire_dtype(mm_wire_dtype)

    # -- lazily built ----------------------------------------------------------------------------

    @cached_property
    def config(self):
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(self.model_dir)

    @cached_property
    def generation_config(self) -> dict:
        return read_json(self.model_dir / "generation_config.json")

    @cached_property
    def tokenizer(self):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(self.model_dir)

    @cached_property
    def input_builder(self) -> InputBuilder:
        return self.make_input_builder()

    @cached_property
    def model_cls_path(self) -> str:
        return model_class_path(self.raw_config)

    @cached_property
    def model_cls(self) -> type:
        try:
            return import_model_class(self.model_cls_path)
        except (ImportError, AttributeError) as error:
            raise NotImplementedError(
                f"{type(self).__name__}: the model class {self.model_cls_path} is not available yet"
            ) from error

    @property
    def shm_store(self) -> ShmStore:
        return self._shm_store if self._shm_store is not None else process_shm_store()

    def release(self, request_id: str) -> None:
        """End ``request_id``'s lease on its segments (a no-op where no store was ever made)."""
        store = self._shm_store if self._shm_store is not None else _process_store
        if store is not None:
            store.release(request_id)

    @cached_property
    def eos_token_ids(self) -> list[int]:
        """Every id that ends generation: generation_config's, config.json's, the tokenizer's."""
        ids: list[int] = []
        for value in (self.generation_config.get("eos_token_id"), self.raw_config.get("eos_token_id"),
                      self.tokenizer.eos_token_id):
            for token in value if isinstance(value, list) else [value]:
                if isinstance(token, int) and token not in ids:
                    ids.append(token)
        return ids

    @property
    def max_model_len(self) -> int | None:
        """The context window the checkpoint declares."""
        return declared_max_model_len(self.raw_config)

    # -- family hooks ----------------------------------------------------------------------------

    def make_input_builder(self) -> InputBuilder:
        raise NotImplementedError

    def builder_kwargs(self) -> dict:
        """What every family's builder gets from the router."""
        return {
            "store": lambda: self.shm_store,
            "media_config": self.media_config,
            "max_length": self.max_model_len,
            "max_images_per_prompt": self.max_images_per_prompt,
        }

    def make_preprocessor(self, cls: type[ImagePreprocessor], config: dict) -> ImagePreprocessor:
        """The family's preprocessor from its config, writing this router's wire dtype."""
        return dataclasses.replace(cls.from_config(config), wire_dtype=self.mm_wire_dtype)

    def preprocessor_config(self) -> dict:
        path = self.model_dir / "preprocessor_config.json"
        config = read_json(path)
        if not config:
            raise ValueError(f"{path} is missing: a multimodal checkpoint needs its preprocessor config")
        return config

    def config_value(self, key: str):
        """A value from config.json, top level first, then text_config (transformers 5 nests)."""
        missing = object()
        value = config_value(self.raw_config, key, missing)
        if value is not missing:
            return value
        raise ValueError(f"{self.model_dir / 'config.json'} has no {key!r}; is this a {type(self).__name__} checkpoint?")

    # -- convenience -----------------------------------------------------------------------------

    def tokenize(self, inputs, **kwargs) -> list[int]:
        return self.input_builder.tokenize(inputs, **kwargs)
