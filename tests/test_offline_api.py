"""What a new user of the offline API meets: the text of a stop token is not in the output
(unless asked for), errors name the offline API's knobs, an empty conversation is an error, and
an embedding checkpoint is refused with a message saying what it is."""

from __future__ import annotations

import pytest

from atb_plugin import LLM, SamplingParams
from atb_plugin.testing.tiny import tiny_checkpoint

GREEDY = dict(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def llm():
    with LLM(tiny_checkpoint("qwen2"), block_size=4) as llm:
        yield llm


def first_new_token(token_ids, tokenizer) -> int:
    """The index of a token with visible text that does not occur earlier in the output."""
    return next(i for i, t in enumerate(token_ids)
                if i > 0 and t not in token_ids[:i] and tokenizer.decode([t]).strip())


def test_the_text_of_a_stop_token_id_is_dropped_unless_asked_for(llm):
    tokenizer = llm.router.tokenizer
    base = llm.generate("hello world", SamplingParams(**GREEDY))[0].outputs[0]
    # A plain (non-special) token as the stop token: its text would show unless dropped.
    index = first_new_token(base.token_ids, tokenizer)
    stop = base.token_ids[index]
    dropped = llm.generate("hello world", SamplingParams(**GREEDY, stop_token_ids=[stop]))[0].outputs[0]
    kept = llm.generate("hello world", SamplingParams(**GREEDY, stop_token_ids=[stop],
                                                      include_stop_str_in_output=True))[0].outputs[0]
    assert dropped.finish_reason == kept.finish_reason == "stop"
    assert dropped.token_ids == kept.token_ids == base.token_ids[:index + 1]  # the id is still reported
    assert dropped.text == tokenizer.decode(base.token_ids[:index], skip_special_tokens=True)
    assert kept.text == tokenizer.decode(base.token_ids[:index + 1], skip_special_tokens=True)


def test_the_text_of_an_eos_token_is_dropped_even_when_special_tokens_are_kept(llm):
    tokenizer = llm.router.tokenizer
    base = llm.generate("hello world", SamplingParams(**GREEDY))[0].outputs[0]
    index = first_new_token(base.token_ids, tokenizer)
    eos = base.token_ids[index]
    llm.engine.eos_token_ids = (eos,)  # pretend this token is the model's EOS
    try:
        params = dict(temperature=0, max_tokens=12, skip_special_tokens=False)
        dropped = llm.generate("hello world", SamplingParams(**params))[0].outputs[0]
        kept = llm.generate("hello world", SamplingParams(**params, include_stop_str_in_output=True))[0].outputs[0]
    finally:
        llm.engine.eos_token_ids = tuple(llm.router.eos_token_ids)
    assert dropped.token_ids == base.token_ids[:index + 1] and dropped.finish_reason == "stop"
    assert dropped.text == tokenizer.decode(base.token_ids[:index])
    assert kept.text == tokenizer.decode(base.token_ids[:index + 1])


def test_a_stop_string_is_kept_only_when_asked_for(llm):
    text = llm.generate("hello world", SamplingParams(**GREEDY))[0].outputs[0].text
    stop = text[len(text) // 2:len(text) // 2 + 2]
    cut = llm.generate("hello world", SamplingParams(**GREEDY, stop=[stop]))[0].outputs[0].text
    kept = llm.generate("hello world", SamplingParams(**GREEDY, stop=[stop], include_stop_str_in_output=True))
    assert stop not in cut and kept[0].outputs[0].text == cut + stop


def test_an_empty_conversation_is_an_error(llm):
    with pytest.raises(ValueError, match="non-empty"):
        llm.chat([])
    with pytest.raises(ValueError, match="non-empty"):
        llm.chat([[{"role": "user", "content": "hi"}], []])


def test_a_refused_image_names_the_offline_knob(llm, tmp_path):
    from tests.helpers import write_test_images

    image = write_test_images(tmp_path, sizes=((30, 30),))[0]
    with pytest.raises(ValueError) as caught:
        with LLM(tiny_checkpoint("qwen2_vl"), block_size=16) as vl:
            vl.chat([{"role": "user", "content": [{"image": str(image)}, {"text": "hi"}]}])
    assert "media_config=MediaConfig(allowed_local_media_paths=" in str(caught.value)
    assert "--allowed-local-media-path" not in str(caught.value)


@pytest.mark.parametrize("family", ["qwen2_vl", "llava"])  # patches and CHW (Qwen-VL is CHW too)
def test_both_wire_dtypes_give_the_same_tokens_and_leave_no_segment(family):
    """MindIE's float32 wire and the default uint8 wire (normalised on the device, bit-exact on
    CPU) are interchangeable: same greedy tokens, same logprobs; every segment freed at close."""
    from shm.segment import list_segment_names, parse_name, read_header
    from tests.server_helpers import data_url

    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(seed=4)}},
                                             {"type": "text", "text": "What is this?"}]}]
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logprobs=1)
    before = set(list_segment_names())
    outputs = {}
    for wire in ("uint8", "float32"):
        with LLM(tiny_checkpoint(family), block_size=16, mm_wire_dtype=wire) as llm:
            outputs[wire] = llm.chat(messages, params)[0].outputs[0]
            written = [name for name in set(list_segment_names()) - before if not parse_name(name)[1]]
            assert len(written) == 1  # the image (the store's marker aside)
            assert str(read_header(written[0]).dtype) == wire
        assert set(list_segment_names()) <= before  # closed: nothing left behind
    assert outputs["uint8"].token_ids == outputs["float32"].token_ids
    assert outputs["uint8"].logprobs == outputs["float32"].logprobs


