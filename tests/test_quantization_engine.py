"""Quantized models in the engine (docs/quantization.md): EngineConfig / CLI / LLM plumbing of
``quantization``, greedy generation through ``LLM``, and tensor parallelism (TP = 2 W8A16 and
the exported checkpoint sharded, against TP = 1)."""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch

from atb_plugin import LLM, SamplingParams
from atb_plugin.engine.config import EngineConfig
from atb_plugin.models.quantization.export import export
from atb_plugin.models.quantization.layers import QuantLinear
from atb_plugin.testing.tiny import tiny_checkpoint
from tests.test_tensor_parallel import CHUNKS, join_group, run_ranks

PROMPTS = ["The quick brown fox jumps over the lazy dog", "Numbers such as 3.14 and 2.71",
           "Once upon a time there was a little robot"]
GREEDY = dict(temperature=0, max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def exported_w8a16():
    with tempfile.TemporaryDirectory(prefix="atb-quant-engine-") as path:
        yield export(tiny_checkpoint("qwen2"), Path(path) / "w8a16", "w8a16").path.parent


def greedy_outputs(model_dir, **engine) -> list:
    with LLM(str(model_dir), block_size=16, **engine) as llm:
        return llm.generate(PROMPTS, SamplingParams(**GREEDY))


def greedy_tokens(model_dir, **engine) -> list[list[int]]:
    return [list(out.outputs[0].token_ids) for out in greedy_outputs(model_dir, **engine)]


# -- configuration -------------------------------------------------------------------------------


def test_engine_config_resolves_and_checks_quantization(exported_w8a16):
    path = str(tiny_checkpoint("qwen2"))
    assert EngineConfig(model=path).quantization is None
    assert EngineConfig(model=path, quantization="w8a8").quantization == "w8a8"
    assert EngineConfig(model=str(exported_w8a16)).quantization == "w8a16"  # detected from the description
    with pytest.raises(ValueError, match="quantization = 'fp4': expected one of w8a16, w8a8"):
        EngineConfig(model=path, quantization="fp4")
    with pytest.raises(ValueError, match="describes an msModelSlim W8A16 checkpoint"):
        EngineConfig(model=str(exported_w8a16), quantization="w8a8")
    with pytest.raises(ValueError, match="generative models only"):
        EngineConfig(model=path, runner="pooling", quantization="w8a16")


def test_cli_quantization_flag(capsys):
    from atb_plugin.server.cli import parse_config

    model = str(tiny_checkpoint("qwen2"))
    assert parse_config(["--model", model, "--quantization", "w8a16"]).engine.quantization == "w8a16"
    assert parse_config(["--model", model]).engine.quantization is None
    with pytest.raises(SystemExit):
        parse_config(["--model", model, "--quantization", "int4"])
    err = capsys.readouterr().err
    assert "--quantization: invalid choice: 'int4'" in err and "w8a16" in err and "w8a8" in err


def test_quantize_lm_head_is_checked_and_reaches_the_model(exported_w8a16):
    from atb_plugin.server.cli import parse_config

    path = str(tiny_checkpoint("qwen2"))
    assert EngineConfig(model=path, quantization="w8a8", quantize_lm_head=True).quantize_lm_head is True
    with pytest.raises(ValueError, match="quantize_lm_head .* needs quantization = 'w8a16' or 'w8a8'"):
        EngineConfig(model=path, quantize_lm_head=True)
    with pytest.raises(ValueError, match="quant_model_description.json already says which layers are int8"):
        EngineConfig(model=str(exported_w8a16), quantize_lm_head=True)
    parsed = parse_config(["--model", path, "--quantization", "w8a8", "--quantize-lm-head"]).engine
    assert (parsed.quantization, parsed.quantize_lm_head) == ("w8a8", True)
    assert parse_config(["--model", path, "--quantization", "w8a8"]).engine.quantize_lm_head is False


@pytest.mark.parametrize("family", ["qwen2", "llama"])  # a tied head (qwen2's tiny checkpoint) and an untied one
@pytest.mark.parametrize("quantization", ["w8a16", "w8a8"])
def test_quantized_lm_head_holds_the_quantized_float_head(family, quantization):
    """The head becomes the scheme's layer over the float head's rows quantized per channel (a
    tied head: a copy of the embedding's rows; the embedding itself stays float and unchanged),
    and the logits are that layer's product of the final hidden states."""
    from routers import get_router
    from atb_plugin import ops
    from atb_plugin.models.quantization.layers import quantize_weight

    model_dir = tiny_checkpoint(family)
    model_cls = get_router(model_dir).model_cls
    float_model = model_cls.from_pretrained(model_dir)
    model = model_cls.from_pretrained(model_dir, quantization=quantization, quantize_lm_head=True)
    assert not isinstance(model_cls.from_pretrained(model_dir, quantization=quantization).get_language_model().lm_head,
                          QuantLinear)
    language_model = model.get_language_model()
    head = language_model.lm_head
    assert isinstance(head, QuantLinear) and head.scheme == {"w8a16": "W8A16", "w8a8": "W8A8_DYNAMIC"}[quantization]
    float_lm = float_model.get_language_model()
    float_head = float_lm.model.embed_tokens.weight if float_lm.lm_head is None else float_lm.lm_head.weight
    q, scale = quantize_weight(float_head)
    assert torch.equal(head.weight, q) and torch.equal(head.weight_scale, scale)
    assert torch.equal(language_model.model.embed_tokens.weight, float_lm.model.embed_tokens.weight)
    assert language_model.model.embed_tokens.weight.dtype == torch.float32
    hidden = torch.randn(3, model.get_language_model().config.hidden_size, generator=torch.Generator().manual_seed(0))
    forward = (ops.w8a16_linear(hidden, q, scale.view(-1), torch.zeros(q.shape[0]), None) if quantization == "w8a16"
               else ops.w8a8_dynamic_linear(hidden, q, scale.view(-1), None))
    vocab = language_model.config.vocab_size
    torch.testing.assert_close(language_model.compute_logits(hidden), forward[:, :vocab], rtol=0, atol=0)
    with pytest.raises(ValueError, match="quantize_lm_head quantizes a float checkpoint's LM head on the fly"):
        model_cls.from_pretrained(model_dir, quantize_lm_head=True)


def test_llm_with_a_quantized_lm_head_generates():
    tokens = greedy_tokens(tiny_checkpoint("qwen2"), quantization="w8a8", quantize_lm_head=True)
    assert len(tokens) == len(PROMPTS) and all(len(t) == GREEDY["max_tokens"] for t in tokens)


# -- generation ----------------------------------------------------------------------------------


def test_llm_generates_with_quantized_layers(exported_w8a16):
    """On-the-fly W8A16 through LLM equals the exported checkpoint through LLM (the same int8
    weights), and both the single-request greedy decode through the model."""
    from routers import get_router
    from atb_plugin.testing.sequence import SequenceRunner

    outputs = greedy_outputs(tiny_checkpoint("qwen2"), quantization="w8a16")
    on_the_fly = [list(out.outputs[0].token_ids) for out in outputs]
    assert greedy_tokens(exported_w8a16) == on_the_fly
    model = get_router(exported_w8a16).model_cls.from_pretrained(exported_w8a16)
    assert any(isinstance(m, QuantLinear) for m in model.modules())
    prompt_ids = list(outputs[0].prompt_token_ids)
    runner = SequenceRunner(model, len(prompt_ids) + 20, block_size=16)
    token = int(runner.step(torch.tensor(prompt_ids))[-1].argmax())
    decoded = [token]
    for _ in range(GREEDY["max_tokens"] - 1):
        token = int(runner.step(torch.tensor([token]))[-1].argmax())
        decoded.append(token)
    assert on_the_fly[0] == decoded


@pytest.mark.parametrize("quantization", ["w8a16", "w8a8"])
def test_llm_quantized_on_the_fly_runs(quantization):
    tokens = greedy_tokens(tiny_checkpoint("llama"), quantization=quantization)
    assert len(tokens) == len(PROMPTS) and all(len(t) == GREEDY["max_tokens"] for t in tokens)


# -- tensor parallelism --------------------------------------------------------------------------


def shard_state(rank: int, size: int, init_method: str, model_dir: str, quantization) -> dict:
    """This rank's quantized tensors and its text logits (the TP tests' prompt and chunks)."""
    from routers import get_router
    from atb_plugin.testing.sequence import SequenceRunner

    join_group(rank, size, init_method)
    model = get_router(model_dir).model_cls.from_pretrained(model_dir, quantization=quantization)
    ids = torch.randint(0, 500, (CHUNKS[-1][1],), generator=torch.Generator().manual_seed(0))
    runner = SequenceRunner(model, 32, block_size=4)
    logits = torch.cat([runner.step(ids[a:b]) for a, b in CHUNKS]).float()
    quantized = {name: value for name, value in model.state_dict().items()
                 if name.rpartition(".")[2] in ("weight", "weight_scale", "weight_offset")
                 and any(name.startswith(p) and isinstance(m, QuantLinear) for p, m in model.named_modules() if p)}
    # numpy, not tensors: a tensor crosses the result queue as a handle to this process's memory
    return {"logits": logits.numpy(), "quantized": {name: value.numpy() for name, value in quantized.items()}}


def test_tp2_w8a16_on_the_fly_equals_exported_and_tp1(exported_w8a16):
    path = str(tiny_checkpoint("qwen2"))
    on_the_fly = run_ranks(shard_state, 2, path, "w8a16")
    from_export = run_ranks(shard_state, 2, str(exported_w8a16), None)
    for a, b in zip(on_the_fly, from_export, strict=True):
        assert a["quantized"].keys() == b["quantized"].keys() and a["quantized"]
        assert all(np.array_equal(a["quantized"][k], b["quantized"][k]) for k in a["quantized"])
    # Each rank's row-parallel scales are the unsplit layer's (docs/quantization.md):
    for rank in on_the_fly:
        assert np.array_equal(rank["quantized"]["model.layers.0.mlp.down_proj.weight_scale"],
                              on_the_fly[0]["quantized"]["model.layers.0.mlp.down_proj.weight_scale"])
    from routers import get_router
    from atb_plugin.testing.sequence import SequenceRunner

    model = get_router(path).model_cls.from_pretrained(path, quantization="w8a16")
    ids = torch.randint(0, 500, (CHUNKS[-1][1],), generator=torch.Generator().manual_seed(0))
    runner = SequenceRunner(model, 32, block_size=4)
    reference = torch.cat([runner.step(ids[a:b]) for a, b in CHUNKS]).float().numpy()
    for rank in on_the_fly:  # float32 summation order differs (two partial sums): 1e-5 of the logits
        assert np.abs(rank["logits"] - reference).max() < 1e-5 * np.abs(reference).max()
        assert np.array_equal(rank["logits"].argmax(-1), reference.argmax(-1))


def test_tp2_w8a16_engine_greedy_tokens_equal_tp1():
    path = tiny_checkpoint("qwen2")
    assert greedy_tokens(path, quantization="w8a16", tensor_parallel_size=2) == greedy_tokens(
        path, quantization="w8a16")
