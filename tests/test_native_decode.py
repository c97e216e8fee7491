"""The captured decode step (atb_plugin/models/native_decode.py): decode-only steps replayed by one
native call must give exactly what the eager forward gives.

Tolerance: none. The captured step runs the eager path's own native kernels (RMSNorm, the panel
linear kernel, rotary, decode attention, SiLU-and-mul) in the same order on the same inputs, and
a float32 residual add is the same operation in C as in torch, so tokens and logprobs are compared
for equality, not closeness.
"""

from __future__ import annotations

import pytest
import torch

from atb_plugin import LLM, SamplingParams
from atb_plugin.engine.config import EngineConfig
from atb_plugin.models import native_decode
from atb_plugin.ops import AttentionMetadata, cpu_native
from atb_plugin.platform import use_platform
from atb_plugin.server.cli import parse_config
from atb_plugin.testing import fake_torch_npu
from atb_plugin.testing.tiny import tiny_checkpoint

PROMPTS = ["hello world", "the quick brown fox jumps over the lazy dog", "a", "one two three four five six"]


@pytest.fixture(autouse=True)
def native_kernels():
    if cpu_native.library_for(torch.float32, torch.device("cpu")) is None:
        pytest.fail("the native CPU kernels should build on this machine (gcc is installed)")


@pytest.fixture
def captured_calls(monkeypatch):
    """How many steps ran captured (so that an equality cannot pass with the capture never used)."""
    calls = []
    original = native_decode.NativeDecodeStep.__call__

    def counting(self, *args, **kwargs):
        calls.append(args[0].shape[0])
        return original(self, *args, **kwargs)

    monkeypatch.setattr(native_decode.NativeDecodeStep, "__call__", counting)
    return calls


def _generate(family: str, enforce_eager: bool, params: SamplingParams, prompts=PROMPTS, **config):
    with LLM(tiny_checkpoint(family), block_size=4, enforce_eager=enforce_eager, **config) as llm:
        outcome = llm.engine.core.runner.decode_capture
        return outcome, [o.outputs[0] for o in llm.generate(prompts, params)]


def _assert_same(captured, eager):
    for a, b in zip(captured, eager, strict=True):
        assert a.token_ids == b.token_ids
        assert [e.logprob for e in a.logprobs] == [e.logprob for e in b.logprobs]
        assert [e.top_logprobs for e in a.logprobs] == [e.top_logprobs for e in b.logprobs]


@pytest.mark.parametrize("family", ["qwen2", "llama", "qwen2_vl", "llava"])
def test_captured_decode_equals_eager_greedy_tokens_and_logprobs(family, captured_calls):
    # 12 new tokens on block_size 4: the decode steps cross block boundaries (new blocks mid-run).
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
    outcome, captured = _generate(family, False, params)
    assert outcome == "captured"
    assert captured_calls and max(captured_calls) == len(PROMPTS)  # the batched decode steps ran captured
    calls = len(captured_calls)
    eager_outcome, eager = _generate(family, True, params)
    assert eager_outcome == "off (enforce_eager)"
    assert len(captured_calls) == calls  # --enforce-eager: never
    _assert_same(captured, eager)


def test_mixed_steps_run_eager_and_seeded_sampling_is_unchanged(captured_calls, monkeypatch):
    # Two sequences at a time, stopping after 4..10 tokens: a new prompt's prefill joins the other
    # sequence's decode in one step (eager) between decode-only steps of one and two rows
    # (captured), each side reading the cache the other wrote.
    mixed = []
    original = AttentionMetadata.is_decode_only.fget
    monkeypatch.setattr(AttentionMetadata, "is_decode_only", property(
        lambda self: mixed.append(self.max_query_len > 1 and bool((self.query_lens_cpu == 1).any()))
        or original(self)))
    prompts = PROMPTS + ["x y z", "in the beginning", "last"]
    params = [SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=4 + i, ignore_eos=True, logprobs=1)
              for i in range(len(prompts))]
    _, captured = _generate("qwen2", False, params, prompts, max_num_seqs=2)
    assert set(captured_calls) == {1, 2} and any(mixed)
    _, eager = _generate("qwen2", True, params, prompts, max_num_seqs=2)
    _assert_same(captured, eager)


def test_switching_to_the_torch_ops_after_load_runs_eager(captured_calls, monkeypatch):
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    with LLM(tiny_checkpoint("qwen2"), block_size=4) as llm:
        assert llm.engine.core.runner.decode_capture == "captured"
        monkeypatch.setenv(cpu_native.KERNELS_ENV, "torch")
        tokens = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
    assert captured_calls == []
    monkeypatch.setenv(cpu_native.KERNELS_ENV, "native")
    _, eager = _generate("qwen2", True, params)
    assert tokens == [o.token_ids for o in eager]  # greedy: the torch ops agree to float32 rounding here


def test_no_capture_without_the_native_kernels_or_their_panels(monkeypatch):
    params = SamplingParams(temperature=0, max_tokens=2)
    outcome, _ = _generate("qwen2", False, params, pack_weights=False)
    assert outcome == "the linear layers are not in native panels (pack_weights off)"
    monkeypatch.setenv(cpu_native.KERNELS_ENV, "torch")
    outcome, _ = _generate("qwen2", False, params)
    assert outcome.startswith("the native CPU kernels are not in use")
    with LLM(tiny_checkpoint("bert"), runner="pooling") as llm:
        assert llm.engine.core.runner.decode_capture == "off (pooling)"


def test_other_platforms_decode_eager(monkeypatch):
    monkeypatch.delenv(cpu_native.KERNELS_ENV, raising=False)
    with fake_torch_npu.install(), use_platform("npu"):
        with LLM(tiny_checkpoint("qwen2")) as llm:
            assert llm.engine.core.runner.decode_capture == "eager (no captured decode step on npu yet)"
            assert llm.engine.core.runner.model.get_language_model().model.captured_decode is None


def test_the_step_refuses_indices_outside_the_cache():
    with LLM(tiny_checkpoint("qwen2"), block_size=4) as llm:
        runner = llm.engine.core.runner
        step = runner.model.get_language_model().model.captured_decode
        hidden = runner.model.config.hidden_size
        embeds, cos = torch.zeros(1, hidden), torch.zeros(1, step.head_dim)
        metadata = AttentionMetadata.for_prefill([1], block_size=4)
        step(embeds, cos, cos, metadata)  # in range: runs
        metadata.block_tables[0, 0] = step.num_blocks  # one past the last block: C would read past it
        with pytest.raises(IndexError, match="past the cache"):
            step(embeds, cos, cos, metadata)
        metadata = AttentionMetadata.for_prefill([1], block_size=4)
        metadata.seq_lens[0] = 5  # longer than its one-block table
        with pytest.raises(IndexError, match="longer than its block table"):
            step(embeds, cos, cos, metadata)
        with pytest.raises(ValueError, match="embeddings"):
            step(torch.zeros(2, hidden), cos, cos, AttentionMetadata.for_prefill([1], block_size=4))


def test_enforce_eager_is_a_validated_flag():
    with pytest.raises(ValueError, match="enforce_eager must be a bool"):
        EngineConfig(model=str(tiny_checkpoint("qwen2")), enforce_eager="yes")
    model = str(tiny_checkpoint("qwen2"))
    assert parse_config(["--model", model, "--enforce-eager"]).engine.enforce_eager is True
    assert parse_config(["--model", model]).engine.enforce_eager is False
