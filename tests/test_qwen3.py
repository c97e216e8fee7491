"""Qwen3 (dense): logits parity with transformers' Qwen3ForCausalLM on the tiny checkpoint (per-head
q/k RMSNorm, no q/k/v bias, head_dim apart from hidden / heads), the paged path equal to the
full forward, the simulated NPU within its bfloat16 bound, greedy tokens equal to transformers'
``generate``; the thinking switch (``enable_thinking`` through ``chat_template_kwargs``) in the
offline ``LLM.chat``; and, through the real service (one server for the module, Qwen3-MoE with
``--reasoning-parser qwen3``), the same greedy answers as the offline engine.

Tolerances as tests/test_models_text.py: 1e-4 on float32 logits (the same math in another
order), 5e-2 of the largest logit for the bfloat16 NPU path.
"""

from __future__ import annotations

import functools

import pytest
import torch

from atb_plugin import LLM, SamplingParams
from atb_plugin.testing.sequence import SequenceRunner, check_simulated_npu
from atb_plugin.testing.tiny import tiny_checkpoint
from tests.helpers import model_pair

TOLERANCE = 1e-4
NPU_TOL = 5e-2
THINK_OFF = "<think>\n\n</think>\n\n"


pytestmark = pytest.mark.usefixtures("atb_kernel_set")
load_pair = functools.partial(model_pair, "qwen3")  # uncached: a test removes the model's norms


def prompt(n: int, vocab: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


def test_the_tiny_checkpoint_has_qwen3s_structure():
    ours, reference = load_pair()
    config = ours.config
    assert config.qk_norm and not config.qkv_bias and not config.tie_word_embeddings
    assert config.head_dim * config.num_attention_heads != config.hidden_size  # head_dim read, not derived
    attention = ours.model.layers[0].self_attn
    assert attention.qkv_proj.bias is None and tuple(attention.q_norm.weight.shape) == (config.head_dim,)
    assert torch.equal(attention.k_norm.weight, reference.model.layers[0].self_attn.k_norm.weight)


def test_logits_match_transformers_and_the_paged_path_equals_the_full_forward():
    ours, reference = load_pair()
    ids = prompt(23, ours.config.vocab_size)
    with torch.no_grad():
        expected = reference(ids[None]).logits[0]
    full = SequenceRunner(ours, max_len=32).step(ids)
    assert (full - expected).abs().max() <= TOLERANCE
    runner = SequenceRunner(ours, max_len=32, block_size=4)
    pieces = [runner.step(ids[:5]), runner.step(ids[5:12])] + [runner.step(ids[i:i + 1]) for i in range(12, 23)]
    assert (torch.cat(pieces) - full).abs().max() <= TOLERANCE


def test_q_k_norms_matter():
    """Without the per-head norms the logits move far beyond the tolerance (the parity test would
    catch a model that skipped them)."""
    ours, _ = load_pair()
    ids = prompt(12, ours.config.vocab_size)
    before = SequenceRunner(ours, max_len=16).step(ids)
    for layer in ours.model.layers:
        layer.self_attn.q_norm = None
    assert (SequenceRunner(ours, max_len=16).step(ids) - before).abs().max() > 100 * TOLERANCE


def test_npu_path_equals_cpu_path_in_bfloat16():
    ours, _ = load_pair()
    calls = check_simulated_npu(ours, prompt(40, ours.config.vocab_size, seed=2), torch.bfloat16, NPU_TOL)
    # per layer: input, post-attention, q and k norms; and the final norm; over 3 prefill/chunk + 7 decode steps
    assert calls["npu_rms_norm"] == 9 * (4 * ours.config.num_hidden_layers + 1)


PROMPTS = ["hello world", "the cat sat on the mat and then", "a", "numbers: 1 2 3 4 5 6 7 8 9 10 11 12"]


def test_llm_greedy_equals_transformers_generate():
    _, reference = load_pair()
    with LLM(tiny_checkpoint("qwen3"), block_size=4) as llm:
        outputs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
        prompt_ids = [llm.router.tokenize(p) for p in PROMPTS]
        outcome = llm.engine.core.runner.decode_capture
    # The captured CPU decode step holds the per-head norms now (tests/test_native_decode_moe.py):
    # the greedy tokens below come from it.
    assert outcome == "captured"
    for ids, output in zip(prompt_ids, outputs):
        ids = torch.tensor([ids])
        expected = reference.generate(ids, max_new_tokens=12, min_new_tokens=12, do_sample=False,
                                      repetition_penalty=1.0, pad_token_id=0)[0, ids.shape[1]:]
        assert list(output.outputs[0].token_ids) == expected.tolist()


# ------------------------------------------------------------------------------------------------
# The thinking switch

CHAT = [{"role": "user", "content": "Hi there"}]


@pytest.fixture(scope="module")
def llm():
    with LLM(tiny_checkpoint("qwen3"), block_size=16) as llm:
        yield llm


def test_enable_thinking_false_closes_an_empty_think_block_in_the_prompt(llm):
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    tokenizer = llm.router.tokenizer
    default = llm.chat(CHAT, greedy)[0]
    thinking = llm.chat(CHAT, greedy, chat_template_kwargs={"enable_thinking": True})[0]
    off = llm.chat(CHAT, greedy, chat_template_kwargs={"enable_thinking": False})[0]
    assert tokenizer.decode(default.prompt_token_ids).endswith("<|im_start|>assistant\n")
    assert thinking.prompt_token_ids == default.prompt_token_ids  # thinking is the template's default
    assert off.prompt_token_ids[:len(default.prompt_token_ids)] == default.prompt_token_ids
    assert tokenizer.decode(off.prompt_token_ids[len(default.prompt_token_ids):]) == THINK_OFF
    expected = tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True, enable_thinking=False)
    assert tokenizer.decode(off.prompt_token_ids) == expected


