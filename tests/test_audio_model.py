"""Qwen2-Audio against transformers' ``Qwen2AudioForConditionalGeneration`` on the tiny checkpoint:
the encoder + projector for several clip lengths, full logits for a chat with two clips built by
the real input builder through shared memory, greedy tokens of the offline ``LLM`` against
``generate``, chunked prefill cut inside an audio block, the simulated NPU (fp32 kernels, then
bf16 as a user would start it), and the block layout.

Tolerance 1e-4 (fp32), the image families' (tests/test_models_qwen2_vl.py): transformers runs the
encoder layers over all 1500 positions with the padding masked, we over the valid ones only
(same rows, another summation order), SDPA vs eager, fused QKV / gate-up."""

from __future__ import annotations

import base64
import functools

import pytest
import torch

from atb_plugin import LLM, SamplingParams
from atb_plugin.multimodal import MediaBlockError, MultimodalPrompt
from atb_plugin.multimodal.wire import qwen2_audio_tokens
from atb_plugin.testing import audio_signals as sig
from atb_plugin.testing.sequence import SequenceRunner
from atb_plugin.testing.tiny import tiny_checkpoint
from input_builders.audio import AudioRef, load_audio
from input_builders.conversation import UnsupportedContentError
from input_builders.media_config import MediaConfig
from routers import get_router
from tests.helpers import model_pair

pytest.importorskip("av")

TOLERANCE = 1e-4
BF16_LOGPROB_TOL = 0.15  # tests/test_npu_engine.py: bf16 through a few layers of the tiny models
FAMILY = "qwen2_audio"


pytestmark = pytest.mark.usefixtures("atb_kernel_set")
load_pair = functools.cache(functools.partial(model_pair, FAMILY))


@functools.cache
def clips() -> tuple[bytes, bytes]:
    """A 2.3 s stereo 44.1 kHz flac of speech-like bursts and a 1.1 s mono 16 kHz wav sweep."""
    return (sig.encode(sig.bursts(2.3, 44100, channels=2), 44100, "flac"),
            sig.encode(sig.sweep(1.1, 16000), 16000, "wav"))


def input_audio(data: bytes, fmt: str) -> dict:
    return {"type": "input_audio", "input_audio": {"data": base64.b64encode(data).decode(), "format": fmt}}


def conversation(text="What do you hear?"):
    first, second = clips()
    return [{"role": "user", "content": [input_audio(first, "flac"), input_audio(second, "wav"),
                                         {"type": "text", "text": text}]}]


def hf_inputs(router, conv):
    """transformers' inputs for the same clips: the extractor on our decoded waveforms, the
    template's <|AUDIO|> widened to the processor's count."""
    from transformers import WhisperFeatureExtractor

    extractor = WhisperFeatureExtractor.from_pretrained(tiny_checkpoint(FAMILY))
    waves = [load_audio(AudioRef(part["input_audio"]["data"]), MediaConfig()).samples
             for part in conv[0]["content"] if part["type"] == "input_audio"]
    out = extractor(waves, sampling_rate=16000, return_attention_mask=True, padding="max_length", return_tensors="pt")
    counts = [qwen2_audio_tokens(int(n)) for n in out["attention_mask"].sum(-1)]
    chat = [{"role": "user", "content": [{"type": "audio", "audio": "x"}] * len(waves)
             + [{"type": "text", "text": conv[0]["content"][-1]["text"]}]}]
    text = router.tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    pieces = text.split("<|AUDIO|>")
    widened = pieces[0] + "".join("<|AUDIO|>" * n + rest for n, rest in zip(counts, pieces[1:]))
    ids = torch.tensor(router.tokenizer(widened, add_special_tokens=False)["input_ids"])
    return ids, out["input_features"], out["attention_mask"]


def build_prompt(store):
    router = get_router(tiny_checkpoint(FAMILY), shm_store=store)
    conv = conversation()
    ids = router.input_builder.make_context(0, conv, request_id="r")
    ours, _ = load_pair()
    mm = MultimodalPrompt.from_ids(ids, ours.media_layout, expected_instance=store.instance_id)
    hf_ids, features, mask = hf_inputs(router, conv)
    assert torch.equal(mm.token_ids, hf_ids)  # same prompt, <|AUDIO|> counts included
    assert [block.grid_thw for block in mm.blocks] == [(int(n),) for n in mask.sum(-1)]
    for block, expected in zip(mm.blocks, features):  # the segments hold the extractor's features
        assert block.pixel_values.dtype == torch.float32
        assert (block.pixel_values - expected).abs().max() <= 1e-5
    return mm, hf_ids, features, mask


def hf_logits(reference, ids, features, mask):
    with torch.no_grad():
        return reference(input_ids=ids[None], input_features=features, feature_attention_mask=mask).logits[0]


