"""Pooling models: runner/convert resolution, poolers against hand-computed tensors, dispatch of
mixed tasks in one batch, adapters and native pooling models against transformers on the same
weights, and all-MiniLM-L6-v2 against the sentence-transformers pipeline.

Tolerances: 1e-5 absolute on float32 outputs (embeddings are unit vectors, probabilities in
[0, 1]): the same weights and formula in float32, differing only in summation order (packed
varlen attention vs a padded batch, index_add vs masked sum)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import transformers

from atb_plugin.default_model import embedding_model_dir
from atb_plugin.frontend.llm import LLM
from atb_plugin.models.poolers import DispatchPooler, PoolingBatch, classifier_pooler, embedding_pooler, pool_rows
from atb_plugin.pooling.config import PoolerConfig, pooler_config, resolve_runner
from atb_plugin.pooling.params import PoolingParams
from atb_plugin.testing.tiny import tiny_checkpoint

ATOL = 1e-5


# -- runner / convert resolution ---------------------------------------------------------------

@pytest.mark.parametrize("architecture, expected", [
    ("Qwen2ForCausalLM", ("generate", "none")),
    ("Qwen2VLForConditionalGeneration", ("generate", "none")),
    ("QWenLMHeadModel", ("generate", "none")),
    ("GteNewForTextEncoding", ("pooling", "embed")),
    ("BertEmbeddingModel", ("pooling", "embed")),
    ("Qwen2ForSequenceClassification", ("pooling", "classify")),
    ("BertForTokenClassification", ("pooling", "classify")),  # *For*Classification
    ("Qwen2ForRewardModel", ("pooling", "reward")),
    ("InternLM2ForRewardModeling", ("pooling", "reward")),
    ("BertModel", ("pooling", "embed")),  # "*Model" is the catch-all, matched last
    ("SomethingUnknown", ("generate", "none")),
])
def test_auto_resolves_from_the_architecture_suffix(architecture, expected):
    choice = resolve_runner(architecture)
    assert (choice.runner, choice.convert) == expected


@pytest.mark.parametrize("architecture, runner, convert, expected", [
    ("Qwen2ForCausalLM", "pooling", "auto", ("pooling", "embed")),  # vLLM: a generative model pools as embed
    ("Qwen2ForCausalLM", "auto", "classify", ("pooling", "classify")),
    ("Qwen2ForCausalLM", "pooling", "reward", ("pooling", "reward")),
    ("BertModel", "pooling", "embed", ("pooling", "embed")),
])
def test_explicit_runner_or_convert_overrides(architecture, runner, convert, expected):
    choice = resolve_runner(architecture, runner, convert)
    assert (choice.runner, choice.convert) == expected


@pytest.mark.parametrize("architecture, runner, convert, message", [
    ("Qwen2ForCausalLM", "generate", "embed", r"runner=generate with convert=embed is not a valid combination "
                                              r"\(runner=generate: convert in \{none\}; runner=pooling: convert in "
                                              r"\{none, embed, classify, reward\}\)"),
    ("BertModel", "generate", "auto", r"BertModel is a pooling model .* cannot run with runner=generate"),
    ("Qwen2ForCausalLM", "pooling", "none", r"is a generative model: to serve it as a pooling model pick a convert"),
    ("BertModel", "pooling", "classify", r"native embed model; convert=classify does not apply"),
    ("Qwen2ForCausalLM", "draft", "auto", r"runner 'draft' is not one of auto, generate, pooling"),
])
def test_invalid_combinations_list_the_valid_ones(architecture, runner, convert, message):
    with pytest.raises(ValueError, match=message):
        resolve_runner(architecture, runner, convert)


def test_pooler_config_comes_from_the_checkpoint_files_else_the_default(tmp_path):
    assert pooler_config(tiny_checkpoint("bert"), "CLS") == PoolerConfig("MEAN", normalize=True)
    assert pooler_config(tiny_checkpoint("qwen2"), "LAST") == PoolerConfig("LAST", normalize=True)
    assert pooler_config(tiny_checkpoint("bert"), "CLS", {"pooling_type": "CLS", "normalize": False}) == \
        PoolerConfig("CLS", normalize=False)
    shutil.copytree(tiny_checkpoint("bert"), tmp_path / "m")
    (tmp_path / "m" / "modules.json").write_text(json.dumps([{"idx": 1, "path": "1_Pooling",
                                                              "type": "sentence_transformers.models.Pooling"}]))
    assert pooler_config(tmp_path / "m", "CLS") == PoolerConfig("MEAN", normalize=False)  # no Normalize module
    (tmp_path / "m" / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_max_tokens": True}))
    with pytest.raises(ValueError, match=r"pooling \['pooling_mode_max_tokens'\] is not supported"):
        pooler_config(tmp_path / "m", "CLS")


def test_pooling_params_are_validated():
    with pytest.raises(ValueError, match="task must be one of embed, token_embed, classify, token_classify, score"):
        PoolingParams("generate")
    with pytest.raises(ValueError, match="dimensions applies to embeddings only"):
        PoolingParams("classify", dimensions=4)
    with pytest.raises(ValueError, match="dimensions must be >= 1"):
        PoolingParams("embed", dimensions=0)
    with pytest.raises(ValueError, match="normalize must be a bool"):
        PoolingParams("embed", normalize="yes")
    assert PoolingParams("token_classify").use_activation is False  # raw rewards by default
    assert PoolingParams("classify").use_activation is True


def test_the_pooling_types_import_no_torch():
    # atb_plugin.pooling is the API process's: the torch side is atb_plugin.models.poolers / pooling_adapters.
    code = ("import sys, atb_plugin.pooling.config, atb_plugin.pooling.params, atb_plugin.pooling.inputs, "
            "atb_plugin.pooling.outputs; assert 'torch' not in sys.modules, 'torch was imported'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[1])


# -- poolers on hand-computed tensors ------------------------------------------------------------

# Three requests packed as in a step: lengths 2, 3, 1.
HIDDEN = torch.tensor([[1., 0.], [3., 4.], [0., 2.], [2., 2.], [4., 0.], [6., 8.]])
TOKENS = torch.tensor([7, 9, 9, 5, 9, 3])
QSL = torch.tensor([0, 2, 5, 6], dtype=torch.int32)


def _batch(*params):
    params = list(params) or [PoolingParams()] * 3
    return PoolingBatch.from_query_start_loc(QSL, params, TOKENS)


def test_pooling_methods_by_hand():
    batch = _batch()
    assert pool_rows(HIDDEN, batch, "CLS").tolist() == [[1, 0], [0, 2], [6, 8]]
    assert pool_rows(HIDDEN, batch, "LAST").tolist() == [[3, 4], [4, 0], [6, 8]]
    assert torch.allclose(pool_rows(HIDDEN, batch, "MEAN"), torch.tensor([[2., 2.], [2., 4 / 3], [6., 8.]]))
    assert [t.tolist() for t in pool_rows(HIDDEN, batch, "ALL")] == [[[1, 0], [3, 4]], [[0, 2], [2, 2], [4, 0]], [[6, 8]]]
    steps = pool_rows(HIDDEN, batch, "STEP", step_tag_id=9)  # the rows at token 9
    assert [t.tolist() for t in steps] == [[[3, 4]], [[0, 2], [4, 0]], []]
    # A subset (what dispatch hands each task) pools only its requests, from the same hidden states.
    assert pool_rows(HIDDEN, batch.subset([2, 0]), "MEAN").tolist() == [[6, 8], [2, 2]]


def test_embedding_head_normalises_and_cuts_dimensions():
    pooler = embedding_pooler(PoolerConfig("LAST"))
    out = pooler(HIDDEN, _batch(PoolingParams(), PoolingParams(normalize=False), PoolingParams(dimensions=1)))
    assert torch.allclose(out[0], torch.tensor([0.6, 0.8]))
    assert out[1].tolist() == [4, 0]
    assert out[2].tolist() == [1.0]  # Matryoshka: the first dimension, then normalised
    token_level = embedding_pooler(PoolerConfig("LAST"), token_level=True)(HIDDEN, _batch())
    assert torch.allclose(token_level[0], torch.tensor([[1., 0.], [0.6, 0.8]]))


def test_classifier_head_softmax_sigmoid_and_raw():
    weight = torch.tensor([[1., 0.], [0., 1.]])
    two_labels = classifier_pooler(PoolerConfig("LAST"), lambda x: x @ weight.t())
    out = two_labels(HIDDEN, _batch(PoolingParams("classify"), PoolingParams("classify", activation=False),
                                    PoolingParams("classify")))
    assert torch.allclose(out[0], torch.softmax(torch.tensor([3., 4.]), -1))
    assert out[1].tolist() == [4, 0]
    one_label = classifier_pooler(PoolerConfig("CLS"), lambda x: x[:, :1])
    assert torch.allclose(one_label(HIDDEN, _batch(*[PoolingParams("score")] * 3))[2], torch.sigmoid(torch.tensor([6.])))
    per_token = classifier_pooler(PoolerConfig("ALL"), lambda x: x[:, 1:], token_level=True)
    assert per_token(HIDDEN, _batch(*[PoolingParams("token_classify")] * 3))[1].tolist() == [[2], [2], [0]]


def test_dispatch_groups_tasks_and_keeps_batch_order():
    config = PoolerConfig("LAST", normalize=False)
    dispatch = DispatchPooler({"embed": embedding_pooler(config), "token_embed": embedding_pooler(config, True),
                               "classify": classifier_pooler(config, lambda x: x.sum(-1, keepdim=True))})
    out = dispatch(HIDDEN, _batch(PoolingParams("classify"), PoolingParams("token_embed", normalize=False),
                                  PoolingParams("embed")))
    assert torch.allclose(out[0], torch.sigmoid(torch.tensor([7.])))
    assert out[1].tolist() == [[0, 2], [2, 2], [4, 0]]
    assert out[2].tolist() == [6, 8]
    with pytest.raises(ValueError, match="does not serve task 'score'"):
        dispatch(HIDDEN, _batch(*[PoolingParams("score")] * 3))


# -- the engine: mixed tasks in one step, KV freed, truncation ----------------------------------

def test_mixed_tasks_run_in_one_step_and_free_their_blocks():
    with LLM(tiny_checkpoint("qwen2_seq_cls")) as llm:
        engine = llm.engine
        prompts = ["hello there", "good bye", "nice to see you again"]
        params = [PoolingParams("classify"), PoolingParams("token_classify"), PoolingParams("score")]
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            engine.add_request(str(i), llm.router.tokenize(prompt), p)
        outputs = engine.step()  # one step pools all three
        assert sorted(o.request_id for o in outputs) == ["0", "1", "2"] and all(o.finished for o in outputs)
        assert engine.kv_cache_manager.usage == 0.0 and not engine.has_unfinished_requests()
        by_id = {o.request_id: o.outputs.data for o in outputs}
        assert by_id["0"].shape == (3,) and abs(by_id["0"].sum() - 1) < 1e-6
        assert by_id["1"].shape == (len(llm.router.tokenize(prompts[1])), 3)  # raw per-token logits
        alone = llm.encode(prompts[:1], PoolingParams("classify"))[0].outputs.data
        np.testing.assert_allclose(by_id["0"], alone, atol=ATOL)


def test_pooling_turns_prefix_caching_off_and_takes_whole_prompts():
    with LLM(tiny_checkpoint("qwen2"), runner="pooling", max_num_batched_tokens=16, max_model_len=64) as llm:
        config = llm.engine.config
        assert not config.enable_prefix_caching and config.max_num_batched_tokens == 64
        long = list(range(1, 61))  # 60 tokens: more than the requested budget of 16, one step anyway
        [output] = llm.encode([long], task="token_embed")
        assert output.outputs.data.shape == (60, 64)


def test_truncation_keeps_the_start_and_too_long_is_an_error():
    with LLM(tiny_checkpoint("bert"), max_model_len=16) as llm:
        text = " ".join(["hello"] * 40)
        with pytest.raises(ValueError, match=r"maximum context length is 16 tokens\. However, your request has 42"):
            llm.embed(text)
        [cut] = llm.embed(text, truncate_prompt_tokens=-1)
        assert len(cut.prompt_token_ids) == 16
        assert cut.prompt_token_ids[0] == 101 and cut.prompt_token_ids[-1] == 102  # [CLS] … [SEP] kept
        [eight] = llm.embed([[101] + [281] * 20], truncate_prompt_tokens=8)  # token ids: the first 8
        assert eight.prompt_token_ids == [101] + [281] * 7
        with pytest.raises(ValueError, match="truncate_prompt_tokens = 17 is larger than max_model_len"):
            llm.embed(text, truncate_prompt_tokens=17)


def test_dimensions_need_a_matryoshka_model(tmp_path):
    with LLM(tiny_checkpoint("bert")) as llm:
        with pytest.raises(ValueError, match="does not support matryoshka representation"):
            llm.embed("hello", dimensions=8)
    with LLM(tiny_checkpoint("bert"), hf_overrides={"is_matryoshka": True}) as llm:
        [full] = llm.embed("hello", normalize=False)
        [cut] = llm.embed("hello", dimensions=8)
        expected = F.normalize(torch.tensor(full.outputs.embedding[:8]), dim=0)
        np.testing.assert_allclose(cut.outputs.embedding, expected.numpy(), atol=ATOL)
        with pytest.raises(ValueError, match="dimensions = 33 exceeds the embedding size 32"):
            llm.embed("hello", dimensions=33)


# -- parity with transformers on the same weights ----------------------------------------------

TEXTS = ["hello there", "a somewhat longer sentence about the weather and other things", "x"]


def _hf_hidden(model_dir, text, cls=transformers.AutoModel):
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    model = cls.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = tokenizer(text, return_tensors="pt")
    with torch.no_grad():
        return model, ids, model(**ids, output_hidden_states=True)


def test_qwen2_converted_to_embed_matches_its_last_hidden_state():
    with LLM(tiny_checkpoint("qwen2"), runner="pooling") as llm:
        ours = llm.embed(TEXTS)
    for text, output in zip(TEXTS, ours):
        _, _, hf = _hf_hidden(tiny_checkpoint("qwen2"), text, transformers.Qwen2Model)
        expected = F.normalize(hf.last_hidden_state[0, -1], dim=0)
        np.testing.assert_allclose(output.outputs.embedding, expected.numpy(), atol=ATOL)


def test_llama_converted_to_embed_matches_its_last_hidden_state():
    with LLM(tiny_checkpoint("llama"), runner="pooling") as llm:
        [output] = llm.embed(TEXTS[1:2])
    _, _, hf = _hf_hidden(tiny_checkpoint("llama"), TEXTS[1], transformers.LlamaModel)
    np.testing.assert_allclose(output.outputs.embedding, F.normalize(hf.last_hidden_state[0, -1], dim=0).numpy(),
                               atol=ATOL)


@pytest.mark.parametrize("family", ["qwen2_vl", "llava", "qwen_vl"])
def test_vision_language_families_convert_too(family):
    """The adapter drops the head inside the language model; text prompts embed."""
    with LLM(tiny_checkpoint(family), runner="pooling") as llm:
        assert llm.engine.runner.model.get_language_model().lm_head is None
        [output] = llm.embed("hello there")
        assert abs(np.linalg.norm(output.outputs.embedding) - 1) < 1e-5


def test_qwen2_sequence_classification_matches_transformers():
    with LLM(tiny_checkpoint("qwen2_seq_cls")) as llm:
        ours = llm.classify(TEXTS)
    for text, output in zip(TEXTS, ours):
        _, _, hf = _hf_hidden(tiny_checkpoint("qwen2_seq_cls"), text, transformers.Qwen2ForSequenceClassification)
        np.testing.assert_allclose(output.outputs.probs, torch.softmax(hf.logits[0], -1).numpy(), atol=ATOL)


def test_qwen2_reward_model_matches_its_score_head_on_every_token():
    path = tiny_checkpoint("qwen2_reward")
    with LLM(path) as llm:
        ours = llm.reward(TEXTS)
    from safetensors.torch import load_file
    head = load_file(str(path / "model.safetensors"))
    for text, output in zip(TEXTS, ours):
        # The decoder is Qwen2's: transformers' Qwen2Model on the same file (the score head is ignored).
        tokenizer = transformers.AutoTokenizer.from_pretrained(path)
        model = transformers.Qwen2Model.from_pretrained(path, dtype=torch.float32).eval()
        with torch.no_grad():
            hidden = model(**tokenizer(text, return_tensors="pt")).last_hidden_state[0]
        expected = F.linear(F.relu(F.linear(hidden, head["score.0.weight"], head["score.0.bias"])),
                            head["score.2.weight"], head["score.2.bias"])
        np.testing.assert_allclose(output.outputs.data, expected.numpy(), atol=ATOL)


def test_bert_cross_encoder_scores_pairs_like_transformers():
    path = tiny_checkpoint("bert_cross_encoder")
    query, documents = "what is the weather", ["the weather is sunny today", "cats sleep a lot", "weather"]
    with LLM(path) as llm:
        ours = llm.score(query, documents)
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    model = transformers.BertForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
    for document, output in zip(documents, ours):
        with torch.no_grad():  # token_type_ids matter: the document's tokens are segment B
            logits = model(**tokenizer(query, document, return_tensors="pt")).logits[0]
        assert abs(output.outputs.score - torch.sigmoid(logits[0]).item()) < ATOL


def test_a_reranker_built_from_two_lm_head_rows():
    path = tiny_checkpoint("qwen2")
    no, yes = 40, 41
    with LLM(path, runner="pooling", convert="classify", hf_overrides={"classifier_from_token": [no, yes]}) as llm:
        ours = llm.classify(TEXTS)
    for text, output in zip(TEXTS, ours):
        model, ids, hf = _hf_hidden(path, text, transformers.Qwen2ForCausalLM)
        head = model.lm_head.weight  # tied to the embeddings in this checkpoint
        expected = torch.sigmoid(hf.hidden_states[-1][0, -1] @ (head[yes] - head[no]))
        assert abs(output.outputs.probs[0] - expected.item()) < ATOL
    with pytest.raises(ValueError, match=r"classifier_from_token must be two token ids"):
        LLM(path, runner="pooling", convert="classify", hf_overrides={"classifier_from_token": ["no", "yes"]})


# -- all-MiniLM-L6-v2 (real weights) against the sentence-transformers pipeline --------------------

MINILM_TEXTS = [
    "A man is eating food.",
    "Someone is having a meal.",
    "The stock market fell sharply on Tuesday.",
    "",
    "Der schnelle braune Fuchs springt über den faulen Hund.",
    "天气很好，我们去公园散步吧。",
    " ".join(["Long documents are embedded whole, up to the model's window."] * 16),  # ~200 tokens
]


def sentence_transformers_reference(model_dir, texts, max_seq_length=256):
    """What sentence-transformers computes for all-MiniLM-L6-v2 (modules.json: Transformer ->
    mean Pooling -> Normalize), written out with transformers: a padded batch, attention-masked
    mean of the last hidden states, L2-normalised."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    model = transformers.AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()
    batch = tokenizer(texts, padding=True, truncation=True, max_length=max_seq_length, return_tensors="pt")
    with torch.no_grad():
        hidden = model(**batch).last_hidden_state
    mask = batch["attention_mask"].unsqueeze(-1).float()
    mean = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
    return F.normalize(mean, p=2, dim=1).numpy()


