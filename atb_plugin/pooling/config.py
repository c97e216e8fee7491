"""Runner type, convert type and pooler choice for a checkpoint (vLLM's three layers)::

    runner   (engine start-up)   generate: sampler, tokens out | pooling: pooler, vectors out
    convert  (model loading)     none | embed | classify | reward: how a class is adapted
    task     (each request)      embed, token_embed | classify, score, token_classify

``resolve_runner`` picks runner and convert from the checkpoint's architecture name with the
ordered suffix table below (first match wins), unless the user names them; ``pooler_config``
reads the checkpoint's own pooling files (sentence-transformers' ``modules.json`` and
``1_Pooling/config.json``) or falls back to the model's default. No torch here: the server's API
process uses the same rules to answer "this model does not serve that task" up front.
"""

from __future__ import annotations

import fnmatch
import json
from dataclasses import dataclass
from pathlib import Path

RUNNER_TYPES = ("generate", "pooling")
CONVERT_TYPES = ("none", "embed", "classify", "reward")
POOLING_TYPES = ("CLS", "LAST", "MEAN", "ALL", "STEP")

# Which converts each runner takes ("none" for pooling = a native pooling model, used as it is).
RUNNER_CONVERTS = {"generate": ("none",), "pooling": ("none", "embed", "classify", "reward")}
# What each convert type serves.
CONVERT_TASKS = {
    "embed": ("embed", "token_embed"),
    "classify": ("classify", "score", "token_classify"),
    "reward": ("token_classify",),
}

# Architecture name -> (runner, convert) defaults; ordered, the first matching pattern wins, so
# the catch-all "*Model" is last. vLLM's table, except that reward models map to the "reward"
# convert (vLLM says "embed" and relies on the native class ignoring it): here the convert type
# is also what tells the server which tasks the model serves.
SUFFIX_DEFAULTS: tuple[tuple[str, tuple[str, str]], ...] = (
    ("*ForCausalLM", ("generate", "none")),
    ("*ForConditionalGeneration", ("generate", "none")),
    ("*ChatModel", ("generate", "none")),
    ("*LMHeadModel", ("generate", "none")),
    ("*ForTextEncoding", ("pooling", "embed")),
    ("*EmbeddingModel", ("pooling", "embed")),
    ("*ForSequenceClassification", ("pooling", "classify")),
    ("*For*Classification", ("pooling", "classify")),
    ("*ForRewardModeling", ("pooling", "reward")),
    ("*RewardModel", ("pooling", "reward")),
    ("*Model", ("pooling", "embed")),
)

# Architectures that can be converted to pooling by an adapter (vLLM's _GENERATE_SUFFIXES).
GENERATIVE_PATTERNS = ("*ForCausalLM", "*ForConditionalGeneration", "*ChatModel", "*LMHeadModel")


@dataclass(frozen=True)
class RunnerChoice:
    runner: str
    convert: str  # "none" for generation and for native pooling models used as they are

    @property
    def tasks(self) -> tuple[str, ...]:
        return ("generate",) if self.runner == "generate" else CONVERT_TASKS[self.convert]


def suffix_defaults(architecture: str) -> tuple[str, str]:
    for pattern, defaults in SUFFIX_DEFAULTS:
        if fnmatch.fnmatchcase(architecture, pattern):
            return defaults
    return ("generate", "none")  # no known suffix: what every family here was built for


def is_generative(architecture: str) -> bool:
    return any(fnmatch.fnmatchcase(architecture, p) for p in GENERATIVE_PATTERNS)


def _combinations() -> str:
    return "; ".join(f"runner={r}: convert in {{{', '.join(c)}}}" for r, c in RUNNER_CONVERTS.items())