def max_diff(a, b) -> float:
    return (a - b).abs().max().item()


# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("frames", [11, 12, 101, 734, 2999, 3000])
def test_encoder_rows_match_transformers(frames):
    ours, reference = load_pair()
    features = torch.randn(1, 128, 3000, generator=torch.Generator().manual_seed(frames))
    mask = torch.zeros(1, 3000, dtype=torch.long)
    mask[0, :frames] = 1
    n = qwen2_audio_tokens(frames)
    hidden = reference.config.text_config.hidden_size
    # transformers' audio path: masked tower + projector, the first n rows (its forward's merge).
    placeholder = torch.full((1, n), reference.config.audio_token_id)
    with torch.no_grad():
        embeds = reference.get_input_embeddings()(placeholder)
        captured = {}
        handle = reference.model.multi_modal_projector.register_forward_hook(
            lambda module, args, out: captured.setdefault("rows", out))
        reference(input_ids=placeholder, input_features=features, feature_attention_mask=mask)
        handle.remove()
        got = ours.get_multimodal_embeddings(features[0], (frames,))
    assert got.shape == (n, hidden) and embeds.shape[-1] == hidden
    assert max_diff(got, captured["rows"][0, :n]) <= TOLERANCE


def test_logits_match_transformers_for_two_clips(store):
    ours, reference = load_pair()
    mm, ids, features, mask = build_prompt(store)
    got = SequenceRunner(ours, max_len=len(ids)).step(ids, inputs_embeds=mm.embed(ours))
    assert max_diff(got, hf_logits(reference, ids, features, mask)) <= TOLERANCE


def test_chunked_prefill_cut_inside_audio_blocks_equals_unchunked(store):
    ours, _ = load_pair()
    mm, ids, _, _ = build_prompt(store)
    whole = SequenceRunner(ours, max_len=len(ids)).step(ids, inputs_embeds=mm.embed(ours))
    first, second = mm.blocks
    cuts = [0, first.start + 1, first.start + 20, second.start + 2, len(ids)]
    runner = SequenceRunner(ours, max_len=len(ids), block_size=4)
    chunks = [runner.step(ids[s:e], torch.arange(s, e), inputs_embeds=mm.embed(ours, s, e))
              for s, e in zip(cuts[:-1], cuts[1:])]
    assert max_diff(torch.cat(chunks), whole) <= TOLERANCE