@pytest.fixture(scope="module")
def minilm():
    with LLM(embedding_model_dir()) as llm:
        yield llm


def test_minilm_equals_the_sentence_transformers_pipeline(minilm):
    assert minilm.engine.config.max_model_len == 256  # sentence_bert_config.json's max_seq_length
    ours = np.array([o.outputs.embedding for o in minilm.embed(MINILM_TEXTS)])
    expected = sentence_transformers_reference(embedding_model_dir(), MINILM_TEXTS)
    assert ours.shape == (len(MINILM_TEXTS), 384)
    np.testing.assert_allclose(ours, expected, atol=ATOL)


def test_minilm_truncates_like_sentence_transformers(minilm):
    text = " ".join(["Every word here counts towards the limit."] * 60)  # ~480 tokens
    with pytest.raises(ValueError, match="maximum context length is 256 tokens"):
        minilm.embed(text)
    [ours] = minilm.embed(text, truncate_prompt_tokens=-1)
    np.testing.assert_allclose(ours.outputs.embedding, sentence_transformers_reference(embedding_model_dir(), [text])[0],
                               atol=ATOL)


def test_minilm_ranks_paraphrases_above_unrelated_sentences(minilm):
    scores = [s.outputs.score for s in minilm.score("A man is eating food.", [
        "Someone is having a meal.", "The stock market fell sharply on Tuesday.", "A cat sleeps on the sofa."])]
    assert scores[0] > 0.5 > max(scores[1:])


