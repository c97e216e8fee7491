"""Parallel sampling (``n > 1``): the frontend fans a request out into n child requests and
merges their outputs (``ParentRequest``); offline, ``LLM.generate`` / ``chat`` return one output
per prompt with n choices, the same as n separate n = 1 requests with seeds seed, seed + 1, ..."""

from __future__ import annotations

import pytest

from atb_plugin import LLM, SamplingParams
from atb_plugin.frontend.output_processor import CompletionOutput, RequestOutput
from atb_plugin.frontend.parallel_sampling import ParentRequest, child_sampling_params, fans_out
from atb_plugin.testing.tiny import tiny_checkpoint

PROMPT = "one two three four five six seven eight nine ten eleven twelve"


@pytest.fixture(scope="module")
def llm():
    with LLM(tiny_checkpoint("qwen2"), block_size=4) as llm:
        yield llm


def child_output(child_id: str, tokens: list[int], finished: bool, *, error=None, prompt_logprobs=None):
    completion = CompletionOutput(0, f"text{tokens}", list(tokens), None, "length" if finished else None,
                                  delta_text="d", delta_token_ids=tokens[-1:])
    return RequestOutput(child_id, "prompt", [1, 2, 3], [completion], finished, error,
                         prompt_logprobs=prompt_logprobs)


# -- ParentRequest -----------------------------------------------------------------------------

def test_children_are_vllm_named_single_samples_with_consecutive_seeds():
    parent = ParentRequest("req", SamplingParams(n=3, seed=2**64 - 2, temperature=0.7, max_tokens=5,
                                                 prompt_logprobs=2))
    assert parent.child_ids == ["0_req", "1_req", "2_req"]
    params = [p for _, p in parent.children]
    assert [p.n for p in params] == [1, 1, 1]
    assert [p.seed for p in params] == [2**64 - 2, 2**64 - 1, 0]  # wraps: seeds live in [0, 2**64)
    assert all(p.temperature == 0.7 and p.max_tokens == 5 for p in params)
    # Only choice 0 computes the prompt's logprobs, so the others may share its cached blocks.
    assert [p.prompt_logprobs for p in params] == [2, None, None]
    assert child_sampling_params(SamplingParams(n=2), 1).seed is None
    assert fans_out(SamplingParams(n=2)) and not fans_out(SamplingParams()) and not fans_out(None)


def test_the_merger_streams_each_choice_and_merges_them_in_index_order():
    parent = ParentRequest("req", SamplingParams(n=3))
    second = child_output("1_req", [7, 8], finished=True)
    choice = parent.add_child_output(second)
    assert (choice.index, choice.delta_token_ids, choice.token_ids) == (1, [8], [7, 8])
    assert second.outputs[0].index == 0  # the child's own output is left as it was
    assert not parent.finished
    merged = parent.make_request_output()
    assert [c.index for c in merged.outputs] == [0, 1, 2]
    assert merged.outputs[0].token_ids == [] and merged.outputs[0].finish_reason is None  # not heard from yet
    assert not merged.finished

    parent.add_child_output(child_output("2_req", [4], finished=True, error="boom"))
    parent.add_child_output(child_output("0_req", [5], finished=False, prompt_logprobs=[None]))
    assert not parent.finished
    assert parent.add_child_output(child_output("0_req", [5, 6], finished=True, prompt_logprobs=[None])).index == 0
    merged = parent.make_request_output()
    assert parent.finished and merged.finished
    assert merged.request_id == "req" and merged.prompt_token_ids == [1, 2, 3]
    assert [c.token_ids for c in merged.outputs] == [[5, 6], [7, 8], [4]]
    assert [c.index for c in merged.outputs] == [0, 1, 2]
    assert merged.error == "boom" and merged.prompt_logprobs == [None]


def test_the_merger_refuses_outputs_of_other_requests():
    parent = ParentRequest("req", SamplingParams(n=2))
    with pytest.raises(ValueError, match="not a child"):
        parent.add_child_output(child_output("2_req", [1], finished=True))
    with pytest.raises(RuntimeError, match="no child"):
        parent.make_request_output()
    with pytest.raises(ValueError, match="request_id"):
        ParentRequest("", SamplingParams(n=2))


# -- offline LLM -------------------------------------------------------------------------------

def test_greedy_n_gives_one_output_per_prompt_with_n_identical_choices(llm):
    params = SamplingParams(n=3, temperature=0, max_tokens=6, ignore_eos=True)
    outputs = llm.generate([PROMPT, "hello world"], params)
    assert len(outputs) == 2
    single = llm.generate([PROMPT, "hello world"], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    for output, alone in zip(outputs, single):
        assert output.finished and [c.index for c in output.outputs] == [0, 1, 2]
        assert all(c.token_ids == alone.outputs[0].token_ids for c in output.outputs)
        assert all(c.text == alone.outputs[0].text for c in output.outputs)
        assert output.prompt_token_ids == alone.prompt_token_ids


def test_seeded_n_equals_separate_requests_with_consecutive_seeds(llm):
    params = SamplingParams(n=3, seed=11, temperature=1.0, max_tokens=8, ignore_eos=True)
    choices = [c.token_ids for c in llm.generate(PROMPT, params)[0].outputs]
    separate = [llm.generate(PROMPT, SamplingParams(seed=11 + i, temperature=1.0, max_tokens=8,
                                                    ignore_eos=True))[0].outputs[0].token_ids for i in range(3)]
    assert choices == separate
    assert len({tuple(c) for c in choices}) > 1  # the seeds differ, so do the samples


def test_the_children_share_the_prompts_kv_blocks(llm):
    llm.engine.core.make_stats()  # reset the prefix-cache counters
    prompt = PROMPT + " a fresh tail so that nothing earlier cached it"
    n = 3
    output = llm.generate(prompt, SamplingParams(n=n, temperature=0, max_tokens=2, prompt_logprobs=1))[0]
    stats = llm.engine.core.make_stats()
    full_blocks = (len(output.prompt_token_ids) - 1) // 4
    # Choice 0 computes the prompt (and its logprobs); the other choices hit its blocks.
    assert stats.prefix_cache_hits == (n - 1) * full_blocks * 4
    assert len(output.prompt_logprobs) == len(output.prompt_token_ids)


def test_chat_with_n_and_an_image_releases_the_parents_lease():
    from tests.server_helpers import data_url

    chat = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(seed=4)}},
                                         {"type": "text", "text": "What is this?"}]}]
    with LLM(tiny_checkpoint("qwen2_vl"), block_size=16) as vl:
        output = vl.chat(chat, SamplingParams(n=2, temperature=0, max_tokens=4, ignore_eos=True))[0]
        assert vl.engine.shm_store.stats()["leased_segments"] == 0
    assert len(output.outputs) == 2 and output.outputs[0].token_ids == output.outputs[1].token_ids
