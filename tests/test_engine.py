"""The engine end to end on tiny checkpoints: greedy output equals transformers' generate, and is
invariant to preemption, prefix caching, batching and chunked prefill; sampling, stops, logprobs;
image chat through LLM.chat with nothing left in shared memory; one bad request fails alone."""

from __future__ import annotations

import pytest
import torch

import shm
from atb_plugin import LLM, SamplingParams
from atb_plugin.testing.tiny import tiny_checkpoint
from shm.segment import list_segment_names
from tests.helpers import write_test_images

PROMPTS = ["hello world", "the cat sat on the mat and then", "a", "numbers: 1 2 3 4 5 6 7 8 9 10 11 12"]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def run(family="qwen2", prompts=PROMPTS, params=GREEDY, **kwargs):
    kwargs.setdefault("block_size", 4)
    with LLM(tiny_checkpoint(family), **kwargs) as llm:
        outputs = llm.generate(prompts, params)
        return [o.outputs[0].token_ids for o in outputs], llm


@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_greedy_equals_transformers_generate(family):
    import transformers

    tokens, llm = run(family)
    cls = {"qwen2": transformers.Qwen2ForCausalLM, "llama": transformers.LlamaForCausalLM}[family]
    reference = cls.from_pretrained(tiny_checkpoint(family)).eval()
    for prompt, ours in zip(PROMPTS, tokens):
        ids = torch.tensor([llm.router.tokenize(prompt)])
        expected = reference.generate(ids, max_new_tokens=12, min_new_tokens=12, do_sample=False,
                                      repetition_penalty=1.0, pad_token_id=0)[0, ids.shape[1]:]
        assert ours == expected.tolist()


def test_output_is_invariant_to_preemption_caching_batching_and_chunking():
    baseline, _ = run(kv_cache_blocks=256)
    preempting, llm = run(kv_cache_blocks=12)  # 11 usable blocks of 4 tokens for 4 requests
    assert llm.engine.scheduler.num_preemptions > 0
    assert preempting == baseline
    assert run(kv_cache_blocks=256, enable_prefix_caching=False)[0] == baseline
    assert run(kv_cache_blocks=256, max_num_batched_tokens=5)[0] == baseline  # chunked prefill
    one_by_one = [run(prompts=[p], kv_cache_blocks=256)[0][0] for p in PROMPTS]
    assert one_by_one == baseline


def test_prefix_cache_hits_a_shared_prefix():
    shared = "one two three four five six seven eight nine ten eleven twelve"
    with LLM(tiny_checkpoint("qwen2"), block_size=4) as llm:
        first = llm.generate(shared + " first", GREEDY)[0]
        second = llm.generate(shared + " second", GREEDY)[0]
    assert first.num_cached_tokens == 0 and second.num_cached_tokens >= 8


def test_seeded_sampling_is_reproducible_whatever_the_batch():
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_tokens=10, ignore_eos=True)
    alone, _ = run(prompts=PROMPTS[:1], params=params)
    batched, _ = run(params=[params] + [SamplingParams(temperature=1.0, max_tokens=10, seed=i) for i in range(3)])
    assert alone[0] == batched[0]


def test_stops_lengths_and_logprobs():
    with LLM(tiny_checkpoint("qwen2"), block_size=4) as llm:
        greedy = llm.generate("hello world", GREEDY)[0].outputs[0]
        stop_token = greedy.token_ids[3]
        by_id = llm.generate("hello world", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                                          stop_token_ids=[stop_token]))[0].outputs[0]
        assert by_id.finish_reason == "stop" and by_id.token_ids == greedy.token_ids[:4]
        text = greedy.text
        stop = text[len(text) // 2:len(text) // 2 + 2]
        by_text = llm.generate("hello world", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                                            stop=[stop]))[0].outputs[0]
        assert by_text.finish_reason == "stop" and stop not in by_text.text and text.startswith(by_text.text)
        assert greedy.finish_reason == "length" and len(greedy.token_ids) == 12
        with_logprobs = llm.generate("hello world", SamplingParams(temperature=0, max_tokens=3, logprobs=2))[0]
        entries = with_logprobs.outputs[0].logprobs
        assert len(entries) == 3 and all(len(e.top_token_ids) == 2 for e in entries)


def test_bad_token_ids_are_refused():
    with LLM(tiny_checkpoint("qwen2"), block_size=4) as llm:
        with pytest.raises(ValueError, match="outside the vocabulary"):
            llm.generate([[1, 2, 10**6]], GREEDY)
        with pytest.raises(ValueError, match="reserved for media handles"):
            llm.generate([[1, -5, 2]], GREEDY)


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen_vl", "llava"])
def test_image_chat_end_to_end_leaves_no_segment(family, tmp_path):
    from input_builders.media_config import MediaConfig

    images = write_test_images(tmp_path)
    chat = [{"role": "user", "content": [{"image": str(images[0])}, {"image": str(images[1])},
                                          {"text": "What is in these pictures?"}]}]
    media = MediaConfig(allowed_local_media_paths=(str(tmp_path),))
    llm = LLM(tiny_checkpoint(family), block_size=16, media_config=media)
    with llm:
        outputs = llm.chat([chat, chat], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
        assert [len(o.outputs[0].token_ids) for o in outputs] == [6, 6]
        assert outputs[0].outputs[0].token_ids == outputs[1].outputs[0].token_ids
        assert llm.engine.shm_store.stats()["requests"] == 0  # leases ended with the requests
        instance = llm.engine.shm_store.instance_id
    assert not [n for n in list_segment_names() if n.startswith("psm_" + instance)]


def test_a_bad_media_block_fails_only_its_request(tmp_path):
    from input_builders.media_config import MediaConfig

    images = write_test_images(tmp_path, sizes=((60, 90),))
    store = shm.ShmStore(shm.ShmStoreConfig(reap_on_start=False, cache_bytes=0))
    media = MediaConfig(allowed_local_media_paths=(str(tmp_path),))
    with LLM(tiny_checkpoint("llava"), block_size=16, media_config=media, shm_store=store) as llm:
        builder = llm.router.input_builder
        ids = builder.make_context(0, [{"role": "user", "content": [{"image": str(images[0])}, {"text": "hi"}]}],
                                   request_id="doomed")
        store.release("doomed")  # cache_bytes=0: the segment is gone before the engine reads it
        llm.engine.add_request("doomed", ids, GREEDY)
        llm.engine.add_request("fine", llm.router.tokenize("hello"), GREEDY)
        outputs = {}
        while llm.engine.has_unfinished_requests():
            for output in llm.engine.step():
                if output.finished:
                    outputs[output.request_id] = output
    assert outputs["doomed"].outputs[0].finish_reason == "error"
    assert "media block 0" in outputs["doomed"].error and "does not exist" in outputs["doomed"].error
    assert outputs["fine"].outputs[0].finish_reason == "length" and len(outputs["fine"].outputs[0].token_ids) == 12
    store.close()


def test_abort_ends_a_running_request_and_frees_its_blocks():
    with LLM(tiny_checkpoint("qwen2"), block_size=4, kv_cache_blocks=64) as llm:
        engine = llm.engine
        engine.add_request("keep", llm.router.tokenize("hello world"), GREEDY)
        engine.add_request("drop", llm.router.tokenize("the cat sat"), GREEDY)
        engine.step()
        aborted = engine.abort_request("drop")
        assert aborted.finished and aborted.outputs[0].finish_reason == "abort"
        assert engine.abort_request("drop") is None  # already gone
        while engine.has_unfinished_requests():
            engine.step()
        assert engine.kv_cache_manager.num_free_blocks == 63  # all back, but the null block