# -- the process boundary and the simulated NPU -----------------------------------------------------

def test_pooling_messages_cross_the_process_boundary():
    from atb_plugin.engine import messages

    request = messages.EngineCoreRequest("r1", [101, 7, 102, 9, 102], None, pooling_params=PoolingParams(
        "score", activation=False), token_type_start=3)
    again = messages.decode_request(messages.encode(request))
    assert again.pooling_params == request.pooling_params and again.token_type_start == 3
    pooled = messages.PooledData.from_array(np.arange(6, dtype=np.float32).reshape(2, 3))
    outputs = messages.decode_outputs(messages.encode(messages.EngineCoreOutputs(
        [messages.EngineCoreOutput("r1", pooled=pooled, finish_reason="stop")])))
    assert outputs.outputs[0].pooled.to_array().tolist() == [[0, 1, 2], [3, 4, 5]]
    with pytest.raises(ValueError, match="either sampling_params .* or pooling_params"):
        messages.EngineCoreRequest("r2", [1], None)
    with pytest.raises(ValueError, match="does not match shape"):
        messages.PooledData([2, 2], b"\0" * 12)
    with pytest.raises(ValueError, match="token_type_start 5 is outside the prompt"):
        messages.EngineCoreRequest("r3", [1, 2], None, pooling_params=PoolingParams("score"), token_type_start=5)