def test_offline_greedy_tokens_equal_transformers_generate(store):
    _, reference = load_pair()
    router = get_router(tiny_checkpoint(FAMILY))
    ids, features, mask = hf_inputs(router, conversation())
    with torch.no_grad():
        expected = reference.generate(input_ids=ids[None], attention_mask=torch.ones_like(ids)[None],
                                      input_features=features, feature_attention_mask=mask, do_sample=False,
                                      max_new_tokens=8, min_new_tokens=8)[0, len(ids):].tolist()
    with LLM(tiny_checkpoint(FAMILY), block_size=16) as llm:
        out = llm.chat(conversation(), SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
        assert out.prompt_token_ids is None or len(out.prompt_token_ids) == len(ids)
        assert list(out.outputs[0].token_ids) == expected
        # A follow-up turn resending both clips reuses their segments: same handles, prefix cache hit.
        again = llm.chat(conversation(), SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
        assert list(again.outputs[0].token_ids) == expected
        assert (again.num_cached_tokens or 0) > len(ids) // 2


def test_npu_path_equals_cpu_path():
    """The encoder's attention on the simulated torch_npu (``_npu_flash_attention_unpad``) and the
    decoder's ATB kernels, fp32: the same rows and logits as the CPU kernels."""
    fake_torch_npu = pytest.importorskip("atb_plugin.testing.fake_torch_npu")
    from atb_plugin.platform import reset_current_platform, use_platform

    ours, _ = load_pair()
    features = torch.randn(128, 3000, generator=torch.Generator().manual_seed(5))
    frames = 733
    n = qwen2_audio_tokens(frames)
    ids = torch.cat([torch.tensor([1, 2, 3]), torch.full((n,), ours.config.audio_token_id), torch.tensor([4, 5, 6])])

    def run():
        rows = ours.get_multimodal_embeddings(features, (frames,))
        embeds = ours.get_input_embeddings(ids)
        embeds[3:3 + n] = rows
        runner = SequenceRunner(ours, max_len=len(ids), block_size=16)
        logits = [runner.step(ids[s:e], torch.arange(s, e), inputs_embeds=embeds[s:e])
                  for s, e in ((0, 100), (100, len(ids) - 2))]
        logits += [runner.step(ids[i:i + 1], torch.arange(i, i + 1), inputs_embeds=embeds[i:i + 1])
                   for i in range(len(ids) - 2, len(ids))]
        return rows, torch.cat(logits)

    with torch.no_grad():
        cpu_rows, cpu_logits = run()
        handle = fake_torch_npu.install(allow_fp32_attention=True)
        try:
            with use_platform("npu"):
                npu_rows, npu_logits = run()
            calls = dict(handle.module.calls)
        finally:
            handle.uninstall()
            reset_current_platform()
    assert calls.get("_npu_flash_attention_unpad") and calls.get("_npu_reshape_and_cache")
    assert max_diff(npu_rows, cpu_rows) <= TOLERANCE
    assert max_diff(npu_logits, cpu_logits) <= TOLERANCE


def test_bf16_on_the_simulated_npu_matches_the_cpu_path(monkeypatch):
    """As a user starts it on Ascend (bf16, block size 128): first-step log-probabilities within
    bf16's tolerance (tests/test_npu_engine.py explains 0.15)."""
    from atb_plugin.platform import use_platform
    from atb_plugin.testing import fake_torch_npu

    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, logprobs=5)
    with LLM(tiny_checkpoint(FAMILY), block_size=16) as llm:
        cpu = llm.chat(conversation(), params)[0].outputs[0]
    monkeypatch.setenv("ATB_PLUGIN_NPU_KERNELS", "atb")
    with fake_torch_npu.install() as fake, use_platform("npu"):
        with LLM(tiny_checkpoint(FAMILY)) as llm:
            assert llm.engine.config.dtype == "bfloat16"
            npu = llm.chat(conversation(), params)[0].outputs[0]
        assert fake.module.calls["_npu_flash_attention_unpad"] > 0  # the audio encoder ran on the NPU path
    cpu_top = dict(zip(cpu.logprobs[0].top_token_ids, cpu.logprobs[0].top_logprobs))
    npu_top = dict(zip(npu.logprobs[0].top_token_ids, npu.logprobs[0].top_logprobs))
    diffs = {t: abs(cpu_top[t] - npu_top[t]) for t in set(cpu_top) & set(npu_top)}
    assert diffs and max(diffs.values()) <= BF16_LOGPROB_TOL, diffs


# ------------------------------------------------------------------------------------------------
# layout, limits and refusals


def test_block_layout(store):
    ours, _ = load_pair()
    mm, ids, _, mask = build_prompt(store)
    layout = ours.media_layout
    assert layout.placeholder_id == ours.config.audio_token_id and layout.num_metadata_slots == 3
    for block, frames in zip(mm.blocks, mask.sum(-1).tolist()):
        assert block.length == qwen2_audio_tokens(frames)
        assert tuple(block.pixel_values.shape) == (128, 3000)
    # the FRAMES slot must be one positive dim
    raw = list(get_router(tiny_checkpoint(FAMILY), shm_store=store).input_builder.make_context(
        0, conversation(), request_id="r2"))
    start = mm.blocks[0].start
    from shm import encode_shape_to_int64
    raw[start + 2] = encode_shape_to_int64((1, 2, 3))
    with pytest.raises(MediaBlockError, match="FRAMES decodes to"):
        MultimodalPrompt.from_ids(raw, layout, expected_instance=store.instance_id)
    store.release("r")
    store.release("r2")


def test_limits_and_refusals(store, tmp_path):
    router = get_router(tiny_checkpoint(FAMILY), shm_store=store, max_images_per_prompt=1)
    with pytest.raises(Exception, match="at most 1 per prompt"):
        router.input_builder.make_context(0, conversation(), request_id="r")
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    with pytest.raises(UnsupportedContentError, match="without image input"):
        router.input_builder.make_context(0, [{"role": "user", "content": [image]}], request_id="r")
    # audio to a model without audio support
    text_router = get_router(tiny_checkpoint("qwen2"), shm_store=store)
    with pytest.raises(UnsupportedContentError, match="without audio input"):
        text_router.input_builder.make_context(0, conversation(), request_id="r")
    # a clip too short for one block (< 11 mel frames)
    short = sig.encode(sig.tones(0.05, 16000), 16000, "wav")
    with pytest.raises(Exception, match="shortest clip"):
        router.input_builder.make_context(0, [{"role": "user", "content": [input_audio(short, "wav")]}],
                                          request_id="r")
    # MindIE's {"audio": path} and vLLM's audio_url under the allowed directory
    path = tmp_path / "clip.wav"
    path.write_bytes(clips()[1])
    router = get_router(tiny_checkpoint(FAMILY), shm_store=store,
                        media_config=MediaConfig(allowed_local_media_paths=(str(tmp_path),)))
    mindie = router.input_builder.make_context(0, [{"role": "user", "content": [{"audio": str(path)}]}],
                                               request_id="r")
    vllm = router.input_builder.make_context(
        0, [{"role": "user", "content": [{"type": "audio_url", "audio_url": {"url": f"file://{path}"}}]}],
        request_id="r")
    assert mindie == vllm and sum(1 for t in mindie if t < 0) == 3
    # the non-chat form (MindIE's item list): "Audio 1: <|audio_bos|> block <|audio_eos|>" then the text
    prompt = router.tokenize([{"audio": str(path)}, {"text": "Transcribe."}], request_id="r")
    tokenizer = router.tokenizer
    assert tokenizer.decode([t for t in prompt if t >= 0 and t != ours_audio_id()]) == \
        "Audio 1: <|audio_bos|><|audio_eos|>\nTranscribe."
    assert sum(1 for t in prompt if t < 0) == 3
    store.release("r")


def ours_audio_id() -> int:
    return load_pair()[0].config.audio_token_id


def test_the_memory_profile_feeds_the_worst_case_window():
    """The start-up profile's item: a full 30 s window of float32 features (whatever the image
    wire dtype), 750 rows, as many as the prompt may carry."""
    from atb_plugin.engine.config import EngineConfig
    from atb_plugin.engine.memory_profile import dummy_inputs
    from atb_plugin.multimodal.prompt import encode_pixels

    ours, _ = load_pair()
    config = EngineConfig(tiny_checkpoint(FAMILY), kv_cache_blocks=8)
    info = ours.get_processing_info(config.model)
    inputs = dummy_inputs(ours, config)
    assert info.modality == "audio" and inputs.num_items == config.limit_mm_per_prompt == 4
    assert inputs.item.pixel_values.dtype == torch.float32 and tuple(inputs.item.pixel_values.shape) == (128, 3000)
    with torch.no_grad():
        rows = encode_pixels(ours, inputs.item.pixel_values, inputs.item.grid_thw)
    assert rows.shape[0] == info.max_tokens_per_item == 750
    assert dummy_inputs(ours, config.replace(limit_mm_per_prompt=2)).num_items == 2
    with pytest.raises(ValueError, match="at most 4 audio clips per prompt"):
        EngineConfig(tiny_checkpoint(FAMILY), kv_cache_blocks=8, limit_mm_per_prompt=5)


def test_limit_mm_per_prompt_may_name_the_modality():
    from atb_plugin.server.cli import parse_config

    model = str(tiny_checkpoint(FAMILY))
    assert parse_config(["--model", model, "--limit-mm-per-prompt", "audio=2"]).engine.limit_mm_per_prompt == 2
    assert parse_config(["--model", model, "--limit-mm-per-prompt", "3"]).engine.limit_mm_per_prompt == 3
    with pytest.raises(SystemExit):
        parse_config(["--model", model, "--limit-mm-per-prompt", "image=2"])  # this model takes audio
    with pytest.raises(SystemExit):
        parse_config(["--model", model, "--limit-mm-per-prompt", "speech=2"])
    media = parse_config(["--model", model, "--max-audio-bytes", "1M", "--max-audio-seconds", "60"]).media_config()
    assert (media.max_audio_bytes, media.max_audio_seconds, media.api) == (1 << 20, 60.0, "server")


def test_a_clip_longer_than_30_seconds_is_several_abutting_blocks(store):
    """35 s: a full window (3000 frames, 750 rows) and a 5 s one (500 frames, 125 rows), back to
    back inside one <|audio_bos|> ... <|audio_eos|>; the first window's segment is what the
    extractor gives for the first 30 s, and the engine answers."""
    from transformers import WhisperFeatureExtractor

    ours, _ = load_pair()
    clip = sig.encode(sig.bursts(35.0, 16000), 16000, "flac")
    conv = [{"role": "user", "content": [input_audio(clip, "flac"), {"type": "text", "text": "Summarise."}]}]
    router = get_router(tiny_checkpoint(FAMILY), shm_store=store)
    ids = router.input_builder.make_context(0, conv, request_id="r")
    mm = MultimodalPrompt.from_ids(ids, ours.media_layout, expected_instance=store.instance_id)
    assert [(b.grid_thw, b.length) for b in mm.blocks] == [((3000,), 750), ((500,), 125)]
    assert mm.blocks[1].start == mm.blocks[0].start + 750  # abutting
    wave = load_audio(AudioRef(conv[0]["content"][0]["input_audio"]["data"]), MediaConfig()).samples
    expected = WhisperFeatureExtractor(feature_size=128)(wave[:480000], sampling_rate=16000,
                                                         return_tensors="pt")["input_features"][0]
    assert (mm.blocks[0].pixel_values - expected).abs().max() <= 1e-5
    store.release("r")
    with LLM(tiny_checkpoint(FAMILY), block_size=16) as llm:
        out = llm.chat(conv, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 3 and len(out.prompt_token_ids) == len(ids)
