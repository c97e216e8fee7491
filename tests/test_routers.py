"""get_router: the registry, lazy attributes, errors."""

from __future__ import annotations

import json

import pytest

import shm
from atb_plugin.testing.tiny import tiny_checkpoint
from routers import (
    ROUTERS,
    BertRouter,
    LlavaRouter,
    Qwen2VlRouter,
    QwenVlRouter,
    TextRouter,
    get_router,
)

EXPECTED = {
    "qwen2": TextRouter,
    "llama": TextRouter,
    "qwen_vl": QwenVlRouter,
    "qwen2_vl": Qwen2VlRouter,
    "qwen2_5_vl": Qwen2VlRouter,
    "llava": LlavaRouter,
    "bert": BertRouter,
}


@pytest.mark.parametrize("family", sorted(EXPECTED))
def test_each_family_gets_its_router(family):
    router = get_router(tiny_checkpoint(family))
    assert type(router) is EXPECTED[family]
    # Picking a router reads config.json only: nothing heavy is built yet.
    assert not {"tokenizer", "input_builder", "config"} & set(vars(router))
    assert router.tokenizer is router.tokenizer  # built once
    assert router.max_model_len and router.max_model_len > 0


def test_qwen_vl_is_told_apart_from_text_qwen(tmp_path):
    config = json.loads((tiny_checkpoint("qwen_vl") / "config.json").read_text())
    assert config["model_type"] == "qwen" and "visual" in config
    del config["visual"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="unsupported model_type 'qwen'"):
        get_router(tmp_path)


def test_unknown_model_type_lists_the_supported_ones(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "mamba"}))
    with pytest.raises(ValueError) as error:
        get_router(tmp_path)
    message = str(error.value)
    assert "'mamba'" in message
    for model_type in ROUTERS:
        assert model_type in message


def test_missing_config_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json does not exist"):
        get_router(tmp_path)


def test_broken_config_is_a_clear_error(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        get_router(tmp_path)


def test_qwen_vl_config_and_generation_config():
    router = get_router(tiny_checkpoint("qwen_vl"))
    assert router.config.visual["image_size"] == 448
    assert router.generation_config["chat_format"] == "chatml"


def test_model_classes_are_resolved_lazily():
    router = get_router(tiny_checkpoint("qwen2"))
    assert "model_cls" not in vars(router)
    from atb_plugin.models.qwen2 import Qwen2ForCausalLM

    assert router.model_cls is Qwen2ForCausalLM
    # A family whose model has not arrived yet says so instead of crashing with an ImportError.
    router = get_router(tiny_checkpoint("qwen_vl"))
    router.model_cls_path = "atb_plugin.models.not_there:Nothing"
    with pytest.raises(NotImplementedError, match="not available yet"):
        router.model_cls


def test_router_uses_the_store_it_is_given_and_tokenizes():
    with shm.ShmStore() as store:
        router = get_router(tiny_checkpoint("qwen2"), shm_store=store)
        assert router.shm_store is store
        ids = router.tokenize("hello world")
        assert ids == router.tokenizer("hello world")["input_ids"]
