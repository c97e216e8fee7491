"""Features together (each has its own test file alone): speculative decoding x multi-LoRA x
DeepSeek MLA x Qwen3-VL x graph mode, each combination against its reference.

- LoRA + speculation (ngram, draft_model), a LoRA row and a base row verifying 1 + k tokens in one
  step: greedy tokens == the adapter merged into the checkpoint (``lora_adapters.merge_adapter``);
- LoRA on an MLA model (DeepSeek): refused at start-up naming the architecture (docs/lora.md);
- LoRA + ngram on Qwen3-VL with an image prompt == the merged checkpoint without speculation;
- ngram on DeepSeek-V2-Lite (latent cache; verify steps in the auto, absorbed and expanded forms)
  == plain decoding;
- graph mode on the simulated NPU: a LoRA request's steps run eager (the base requests' replay),
  DeepSeek decodes eager with a warning (docs/graph-mode.md, fallback rules); tokens == eager.
"""

from __future__ import annotations

import contextlib
import logging

import pytest

import transformers.activations  # noqa: F401 - imported before the fake NPU is installed (its NPU probe)
from atb_plugin import LLM, LoRARequest, SamplingParams
from atb_plugin.platform import use_platform
from atb_plugin.testing import fake_torch_npu
from atb_plugin.testing.lora_adapters import make_adapter, merge_adapter
from atb_plugin.testing.tiny import tiny_checkpoint

# Repetitive prompts: ngram finds drafts, and accepts some of them.
PROMPTS = ["the quick brown fox jumps over the lazy dog the quick brown fox jumps", "one two three one two three one two"]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
GRAPHS = {"cudagraph_mode": "FULL_DECODE_ONLY", "cudagraph_capture_sizes": [1, 2, 4]}


