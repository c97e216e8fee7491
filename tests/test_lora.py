"""Multi-LoRA offline (atb_plugin/lora, docs/lora.md): greedy tokens through an adapter equal the
checkpoint with that adapter merged into its weights (``W + s * B @ A``, computed by
``atb_plugin.testing.lora_adapters`` in float64, not by the code under test), in batches that mix
adapters and the base model; the device slots and the host LRU; prefix caching per adapter; the
captured decode step; every bad adapter refused with a message naming it."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from atb_plugin import LLM, LoRARequest, SamplingParams
from atb_plugin.engine.sampling_params import StructuredOutputsParams
from atb_plugin.lora import LoRAError
from atb_plugin.lora.peft import inspect_adapter
from atb_plugin.platform import use_platform
from atb_plugin.testing import fake_torch_npu
from atb_plugin.testing.lora_adapters import make_adapter, merge_adapter
from atb_plugin.testing.tiny import tiny_checkpoint
from tests.test_native_decode import captured_calls  # noqa: F401 (a fixture: steps that ran captured)

PROMPTS = ["hello world", "the quick brown fox jumps over the lazy dog", "a b c d e f g h i j", "one two three"]
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


def _adapters(base, root):
    """Three adapters on ``base``: different ranks and alphas, one with rank / alpha patterns,
    one rsLoRA on attention only."""
    return {
        "a": make_adapter(root / "a", base, r=8, lora_alpha=16, seed=1),
        "b": make_adapter(root / "b", base, r=4, lora_alpha=8, seed=2, rank_pattern={"q_proj": 2, "down_proj": 6},
                          alpha_pattern={"o_proj": 3.0}),
        "c": make_adapter(root / "c", base, r=16, lora_alpha=4, seed=3, use_rslora=True,
                          target_modules=("q_proj", "v_proj", "o_proj")),
    }


def _tokens(outputs):
    return [list(o.outputs[0].token_ids) for o in outputs]


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def setup(request, tmp_path_factory):
    """(base checkpoint, adapters, each adapter's merged-reference tokens, the base's tokens)."""
    base = tiny_checkpoint(request.param)
    root = tmp_path_factory.mktemp(f"lora-{request.param}")
    adapters = _adapters(base, root)
    return base, adapters, merged_references(base, adapters, root, lambda llm: _tokens(llm.generate(PROMPTS, GREEDY)))


def merged_references(base, adapters, root, outputs):
    """``outputs(llm)`` of each adapter's merged checkpoint (written under ``root``), and of the
    base model under None."""
    references = {}
    for name, adapter in adapters.items():
        with LLM(merge_adapter(root / f"merged-{name}", base, adapter), block_size=4) as llm:
            references[name] = outputs(llm)
    with LLM(base, block_size=4) as llm:
        references[None] = outputs(llm)
    return references


def _request(adapters, name, int_ids={"a": 1, "b": 2, "c": 3}):
    return None if name is None else LoRARequest(name, int_ids[name], str(adapters[name]))


def test_each_row_gets_its_own_adapter_in_a_mixed_batch(setup, captured_calls):  # noqa: F811 (the fixture)
    base, adapters, references = setup
    for name in "abc":
        assert references[name] != references[None], "an adapter that changes nothing proves nothing"
    with LLM(base, block_size=4, enable_lora=True, max_loras=3, max_lora_rank=16) as llm:
        # One adapter for all prompts, then a batch of a, b, c and the base model together.
        assert _tokens(llm.generate(PROMPTS, GREEDY, lora_request=_request(adapters, "a"))) == references["a"]
        mix = ["a", "b", None, "c"]
        got = _tokens(llm.generate(PROMPTS, GREEDY, lora_request=[_request(adapters, n) for n in mix]))
        assert got == [references[n][i] for i, n in enumerate(mix)]
        # The base model alone: its decode steps run captured again (steps with adapted rows run eager).
        before = len(captured_calls)
        assert _tokens(llm.generate(PROMPTS, GREEDY)) == references[None]
        if llm.engine.runner.decode_capture == "captured":
            assert len(captured_calls) - before == GREEDY.max_tokens - 1


def test_more_adapters_than_slots_lru_and_host_cache(setup):
    base, adapters, references = setup
    with LLM(base, block_size=4, enable_lora=True, max_loras=2, max_cpu_loras=2, max_lora_rank=16) as llm:
        manager = llm.engine.runner.lora
        names = ["a", "b", "c", "a"]
        got = _tokens(llm.generate(PROMPTS, GREEDY, lora_request=[_request(adapters, n) for n in names]))
        assert got == [references[n][i] for i, n in enumerate(names)]
        assert manager.loads == 3 and len(manager.host) == 2  # three read, the oldest evicted from the host
        assert sum(slot is not None for slot in manager.slots) == 2
        # "a" was evicted from the host cache by "c" (or kept: whichever ran last); run what is
        # not cached and check it is read again and still right.
        missing = [n for n in "abc" if _request(adapters, n).key not in manager.host]
        assert _tokens(llm.generate(PROMPTS[:1], GREEDY, lora_request=_request(adapters, missing[0]))) == \
            [references[missing[0]][0]]
        assert manager.loads == 4


def test_prefix_cache_never_shares_blocks_between_adapters(setup):
    base, adapters, references = setup
    prompt = [PROMPTS[1]]
    with LLM(base, block_size=4, enable_lora=True, max_loras=2, max_lora_rank=16) as llm:
        first = llm.generate(prompt, GREEDY, lora_request=_request(adapters, "a"))
        again = llm.generate(prompt, GREEDY, lora_request=_request(adapters, "a"))
        other = llm.generate(prompt, GREEDY, lora_request=_request(adapters, "b"))
        plain = llm.generate(prompt, GREEDY)
    assert again[0].num_cached_tokens > 0  # the same adapter hits its own blocks
    assert other[0].num_cached_tokens == 0 and plain[0].num_cached_tokens == 0
    assert _tokens(first) == _tokens(again) == [references["a"][1]]
    assert _tokens(other) == [references["b"][1]] and _tokens(plain) == [references[None][1]]


def test_n_and_seeded_sampling_through_an_adapter(setup):
    """n > 1 children all run through the adapter: seeded samples equal the merged model's."""
    base, adapters, _ = setup
    params = SamplingParams(temperature=0.8, max_tokens=6, n=3, seed=7)
    with LLM(base, block_size=4, enable_lora=True, max_lora_rank=16) as llm:
        got = [c.token_ids for c in llm.generate(PROMPTS[0], params, lora_request=_request(adapters, "a"))[0].outputs]
    merged = adapters["a"].parent / "merged-a"
    with LLM(merged, block_size=4) as llm:
        want = [c.token_ids for c in llm.generate(PROMPTS[0], params)[0].outputs]
    assert got == want