def test_generation_on_an_embedding_checkpoint_is_refused_with_what_it_serves():
    with LLM(tiny_checkpoint("bert")) as llm:
        with pytest.raises(ValueError, match=r"is a pooling model \(tasks: embed, token_embed\); it does not generate"):
            llm.generate("hello")
        with pytest.raises(ValueError, match=r"does not serve task 'classify'; it serves embed, token_embed"):
            llm.classify("hello")
    with pytest.raises(ValueError, match=r"BertModel is a pooling model .* cannot run with runner=generate"):
        LLM(tiny_checkpoint("bert"), runner="generate")


def test_the_shm_cache_size_is_an_llm_argument():
    from shm.segment import list_segment_names

    with LLM(tiny_checkpoint("qwen2"), block_size=4, shm_cache_bytes=1 << 20) as small:
        assert small.engine.shm_store.cache_bytes == 1 << 20
        instance = small.engine.shm_store.instance_id
    assert not [n for n in list_segment_names() if n.startswith("psm_" + instance)]  # its own store: closed
    with pytest.raises(ValueError, match="not both"):
        LLM(tiny_checkpoint("qwen2"), shm_cache_bytes=0, shm_store=object())


def test_the_engine_owns_the_threads_it_is_given():
    import torch

    from atb_plugin.utils import available_cores

    before = torch.get_num_threads()
    try:
        with LLM(tiny_checkpoint("qwen2"), block_size=16, num_threads=1) as llm:
            assert llm.engine.config.num_threads == 1 and torch.get_num_threads() == 1
        with LLM(tiny_checkpoint("qwen2"), block_size=16) as llm:  # default: every core it may use
            assert llm.engine.config.num_threads == available_cores() == torch.get_num_threads()
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen_vl"])
def test_a_resent_image_held_by_the_prefix_cache_is_not_encoded_again(family, monkeypatch):
    """Turn 2 of a chat that resends turn 1's image: the image's KV comes from the prefix cache,
    so the encoder does not run for it, and the answer equals a run that encodes it (no cache)."""
    from tests.server_helpers import data_url

    image = {"type": "image_url", "image_url": {"url": data_url(seed=8)}}
    turn1 = [{"role": "user", "content": [image, {"type": "text", "text": "What is this?"}]}]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    answers, encoded = {}, {}
    for caching in (True, False):
        with LLM(tiny_checkpoint(family), block_size=16, enable_prefix_caching=caching) as llm:
            model = llm.engine.runner.model
            calls = []
            encode = model.get_multimodal_embeddings
            monkeypatch.setattr(model, "get_multimodal_embeddings", lambda *a, **k: calls.append(1) or encode(*a, **k))
            first = llm.chat(turn1, params)[0].outputs[0].text
            turn2 = turn1 + [{"role": "assistant", "content": first},
                             {"role": "user", "content": [image, {"type": "text", "text": "And now?"}]}]
            calls.clear()
            output = llm.chat(turn2, params)[0]
            answers[caching], encoded[caching] = output.outputs[0].token_ids, len(calls)
            if caching:
                assert output.num_cached_tokens > 0
    # Turn 2 holds two image blocks: with the cache, only the second (new position) is encoded.
    assert encoded == {True: 1, False: 2}
    assert answers[True] == answers[False]