def _tokens(outputs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


def _accepted(llm) -> int:
    return llm.engine.scheduler.spec_decoding.num_accepted_tokens


@pytest.fixture(scope="module")
def qwen2_lora(tmp_path_factory):
    """(base, adapter request, merged-reference tokens of PROMPTS, the base's tokens)."""
    base = tiny_checkpoint("qwen2")
    root = tmp_path_factory.mktemp("combo-lora")
    adapter = make_adapter(root / "a", base, r=8, seed=1)
    with LLM(merge_adapter(root / "merged", base, adapter), block_size=4) as llm:
        merged = _tokens(llm.generate(PROMPTS, GREEDY))
    with LLM(base, block_size=4) as llm:
        plain = _tokens(llm.generate(PROMPTS, GREEDY))
    assert merged != plain, "an adapter that changes nothing proves nothing"
    return base, LoRARequest("a", 1, str(adapter)), merged, plain


# The draft: the base checkpoint (the base row accepts every draft, the adapted row some).
@pytest.mark.parametrize("spec", [NGRAM, {"method": "draft_model", "model": str(tiny_checkpoint("qwen2")),
                                          "num_speculative_tokens": 3}], ids=["ngram", "draft_model"])
def test_lora_with_speculation_equals_the_merged_adapter(qwen2_lora, spec):
    base, lora, merged, plain = qwen2_lora
    with LLM(base, block_size=4, enable_lora=True, max_lora_rank=8, speculative_config=spec) as llm:
        assert _tokens(llm.generate(PROMPTS, GREEDY, lora_request=lora)) == merged
        # A step holding an adapted row and a base row, both verifying 1 + k tokens.
        mixed = _tokens(llm.generate(PROMPTS, GREEDY, lora_request=[lora, None]))
        assert _accepted(llm) > 0
    assert mixed == [merged[0], plain[1]]


def test_lora_on_multi_head_latent_attention_is_refused_at_start_up():
    with pytest.raises(ValueError, match="LoRA on multi-head latent attention .*DeepseekV2ForCausalLM"):
        LLM(tiny_checkpoint("deepseek_v2_lite"), enable_lora=True)


def test_lora_and_ngram_on_qwen3_vl_with_an_image_equal_the_merged_adapter(tmp_path):
    from input_builders.media_config import MediaConfig
    from tests.helpers import write_test_images

    write_test_images(tmp_path, sizes=((60, 90),))
    media = MediaConfig(allowed_local_media_paths=(str(tmp_path),))
    chat = [{"role": "user", "content": [{"image": str(tmp_path / "image0.png")},
                                         {"text": "one two three one two three one two three"}]}]
    base = tiny_checkpoint("qwen3_vl")
    adapter = make_adapter(tmp_path / "a", base, r=8, seed=1, prefix="model.language_model")
    with LLM(base, media_config=media, block_size=4) as llm:
        plain = _tokens(llm.chat(chat, GREEDY))
    with LLM(base, media_config=media, block_size=4, speculative_config=NGRAM) as llm:
        assert _tokens(llm.chat(chat, GREEDY)) == plain
        assert _accepted(llm) > 0
    with LLM(merge_adapter(tmp_path / "merged", base, adapter), media_config=media, block_size=4) as llm:
        merged = _tokens(llm.chat(chat, GREEDY))
    assert merged != plain
    with LLM(base, media_config=media, block_size=4, enable_lora=True, max_lora_rank=8,
             speculative_config=NGRAM) as llm:
        assert _tokens(llm.chat(chat, GREEDY, lora_request=LoRARequest("a", 1, str(adapter)))) == merged


def test_ngram_on_deepseek_mla_equals_plain_in_every_form():
    """Verify steps of 1 + k query tokens over the latent cache: the auto form (expanded: the step
    is not decode-only), and each form forced."""
    base = tiny_checkpoint("deepseek_v2_lite")
    with LLM(base, block_size=4) as llm:
        plain = _tokens(llm.generate(PROMPTS, GREEDY))
    with LLM(base, block_size=4, speculative_config=NGRAM) as llm:
        for form in ("auto", "absorbed", "expanded"):
            llm.engine.runner.model.set_mla_form(form)
            assert _tokens(llm.generate(PROMPTS, GREEDY)) == plain, form
        assert _accepted(llm) > 0


@contextlib.contextmanager
def _simulated_npu(monkeypatch):
    monkeypatch.setenv("ATB_PLUGIN_NPU_KERNELS", "fia")
    with fake_torch_npu.install() as fake, use_platform("npu"):
        yield fake


def test_graph_mode_runs_lora_rows_eager_and_replays_the_base_model(qwen2_lora, monkeypatch):
    """Against eager decoding on the same simulated NPU (its bfloat16, not the CPU's float32)."""
    base, lora, *_ = qwen2_lora
    tokens = {}
    with _simulated_npu(monkeypatch) as fake:
        for eager in (False, True):
            graphs = {"enforce_eager": True} if eager else {"compilation_config": GRAPHS}
            with LLM(base, enable_lora=True, max_lora_rank=8, **graphs) as llm:
                runner = llm.engine.client.core.runner
                tokens[eager] = [_tokens(llm.generate(PROMPTS, GREEDY, lora_request=lora)),
                                 _tokens(llm.generate(PROMPTS, GREEDY, lora_request=[lora, None]))]
                if not eager:
                    assert runner.graphs.replays == 0  # every decode step held an adapted row
                tokens[eager].append(_tokens(llm.generate(PROMPTS, GREEDY)))
                if not eager:
                    assert runner.graphs.replays == GREEDY.max_tokens - 1
        assert fake.graph_stats() == {"captures": 3, "replays": GREEDY.max_tokens - 1}
    assert tokens[False] == tokens[True]
    assert tokens[True][0] != tokens[True][2]  # the adapter changes the tokens


def test_graph_mode_on_deepseek_decodes_eager_with_a_warning(monkeypatch, caplog):
    base = tiny_checkpoint("deepseek_v2_lite")
    with _simulated_npu(monkeypatch) as fake, caplog.at_level(logging.WARNING):
        with LLM(base, compilation_config=GRAPHS) as llm:
            runner = llm.engine.client.core.runner
            assert runner.graphs is None
            assert runner.decode_capture == "eager (multi-head latent attention is not graph-capturable yet)"
            graphs = _tokens(llm.generate(PROMPTS, GREEDY))
        with LLM(base, enforce_eager=True) as llm:
            eager = _tokens(llm.generate(PROMPTS, GREEDY))
        assert fake.graph_stats() == {"captures": 0, "replays": 0}
    assert "multi-head latent attention is not graph-capturable yet" in caplog.text
    assert graphs == eager