def test_structured_output_through_an_adapter(setup):
    base, adapters, _ = setup
    params = SamplingParams(temperature=0, max_tokens=12, structured_outputs=StructuredOutputsParams(regex="[a-z ]+"))
    with LLM(base, block_size=4, enable_lora=True, max_lora_rank=16) as llm:
        got = _tokens(llm.generate(PROMPTS[:2], params, lora_request=_request(adapters, "b")))
    with LLM(adapters["b"].parent / "merged-b", block_size=4) as llm:
        assert got == _tokens(llm.generate(PROMPTS[:2], params))


def test_adapter_slots_are_weights_before_the_kv_cache_is_sized():
    """The slots are allocated with the model, before the KV budget is computed: they count as
    weights there (engine/memory_profile.py), and on a device the profile's peak holds them."""
    base = tiny_checkpoint("llama")
    with LLM(base, block_size=4) as llm:
        plain = llm.engine.core.executor.weight_bytes[0]
    with LLM(base, block_size=4, enable_lora=True, max_loras=3, max_lora_rank=8) as llm:
        manager = llm.engine.runner.lora
        slots = manager.slot_bytes()
        assert llm.engine.core.executor.weight_bytes[0] == plain + slots
    # 2 layers x 3 slots x rank 8 x float32: A (3 + 1 + 2 + 1 slices) and B of every layer.
    a = 3 * 8 * 64 + 8 * 64 + 2 * 8 * 64 + 8 * 128
    b = 8 * (64 + 32 + 32) + 8 * 64 + 8 * (128 + 128) + 8 * 64
    assert slots == 2 * 3 * 4 * (a + b)


# -- bad adapters ---------------------------------------------------------------------------------------


def _copy(adapter, to):
    shutil.copytree(adapter, to)
    return to


def _edit_config(adapter, **changes):
    path = adapter / "adapter_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))
    return adapter


@pytest.fixture(scope="module")
def llama_lora():
    with LLM(tiny_checkpoint("llama"), block_size=4, enable_lora=True, max_lora_rank=8) as llm:
        yield llm


