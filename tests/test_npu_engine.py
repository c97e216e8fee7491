"""The engine on the simulated NPU as a user would start it (no dtype, no block size given): the
platform picks bf16 and block size 128, and the answers match the CPU path within bf16's
tolerance, for every generative family on both NPU kernel sets."""

from __future__ import annotations

import pytest

from atb_plugin import LLM, SamplingParams
from atb_plugin.platform import use_platform
from atb_plugin.testing import fake_torch_npu
from atb_plugin.testing.tiny import tiny_checkpoint

FAMILIES = ["qwen2", "llama", "qwen2_vl", "llava", "qwen_vl"]
PROMPT = "the cat sat on the mat and then"
PARAMS = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=5)
# bf16 keeps 8 significant bits: each matmul/attention output carries a relative error of ~2**-8,
# a few layers compound it to ~1e-2 of the logits' scale; the tiny models' logits are O(1-5), so
# first-step log-probabilities agree within 0.15 (measured: at most 0.016).
BF16_LOGPROB_TOL = 0.15


@pytest.fixture(scope="module")
def cpu_answers():
    answers = {}
    for family in FAMILIES:
        with LLM(tiny_checkpoint(family), block_size=16) as llm:
            answers[family] = llm.generate(PROMPT, PARAMS)[0].outputs[0]
    return answers


@pytest.mark.parametrize("kernel_set", ["atb", "fia"])
@pytest.mark.parametrize("family", FAMILIES)
def test_npu_defaults_are_bf16_and_match_the_cpu_path(family, kernel_set, cpu_answers, monkeypatch):
    monkeypatch.setenv("ATB_PLUGIN_NPU_KERNELS", kernel_set)
    with fake_torch_npu.install() as fake, use_platform("npu"):
        with LLM(tiny_checkpoint(family)) as llm:
            config = llm.engine.config
            assert (config.dtype, config.block_size) == ("bfloat16", 128)
            npu = llm.generate(PROMPT, PARAMS)[0].outputs[0]
        ops = fake.module.calls
        if kernel_set == "fia":
            assert ops["npu_fused_infer_attention_score"] > 0 and ops["_npu_paged_attention"] == 0
        else:
            assert ops["_npu_paged_attention"] + ops["_npu_flash_attention"] > 0
            assert ops["npu_fused_infer_attention_score"] == 0
    cpu = cpu_answers[family]
    first_npu, first_cpu = npu.logprobs[0], cpu.logprobs[0]
    cpu_top = dict(zip(first_cpu.top_token_ids, first_cpu.top_logprobs))
    npu_top = dict(zip(first_npu.top_token_ids, first_npu.top_logprobs))
    for token in set(cpu_top) & set(npu_top):
        assert abs(cpu_top[token] - npu_top[token]) <= BF16_LOGPROB_TOL, (family, token)
    gap = first_cpu.top_logprobs[0] - first_cpu.top_logprobs[1]
    if gap > 2 * BF16_LOGPROB_TOL:  # a clear winner must win on the NPU too
        assert npu.token_ids[0] == cpu.token_ids[0]


# fp16 keeps 11 significant bits (8x finer than bf16): the same argument gives 0.05 (measured
# diffs are reported by the test on failure).
LOGPROB_TOL = {"bfloat16": BF16_LOGPROB_TOL, "float16": 0.05}


@pytest.fixture(scope="module")
def image_dir(tmp_path_factory):
    from tests.helpers import write_test_images

    directory = tmp_path_factory.mktemp("npu-images")
    write_test_images(directory, sizes=((60, 90),))
    return directory


def image_chat(directory) -> list[dict]:
    return [{"role": "user", "content": [{"image": str(directory / "image0.png")}, {"text": "What is this?"}]}]


@pytest.mark.parametrize("dtype, kernel_set", [("bfloat16", "fia"), ("float16", "atb")])
@pytest.mark.parametrize("family", ["qwen2_vl", "llava", "qwen_vl"])
def test_image_chat_on_the_npu_matches_the_cpu_path(family, dtype, kernel_set, image_dir, monkeypatch):
    """The vision tower (ATB varlen attention) and the merge run in half precision on the NPU."""
    from input_builders.media_config import MediaConfig

    media = MediaConfig(allowed_local_media_paths=(str(image_dir),))
    with LLM(tiny_checkpoint(family), block_size=16, media_config=media) as llm:
        cpu = llm.chat(image_chat(image_dir), PARAMS)[0].outputs[0]
    monkeypatch.setenv("ATB_PLUGIN_NPU_KERNELS", kernel_set)
    with fake_torch_npu.install() as fake, use_platform("npu"):
        with LLM(tiny_checkpoint(family), media_config=media, dtype="auto" if dtype == "bfloat16" else dtype) as llm:
            assert llm.engine.config.dtype == dtype
            npu = llm.chat(image_chat(image_dir), PARAMS)[0].outputs[0]
        assert fake.module.calls["_npu_flash_attention_unpad"] > 0  # the vision tower ran on the NPU path
    cpu_top = dict(zip(cpu.logprobs[0].top_token_ids, cpu.logprobs[0].top_logprobs))
    npu_top = dict(zip(npu.logprobs[0].top_token_ids, npu.logprobs[0].top_logprobs))
    diffs = {t: abs(cpu_top[t] - npu_top[t]) for t in set(cpu_top) & set(npu_top)}
    assert diffs and max(diffs.values()) <= LOGPROB_TOL[dtype], diffs