def test_earlier_reasoning_is_dropped_from_the_history(llm):
    """Qwen3's template keeps <think> only in assistant turns after the last user query."""
    history = [*CHAT, {"role": "assistant", "content": "<think>\nhmm\n</think>\n\nHello!"},
               {"role": "user", "content": "Bye"}]
    out = llm.chat(history, SamplingParams(temperature=0, max_tokens=1))[0]
    text = llm.router.tokenizer.decode(out.prompt_token_ids)
    assert "hmm" not in text and "<|im_start|>assistant\nHello!<|im_end|>" in text


def test_the_qwen3_reasoning_parser_reads_qwen3_output(llm):
    """The parser the server uses for --reasoning-parser qwen3, on this model's decoded output:
    an answer after the empty think block (thinking off) is all content; a forced <think>
    start without its end is all reasoning."""
    from atb_plugin.server.reasoning_parsers import get_reasoning_parser

    parser = get_reasoning_parser("qwen3")
    plain = llm.chat(CHAT, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                     chat_template_kwargs={"enable_thinking": False})[0].outputs[0].text
    assert parser.extract(plain) == (None, plain)
    think = llm.router.tokenizer.convert_tokens_to_ids("<think>")
    forced = llm.chat(CHAT, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True,
                                           logit_bias={think: 100.0}))[0].outputs[0].text
    assert forced == "<think>" * 3
    assert parser.extract(forced) == ("<think>" * 2, None)


# ------------------------------------------------------------------------------------------------
# Through the service (Qwen3-MoE)


@pytest.fixture(scope="module")
def server(serve):
    with serve(tiny_checkpoint("qwen3_moe"), "--reasoning-parser", "qwen3", "--max-model-len", "256") as server:
        yield server


@pytest.mark.slow
@pytest.mark.parametrize("kwargs", [{}, {"enable_thinking": False}])
def test_server_greedy_chat_equals_the_offline_engine(server, kwargs):
    client = server.client()
    name = client.models.list().data[0].id
    messages = [{"role": "user", "content": "The quick brown fox jumps over the lazy dog"}]
    reply = client.chat.completions.create(model=name, messages=messages, max_tokens=10, temperature=0,
                                           extra_body={"ignore_eos": True, "chat_template_kwargs": kwargs})
    with LLM(tiny_checkpoint("qwen3_moe"), block_size=16, max_model_len=256) as offline:
        expected = offline.chat(messages, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
                                chat_template_kwargs=kwargs)[0]
        completion = offline.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))[0]
    assert reply.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert reply.choices[0].message.content == expected.outputs[0].text
    assert getattr(reply.choices[0].message, "reasoning_content", None) is None  # no <think> opened: all content (qwen3 parser)
    text = client.completions.create(model=name, prompt=PROMPTS[1], max_tokens=10, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    assert text == completion.outputs[0].text