def test_bad_adapters_are_refused_naming_the_problem(llama_lora, tmp_path):
    base = tiny_checkpoint("llama")
    good = make_adapter(tmp_path / "good", base, r=4)
    truncated = _copy(good, tmp_path / "truncated")
    weights = truncated / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-10])
    garbled = _copy(good, tmp_path / "garbled")
    (garbled / "adapter_model.safetensors").write_bytes(b"\xff" * 64)
    towers = make_adapter(tmp_path / "tower", base, r=4, extra_tensors={
        "base_model.model.visual.blocks.0.attn.qkv.lora_A.weight": torch.zeros(4, 8)})
    cases = {
        "above max_lora_rank 8": make_adapter(tmp_path / "big", base, r=16),
        "'fc1' is not a layer the model adapts": _edit_config(_copy(good, tmp_path / "fc1"), target_modules=["fc1"]),
        "vision / audio tower": towers,
        "base-model mismatch": make_adapter(tmp_path / "qwen3", tiny_checkpoint("qwen3"), r=4),
        "truncated or corrupt": truncated,
        "not a readable safetensors file": garbled,
        "no such directory": tmp_path / "missing",
        "DoRA": _edit_config(_copy(good, tmp_path / "dora"), use_dora=True),
        "rank 4 in adapter_model.safetensors, 2 in adapter_config.json": _edit_config(
            _copy(good, tmp_path / "lies"), r=2),
    }
    for int_id, (message, path) in enumerate(cases.items(), 1):
        with pytest.raises(ValueError, match=message) as caught:
            llama_lora.generate(PROMPTS[0], GREEDY, lora_request=LoRARequest(f"bad{int_id}", int_id, str(path)))
        assert f"bad{int_id}" in str(caught.value)
    assert not llama_lora.engine.has_unfinished_requests()
    # The engine still serves the good one afterwards.
    assert llama_lora.generate(PROMPTS[0], GREEDY, lora_request=LoRARequest("good", 99, str(good)))


def test_an_adapter_broken_after_its_check_fails_its_requests_only(llama_lora, tmp_path):
    """The engine reads the files again when it loads an adapter: one that changed since the
    frontend's check fails its own requests ("error"), the rest of the batch runs."""
    base = tiny_checkpoint("llama")
    broken = make_adapter(tmp_path / "broken", base, r=4)
    lora = LoRARequest("broken", 500, str(broken))
    llama_lora.input_processor.check_lora(lora)  # checked while intact ...
    (broken / "adapter_model.safetensors").write_bytes(b"\x00" * 16)  # ... then broken
    outputs = llama_lora.generate(PROMPTS[:2], GREEDY, lora_request=[lora, None])
    assert outputs[0].outputs[0].finish_reason == "error" and "broken" in outputs[0].error
    assert len(outputs[1].outputs[0].token_ids) == GREEDY.max_tokens


def test_moe_experts_are_refused(tmp_path):
    base = tiny_checkpoint("qwen3_moe")
    adapter = make_adapter(tmp_path / "moe", base, r=4)
    with pytest.raises(LoRAError, match="mixture-of-experts"):
        inspect_adapter(adapter, json.loads((base / "config.json").read_text()), 16)
    # Attention-only adapters of the same model are fine.
    attention = make_adapter(tmp_path / "attn", base, r=4, target_modules=("q_proj", "k_proj", "v_proj", "o_proj"))
    inspect_adapter(attention, json.loads((base / "config.json").read_text()), 16)


def test_attention_adapter_on_a_moe_model_captured_equals_eager(tmp_path):
    # The captured CPU step holds sparse MoE layers and LoRA rows; an MoE layer's experts are not
    # adapted, so such a model's adapted steps must still run (eager) and agree with enforce_eager.
    base = tiny_checkpoint("qwen3_moe")
    adapter = make_adapter(tmp_path / "attn", base, r=4, target_modules=("q_proj", "k_proj", "v_proj", "o_proj"))
    outputs = []
    for eager in (False, True):
        with LLM(base, block_size=4, enable_lora=True, max_loras=1, max_lora_rank=8, enforce_eager=eager) as llm:
            outputs.append(_tokens(llm.generate(PROMPTS[:2], GREEDY, lora_request=LoRARequest("attn", 1, str(adapter)))))
    assert outputs[0] == outputs[1]


