"""Qwen2 and Llama: logits parity with transformers on the tiny checkpoints, and the paged path
(prefill, chunked prefill, token-by-token decode) equal to the full forward.

Tolerance 1e-4 (fp32): both sides compute the same math in a different order (fused QKV /
gate-up matmuls, SDPA vs eager softmax), which moves results by ~1e-6 per layer."""

from __future__ import annotations

import pytest
import torch

from atb_plugin.models.weights import WeightLoadingError
from atb_plugin.testing.sequence import SequenceRunner, check_simulated_npu
from atb_plugin.testing.tiny import tiny_checkpoint
from routers import get_router
from tests.helpers import copy_checkpoint
from tests.helpers import model_pair as load_pair

FAMILIES = ["qwen2", "llama"]
TOLERANCE = 1e-4




def prompt(n: int, vocab: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


pytestmark = pytest.mark.usefixtures("atb_kernel_set")


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_transformers(family):
    ours, reference = load_pair(family)
    ids = prompt(23, ours.config.vocab_size)
    with torch.no_grad():
        expected = reference(ids[None]).logits[0]
    got = SequenceRunner(ours, max_len=32).step(ids)
    assert (got - expected).abs().max() <= TOLERANCE


@pytest.mark.parametrize("family", FAMILIES)
def test_chunked_prefill_and_decode_equal_the_full_forward(family):
    ours, _ = load_pair(family)
    ids = prompt(21, ours.config.vocab_size, seed=1)
    full = SequenceRunner(ours, max_len=32).step(ids)
    runner = SequenceRunner(ours, max_len=32, block_size=4)
    pieces = [runner.step(ids[:5]), runner.step(ids[5:12])]  # chunks crossing block boundaries
    pieces += [runner.step(ids[i:i + 1]) for i in range(12, 21)]  # then one token at a time
    assert (torch.cat(pieces) - full).abs().max() <= TOLERANCE


def test_tied_embeddings_have_no_separate_head():
    ours, _ = load_pair("qwen2")
    assert ours.config.tie_word_embeddings and ours.lm_head is None


def test_llama_rope_scaling_is_llama3():
    ours, _ = load_pair("llama")
    assert ours.config.rope.get("rope_type", ours.config.rope.get("type")) == "llama3"


def test_missing_and_unexpected_weights_are_named(tmp_path):
    from safetensors.torch import load_file, save_file

    source = tiny_checkpoint("qwen2")
    copy_checkpoint(source, tmp_path)
    state = load_file(str(source / "model.safetensors"))
    state.pop("model.layers.0.self_attn.k_proj.weight")
    state["model.layers.0.extra.weight"] = torch.zeros(2)
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(WeightLoadingError, match=r"missing from the checkpoint: model\.layers\.0\.self_attn\.qkv_proj\.weight.*not used by the model: model\.layers\.0\.extra\.weight"):
        get_router(tmp_path).model_cls.from_pretrained(tmp_path)


def test_sharded_checkpoint_and_dtype(tmp_path):
    import json
    from safetensors.torch import load_file, save_file

    source = tiny_checkpoint("llama")
    copy_checkpoint(source, tmp_path, exclude=("model.safetensors",))
    state = load_file(str(source / "model.safetensors"))
    names = sorted(state)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    weight_map = {}
    for file, keys in shards.items():
        save_file({k: state[k] for k in keys}, str(tmp_path / file))
        weight_map.update({k: file for k in keys})
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    cls = get_router(tmp_path).model_cls
    sharded = cls.from_pretrained(tmp_path)
    single = cls.from_pretrained(source)
    ids = prompt(9, sharded.config.vocab_size)
    assert torch.equal(SequenceRunner(sharded, 16).step(ids), SequenceRunner(single, 16).step(ids))
    half = cls.from_pretrained(tmp_path, dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in half.parameters())
    assert (SequenceRunner(half, 16).step(ids).float() - SequenceRunner(single, 16).step(ids)).abs().max() < 0.1


# NPU path tolerances (the ATB attention ops take fp16 / bf16 only; the CPU path runs fp32 on the
# same weights). Tolerance relative to the largest fp32 logit (~4 for the tiny models, 2 layers):
# - bfloat16: 8 significant bits, ~4e-3 relative error per rounding; weights, activations and
#   the cache are all rounded, over ~10 ops per layer; measured max error ~3% of the largest
#   logit (0.07 / 0.12 of ~4.2 for qwen2 / llama) -> 5e-2.
# - float16: 11 significant bits, ~5e-4 per rounding -> ~8x tighter; measured ~0.15-0.25% -> 8e-3.
# Greedy tokens are compared only where the fp32 top-2 margin exceeds twice the tolerance.
NPU_TOL = {torch.bfloat16: 5e-2, torch.float16: 8e-3}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("family", FAMILIES)
def test_npu_path_equals_cpu_path(family, dtype):
    """The same model through the ATB kernels (simulated torch_npu) in bf16 / fp16 against the CPU
    path in fp32: prefill, a chunked-prefill step and decode steps, each on the op the real NPU
    would use. Block size 16: ATB's rule."""
    ours, _ = load_pair(family)
    calls = check_simulated_npu(ours, prompt(40, ours.config.vocab_size, seed=2), dtype, NPU_TOL[dtype])
    for op in ("_npu_reshape_and_cache", "_npu_flash_attention", "_npu_paged_attention_splitfuse",
               "_npu_paged_attention", "npu_rms_norm", "npu_rotary_mul", "npu_swiglu"):
        assert calls.get(op), f"{op} was not used"


def test_npu_host_syncs_per_step_do_not_grow_with_layers(tmp_path):
    """The NPU kernels read device tensors on the host once per step (the slot-validity check),
    not once per layer: a 2-layer and a 4-layer model report the same syncs per step."""
    import copy

    from atb_plugin.platform import use_platform
    from atb_plugin.testing import fake_torch_npu

    ours, _ = load_pair("qwen2")
    assert ours.config.num_hidden_layers == 2
    deeper = copy.deepcopy(ours)
    layers = deeper.model.layers
    layers.extend(copy.deepcopy(list(layers)))
    import dataclasses
    deeper.config = dataclasses.replace(deeper.config, num_hidden_layers=len(layers))
    ids = prompt(24, ours.config.vocab_size, seed=4)

    def syncs_per_step(model):
        model = model.to(torch.float16)
        counts = []
        with fake_torch_npu.install() as fake, use_platform("npu"):
            runner = SequenceRunner(model, max_len=32, block_size=16)
            for chunk in (ids[:10], ids[10:20], ids[20:21], ids[21:22]):  # prefill, chunked, decodes
                before = fake.host_syncs
                runner.step(chunk)
                counts.append(fake.host_syncs - before)
            calls = fake.module.calls["_npu_reshape_and_cache"]
        return counts, calls

    shallow, shallow_calls = syncs_per_step(copy.deepcopy(ours))
    deep, deep_calls = syncs_per_step(deeper)
    assert deep_calls == 2 * shallow_calls  # the deeper model really ran twice the layers
    assert deep == shallow and max(deep) <= 1, (shallow, deep)