# bf16 on the simulated NPU: 8 significant bits, a few layers compound to ~1e-2 relative; unit
# embeddings and probabilities agree within 0.03 (measured well below).
NPU_TOL = 3e-2


@pytest.mark.parametrize("family, runner, call", [
    ("bert", "auto", lambda llm: [o.outputs.embedding for o in llm.embed(TEXTS)]),
    ("bert_cross_encoder", "auto", lambda llm: [o.outputs.score for o in llm.score(TEXTS[0], TEXTS)]),
    ("qwen2", "pooling", lambda llm: [o.outputs.embedding for o in llm.embed(TEXTS)]),
])
def test_pooling_on_the_simulated_npu_matches_the_cpu_path(family, runner, call, monkeypatch):
    from atb_plugin.platform import use_platform
    from atb_plugin.testing import fake_torch_npu

    with LLM(tiny_checkpoint(family), runner=runner) as llm:
        cpu = np.array(call(llm))
    monkeypatch.setenv("ATB_PLUGIN_NPU_KERNELS", "atb")
    with fake_torch_npu.install() as fake, use_platform("npu"):
        with LLM(tiny_checkpoint(family), runner=runner) as llm:
            assert llm.engine.config.dtype == "bfloat16"
            npu = np.array(call(llm))
        calls = fake.module.calls
        assert calls["_npu_flash_attention_unpad"] + calls["_npu_flash_attention"] > 0
    np.testing.assert_allclose(npu, cpu, atol=NPU_TOL)
