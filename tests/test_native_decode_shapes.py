"""The captured decode step at the real default model's shapes (SmolLM2-135M-Instruct: hidden 576,
9 query heads of 64 over 3 KV heads, intermediate 1536, rope_theta 100000, rms_norm_eps 1e-5, tied
embeddings), which the tiny checkpoints (head_dim 16 or 32, hidden 64) do not have: a head_dim the
attention kernel unrolls (64), widths that are not a multiple of the panel (576 = 9 x 64 inputs,
960 = 15 x 64 outputs of the fused QKV are; 9 heads are not a power of two), 8 requests (the
bfloat16 dot kernel's DOT_SPLIT_ROWS, which a float32 model must never reach) and several KV blocks
per request. Two layers and the tiny tokenizer keep it fast.

A float32 model's captured step is bit-identical to its eager forward (tests/test_native_decode.py
says why), so tokens and logprobs are compared for equality. What the reported "0.13 logprob
difference on SmolLM2 fp32" was: a bfloat16 model (``dtype="auto"`` measured bfloat16 faster on
that start), whose captured step computes in float32 by design (docs/architecture.md, "The captured
decode step"); the float32 model's step was exact there too (benchmarks/RESULTS.md, "Captured vs
eager on SmolLM2").
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from atb_plugin import LLM, SamplingParams
from atb_plugin.models import native_decode
from atb_plugin.ops import cpu_native
from atb_plugin.testing import tiny
from atb_plugin.testing.tiny import tiny_checkpoint

SMOLLM2_DECODER = {"hidden_size": 576, "intermediate_size": 1536, "num_attention_heads": 9, "num_key_value_heads": 3,
                   "head_dim": 64, "rope_theta": 100000.0, "rms_norm_eps": 1e-5, "tie_word_embeddings": True,
                   "rope_scaling": None, "num_hidden_layers": 2}
PROMPTS = ["hello world", "the quick brown fox jumps over the lazy dog", "a", "one two three four five six",
           "seven", "eight nine ten", "over the lazy dog, again and again", "fox"]


@pytest.fixture(scope="module")
def smollm2_shaped(tmp_path_factory):
    """The tiny Llama's tokenizer and files under SmolLM2's decoder shape, seeded random weights."""
    out = tmp_path_factory.mktemp("smollm2-shaped")
    source = tiny_checkpoint("llama")
    for entry in source.iterdir():
        if entry.is_file() and entry.name not in ("config.json", "model.safetensors"):
            shutil.copy(entry, out / entry.name)
    config = {**json.loads((source / "config.json").read_text()), **SMOLLM2_DECODER}
    tiny._save_transformers_model(out, config, seed=0)
    return out


def _run(model, enforce_eager: bool):
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=2)
    # block_size 16 and 40 new tokens: every request spans 3 or more blocks; float32 pinned to the panels
    # (the form the plan reads) so no calibration is timed here.
    with LLM(str(model), dtype="float32", block_size=16, enforce_eager=enforce_eager) as llm:
        step = llm.engine.core.runner.model.model.captured_decode
        if step is not None:  # a float32 model's plan holds float32 panels, never the bfloat16 dot products
            for layer in step._layers:
                for linear in (layer.qkv, layer.o, layer.gate_up, layer.down):
                    assert (linear.format, linear.dot_rows) == (cpu_native.LINEAR_F32, 0)
        return llm.engine.core.runner.decode_capture, [o.outputs[0] for o in llm.generate(PROMPTS, params)]


def test_captured_decode_equals_eager_at_smollm2_shapes(smollm2_shaped, monkeypatch):
    if cpu_native.library_for(torch.float32, torch.device("cpu")) is None:
        pytest.fail("the native CPU kernels should build on this machine (gcc is installed)")
    monkeypatch.setenv(cpu_native.KERNELS_ENV, "auto,float32=panels")
    calls: list[int] = []
    original = native_decode.NativeDecodeStep.__call__

    def counting(self, *args, **kwargs):
        calls.append(args[0].shape[0])
        return original(self, *args, **kwargs)

    monkeypatch.setattr(native_decode.NativeDecodeStep, "__call__", counting)
    outcome, captured = _run(smollm2_shaped, False)
    assert outcome == "captured" and calls and max(calls) == len(PROMPTS)
    ran = len(calls)
    eager_outcome, eager = _run(smollm2_shaped, True)
    assert eager_outcome == "off (enforce_eager)" and len(calls) == ran
    for a, b in zip(captured, eager, strict=True):
        assert a.token_ids == b.token_ids
        assert [e.logprob for e in a.logprobs] == [e.logprob for e in b.logprobs]
        assert [e.top_logprobs for e in a.logprobs] == [e.top_logprobs for e in b.logprobs]