def test_lora_off_and_config_knobs():
    base = tiny_checkpoint("llama")
    with LLM(base, block_size=4) as llm:
        with pytest.raises(ValueError, match="enable_lora=True"):
            llm.generate(PROMPTS[0], GREEDY, lora_request=LoRARequest("x", 1, "/nowhere"))
    for bad, message in (({"max_loras": 0}, "max_loras"), ({"max_lora_rank": 0}, "max_lora_rank"),
                         ({"max_loras": 4, "max_cpu_loras": 2}, "max_cpu_loras"),
                         ({"enable_lora": "yes"}, "enable_lora")):
        with pytest.raises(ValueError, match=message):
            LLM(base, block_size=4, **bad)
    with pytest.raises(ValueError, match="lora_int_id"):
        LoRARequest("x", 0, "/p")


# -- quantized base, simulated NPU ----------------------------------------------------------------------


def _first_logprobs(llm, lora=None):
    params = SamplingParams(temperature=0, max_tokens=1, logprobs=5)
    out = llm.generate(PROMPTS, params, lora_request=lora)
    return [dict(zip(o.outputs[0].logprobs[0].top_token_ids, o.outputs[0].logprobs[0].top_logprobs)) for o in out]


def _top(logprobs):
    return [max(entry, key=entry.get) for entry in logprobs]


def _max_gap(got, want):
    return max(abs(g[t] - w[t]) for g, w in zip(got, want) for t in set(g) & set(w))


# int8 weights with per-channel scales and int8 activations per token: relative error ~2**-8 per
# product. Measured on this tiny llama: the W8A8 base alone is 0.042 from the float base in
# first-token log-probabilities, W8A8 + adapter 0.053 from the float merged model (the adapter's
# delta is float: it adds no quantization error of its own). Bound: 0.1.
INT8_LOGPROB_TOL = 0.1
BF16_LOGPROB_TOL = 0.15  # tests/test_npu_engine.py's bound


def test_w8a8_base_with_a_float_adapter_matches_its_merged_reference(tmp_path):
    base = tiny_checkpoint("llama")
    adapter = make_adapter(tmp_path / "a", base, r=8, lora_alpha=16, seed=1)
    merged = merge_adapter(tmp_path / "merged", base, adapter)
    with LLM(merged, block_size=4) as llm:
        want = _first_logprobs(llm)
    with LLM(base, block_size=4) as llm:
        plain = _first_logprobs(llm)
    with LLM(base, block_size=4, quantization="w8a8", enable_lora=True) as llm:
        assert llm.engine.config.quantization == "w8a8"
        got = _first_logprobs(llm, LoRARequest("a", 1, str(adapter)))
    assert _max_gap(got, want) <= INT8_LOGPROB_TOL
    assert _top(got) == _top(want) != _top(plain)  # the adapter changes the answer; the int8 base keeps it


def test_simulated_npu_bf16_applies_the_adapter(tmp_path):
    """bf16 on the (fake) NPU: within bf16's tolerance of the float32 merged model, and not the
    base model's answer (the delta is accumulated in float32, never rounded away)."""
    base = tiny_checkpoint("llama")
    adapter = make_adapter(tmp_path / "a", base, r=8, lora_alpha=16, seed=1)
    with LLM(merge_adapter(tmp_path / "merged", base, adapter), block_size=16) as llm:
        want = _first_logprobs(llm)
    with LLM(base, block_size=16) as llm:
        plain = _first_logprobs(llm)
    with fake_torch_npu.install(), use_platform("npu"):
        with LLM(base, enable_lora=True) as llm:
            assert llm.engine.config.dtype == "bfloat16"
            got = _first_logprobs(llm, LoRARequest("a", 1, str(adapter)))
            base_npu = _first_logprobs(llm)
    assert _max_gap(got, want) <= BF16_LOGPROB_TOL and _max_gap(base_npu, plain) <= BF16_LOGPROB_TOL
    assert _top(got) == _top(want) != _top(base_npu)  # not the base model's answer


# -- tensor parallelism ---------------------------------------------------------------------------------


@pytest.mark.slow
def test_tensor_parallel_2_equals_tp1(setup):
    """TP = 2: column-parallel layers hold A whole and B's rows of their own output, row-parallel
    ones A's columns of their own input and B whole (layers.py); a mixed batch gives TP = 1's
    tokens, which are the merged references."""
    base, adapters, references = setup
    mix = ["a", None, "b", "c"]
    with LLM(base, block_size=4, enable_lora=True, max_loras=3, max_lora_rank=16, tensor_parallel_size=2) as llm:
        got = _tokens(llm.generate(PROMPTS, GREEDY, lora_request=[_request(adapters, n) for n in mix]))
    assert got == [references[n][i] for i, n in enumerate(mix)]