def resolve_runner(architecture: str, runner: str = "auto", convert: str = "auto") -> RunnerChoice:
    """(runner, convert) for a checkpoint whose ``architectures[0]`` is ``architecture``.

    "auto" takes the suffix table's answer; an explicit runner or convert overrides it (a
    generative checkpoint with ``runner="pooling"`` and convert "auto" becomes an embedding
    model, as in vLLM). A combination that cannot work is a ValueError listing the valid ones."""
    if runner not in ("auto", *RUNNER_TYPES):
        raise ValueError(f"runner {runner!r} is not one of auto, {', '.join(RUNNER_TYPES)}")
    if convert not in ("auto", *CONVERT_TYPES):
        raise ValueError(f"convert {convert!r} is not one of auto, {', '.join(CONVERT_TYPES)}")
    default_runner, default_convert = suffix_defaults(architecture)
    if runner == "auto":
        runner = "pooling" if convert not in ("auto", "none") else default_runner
    if convert == "auto":
        if runner == "generate":
            convert = "none"
        elif default_runner == "pooling":
            convert = default_convert
        else:
            convert = "embed"
    if convert not in RUNNER_CONVERTS[runner]:
        raise ValueError(f"runner={runner} with convert={convert} is not a valid combination ({_combinations()})")
    if runner == "generate" and default_runner == "pooling":
        raise ValueError(f"{architecture} is a pooling model (it outputs vectors, not tokens): it cannot run with "
                         f"runner=generate; use runner=pooling (valid: {_combinations()})")
    if runner == "pooling" and convert == "none" and is_generative(architecture):
        raise ValueError(f"{architecture} is a generative model: to serve it as a pooling model pick a convert "
                         f"type (embed, classify, reward); valid: {_combinations()}")
    if runner == "pooling" and default_runner == "pooling" and convert != default_convert \
            and not is_generative(architecture):
        # A native pooling model has one head; it cannot be re-headed by an adapter.
        raise ValueError(f"{architecture} is a native {default_convert} model; convert={convert} does not apply "
                         f"(use convert=auto or {default_convert})")
    return RunnerChoice(runner, convert)


@dataclass(frozen=True)
class PoolerConfig:
    """How hidden states become one output: ``pooling_type`` (CLS, LAST, MEAN, ALL, STEP),
    whether embeddings are normalised by default, and for STEP pooling the step tag token and
    the label token ids kept (process reward models)."""

    pooling_type: str
    normalize: bool = True
    step_tag_id: int | None = None
    returned_token_ids: tuple[int, ...] | None = None

    def __post_init__(self):
        if self.pooling_type not in POOLING_TYPES:
            raise ValueError(f"pooling_type {self.pooling_type!r} is not one of {', '.join(POOLING_TYPES)}")


# sentence-transformers' 1_Pooling/config.json keys, in the order it applies them.
_ST_MODES = (("pooling_mode_cls_token", "CLS"), ("pooling_mode_mean_tokens", "MEAN"),
             ("pooling_mode_lasttoken", "LAST"))


def pooler_config(model_dir, default_pooling_type: str, overrides: dict | None = None) -> PoolerConfig:
    """The pooler a checkpoint asks for. Its own sentence-transformers files win (``modules.json``
    names a Pooling module whose ``config.json`` sets the mode, and a ``Normalize`` module or
    not); otherwise the model's ``default_pooling_type``, normalised. ``overrides``
    (``hf_overrides["pooler_config"]``) replace any field last."""
    fields: dict = {"pooling_type": default_pooling_type, "normalize": True}
    modules_path = Path(model_dir) / "modules.json"
    if modules_path.is_file():
        modules = json.loads(modules_path.read_text())
        types = [m.get("type", "") for m in modules]
        fields["normalize"] = any(t.endswith(".Normalize") for t in types)
        for module in modules:
            if module.get("type", "").endswith(".Pooling"):
                config_path = Path(model_dir) / module.get("path", "1_Pooling") / "config.json"
                st = json.loads(config_path.read_text()) if config_path.is_file() else {}
                chosen = [ours for key, ours in _ST_MODES if st.get(key)]
                unsupported = [k for k in ("pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens",
                                           "pooling_mode_weightedmean_tokens") if st.get(k)]
                if unsupported or len(chosen) > 1:
                    raise ValueError(f"{config_path}: pooling {unsupported or chosen} is not supported "
                                     f"(one of {', '.join(m for _, m in _ST_MODES)})")
                if chosen:
                    fields["pooling_type"] = chosen[0]
    fields.update(overrides or {})
    if fields.get("returned_token_ids") is not None:
        fields["returned_token_ids"] = tuple(fields["returned_token_ids"])
    unknown = set(fields) - set(PoolerConfig.__dataclass_fields__)
    if unknown:
        raise ValueError(f"unknown pooler_config field(s) {sorted(unknown)}; known: "
                         f"{sorted(PoolerConfig.__dataclass_fields__)}")
    return PoolerConfig(**fields)


def sentence_transformers_max_len(model_dir) -> int | None:
    """``max_seq_length`` of a sentence-transformers checkpoint (``sentence_bert_config.json``):
    the length it was trained and is used at (all-MiniLM-L6-v2: 256 of BERT's 512 positions), so
    it caps ``max_model_len`` as in sentence-transformers and vLLM. None when absent."""
    path = Path(model_dir) / "sentence_bert_config.json"
    if not path.is_file():
        return None
    value = json.loads(path.read_text()).get("max_seq_length")
    return value if isinstance(value, int) and value > 0 else None
