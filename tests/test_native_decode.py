"""The captured decode step (atb_plugin/models/native_decode.py): decode-only steps replayed by one
native call must give exactly what the eager forward gives, for a float32 model and for one whose
linear layers are int8 (W8A16, dynamic W8A8).

Tolerance: none there. The captured step runs the eager path's own native kernels (RMSNorm, the
panel or int8 linear kernels, rotary, decode attention, SiLU-and-mul) in the same order on the same
inputs, and a float32 residual add is the same operation in C as in torch, so tokens and logprobs
are compared for equality, not closeness.

A bfloat16 model's captured step keeps the weights and the KV cache in bfloat16 but computes in
float32 (its eager ops round every output to bfloat16): it is checked against a float32 model
holding the very same weight and cache values, with the bound stated at that test.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from atb_plugin import LLM, SamplingParams
from atb_plugin.engine.config import EngineConfig
from atb_plugin.models import native_decode
from atb_plugin.models.quantization.export import export
from atb_plugin.ops import AttentionMetadata, cpu_native, packed_linear
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
    with LLM(config.pop("model", None) or tiny_checkpoint(family), block_size=4, enforce_eager=enforce_eager,
             **config) as llm:
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


@pytest.mark.parametrize("family, quantization, head", [("qwen2", "w8a8", False), ("qwen2", "w8a16", False),
                                                        ("llama", "w8a8", False), ("qwen2", "w8a8", True)])
def test_captured_int8_decode_equals_eager(family, quantization, head, captured_calls):
    # The quantized layers' eager forward calls the same native int8 kernels the plan calls.
    # head: the LM head in int8 too (outside the plan: compute_logits runs it eagerly).
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
    outcome, captured = _generate(family, False, params, quantization=quantization, quantize_lm_head=head)
    assert outcome == "captured" and captured_calls
    _, eager = _generate(family, True, params, quantization=quantization, quantize_lm_head=head)
    _assert_same(captured, eager)


def test_checkpoint_with_float_and_int8_layers_captures_and_static_w8a8_runs_eager(tmp_path, captured_calls):
    # An msModelSlim W8A8_DYNAMIC export that leaves down_proj float: each layer's plan mixes int8
    # rows and float32 panels, and still equals the eager path. Static W8A8 layers have no native
    # kernel: that model decodes eagerly and says why.
    mixed = export(tiny_checkpoint("qwen2"), tmp_path / "mixed", "w8a8_dynamic", keep_float=["down_proj"]).path.parent
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=2)
    outcome, captured = _generate("qwen2", False, params, model=mixed)
    assert outcome == "captured" and captured_calls
    _, eager = _generate("qwen2", True, params, model=mixed)
    _assert_same(captured, eager)
    static = export(tiny_checkpoint("qwen2"), tmp_path / "static", "w8a8").path.parent
    outcome, _ = _generate("qwen2", False, SamplingParams(temperature=0, max_tokens=2), model=static)
    assert outcome.startswith("a linear layer cannot be captured: W8A8StaticLinear has no native form")


@pytest.fixture(scope="module")
def bf16_exact_checkpoint(tmp_path_factory):
    """The tiny qwen2 checkpoint with every weight rounded to a bfloat16 value (stored as float32):
    a float32 model and a bfloat16 model loaded from it hold the same weights."""
    source = tiny_checkpoint("qwen2")
    target = tmp_path_factory.mktemp("bf16-exact")
    for path in source.iterdir():
        if path.suffix == ".safetensors":
            tensors = load_file(path)
            save_file({k: v.to(torch.bfloat16).to(v.dtype) if v.is_floating_point() else v
                       for k, v in tensors.items()}, target / path.name)
        elif path.is_file():
            (target / path.name).write_bytes(path.read_bytes())
    return target


@pytest.fixture
def native_bf16_panels(monkeypatch):
    """bfloat16 weights in the native panels, the only form the captured step takes. Where the CPU
    runs bfloat16 dot products and oneDNN packs bfloat16 (AVX-512 BF16, AMX), the packing rule
    hands them to oneDNN instead and the step decodes eagerly (test_cpu_native_lowp checks that
    rule), which would leave nothing captured to test here."""
    monkeypatch.setattr(packed_linear, "native_bf16_preferred", lambda: True)


def test_captured_bf16_step_is_float32_math_over_bf16_weights_and_cache(bf16_exact_checkpoint, native_bf16_panels):
    # Two requests, 7 and 3 tokens cached, one new token each, over random bfloat16-valued caches
    # and embeddings. Reference: the float32 model (same weights) run eagerly over float32 caches
    # holding the same values. The captured bfloat16 step differs from it by (a) the new token's K /
    # V rows, rounded to bfloat16 as they are stored (relative 2^-9 each, one token of 7 or 3),
    # (b) the final hidden states rounded to bfloat16 (relative 2^-9), (c) float32 sum order:
    # bound 2^-7 of the largest output. Its eager path rounds every op's output to bfloat16, so it
    # must be further from the reference than the captured step.
    seq_lens, block_size = [7, 3], 4
    metadata = AttentionMetadata(
        query_start_loc=torch.tensor([0, 1, 2], dtype=torch.int32), seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=torch.tensor([[1, 2], [3, 0]], dtype=torch.int32),
        slot_mapping=torch.tensor([2 * block_size + 2, 3 * block_size + 2]), max_query_len=1, max_seq_len=7)
    positions = torch.tensor([6, 2])
    generator = torch.Generator().manual_seed(0)
    outputs = {}
    for dtype in ("float32", "bfloat16"):
        with LLM(bf16_exact_checkpoint, block_size=block_size, dtype=dtype, enforce_eager=dtype == "float32") as llm:
            runner = llm.engine.core.runner
            model = runner.model.get_language_model().model
            generator.manual_seed(0)
            for key_cache, value_cache in runner.kv_caches:
                for cache in (key_cache, value_cache):
                    cache.copy_(torch.randn(cache.shape, generator=generator).to(torch.bfloat16))
            embeds = torch.randn(2, model.config.hidden_size, generator=generator).to(torch.bfloat16)
            saved = [(k.clone(), v.clone()) for k, v in runner.kv_caches]
            if dtype == "float32":
                assert model.captured_decode is None
                outputs["reference"] = model(positions, runner.kv_caches, metadata, embeds.to(torch.float32))
                continue
            assert runner.decode_capture == "captured" and model.captured_decode.applies(runner.kv_caches, metadata)
            outputs["captured"] = model(positions, runner.kv_caches, metadata, embeds)
            written = [(k.clone(), v.clone()) for k, v in runner.kv_caches]
            for (key_cache, value_cache), (k, v) in zip(runner.kv_caches, saved):
                key_cache.copy_(k)
                value_cache.copy_(v)
            model.captured_decode, step = None, model.captured_decode
            outputs["eager"] = model(positions, runner.kv_caches, metadata, embeds)
            model.captured_decode = step
            # The plan writes this step's rows, in bfloat16, and no others; the eager path wrote the
            # same rows (from bfloat16-rounded activations: the same bound as the outputs).
            slots = metadata.slot_mapping
            for (k, v), (k_eager, v_eager), (k_before, v_before) in zip(written, runner.kv_caches, saved):
                for cache, eager_cache, before in ((k, k_eager, k_before), (v, v_eager, v_before)):
                    rows, eager_rows = (c.view(-1, *c.shape[2:]) for c in (cache, eager_cache))
                    untouched = torch.ones(rows.shape[0], dtype=torch.bool)
                    untouched[slots] = False
                    assert torch.equal(rows[untouched], before.view(-1, *before.shape[2:])[untouched])
                    scale = eager_rows[slots].float().abs().max().item()
                    torch.testing.assert_close(rows[slots].float(), eager_rows[slots].float(), rtol=0,
                                               atol=2 ** -5 * scale)
    reference = outputs["reference"].double()
    assert outputs["captured"].dtype == torch.bfloat16
    captured_error = (outputs["captured"].double() - reference).abs().max().item()
    eager_error = (outputs["eager"].double() - reference).abs().max().item()
    print(f"max |captured - float32| {captured_error:.3g}, |eager - float32| {eager_error:.3g}, "
          f"max |float32| {reference.abs().max().item():.3g}")
    assert captured_error <= 2 ** -7 * reference.abs().max().item()
    assert captured_error < eager_error


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
    assert outcome == ("a linear layer cannot be captured: Linear has no native form (pack_weights off, or a "
                       "format the plan lacks)")
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


def test_linear_operands_are_checked_when_made():
    # What the plan's kernels trust about a layer's tensors is checked once, when a layer names them.
    weight = torch.zeros(4, 8, dtype=torch.int8)
    scale = torch.ones(4)
    cpu_native.LinearOperands(cpu_native.LINEAR_W8A8_DYNAMIC, weight, scale=scale)  # well-formed
    with pytest.raises(ValueError, match="with a torch.int8 weight"):
        cpu_native.LinearOperands(cpu_native.LINEAR_F32, weight)
    with pytest.raises(ValueError, match="an offset for W8A16 only"):
        cpu_native.LinearOperands(cpu_native.LINEAR_W8A16, weight, scale=scale)
    with pytest.raises(ValueError, match="for 4 float32 outputs"):
        cpu_native.LinearOperands(cpu_native.LINEAR_W8A8_DYNAMIC, weight, scale=torch.ones(3))
    with pytest.raises(ValueError, match="contiguous=False"):
        cpu_native.LinearOperands(cpu_native.LINEAR_W8A8_DYNAMIC, torch.zeros(8, 4, dtype=torch.int8).t(),
                                  scale=scale)
