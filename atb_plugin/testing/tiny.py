"""Tiny, seeded, structurally real Hugging Face checkpoints for every family we serve.

    python -m atb_plugin.testing.tiny --family qwen2_vl --out /tmp/tiny-qwen2-vl [--seed 0]

or, from Python, ``make_tiny_checkpoint(family, out_dir, seed)`` and, for tests,
``tiny_checkpoint(family, seed)`` (built once per content of this file, cached in the temp dir).

Why: tests and benchmarks need checkpoints that look exactly like the published ones — the same
``config.json`` keys and layout, the same parameter names, the same special tokens with their ids named
where the real config names them, a real fast tokenizer with the family's chat template — but that
weigh under 1 MB (Qwen-VL: 7 MB, its resampler is 256 wide), build offline in a fraction of a second
and are reproducible from a seed. Every family except ``qwen_vl`` loads in transformers 5.23 with
``from_pretrained(dir)`` and no missing or unexpected keys, so models can be checked for logits
parity against transformers. (``qwen_vl``'s tokenizer loads with
``PreTrainedTokenizerFast.from_pretrained(dir)``; AutoTokenizer works but warns that transformers
has no ``qwen`` config.)

What each directory holds:

- ``config.json`` — written by hand in the layout of the published checkpoint (Qwen2-VL's flat
  layout with ``rope_scaling: {"type": "mrope", "mrope_section": ...}``, LLaVA's nested
  ``text_config`` / ``vision_config``, ...), not the layout transformers 5 would re-save, because the
  serving code has to read the published files.
- ``generation_config.json`` (not for BERT, which has none), with the real checkpoints' defaults.
- ``tokenizer.json`` + ``tokenizer_config.json`` + ``chat_template.jinja`` (the file transformers
  5.23 itself writes; BERT has no chat template but ``vocab.txt`` like MiniLM).
- ``preprocessor_config.json`` for the VL families with a transformers image processor
  (Qwen2-VL, Qwen2.5-VL, LLaVA; LLaVA also ``processor_config.json`` as llava-hf ships it).
- ``model.safetensors`` — fp32, metadata ``{"format": "pt"}`` only, so the bytes depend on the seed alone.
- BERT also gets the sentence-transformers files of all-MiniLM-L6-v2 (``modules.json``,
  ``sentence_bert_config.json``, ``1_Pooling/config.json``: mean pooling, then normalise).

Tokenizers: one byte-level BPE is trained (deterministically) on the small English corpus below;
each family then lays out its special tokens the way its real vocabulary does — appended after the
BPE vocabulary for Qwen / Llama-3 (so ``<img>``, ``</img>``, ``<imgpad>`` are consecutive as in
Qwen-VL), first for Llama-2-based LLaVA (``<unk>``, ``<s>``, ``</s>`` = 0, 1, 2; ``<image>``, ``<pad>`` at the
end) and at BERT's ids (``[PAD]`` 0, ``[UNK]`` 100, ``[CLS]`` 101, ``[SEP]`` 102, ``[MASK]`` 103; WordPiece).
``vocab_size`` equals the tokenizer size.

Weights: for transformers families the real model class is instantiated from the written
``config.json`` and saved by ``save_pretrained``, which writes the published names (e.g. LLaVA's
``language_model.model.*``) but for two details fixed up afterwards: LLaVA's
``vision_tower.vision_model.*`` level and MiniLM's legacy ``embeddings.position_ids``. For Qwen-VL
the state dict is built here (see ``qwen_vl_weight_shapes``).
Either way every tensor is then drawn from one seeded generator, in name order: matrices with std
``fan_in ** -0.5``, norm scales ``1 + 0.1·N(0,1)``, biases ``0.1·N(0,1)``. Nothing is left at 0 or 1,
so a parity test notices a forgotten bias or norm weight.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import importlib.metadata
import json
import math
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

__all__ = ["FAMILIES", "build_deepseek_v2_lite", "build_deepseek_v3", "build_qwen2_moe", "build_qwen3_moe", "make_tiny_checkpoint", "tiny_checkpoint", "qwen_vl_weight_shapes", "main"]

# The transformers version the files claim to come from (and that the project pins).
_TRANSFORMERS_VERSION = "5.23.0"

# OpenAI CLIP normalisation, used by all three image processors written here.
CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
CLIP_STD = [0.26862954, 0.26130258, 0.27577711]

# --------------------------------------------------------------------------------------------------
# Tokenizers
# --------------------------------------------------------------------------------------------------

# Training text for the BPE merges (original prose; any English does). Changing it changes every
# tokenizer, and with it every vocabulary size and special-token id below.
_CORPUS = """\
The quick brown fox jumps over the lazy dog, and the dog does not seem to mind at all.
A serving system accepts requests, schedules their tokens in batches and streams the answers back.
Each request carries a conversation: a system prompt, the user's questions and the assistant's replies.
What is in this picture? It shows a red apple on a wooden table next to a glass of water.
Describe the image in one sentence, then list three colours that you can see in it.
The cat sat on the mat while the rain fell softly against the window of the small house.
Images are decoded, resized, normalised and written to shared memory before the model reads them.
There were 12 apples, 7 pears and 365 grapes in the basket; how many pieces of fruit is that?
She said: "I'll be there at 10:30, don't wait for me if the train is late."
Large language models predict the next token from the tokens that came before it.
Hello! How are you today? I'm fine, thank you. Could you help me write a short poem about the sea?
The weather in the mountains changes quickly, so hikers should always carry a warm coat.
Please summarise the following paragraph and explain why it matters for the reader.
Once upon a time there was a little robot who wanted to learn how to paint the sky.
The library opens at nine in the morning and closes at six in the evening, except on Sundays.
Numbers such as 3.14, 2.71 and 1.41 appear often in mathematics and physics.
A good answer is short, correct and polite; a better answer also explains its reasoning.
The river runs through the city, under seven bridges, before it reaches the open sea.
Tokens, pixels, patches and features: the encoder turns an image into vectors the decoder can read.
Thank you for your question. Here is what I found, step by step, with sources where possible.
"""

# Pre-tokenisation split patterns of the real tokenizers.
_QWEN2_SPLIT = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
_LLAMA3_SPLIT = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

# Size of the trained byte-level BPE vocabulary (256 byte tokens + merges), before special tokens.
_BPE_VOCAB_SIZE = 512


@functools.lru_cache(maxsize=None)
def _bpe_vocab_and_merges() -> tuple[tuple[str, ...], tuple[tuple[str, str], ...]]:
    """Train the shared byte-level BPE once per process: (tokens in id order, merges).

    The `tokenizers` BPE trainer breaks ties deterministically, so the result is the same in every
    process (the WordPiece trainer is not, which is why BERT's vocabulary is built by hand)."""
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = _byte_level_pre_tokenizer(_QWEN2_SPLIT)
    trainer = trainers.BpeTrainer(
        vocab_size=_BPE_VOCAB_SIZE,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS.splitlines(keepends=True), trainer)
    model = json.loads(tok.to_str())["model"]
    vocab = sorted(model["vocab"].items(), key=lambda kv: kv[1])
    merges = tuple(tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in model["merges"])
    return tuple(token for token, _ in vocab), merges


def _byte_level_pre_tokenizer(split_regex: str) -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(split_regex), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def _byte_level_tokenizer(
    split_regex: str,
    *,
    leading: Sequence[str] = (),
    trailing: Sequence[str] = (),
    nfc: bool = False,
    prepend: str | None = None,
) -> Tokenizer:
    """The shared BPE with this family's special tokens: `leading` take ids 0.. (Llama-2 style),
    `trailing` are appended after the BPE vocabulary (Qwen / Llama-3 style). `prepend` is a special
    token the post-processor puts in front of every encoded text (Llama's BOS)."""
    bpe_tokens, merges = _bpe_vocab_and_merges()
    vocab = {token: i for i, token in enumerate([*leading, *bpe_tokens])}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=list(merges), fuse_unk=False, byte_fallback=False))
    if nfc:
        tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = _byte_level_pre_tokenizer(split_regex)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in [*leading, *trailing]])
    if prepend is not None:
        bos = tok.token_to_id(prepend)
        tok.post_processor = processors.TemplateProcessing(
            single=f"{prepend}:0 $A:0", pair=f"{prepend}:0 $A:0 {prepend}:1 $B:1", special_tokens=[(prepend, bos)]
        )
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok


_BERT_SPECIALS = ["[PAD]", *(f"[unused{i}]" for i in range(99)), "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
_BERT_SUFFIXES = ["##s", "##es", "##ed", "##ing", "##er", "##est", "##ly", "##ion", "##al", "##ful", "##ness"]


def _wordpiece_tokenizer() -> Tokenizer:
    """An uncased BERT WordPiece tokenizer laid out like bert-base-uncased / all-MiniLM-L6-v2.

    Vocabulary (built directly, so it is deterministic): the specials at BERT's ids, every character
    of the corpus and its ``##`` continuation, common suffixes, then the corpus words by frequency."""
    pre = pre_tokenizers.BertPreTokenizer()
    norm = normalizers.BertNormalizer(clean_text=True, handle_chinese_chars=True, strip_accents=None, lowercase=True)
    counts: dict[str, int] = {}
    for line in _CORPUS.splitlines():
        for word, _ in pre.pre_tokenize_str(norm.normalize_str(line)):
            counts[word] = counts.get(word, 0) + 1
    chars = sorted({c for word in counts for c in word})
    pieces = [*chars, *(f"##{c}" for c in chars if c.isalnum()), *_BERT_SUFFIXES]
    words = [w for w, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])) if len(w) > 1]
    tokens = list(dict.fromkeys([*_BERT_SPECIALS, *pieces, *words]))
    tok = Tokenizer(models.WordPiece({t: i for i, t in enumerate(tokens)}, unk_token="[UNK]"))
    tok.normalizer = norm
    tok.pre_tokenizer = pre
    tok.decoder = decoders.WordPiece(prefix="##")
    named = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in named])
    cls, sep = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS]:0 $A:0 [SEP]:0",
        pair="[CLS]:0 $A:0 [SEP]:0 $B:1 [SEP]:1",
        special_tokens=[("[CLS]", cls), ("[SEP]", sep)],
    )
    return tok


def _ids(tok: Tokenizer, *tokens: str) -> list[int]:
    ids = [tok.token_to_id(t) for t in tokens]
    assert None not in ids, (tokens, ids)
    return ids


# --------------------------------------------------------------------------------------------------
# Chat templates (jinja, rendered by transformers' apply_chat_template)
# --------------------------------------------------------------------------------------------------

# Text of a message whose content is a string or a list of OpenAI-style parts (text parts only).
_TEXT_OF = r"""
{%- macro text_of(content) -%}
    {%- if content is string -%}
        {{- content -}}
    {%- else -%}
        {%- for part in content if part is mapping and 'text' in part -%}
            {{- part['text'] -}}
        {%- endfor -%}
    {%- endif -%}
{%- endmacro -%}
"""

# Qwen2-Instruct's ChatML template (plus list content).
QWEN2_CHAT_TEMPLATE = _TEXT_OF + r"""
{%- if messages[0]['role'] != 'system' -%}
    {{- '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' -}}
{%- endif -%}
{%- for message in messages -%}
    {{- '<|im_start|>' + message['role'] + '\n' + text_of(message['content']) + '<|im_end|>\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<|im_start|>assistant\n' -}}
{%- endif -%}
"""

# Qwen2.5-Instruct's template (plus list content): `tools` go into the system prompt inside
# <tools></tools>, an assistant's `tool_calls` become <tool_call> blocks (arguments rendered with
# tojson, so they must be a mapping), and each run of `tool` messages becomes one user turn of
# <tool_response> blocks.
QWEN2_5_CHAT_TEMPLATE = _TEXT_OF + r"""
{%- if tools -%}
    {{- '<|im_start|>system\n' -}}
    {%- if messages[0]['role'] == 'system' -%}
        {{- text_of(messages[0]['content']) -}}
    {%- else -%}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' -}}
    {%- endif -%}
    {{- "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" -}}
    {%- for tool in tools -%}
        {{- "\n" -}}
        {{- tool | tojson -}}
    {%- endfor -%}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" -}}
{%- else -%}
    {%- if messages[0]['role'] == 'system' -%}
        {{- '<|im_start|>system\n' + text_of(messages[0]['content']) + '<|im_end|>\n' -}}
    {%- else -%}
        {{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n' -}}
    {%- endif -%}
{%- endif -%}
{%- for message in messages -%}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) -%}
        {{- '<|im_start|>' + message.role + '\n' + text_of(message.content) + '<|im_end|>' + '\n' -}}
    {%- elif message.role == "assistant" -%}
        {{- '<|im_start|>' + message.role -}}
        {%- if text_of(message.content) -%}
            {{- '\n' + text_of(message.content) -}}
        {%- endif -%}
        {%- for tool_call in message.tool_calls -%}
            {%- if tool_call.function is defined -%}
                {%- set tool_call = tool_call.function -%}
            {%- endif -%}
            {{- '\n<tool_call>\n{"name": "' -}}
            {{- tool_call.name -}}
            {{- '", "arguments": ' -}}
            {{- tool_call.arguments | tojson -}}
            {{- '}\n</tool_call>' -}}
        {%- endfor -%}
        {{- '<|im_end|>\n' -}}
    {%- elif message.role == "tool" -%}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") -%}
            {{- '<|im_start|>user' -}}
        {%- endif -%}
        {{- '\n<tool_response>\n' -}}
        {{- text_of(message.content) -}}
        {{- '\n</tool_response>' -}}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") -%}
            {{- '<|im_end|>\n' -}}
        {%- endif -%}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<|im_start|>assistant\n' -}}
{%- endif -%}
"""

# Qwen3's template (Qwen3-8B / Qwen3-30B-A3B, plus list content): Qwen2.5's tools and tool turns;
# an assistant turn after the last user query keeps its reasoning as <think>...</think> (from
# `reasoning_content`, or split off its content), earlier ones lose it; the thinking switch:
# `enable_thinking=False` (a chat_template_kwargs variable) writes an empty think block after the
# generation prompt, so the model answers without reasoning.
QWEN3_CHAT_TEMPLATE = _TEXT_OF + r"""
{%- if tools -%}
    {{- '<|im_start|>system\n' -}}
    {%- if messages[0].role == 'system' -%}
        {{- text_of(messages[0].content) + '\n\n' -}}
    {%- endif -%}
    {{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" -}}
    {%- for tool in tools -%}
        {{- "\n" -}}
        {{- tool | tojson -}}
    {%- endfor -%}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" -}}
{%- else -%}
    {%- if messages[0].role == 'system' -%}
        {{- '<|im_start|>system\n' + text_of(messages[0].content) + '<|im_end|>\n' -}}
    {%- endif -%}
{%- endif -%}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) -%}
{%- for message in messages[::-1] -%}
    {%- set index = (messages|length - 1) - loop.index0 -%}
    {%- set text = text_of(message.content) -%}
    {%- if ns.multi_step_tool and message.role == "user" and not(text.startswith('<tool_response>') and text.endswith('</tool_response>')) -%}
        {%- set ns.multi_step_tool = false -%}
        {%- set ns.last_query_index = index -%}
    {%- endif -%}
{%- endfor -%}
{%- for message in messages -%}
    {%- set content = text_of(message.content) -%}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) -%}
        {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>' + '\n' -}}
    {%- elif message.role == "assistant" -%}
        {%- set reasoning_content = '' -%}
        {%- if message.reasoning_content is string -%}
            {%- set reasoning_content = message.reasoning_content -%}
        {%- else -%}
            {%- if '</think>' in content -%}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') -%}
                {%- set content = content.split('</think>')[-1].lstrip('\n') -%}
            {%- endif -%}
        {%- endif -%}
        {%- if loop.index0 > ns.last_query_index -%}
            {%- if loop.last or (not loop.last and reasoning_content) -%}
                {{- '<|im_start|>' + message.role + '\n<think>\n' + reasoning_content.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') -}}
            {%- else -%}
                {{- '<|im_start|>' + message.role + '\n' + content -}}
            {%- endif -%}
        {%- else -%}
            {{- '<|im_start|>' + message.role + '\n' + content -}}
        {%- endif -%}
        {%- if message.tool_calls -%}
            {%- for tool_call in message.tool_calls -%}
                {%- if (loop.first and content) or (not loop.first) -%}
                    {{- '\n' -}}
                {%- endif -%}
                {%- if tool_call.function -%}
                    {%- set tool_call = tool_call.function -%}
                {%- endif -%}
                {{- '<tool_call>\n{"name": "' -}}
                {{- tool_call.name -}}
                {{- '", "arguments": ' -}}
                {%- if tool_call.arguments is string -%}
                    {{- tool_call.arguments -}}
                {%- else -%}
                    {{- tool_call.arguments | tojson -}}
                {%- endif -%}
                {{- '}\n</tool_call>' -}}
            {%- endfor -%}
        {%- endif -%}
        {{- '<|im_end|>\n' -}}
    {%- elif message.role == "tool" -%}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") -%}
            {{- '<|im_start|>user' -}}
        {%- endif -%}
        {{- '\n<tool_response>\n' -}}
        {{- content -}}
        {{- '\n</tool_response>' -}}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") -%}
            {{- '<|im_end|>\n' -}}
        {%- endif -%}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<|im_start|>assistant\n' -}}
    {%- if enable_thinking is defined and enable_thinking is false -%}
        {{- '<think>\n\n</think>\n\n' -}}
    {%- endif -%}
{%- endif -%}
"""

# Qwen2-VL-Instruct's template (Qwen2.5-VL uses the same): an image part is
# {"type": "image"}, {"type": "image_url", ...} or any dict with an "image" key.
QWEN2_VL_CHAT_TEMPLATE = r"""
{%- set image_count = namespace(value=0) -%}
{%- set video_count = namespace(value=0) -%}
{%- for message in messages -%}
    {%- if loop.first and message['role'] != 'system' -%}
        {{- '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' -}}
    {%- endif -%}
    {{- '<|im_start|>' + message['role'] + '\n' -}}
    {%- if message['content'] is string -%}
        {{- message['content'] -}}
    {%- else -%}
        {%- for part in message['content'] -%}
            {%- if part['type'] == 'image' or part['type'] == 'image_url' or 'image' in part or 'image_url' in part -%}
                {%- set image_count.value = image_count.value + 1 -%}
                {%- if add_vision_id -%}{{- 'Picture ' + image_count.value|string + ': ' -}}{%- endif -%}
                {{- '<|vision_start|><|image_pad|><|vision_end|>' -}}
            {%- elif part['type'] == 'video' or 'video' in part -%}
                {%- set video_count.value = video_count.value + 1 -%}
                {%- if add_vision_id -%}{{- 'Video ' + video_count.value|string + ': ' -}}{%- endif -%}
                {{- '<|vision_start|><|video_pad|><|vision_end|>' -}}
            {%- elif 'text' in part -%}
                {{- part['text'] -}}
            {%- endif -%}
        {%- endfor -%}
    {%- endif -%}
    {{- '<|im_end|>\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<|im_start|>assistant\n' -}}
{%- endif -%}
"""

# Qwen-VL-Chat's prompt format (its `make_context` + `tokenizer.from_list_format`): ChatML with the
# default system prompt; the i-th image of a message becomes "Picture i: <img>PATH</img>\n". Here the
# path is left out — "<img></img>" — because the input builder fills the block with the 256 slots of
# docs/wire-format.md (start, NAME, SHAPE, <imgpad> x 254, end).
QWEN_VL_CHAT_TEMPLATE = r"""
{%- if messages[0]['role'] != 'system' -%}
    {{- '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' -}}
{%- endif -%}
{%- for message in messages -%}
    {{- '<|im_start|>' + message['role'] + '\n' -}}
    {%- if message['content'] is string -%}
        {{- message['content'] -}}
    {%- else -%}
        {%- set image_count = namespace(value=0) -%}
        {%- for part in message['content'] -%}
            {%- if part['type'] == 'image' or part['type'] == 'image_url' or 'image' in part or 'image_url' in part -%}
                {%- set image_count.value = image_count.value + 1 -%}
                {{- 'Picture ' + image_count.value|string + ': <img></img>\n' -}}
            {%- elif 'text' in part -%}
                {{- part['text'] -}}
            {%- endif -%}
        {%- endfor -%}
    {%- endif -%}
    {{- '<|im_end|>\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<|im_start|>assistant\n' -}}
{%- endif -%}
"""

# Meta-Llama-3-Instruct's template (plus list content).
LLAMA3_CHAT_TEMPLATE = _TEXT_OF + r"""
{{- bos_token -}}
{%- for message in messages -%}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + text_of(message['content']) | trim + '<|eot_id|>' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
{%- endif -%}
"""

# LLaVA-1.5's conversation format (vicuna_v1): "SYSTEM USER: <image>\nTEXT ASSISTANT: REPLY</s>USER: ...
# ASSISTANT:". Image parts render as "<image>\n" ahead of the message's text, as LLaVA puts them.
LLAVA_CHAT_TEMPLATE = r"""
{%- macro render(content) -%}
    {%- if content is string -%}
        {{- content -}}
    {%- else -%}
        {%- for part in content -%}
            {%- if part['type'] == 'image' or part['type'] == 'image_url' or 'image' in part or 'image_url' in part -%}
                {{- '<image>\n' -}}
            {%- endif -%}
        {%- endfor -%}
        {{- content | selectattr('text', 'defined') | map(attribute='text') | join(' ') -}}
    {%- endif -%}
{%- endmacro -%}
{{- bos_token -}}
{%- if messages[0]['role'] == 'system' -%}
    {{- render(messages[0]['content']) + ' ' -}}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {{- "A chat between a curious human and an artificial intelligence assistant. The assistant gives helpful, detailed, and polite answers to the human's questions. " -}}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if message['role'] == 'assistant' -%}
        {{- 'ASSISTANT: ' + render(message['content']) + eos_token -}}
    {%- else -%}
        {{- 'USER: ' + render(message['content']) + ' ' -}}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- 'ASSISTANT:' -}}
{%- endif -%}
"""

# --------------------------------------------------------------------------------------------------
# Writing files
# --------------------------------------------------------------------------------------------------


def _write_json(path: Path, obj: object) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    # Sorted keys, as transformers writes its JSON files: the files do not depend on how the dicts were built.
    path.write_text(json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")


def _write_tokenizer(out: Path, tok: Tokenizer, config: dict, chat_template: str | None) -> None:
    """tokenizer.json, tokenizer_config.json and (when the family has one) chat_template.jinja."""
    (out / "tokenizer.json").write_text(tok.to_str(pretty=True) + "\n", encoding="utf-8")
    _write_json(out / "tokenizer_config.json", config)
    if chat_template is not None:
        (out / "chat_template.jinja").write_text(chat_template.strip() + "\n", encoding="utf-8")


def _fill_(name: str, tensor: torch.Tensor, gen: torch.Generator) -> None:
    """Overwrite one tensor in place with seeded values whose scale suits its role (module docstring)."""
    noise = torch.randn(tensor.shape, generator=gen, dtype=torch.float32)
    if tensor.ndim == 3 and ".experts." in name:  # stacked experts (E, out, in): fan-in is the last dim
        value = noise * tensor.shape[-1] ** -0.5
    elif tensor.ndim >= 2:
        value = noise * math.prod(tensor.shape[1:]) ** -0.5
    elif name.endswith("weight"):
        value = 1.0 + 0.1 * noise  # 1-D weights are norm scales in every family here
    else:
        value = 0.1 * noise
    tensor.copy_(value.to(tensor.dtype))


def _write_safetensors(out: Path, state: dict[str, torch.Tensor]) -> None:
    save_file({k: v.contiguous() for k, v in state.items()}, str(out / "model.safetensors"), metadata={"format": "pt"})


def _save_transformers_model(
    out: Path, config: dict, seed: int, adjust: Callable[[dict[str, torch.Tensor]], None] | None = None
) -> None:
    """Write `config` as config.json, build its `architectures[0]` class from that file exactly as
    from_pretrained would, give it seeded weights and save them under the published names.

    `save_pretrained` already reverts most of transformers 5's module renames (LLaVA's
    ``language_model.model.*``); `adjust` edits the state dict in place for what it does not."""
    import transformers  # imported here: listing FAMILIES or building qwen_vl does not need it

    _write_json(out / "config.json", config)
    hf_config = transformers.AutoConfig.from_pretrained(out)
    model_cls = getattr(transformers, config["architectures"][0])
    gen = torch.Generator().manual_seed(seed)
    with torch.random.fork_rng(devices=[]):  # model __init__ draws from the global RNG: leave the caller's alone
        torch.manual_seed(seed)
        model = model_cls(hf_config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():  # tied weights are listed once
            _fill_(name, param, gen)
    bars_on = transformers.utils.logging.is_progress_bar_enabled()
    transformers.utils.logging.disable_progress_bar()  # else a "Writing model shards" bar per family
    try:
        with tempfile.TemporaryDirectory(prefix="atb-plugin-tiny-save-") as scratch:
            model.save_pretrained(scratch)
            state = load_file(Path(scratch) / "model.safetensors")
    finally:
        if bars_on:
            transformers.utils.logging.enable_progress_bar()
    if adjust is not None:
        adjust(state)
    _write_safetensors(out, state)


# --------------------------------------------------------------------------------------------------
# Families
# --------------------------------------------------------------------------------------------------

# Shared by the tiny decoders: big enough for engine tests, small enough for their tables.
_MAX_POSITIONS = 4096

# The decoder all text models here share (2 layers, hidden 64, 4 query heads of 16, GQA with 2 KV
# heads); families add or override what their published config says.
_TINY_DECODER = {
    "hidden_act": "silu",
    "hidden_size": 64,
    "initializer_range": 0.02,
    "intermediate_size": 128,
    "max_position_embeddings": _MAX_POSITIONS,
    "num_attention_heads": 4,
    "num_hidden_layers": 2,
    "num_key_value_heads": 2,
    "torch_dtype": "float32",
    "transformers_version": _TRANSFORMERS_VERSION,
    "use_cache": True,
}
_QWEN2_DECODER = {
    **_TINY_DECODER,
    "attention_dropout": 0.0,
    "max_window_layers": 2,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "sliding_window": _MAX_POSITIONS,
    "use_sliding_window": False,
}

_QWEN_CHATML = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


def _qwen_tokenizer_config(**extra: object) -> dict:
    return {
        "add_prefix_space": False,
        "bos_token": None,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": _MAX_POSITIONS,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
        **extra,
    }


def _qwen_generation_config(endoftext: int, im_end: int, **sampling: float) -> dict:
    return {
        "bos_token_id": endoftext,
        "do_sample": True,
        "eos_token_id": [im_end, endoftext],
        "pad_token_id": endoftext,
        "transformers_version": _TRANSFORMERS_VERSION,
        **sampling,
    }


def _build_qwen2(out: Path, seed: int, architecture: str = "Qwen2ForCausalLM", *,
                 chat_template: str = QWEN2_CHAT_TEMPLATE, plain_tokens: Sequence[str] = (),
                 sampling: dict | None = None, **extra: object) -> None:
    """Qwen2-Instruct like Qwen2-0.5B/1.5B: GQA, q/k/v biases, tied embeddings. ``architecture``
    and ``extra`` config keys make its pooling variants (same decoder, another head);
    ``chat_template`` and ``plain_tokens`` (added tokens that are not special, appended after the
    ChatML ones) make Qwen2.5-Instruct."""
    tok = _byte_level_tokenizer(_QWEN2_SPLIT, trailing=_QWEN_CHATML, nfc=True)
    # Not special, as in the real vocabulary: skip_special_tokens keeps them in the output text,
    # where the tool parser looks for them.
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in plain_tokens])
    endoftext, _, im_end = _ids(tok, *_QWEN_CHATML)
    config = {
        **_QWEN2_DECODER,
        "architectures": [architecture],
        "model_type": "qwen2",
        "bos_token_id": endoftext,
        "eos_token_id": im_end,
        "pad_token_id": endoftext,
        "tie_word_embeddings": True,
        "vocab_size": tok.get_vocab_size(),
        **extra,
    }
    _save_transformers_model(out, config, seed)
    _write_json(
        out / "generation_config.json",
        _qwen_generation_config(endoftext, im_end, **(sampling or dict(repetition_penalty=1.05, temperature=0.7,
                                                                         top_k=20, top_p=0.8))),
    )
    _write_tokenizer(out, tok, _qwen_tokenizer_config(), chat_template)


# Qwen3's added tokens that are not special (tool calls, tool responses, reasoning), in the order of
# the real vocabulary (151657 .. 151668, less the FIM / repo tokens between).
_QWEN3_PLAIN_TOKENS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>")
# Qwen3-8B's decoder keys, tiny: no q/k/v bias, an explicit head_dim (4 x 32 query features against a
# hidden size of 64, as the published 32 x 128 against 4096), untied head, no sliding window.
_QWEN3_DECODER = dict(attention_bias=False, head_dim=32, tie_word_embeddings=False, sliding_window=None,
                      rope_scaling=None)
_QWEN3_SAMPLING = dict(temperature=0.6, top_k=20, top_p=0.95)  # Qwen3's generation_config.json


def _build_qwen3(out: Path, seed: int) -> None:
    """Qwen3-8B like: Qwen2's tokenizer layout with the think / tool tokens, per-head q/k RMSNorm."""
    _build_qwen2(out, seed, "Qwen3ForCausalLM", chat_template=QWEN3_CHAT_TEMPLATE, plain_tokens=_QWEN3_PLAIN_TOKENS,
                 sampling=_QWEN3_SAMPLING, model_type="qwen3", **_QWEN3_DECODER)


def build_qwen3_moe(out: Path, seed: int, **config: object) -> None:
    """Qwen3-30B-A3B like (published keys: ``num_experts``, ``num_experts_per_tok``,
    ``moe_intermediate_size``, ``norm_topk_prob``, ``decoder_sparse_step``, ``mlp_only_layers``):
    3 layers, 8 experts of 32, top-2, renormalised, layer 1 dense (``intermediate_size`` 128).
    ``config`` overrides config.json keys (tests build variants: other expert counts, top-k,
    ``norm_topk_prob`` off, ...); the weights follow the config."""
    moe = dict(num_hidden_layers=3, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
               norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[1], output_router_logits=False,
               router_aux_loss_coef=0.001)
    _build_qwen2(out, seed, "Qwen3MoeForCausalLM", chat_template=QWEN3_CHAT_TEMPLATE,
                 plain_tokens=_QWEN3_PLAIN_TOKENS, sampling=_QWEN3_SAMPLING, model_type="qwen3_moe",
                 **{**_QWEN3_DECODER, **moe, **config})



def build_qwen2_moe(out: Path, seed: int, **config: object) -> None:
    """Qwen1.5-MoE-A2.7B like: the Qwen2 decoder (q/k/v biases, ChatML) with sparse layers of 8
    experts of 32, top-2, not renormalised, and a shared expert of 48 behind a sigmoid gate;
    3 layers, layer 2 dense. ``config`` overrides config.json keys, as for ``build_qwen3_moe``."""
    moe = dict(num_hidden_layers=3, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
               shared_expert_intermediate_size=48, norm_topk_prob=False, decoder_sparse_step=1, mlp_only_layers=[2],
               output_router_logits=False, router_aux_loss_coef=0.001, tie_word_embeddings=False)
    _build_qwen2(out, seed, "Qwen2MoeForCausalLM", model_type="qwen2_moe", **{**moe, **config})


# -- DeepSeek-V2 / V3 (models/deepseek.py) ----------------------------------------------------------

# DeepSeek-V3's special tokens at the front of its vocabulary (bos 0, eos 1), the chat markers after.
_DEEPSEEK_SPECIALS = ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜▁pad▁｜>")
_DEEPSEEK_MARKERS = ("<｜User｜>", "<｜Assistant｜>")
# DeepSeek-V3's template, trimmed to what the tiny tests render: the system prompt after BOS, then
# the turns, each assistant turn closed by EOS.
DEEPSEEK_CHAT_TEMPLATE = _TEXT_OF + r"""
{{- bos_token -}}
{%- for message in messages if message['role'] == 'system' -%}{{- text_of(message['content']) -}}{%- endfor -%}
{%- for message in messages -%}
    {%- if message['role'] == 'user' -%}
        {{- '<｜User｜>' + text_of(message['content']) -}}
    {%- elif message['role'] == 'assistant' -%}
        {{- '<｜Assistant｜>' + text_of(message['content']) + '<｜end▁of▁sentence｜>' -}}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<｜Assistant｜>' -}}{%- endif -%}
"""
# The MLA / MoE keys both tiny configs share: 4 heads of 16 + 8 (rope) query features, a latent of
# 32 + 8, values of 16; 8 routed experts of 32, top-2; YaRN with DeepSeek's mscale (an original
# context of 128 so that the 8 rope dimensions span all three YaRN bands).
_DEEPSEEK_DECODER = {
    **_TINY_DECODER,
    "attention_bias": False,
    "attention_dropout": 0.0,
    "first_k_dense_replace": 1,
    "kv_lora_rank": 32,
    "moe_intermediate_size": 32,
    "moe_layer_freq": 1,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "num_key_value_heads": 4,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "rms_norm_eps": 1e-06,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "v_head_dim": 16,
}


def _deepseek_mtp_and_bias(config: dict, seed: int) -> Callable[[dict[str, torch.Tensor]], None]:
    """Fill V3's router biases (buffers: save_pretrained writes them as built, zeros) and append
    the MTP layers in DeepSeek's layout after the decoder: layer ``num_hidden_layers + i`` is a
    decoder layer (the last layer's names and shapes) plus ``enorm``, ``hnorm``, ``eh_proj``
    (H x 2H), ``shared_head.norm``, ``shared_head.head`` and ``embed_tokens``."""

    def adjust(state: dict[str, torch.Tensor]) -> None:
        gen = torch.Generator().manual_seed(seed + 1)
        layers, hidden, vocab = config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]
        template = f"model.layers.{layers - 1}."
        for i in range(config.get("num_nextn_predict_layers", 0)):
            prefix = f"model.layers.{layers + i}."
            extra = {prefix + name[len(template):]: torch.empty_like(t) for name, t in state.items()
                     if name.startswith(template)}
            extra.update({prefix + "enorm.weight": torch.empty(hidden), prefix + "hnorm.weight": torch.empty(hidden),
                          prefix + "eh_proj.weight": torch.empty(hidden, 2 * hidden),
                          prefix + "shared_head.norm.weight": torch.empty(hidden),
                          prefix + "shared_head.head.weight": torch.empty(vocab, hidden),
                          prefix + "embed_tokens.weight": torch.empty(vocab, hidden)})
            state.update(extra)
        for name in sorted(state):
            if name.endswith("e_score_correction_bias") or name.startswith(tuple(
                    f"model.layers.{layers + i}." for i in range(config.get("num_nextn_predict_layers", 0)))):
                _fill_(name, state[name], gen)

    return adjust


def _build_deepseek(out: Path, seed: int, *, architecture: str, model_type: str, **extra: object) -> None:
    tok = _byte_level_tokenizer(_LLAMA3_SPLIT, leading=_DEEPSEEK_SPECIALS, trailing=_DEEPSEEK_MARKERS)
    bos, eos, pad = _ids(tok, *_DEEPSEEK_SPECIALS)
    config = {**_DEEPSEEK_DECODER, "architectures": [architecture], "model_type": model_type, "bos_token_id": bos,
              "eos_token_id": eos, "vocab_size": tok.get_vocab_size(), **extra}
    _save_transformers_model(out, config, seed, _deepseek_mtp_and_bias(config, seed))
    _write_json(out / "generation_config.json",
                {"bos_token_id": bos, "do_sample": True, "eos_token_id": eos, "temperature": 0.6, "top_p": 0.95,
                 "transformers_version": _TRANSFORMERS_VERSION})
    tokenizer_config = {
        "add_bos_token": False, "add_eos_token": False, "bos_token": _DEEPSEEK_SPECIALS[0],
        "clean_up_tokenization_spaces": False, "eos_token": _DEEPSEEK_SPECIALS[1], "legacy": True,
        "model_max_length": _MAX_POSITIONS, "pad_token": _DEEPSEEK_SPECIALS[2],
        "tokenizer_class": "PreTrainedTokenizerFast", "unk_token": None,
    }
    _write_tokenizer(out, tok, tokenizer_config, DEEPSEEK_CHAT_TEMPLATE)


def build_deepseek_v2_lite(out: Path, seed: int, **config: object) -> None:
    """DeepSeek-V2-Lite like: no q LoRA (``q_proj``), softmax routing, greedy top-2 over 8 experts
    (``n_group`` 1), 2 shared experts, layer 0 dense, YaRN with mscale 0.707."""
    _build_deepseek(out, seed, architecture="DeepseekV2ForCausalLM", model_type="deepseek_v2", **{
        "aux_loss_alpha": 0.001, "n_group": 1, "n_shared_experts": 2, "norm_topk_prob": False, "q_lora_rank": None,
        "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 32, "mscale": 0.707, "mscale_all_dim": 0.707,
                         "original_max_position_embeddings": 128, "type": "yarn"},
        "routed_scaling_factor": 1.0, "scoring_func": "softmax", "seq_aux": True, "topk_group": 1,
        "topk_method": "greedy", **config})


def build_deepseek_v3(out: Path, seed: int, **config: object) -> None:
    """DeepSeek-V3 like: q LoRA 48, sigmoid routing with ``e_score_correction_bias`` and grouped
    top-2 (4 groups of 2, 2 kept), 1 shared expert, ``routed_scaling_factor`` 2.5, layer 0 dense,
    YaRN with mscale 1, one MTP layer (``num_nextn_predict_layers``) in DeepSeek's layout."""
    _build_deepseek(out, seed, architecture="DeepseekV3ForCausalLM", model_type="deepseek_v3", **{
        "n_group": 4, "n_shared_experts": 1, "norm_topk_prob": True, "num_nextn_predict_layers": 1,
        "q_lora_rank": 48, "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 32, "mscale": 1.0,
                                            "mscale_all_dim": 1.0, "original_max_position_embeddings": 128,
                                            "type": "yarn"},
        "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "topk_group": 2, "topk_method": "noaux_tc",
        **config})


def _build_qwen2_seq_cls(out: Path, seed: int) -> None:
    """A Qwen2ForSequenceClassification checkpoint (3 labels): ``model.*`` + ``score.weight``."""
    _build_qwen2(out, seed, "Qwen2ForSequenceClassification",
                 id2label={"0": "negative", "1": "neutral", "2": "positive"},
                 label2id={"negative": 0, "neutral": 1, "positive": 2})


def _build_qwen2_reward(out: Path, seed: int) -> None:
    """A Qwen2ForRewardModel checkpoint as Qwen2.5-Math-RM ships it (remote code, so not built by
    transformers): the Qwen2 decoder ``model.*`` and ``score.0`` (H×H) -> ReLU -> ``score.2`` (1×H)."""
    _build_qwen2(out, seed)
    config = json.loads((out / "config.json").read_text())
    config["architectures"] = ["Qwen2ForRewardModel"]
    _write_json(out / "config.json", config)
    state = load_file(out / "model.safetensors")
    hidden = config["hidden_size"]
    gen = torch.Generator().manual_seed(seed + 1)
    for name, shape in (("score.0.weight", (hidden, hidden)), ("score.0.bias", (hidden,)),
                        ("score.2.weight", (1, hidden)), ("score.2.bias", (1,))):
        state[name] = torch.empty(shape)
        _fill_(name, state[name], gen)
    _write_safetensors(out, state)


_LLAMA3_SPECIALS = (  # ids 128000.. in the real vocabulary, in this order
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|reserved_special_token_0|>",
    "<|reserved_special_token_1|>",
    "<|finetune_right_pad_id|>",
    "<|reserved_special_token_2|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eom_id|>",
    "<|eot_id|>",
    "<|python_tag|>",
)


def _build_llama(out: Path, seed: int) -> None:
    """Llama-3.1-Instruct: GQA, untied head, llama3 rope scaling, BOS added by the tokenizer."""
    tok = _byte_level_tokenizer(_LLAMA3_SPLIT, trailing=_LLAMA3_SPECIALS, prepend="<|begin_of_text|>")
    bos, end_of_text, pad, eom, eot = _ids(
        tok, "<|begin_of_text|>", "<|end_of_text|>", "<|finetune_right_pad_id|>", "<|eom_id|>", "<|eot_id|>"
    )
    config = {
        **_TINY_DECODER,
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": bos,
        "eos_token_id": [end_of_text, eom, eot],
        "pad_token_id": pad,  # the real config has none; <|finetune_right_pad_id|> is Llama-3.1's pad token
        "head_dim": 16,
        "mlp_bias": False,
        "pretraining_tp": 1,
        "rms_norm_eps": 1e-05,
        "rope_scaling": {
            "factor": 8.0,
            "high_freq_factor": 4.0,
            "low_freq_factor": 1.0,
            # real: 8192. 1024 keeps it below max_position_embeddings and, with head_dim 16, still has
            # frequencies in all three llama3 bands (kept, interpolated, divided by factor).
            "original_max_position_embeddings": 1024,
            "rope_type": "llama3",
        },
        "rope_theta": 500000.0,
        "tie_word_embeddings": False,
        "vocab_size": tok.get_vocab_size(),
    }
    _save_transformers_model(out, config, seed)
    _write_json(
        out / "generation_config.json",
        {"bos_token_id": bos, "do_sample": True, "eos_token_id": [end_of_text, eom, eot], "temperature": 0.6,
         "top_p": 0.9, "transformers_version": _TRANSFORMERS_VERSION},
    )
    tokenizer_config = {
        "bos_token": "<|begin_of_text|>",
        "clean_up_tokenization_spaces": False,  # real: True, which transformers 5 refuses for BPE (warns)
        "eos_token": "<|eot_id|>",
        "model_input_names": ["input_ids", "attention_mask"],
        "model_max_length": _MAX_POSITIONS,
        "pad_token": "<|finetune_right_pad_id|>",
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    _write_tokenizer(out, tok, tokenizer_config, LLAMA3_CHAT_TEMPLATE)


_QWEN2_VL_SPECIALS = (  # ids 151643.. in the real vocabulary, in this order
    *_QWEN_CHATML,
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
)

# Qwen2-VL's smart_resize bounds, kept small for fast tests: from 56x56 up to 64 * 4 merged tokens'
# worth, about 448x448 = 32x32 patches of 14x14 pixels x 2 frames x 3 channels = 1176 values each.
QWEN2_VL_MIN_PIXELS = 56 * 56
QWEN2_VL_MAX_PIXELS = 28 * 28 * 64 * 4


def _build_qwen2_vl_like(out: Path, seed: int, *, architecture: str, model_type: str, vision_config: dict,
                         processor_class: str, sampling: dict) -> None:
    """Qwen2-VL and Qwen2.5-VL share everything but the vision tower and a few defaults."""
    tok = _byte_level_tokenizer(_QWEN2_SPLIT, trailing=_QWEN2_VL_SPECIALS, nfc=True)
    endoftext, _, im_end = _ids(tok, *_QWEN_CHATML)
    v_start, v_end, v_pad, image_pad, video_pad = _ids(
        tok, "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>"
    )
    config = {  # the published flat layout: text settings at the top, the tower in vision_config
        **_QWEN2_DECODER,
        "architectures": [architecture],
        "model_type": model_type,
        "bos_token_id": endoftext,
        "eos_token_id": im_end,
        "pad_token_id": endoftext,
        "vision_start_token_id": v_start,
        "vision_end_token_id": v_end,
        "vision_token_id": v_pad,
        "image_token_id": image_pad,
        "video_token_id": video_pad,
        # head_dim 16 -> 8 rotary frequencies split over (time, height, width); real: [16, 24, 24] of 64.
        "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]},
        "tie_word_embeddings": False,
        "vision_config": vision_config,
        "vocab_size": tok.get_vocab_size(),
    }
    _save_transformers_model(out, config, seed)
    _write_json(out / "generation_config.json", _qwen_generation_config(endoftext, im_end, **sampling))
    _write_json(
        out / "preprocessor_config.json",
        {
            "do_convert_rgb": True,
            "do_normalize": True,
            "do_rescale": True,
            "do_resize": True,
            "image_mean": CLIP_MEAN,
            "image_processor_type": "Qwen2VLImageProcessor",  # transformers picks the Pil class without torchvision
            "image_std": CLIP_STD,
            "max_pixels": QWEN2_VL_MAX_PIXELS,
            "merge_size": 2,
            "min_pixels": QWEN2_VL_MIN_PIXELS,
            "patch_size": 14,
            "processor_class": processor_class,
            "resample": 3,
            "rescale_factor": 1 / 255,
            "size": {"longest_edge": QWEN2_VL_MAX_PIXELS, "shortest_edge": QWEN2_VL_MIN_PIXELS},
            "temporal_patch_size": 2,
        },
    )
    _write_tokenizer(out, tok, _qwen_tokenizer_config(processor_class=processor_class), QWEN2_VL_CHAT_TEMPLATE)


def _build_qwen2_vl(out: Path, seed: int) -> None:
    """Qwen2-VL-Instruct: ViT with 2-D rotary, LayerNorm and quick-GELU MLP; 2x2 patch merger."""
    _build_qwen2_vl_like(
        out,
        seed,
        architecture="Qwen2VLForConditionalGeneration",
        model_type="qwen2_vl",
        vision_config={
            "depth": 2,
            "embed_dim": 32,
            "hidden_size": 64,  # the merger's output: the text model's hidden size
            "in_chans": 3,
            "mlp_ratio": 4,
            "num_heads": 4,
            "patch_size": 14,
            "spatial_merge_size": 2,
            "spatial_patch_size": 14,
            "temporal_patch_size": 2,
        },
        processor_class="Qwen2VLProcessor",
        sampling={"temperature": 0.01, "top_k": 1, "top_p": 0.001},
    )


def _build_qwen2_5_vl(out: Path, seed: int) -> None:
    """Qwen2.5-VL-Instruct: RMSNorm + SwiGLU ViT whose blocks 1 and 3 attend globally and blocks 0
    and 2 within 112-pixel windows (4x4 merged tokens), as the real one does with [7, 15, 23, 31]."""
    _build_qwen2_vl_like(
        out,
        seed,
        architecture="Qwen2_5_VLForConditionalGeneration",
        model_type="qwen2_5_vl",
        vision_config={
            "depth": 4,
            "fullatt_block_indexes": [1, 3],
            "hidden_act": "silu",
            "hidden_size": 32,
            "in_chans": 3,
            "intermediate_size": 64,
            "num_heads": 4,
            "out_hidden_size": 64,  # the merger's output: the text model's hidden size
            "patch_size": 14,
            "spatial_merge_size": 2,
            "spatial_patch_size": 14,
            "temporal_patch_size": 2,
            "tokens_per_second": 2,
            "window_size": 112,
        },
        processor_class="Qwen2_5_VLProcessor",
        sampling={"repetition_penalty": 1.05, "temperature": 0.1, "top_k": 1, "top_p": 0.001},
    )


# Qwen3-VL-Instruct's template, as published less its tool-calling branch: Qwen2-VL's (an image part
# renders <|vision_start|><|image_pad|><|vision_end|>, a video part <|vision_start|><|video_pad|>
# <|vision_end|>, which the processor widens into timestamped frames) with no default system prompt.
_QWEN2_VL_DEFAULT_SYSTEM = r"""
    {%- if loop.first and message['role'] != 'system' -%}
        {{- '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' -}}
    {%- endif -%}"""
assert _QWEN2_VL_DEFAULT_SYSTEM in QWEN2_VL_CHAT_TEMPLATE
QWEN3_VL_CHAT_TEMPLATE = QWEN2_VL_CHAT_TEMPLATE.replace(_QWEN2_VL_DEFAULT_SYSTEM, "")

# Qwen3-VL's pixel bounds, small for fast tests (patch 16 x merge 2 = 32-pixel merge windows): an
# image from 2x2 to 8x8 windows (64 tokens); a video's frames share 64 windows' worth (t·h·w pixels).
QWEN3_VL_MIN_PIXELS = 32 * 32 * 4
QWEN3_VL_MAX_PIXELS = 32 * 32 * 64
QWEN3_VL_VIDEO_MAX_PIXELS = 32 * 32 * 64
QWEN3_VL_VIDEO_MAX_FRAMES = 16


def _qwen3_vl_moe_published_experts(state: dict[str, torch.Tensor]) -> None:
    """Qwen3-VL-MoE publishes its stacked experts as ``gate_up_proj (E, H, 2I)`` and ``down_proj
    (E, I, H)``; transformers holds (and saves) them transposed, and transposes the published
    ones on load (its conversion mapping, which tells them apart by shape: keep 2I != H)."""
    for name in [n for n in state if n.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj"))]:
        state[name] = state[name].transpose(1, 2).contiguous()


def _build_qwen3_vl(out: Path, seed: int, moe: dict | None = None) -> None:
    """Qwen3-VL-Instruct (``moe``: Qwen3-VL-MoE, the sparse keys of Qwen3-VL-30B-A3B): the nested
    published layout (``text_config`` with interleaved M-RoPE, ``vision_config`` with DeepStack
    indexes), a ViT of 16-pixel patches with a learned 8x8 position grid, the Qwen3 decoder
    (q/k norms, head_dim 32 against a hidden size of 64), and both processor configs."""
    tok = _byte_level_tokenizer(_QWEN2_SPLIT, trailing=_QWEN2_VL_SPECIALS, nfc=True)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in _QWEN3_PLAIN_TOKENS])
    endoftext, _, im_end = _ids(tok, *_QWEN_CHATML)
    v_start, v_end, image_pad, video_pad = _ids(tok, "<|vision_start|>", "<|vision_end|>", "<|image_pad|>",
                                                "<|video_pad|>")
    architecture, model_type = "Qwen3VLForConditionalGeneration", "qwen3_vl"
    text = {
        **_TINY_DECODER,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": endoftext,
        "eos_token_id": im_end,
        "head_dim": 32,
        "model_type": "qwen3_vl_text",
        "rms_norm_eps": 1e-06,
        # 16 rotary frequencies, interleaved t, h, w, t, h, w, ... (real: [24, 20, 20] of 64)
        "rope_scaling": {"mrope_interleaved": True, "mrope_section": [6, 5, 5], "rope_type": "default"},
        "rope_theta": 5000000,
        "tie_word_embeddings": False,
        "vocab_size": tok.get_vocab_size(),
    }
    if moe is not None:
        architecture, model_type = "Qwen3VLMoeForConditionalGeneration", "qwen3_vl_moe"
        text.update(model_type="qwen3_vl_moe_text", **moe)
    config = {
        "architectures": [architecture],
        "model_type": model_type,
        "image_token_id": image_pad,
        "video_token_id": video_pad,
        "vision_start_token_id": v_start,
        "vision_end_token_id": v_end,
        "text_config": text,
        "tie_word_embeddings": False,
        "transformers_version": _TRANSFORMERS_VERSION,
        "vocab_size": text["vocab_size"],  # also at the top (unread by transformers), as the flat VL configs have it
        "vision_config": {
            "deepstack_visual_indexes": [0, 2],  # real: [5, 11, 17] of 24 blocks (2B) or [8, 16, 24] of 27
            "depth": 3,
            "hidden_act": "gelu_pytorch_tanh",
            "hidden_size": 32,
            "in_channels": 3,
            "initializer_range": 0.02,
            "intermediate_size": 64,
            "model_type": model_type,
            "num_heads": 4,
            "num_position_embeddings": 64,  # an 8x8 grid, interpolated to each image's patches (real 48x48)
            "out_hidden_size": 64,
            "patch_size": 16,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
        },
    }
    _save_transformers_model(out, config, seed, _qwen3_vl_moe_published_experts if moe is not None else None)
    _write_json(out / "generation_config.json",
                _qwen_generation_config(endoftext, im_end, temperature=0.7, top_k=20, top_p=0.8))
    half = [0.5, 0.5, 0.5]
    common = {"do_convert_rgb": True, "do_normalize": True, "do_rescale": True, "do_resize": True,
              "image_mean": half, "image_std": half, "merge_size": 2, "patch_size": 16,
              "processor_class": "Qwen3VLProcessor", "resample": 3, "rescale_factor": 1 / 255,
              "temporal_patch_size": 2}
    _write_json(out / "preprocessor_config.json", {
        **common, "image_processor_type": "Qwen2VLImageProcessorFast",
        "size": {"longest_edge": QWEN3_VL_MAX_PIXELS, "shortest_edge": QWEN3_VL_MIN_PIXELS}})
    _write_json(out / "video_preprocessor_config.json", {
        **common, "video_processor_type": "Qwen3VLVideoProcessor", "do_sample_frames": True, "fps": 2,
        "min_frames": 4, "max_frames": QWEN3_VL_VIDEO_MAX_FRAMES,
        "size": {"longest_edge": QWEN3_VL_VIDEO_MAX_PIXELS, "shortest_edge": QWEN3_VL_MIN_PIXELS}})
    _write_tokenizer(out, tok, _qwen_tokenizer_config(processor_class="Qwen3VLProcessor"), QWEN3_VL_CHAT_TEMPLATE)


def _build_qwen3_vl_moe(out: Path, seed: int) -> None:
    """Qwen3-VL-30B-A3B-Instruct like: 3 decoder layers, each sparse (8 experts of 24, top-2, always
    renormalised), experts stored stacked as published (``mlp.experts.gate_up_proj`` / ``down_proj``)."""
    _build_qwen3_vl(out, seed, moe=dict(num_hidden_layers=3, num_experts=8, num_experts_per_tok=2,
                                        moe_intermediate_size=24, decoder_sparse_step=1, mlp_only_layers=[]))


# LLaVA-1.5's CLIP tower, shrunk: 56-pixel images in 14-pixel patches = 4x4 = 16 patches (+ CLS),
# and the "default" feature strategy drops CLS, so each image takes 16 placeholder tokens.
LLAVA_IMAGE_SIZE = 56
LLAVA_IMAGE_TOKENS = (LLAVA_IMAGE_SIZE // 14) ** 2


def _llava_published_names(state: dict[str, torch.Tensor]) -> None:
    """llava-hf keeps CLIPVisionModel's ``vision_model.`` level (``vision_tower.vision_model.encoder...``);
    transformers 5 drops it on load but does not put it back when saving a model it built itself."""
    for key in [k for k in state if k.startswith("vision_tower.")]:
        state["vision_tower.vision_model." + key.removeprefix("vision_tower.")] = state.pop(key)


def _build_llava(out: Path, seed: int) -> None:
    """llava-hf/llava-1.5-7b-hf: CLIP ViT-L/14 tower (features of the second-to-last layer, CLS
    dropped), 2-layer GELU projector, Vicuna language model (Llama-2: MHA, no rope scaling)."""
    tok = _byte_level_tokenizer(
        _LLAMA3_SPLIT, leading=("<unk>", "<s>", "</s>"), trailing=("<image>", "<pad>"), prepend="<s>"
    )
    bos, eos, image, pad = _ids(tok, "<s>", "</s>", "<image>", "<pad>")
    vocab_size = tok.get_vocab_size()
    text_config = {
        **_TINY_DECODER,
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "bos_token_id": bos,
        "eos_token_id": eos,
        "pad_token_id": pad,
        "num_key_value_heads": 4,
        "rms_norm_eps": 1e-05,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "vocab_size": vocab_size,
    }
    del text_config["transformers_version"]
    vision_config = {
        "hidden_act": "quick_gelu",
        "hidden_size": 32,
        "image_size": LLAVA_IMAGE_SIZE,
        "intermediate_size": 64,
        "layer_norm_eps": 1e-05,
        "model_type": "clip_vision_model",
        "num_attention_heads": 4,
        "num_hidden_layers": 2,
        "patch_size": 14,
        "projection_dim": 64,
    }
    config = {
        "architectures": ["LlavaForConditionalGeneration"],
        "model_type": "llava",
        "ignore_index": -100,
        "image_seq_length": LLAVA_IMAGE_TOKENS,
        "image_token_index": image,  # transformers 5.23 also answers to config.image_token_id
        "pad_token_id": pad,
        "projector_hidden_act": "gelu",
        "text_config": text_config,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "transformers_version": _TRANSFORMERS_VERSION,
        "vision_config": vision_config,
        "vision_feature_layer": -2,
        "vision_feature_select_strategy": "default",
        "vocab_size": vocab_size,
    }
    _save_transformers_model(out, config, seed, adjust=_llava_published_names)
    _write_json(
        out / "generation_config.json",
        {"bos_token_id": bos, "eos_token_id": eos, "pad_token_id": pad, "transformers_version": _TRANSFORMERS_VERSION},
    )
    _write_json(
        out / "preprocessor_config.json",
        {
            "crop_size": {"height": LLAVA_IMAGE_SIZE, "width": LLAVA_IMAGE_SIZE},
            "do_center_crop": True,
            "do_convert_rgb": True,
            "do_normalize": True,
            "do_rescale": True,
            "do_resize": True,
            "image_mean": CLIP_MEAN,
            "image_processor_type": "CLIPImageProcessor",  # transformers picks the Pil class without torchvision
            "image_std": CLIP_STD,
            "processor_class": "LlavaProcessor",
            "resample": 3,
            "rescale_factor": 1 / 255,
            "size": {"shortest_edge": LLAVA_IMAGE_SIZE},
        },
    )
    _write_json(
        out / "processor_config.json",
        {"image_token": "<image>", "num_additional_image_tokens": 1, "patch_size": 14,
         "processor_class": "LlavaProcessor", "vision_feature_select_strategy": "default"},
    )
    tokenizer_config = {
        "add_bos_token": True,
        "add_eos_token": False,
        "bos_token": "<s>",
        "clean_up_tokenization_spaces": False,
        "eos_token": "</s>",
        "image_token": "<image>",
        "model_max_length": _MAX_POSITIONS,
        "pad_token": "<pad>",
        "padding_side": "left",
        "processor_class": "LlavaProcessor",
        # The real one is a SentencePiece LlamaTokenizer; transformers 5's LlamaTokenizer would rebuild
        # that pipeline around our byte-level BPE, so the generic class loads tokenizer.json as written.
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": "<unk>",
    }
    _write_tokenizer(out, tok, tokenizer_config, LLAVA_CHAT_TEMPLATE)


def _bert_position_ids(state: dict[str, torch.Tensor]) -> None:
    """all-MiniLM-L6-v2 (saved by transformers 4.x) still carries the int64 ``embeddings.position_ids``
    buffer (1, max_positions); transformers 5 ignores it on load, and our loader has to as well."""
    positions = state["embeddings.position_embeddings.weight"].shape[0]
    state["embeddings.position_ids"] = torch.arange(positions, dtype=torch.int64).unsqueeze(0)


def _build_bert(out: Path, seed: int, cross_encoder: bool = False) -> None:
    """sentence-transformers/all-MiniLM-L6-v2: BertModel names without a ``bert.`` prefix, with the
    pooler; the sentence-transformers files say mean pooling, then normalise. ``cross_encoder``:
    a BertForSequenceClassification with one label instead (cross-encoder/ms-marco-MiniLM-L-6-v2's
    layout: ``bert.*`` + ``classifier.*``, no sentence-transformers files)."""
    tok = _wordpiece_tokenizer()
    head = {"architectures": ["BertForSequenceClassification"], "id2label": {"0": "LABEL_0"},
            "label2id": {"LABEL_0": 0}} if cross_encoder else {"architectures": ["BertModel"]}
    config = {
        **head,
        "model_type": "bert",
        "attention_probs_dropout_prob": 0.1,
        "gradient_checkpointing": False,
        "hidden_act": "gelu",
        "hidden_dropout_prob": 0.1,
        "hidden_size": 32,
        "initializer_range": 0.02,
        "intermediate_size": 64,
        "layer_norm_eps": 1e-12,
        "max_position_embeddings": 512,
        "num_attention_heads": 4,
        "num_hidden_layers": 2,
        "pad_token_id": tok.token_to_id("[PAD]"),
        "position_embedding_type": "absolute",
        "transformers_version": _TRANSFORMERS_VERSION,
        "type_vocab_size": 2,
        "use_cache": True,
        "vocab_size": tok.get_vocab_size(),
    }
    _save_transformers_model(out, config, seed, adjust=None if cross_encoder else _bert_position_ids)
    tokenizer_config = {
        "cls_token": "[CLS]",
        "do_basic_tokenize": True,
        "do_lower_case": True,
        "mask_token": "[MASK]",
        "model_max_length": 512,
        "never_split": None,
        "pad_token": "[PAD]",
        "sep_token": "[SEP]",
        "strip_accents": None,
        "tokenize_chinese_chars": True,
        "tokenizer_class": "BertTokenizer",
        "unk_token": "[UNK]",
    }
    _write_tokenizer(out, tok, tokenizer_config, chat_template=None)
    vocab = sorted(tok.get_vocab().items(), key=lambda kv: kv[1])
    (out / "vocab.txt").write_text("".join(f"{token}\n" for token, _ in vocab), encoding="utf-8")
    if cross_encoder:
        return
    _write_json(
        out / "modules.json",
        [
            {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
            {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
            {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
        ],
    )
    _write_json(out / "sentence_bert_config.json", {"do_lower_case": False, "max_seq_length": 256})
    _write_json(
        out / "1_Pooling" / "config.json",
        {
            "pooling_mode_cls_token": False,
            "pooling_mode_max_tokens": False,
            "pooling_mode_mean_sqrt_len_tokens": False,
            "pooling_mode_mean_tokens": True,
            "word_embedding_dimension": config["hidden_size"],
        },
    )


# ---- Qwen-VL (not in transformers: its checkpoint ships modeling_qwen.py / visual.py as remote code)

QWEN_VL_CONFIG = {
    "hidden_size": 256,  # = visual.output_dim; the resampler has output_dim // 128 = 2 heads
    "num_attention_heads": 4,
    "kv_channels": 64,  # head dim; kv_channels * num_attention_heads == hidden_size
    "num_hidden_layers": 2,
    "intermediate_size": 512,  # the MLP's w1 / w2 have intermediate_size // 2 rows
    "visual": {"heads": 4, "image_size": 448, "layers": 2, "mlp_ratio": 4.9231, "output_dim": 256,
               "patch_size": 14, "width": 64},
}
QWEN_VL_QUERIES = 256  # resampler queries = image slots between <img> and </img> (docs/wire-format.md)


def qwen_vl_weight_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """Parameter names and shapes of a Qwen-VL(-Chat) checkpoint for `config` (a config.json dict).

    Names follow the published checkpoint (modeling_qwen.py + visual.py). With h = hidden_size,
    V = vocab_size, f = intermediate_size // 2, w = visual.width, m = int(w * visual.mlp_ratio),
    d = visual.output_dim (= h), p = visual.patch_size, Q = 256 queries:

    language model (QWenLMHeadModel; RMSNorm without bias, c_attn with bias, no other biases)
      transformer.wte.weight                       (V, h)
      transformer.h.{i}.ln_1.weight                (h,)
      transformer.h.{i}.attn.c_attn.weight         (3h, h)    q | k | v stacked
      transformer.h.{i}.attn.c_attn.bias           (3h,)
      transformer.h.{i}.attn.c_proj.weight         (h, h)
      transformer.h.{i}.ln_2.weight                (h,)
      transformer.h.{i}.mlp.w1.weight              (f, h)     w1 * silu(w2): w1 is the "up", w2 the "gate"
      transformer.h.{i}.mlp.w2.weight              (f, h)
      transformer.h.{i}.mlp.c_proj.weight          (h, f)
      transformer.ln_f.weight                      (h,)
      lm_head.weight                               (V, h)     not tied
    vision tower (visual.VisionTransformer; LayerNorm eps 1e-6 with bias)
      transformer.visual.conv1.weight              (w, 3, p, p)   no bias
      transformer.visual.positional_embedding      (256, w)   16x16 grid, bicubically resized to 32x32
      transformer.visual.ln_pre.{weight,bias}      (w,)
      transformer.visual.transformer.resblocks.{i}.ln_1.{weight,bias}        (w,)
      transformer.visual.transformer.resblocks.{i}.attn.in_proj.weight       (3w, w)  an nn.Linear:
      transformer.visual.transformer.resblocks.{i}.attn.in_proj.bias         (3w,)    ".in_proj.", with a dot
      transformer.visual.transformer.resblocks.{i}.attn.out_proj.{weight,bias}  (w, w) / (w,)
      transformer.visual.transformer.resblocks.{i}.ln_2.{weight,bias}        (w,)
      transformer.visual.transformer.resblocks.{i}.mlp.c_fc.{weight,bias}    (m, w) / (m,)   GELU
      transformer.visual.transformer.resblocks.{i}.mlp.c_proj.{weight,bias}  (w, m) / (w,)
      transformer.visual.attn_pool.query           (Q, d)
      transformer.visual.attn_pool.pos_embed       (Q, d)     fixed 2-D sin-cos of the 16x16 grid
      transformer.visual.attn_pool.kv_proj.weight  (d, w)     no bias
      transformer.visual.attn_pool.attn.in_proj_weight   (3d, d)  an nn.MultiheadAttention with d // 128
      transformer.visual.attn_pool.attn.in_proj_bias     (3d,)    heads: "_weight", no dot
      transformer.visual.attn_pool.attn.out_proj.{weight,bias}  (d, d) / (d,)
      transformer.visual.attn_pool.ln_q.{weight,bias}    (d,)
      transformer.visual.attn_pool.ln_kv.{weight,bias}   (d,)
      transformer.visual.ln_post.{weight,bias}     (d,)
      transformer.visual.proj                      (d, d)     applied as x @ proj
    """
    h, vocab, f = config["hidden_size"], config["vocab_size"], config["intermediate_size"] // 2
    vis = config["visual"]
    w, d, p = vis["width"], vis["output_dim"], vis["patch_size"]
    m = int(w * vis["mlp_ratio"])
    shapes: dict[str, tuple[int, ...]] = {"transformer.wte.weight": (vocab, h)}
    for i in range(config["num_hidden_layers"]):
        pre = f"transformer.h.{i}."
        shapes |= {
            pre + "ln_1.weight": (h,),
            pre + "attn.c_attn.weight": (3 * h, h),
            pre + "attn.c_attn.bias": (3 * h,),
            pre + "attn.c_proj.weight": (h, h),
            pre + "ln_2.weight": (h,),
            pre + "mlp.w1.weight": (f, h),
            pre + "mlp.w2.weight": (f, h),
            pre + "mlp.c_proj.weight": (h, f),
        }
    shapes |= {"transformer.ln_f.weight": (h,), "lm_head.weight": (vocab, h)}
    v = "transformer.visual."
    shapes |= {
        v + "conv1.weight": (w, 3, p, p),
        v + "positional_embedding": (256, w),
        v + "ln_pre.weight": (w,),
        v + "ln_pre.bias": (w,),
    }
    for i in range(vis["layers"]):
        pre = f"{v}transformer.resblocks.{i}."
        shapes |= {
            pre + "ln_1.weight": (w,),
            pre + "ln_1.bias": (w,),
            pre + "attn.in_proj.weight": (3 * w, w),
            pre + "attn.in_proj.bias": (3 * w,),
            pre + "attn.out_proj.weight": (w, w),
            pre + "attn.out_proj.bias": (w,),
            pre + "ln_2.weight": (w,),
            pre + "ln_2.bias": (w,),
            pre + "mlp.c_fc.weight": (m, w),
            pre + "mlp.c_fc.bias": (m,),
            pre + "mlp.c_proj.weight": (w, m),
            pre + "mlp.c_proj.bias": (w,),
        }
    a = v + "attn_pool."
    shapes |= {
        a + "query": (QWEN_VL_QUERIES, d),
        a + "pos_embed": (QWEN_VL_QUERIES, d),
        a + "kv_proj.weight": (d, w),
        a + "attn.in_proj_weight": (3 * d, d),
        a + "attn.in_proj_bias": (3 * d,),
        a + "attn.out_proj.weight": (d, d),
        a + "attn.out_proj.bias": (d,),
        a + "ln_q.weight": (d,),
        a + "ln_q.bias": (d,),
        a + "ln_kv.weight": (d,),
        a + "ln_kv.bias": (d,),
        v + "ln_post.weight": (d,),
        v + "ln_post.bias": (d,),
        v + "proj": (d, d),
    }
    return shapes


def _sincos_2d(dim: int, grid: int) -> torch.Tensor:
    """MAE's 2-D sin-cos table (grid*grid, dim) that Qwen-VL's Resampler stores as `pos_embed`:
    rows in row-major (y, x) order; the first half of the channels encodes x, the second y."""
    omega = 1.0 / 10000 ** (torch.arange(dim // 4, dtype=torch.float64) / (dim / 4))
    coords = torch.arange(grid, dtype=torch.float64)
    gw, gh = torch.meshgrid(coords, coords, indexing="xy")  # like np.meshgrid(grid_w, grid_h)

    def one_d(pos: torch.Tensor) -> torch.Tensor:
        out = pos.reshape(-1, 1) * omega
        return torch.cat([out.sin(), out.cos()], dim=1)

    return torch.cat([one_d(gw), one_d(gh)], dim=1).float()


_QWEN_VL_SPECIALS = (
    *_QWEN_CHATML,
    "<ref>",
    "</ref>",
    "<box>",
    "</box>",
    "<quad>",
    "</quad>",
    "<img>",
    "</img>",
    "<imgpad>",
)


def _build_qwen_vl(out: Path, seed: int) -> None:
    """Qwen-VL-Chat: Qwen-7B-style decoder + 448px ViT-bigG-style tower + 256-query resampler."""
    tok = _byte_level_tokenizer(_QWEN2_SPLIT, trailing=_QWEN_VL_SPECIALS, nfc=True)
    endoftext, img_start, img_end, img_pad = _ids(tok, "<|endoftext|>", "<img>", "</img>", "<imgpad>")
    assert (img_end, img_pad) == (img_start + 1, img_start + 2)  # the real tokenizer's layout
    cfg = QWEN_VL_CONFIG
    config = {
        "architectures": ["QWenLMHeadModel"],
        "attn_dropout_prob": 0.0,
        # No "auto_map": the published one points at modeling_qwen.py, which is not shipped here, and
        # would make AutoTokenizer ask for trust_remote_code.
        "bf16": False,
        "emb_dropout_prob": 0.0,
        "fp16": False,
        "fp32": False,
        "hidden_size": cfg["hidden_size"],
        "initializer_range": 0.02,
        "intermediate_size": cfg["intermediate_size"],
        "kv_channels": cfg["kv_channels"],
        "layer_norm_epsilon": 1e-06,
        "max_position_embeddings": _MAX_POSITIONS,
        "model_type": "qwen",
        "no_bias": True,
        "num_attention_heads": cfg["num_attention_heads"],
        "num_hidden_layers": cfg["num_hidden_layers"],
        "onnx_safe": None,
        "rotary_emb_base": 10000,
        "rotary_pct": 1.0,
        "scale_attn_weights": True,
        "seq_length": 2048,
        "tie_word_embeddings": False,
        "tokenizer_type": "QWenTokenizer",
        "torch_dtype": "float32",
        "transformers_version": "4.32.0",
        "use_cache": True,
        "use_dynamic_ntk": True,
        "use_flash_attn": False,
        "use_logn_attn": True,
        "visual": {**cfg["visual"], "image_start_id": img_start},
        "vocab_size": tok.get_vocab_size(),
    }
    _write_json(out / "config.json", config)
    gen = torch.Generator().manual_seed(seed)
    state = {}
    for name, shape in qwen_vl_weight_shapes(config).items():
        state[name] = torch.empty(shape)
        _fill_(name, state[name], gen)
    d = config["visual"]["output_dim"]
    state["transformer.visual.attn_pool.pos_embed"] = _sincos_2d(d, math.isqrt(QWEN_VL_QUERIES))
    _write_safetensors(out, state)
    # As published: eos is <|endoftext|>; chat() adds <|im_end|> / <|im_start|> as stop words itself.
    _write_json(
        out / "generation_config.json",
        {
            "chat_format": "chatml",
            "do_sample": True,
            "eos_token_id": endoftext,
            "max_new_tokens": 512,
            "max_window_size": 1024,
            "pad_token_id": endoftext,
            "top_k": 0,
            "top_p": 0.3,
            "transformers_version": "4.32.0",
        },
    )
    _write_tokenizer(
        out,
        tok,
        {
            "clean_up_tokenization_spaces": False,
            "eos_token": "<|endoftext|>",
            "model_max_length": 2048,
            "pad_token": "<|endoftext|>",
            "tokenizer_class": "PreTrainedTokenizerFast",
        },
        QWEN_VL_CHAT_TEMPLATE,
    )


# Qwen2-Audio-7B-Instruct's chat template, as published: each audio part (a content item with an
# "audio" or "audio_url" key) renders as "Audio N: <|audio_bos|><|AUDIO|><|audio_eos|>\n".
QWEN2_AUDIO_CHAT_TEMPLATE = r"""
{%- set audio_count = namespace(value=0) -%}
{%- for message in messages -%}
    {%- if loop.first and message['role'] != 'system' -%}
        {{- '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' -}}
    {%- endif -%}
    {{- '<|im_start|>' + message['role'] + '\n' -}}
    {%- if message['content'] is string -%}
        {{- message['content'] + '<|im_end|>\n' -}}
    {%- else -%}
        {%- for content in message['content'] -%}
            {%- if 'audio' in content or 'audio_url' in content -%}
                {%- set audio_count.value = audio_count.value + 1 -%}
                {{- 'Audio ' + audio_count.value|string + ': <|audio_bos|><|AUDIO|><|audio_eos|>\n' -}}
            {%- elif 'text' in content -%}
                {{- content['text'] -}}
            {%- endif -%}
        {%- endfor -%}
        {{- '<|im_end|>\n' -}}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<|im_start|>assistant\n' -}}
{%- endif -%}
"""

# ids 151646.. in the real vocabulary, after the ChatML tokens
_QWEN2_AUDIO_SPECIALS = (*_QWEN_CHATML, "<|AUDIO|>", "<|audio_bos|>", "<|audio_eos|>")


def _build_qwen2_audio(out: Path, seed: int) -> None:
    """Qwen2-Audio-7B-Instruct: Whisper-style encoder (128 mel bins, 1500 positions: the real
    window, so the features are the real ones; 2 layers of width 32), linear projector, Qwen2 decoder."""
    tok = _byte_level_tokenizer(_QWEN2_SPLIT, trailing=_QWEN2_AUDIO_SPECIALS, nfc=True)
    endoftext, _, im_end, audio = _ids(tok, *_QWEN_CHATML, "<|AUDIO|>")
    config = {  # the published nested layout: audio_config, text_config
        "architectures": ["Qwen2AudioForConditionalGeneration"],
        "model_type": "qwen2_audio",
        "audio_token_index": audio,
        "ignore_index": -100,
        "audio_config": {
            "model_type": "qwen2_audio_encoder",
            "activation_function": "gelu",
            "d_model": 32,
            "encoder_attention_heads": 4,
            "encoder_ffn_dim": 64,
            "encoder_layers": 2,
            "max_source_positions": 1500,
            "num_mel_bins": 128,
            "scale_embedding": False,
        },
        "text_config": {
            **_QWEN2_DECODER,
            "model_type": "qwen2",
            "bos_token_id": endoftext,
            "eos_token_id": im_end,
            "tie_word_embeddings": False,
            "vocab_size": tok.get_vocab_size(),
        },
        "torch_dtype": "float32",
        "transformers_version": _TRANSFORMERS_VERSION,
        "vocab_size": tok.get_vocab_size(),
    }
    _save_transformers_model(out, config, seed)
    _write_json(out / "generation_config.json", _qwen_generation_config(endoftext, im_end, top_k=1))
    _write_json(
        out / "preprocessor_config.json",
        {
            "chunk_length": 30,
            "dither": 0.0,
            "feature_extractor_type": "WhisperFeatureExtractor",
            "feature_size": 128,
            "hop_length": 160,
            "n_fft": 400,
            "n_samples": 480000,
            "nb_max_frames": 3000,
            "padding_side": "right",
            "padding_value": 0.0,
            "processor_class": "Qwen2AudioProcessor",
            "return_attention_mask": True,
            "sampling_rate": 16000,
        },
    )
    _write_tokenizer(out, tok, _qwen_tokenizer_config(processor_class="Qwen2AudioProcessor"),
                     QWEN2_AUDIO_CHAT_TEMPLATE)


# --------------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------------

FAMILIES: dict[str, Callable[[Path, int], None]] = {
    "qwen2": _build_qwen2,
    # Qwen2.5-Instruct: Qwen2's decoder with the tool-calling chat template and <tool_call> tokens
    "qwen2_5": functools.partial(_build_qwen2, chat_template=QWEN2_5_CHAT_TEMPLATE,
                                 plain_tokens=("<tool_call>", "</tool_call>")),
    "llama": _build_llama,
    "qwen3": _build_qwen3,
    "qwen3_moe": build_qwen3_moe,
    "qwen2_moe": build_qwen2_moe,
    "deepseek_v2_lite": build_deepseek_v2_lite,
    "deepseek_v3": build_deepseek_v3,
    "qwen_vl": _build_qwen_vl,
    "qwen2_vl": _build_qwen2_vl,
    "qwen2_5_vl": _build_qwen2_5_vl,
    "qwen3_vl": _build_qwen3_vl,
    "qwen3_vl_moe": _build_qwen3_vl_moe,
    "llava": _build_llava,
    "qwen2_audio": _build_qwen2_audio,
    "bert": _build_bert,
    # Pooling variants (same tokenizers and decoders, other heads)
    "qwen2_seq_cls": _build_qwen2_seq_cls,
    "qwen2_reward": _build_qwen2_reward,
    "bert_cross_encoder": functools.partial(_build_bert, cross_encoder=True),
}


def make_tiny_checkpoint(family: str, out_dir: str | os.PathLike[str], seed: int = 0) -> Path:
    """Write the tiny `family` checkpoint for `seed` into `out_dir` and return its path.

    The directory is created if needed; files of the same name are overwritten, others left alone."""
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; choose from {', '.join(FAMILIES)}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    FAMILIES[family](out, seed)
    return out


@functools.lru_cache(maxsize=1)
def _source_hash() -> str:
    """This file plus the versions of what writes the bytes: a change to either means a new build."""
    digest = hashlib.sha256(Path(__file__).read_bytes())
    for dist in ("torch", "transformers", "tokenizers", "safetensors"):
        digest.update(f"{dist}=={importlib.metadata.version(dist)}".encode())
    return digest.hexdigest()[:12]


_built: dict[tuple[str, int], Path] = {}


def tiny_checkpoint(family: str, seed: int = 0) -> Path:
    """The tiny checkpoint for (`family`, `seed`), built at most once per content of this file.

    Lives under ``<tmp>/atb-plugin-tiny-<uid>/<family>-<seed>-<hash of tiny.py and library versions>``;
    treat it as read-only (copy it first to make a variant).
    Several processes (pytest-xdist workers, a benchmark) may ask at once: each builds into its own
    scratch directory and renames it into place; the first rename wins, the others are discarded."""
    key = (family, seed)
    if key in _built and _built[key].is_dir():
        return _built[key]
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; choose from {', '.join(FAMILIES)}")
    uid = os.getuid() if hasattr(os, "getuid") else "user"
    root = Path(tempfile.gettempdir()) / f"atb-plugin-tiny-{uid}"
    final = root / f"{family}-{seed}-{_source_hash()}"
    if not final.is_dir():
        root.mkdir(parents=True, exist_ok=True)
        scratch = Path(tempfile.mkdtemp(prefix=f".{family}-{seed}-", dir=root))
        try:
            make_tiny_checkpoint(family, scratch, seed)
            try:
                os.rename(scratch, final)
            except OSError:
                if not final.is_dir():  # not "someone else finished first": a real error
                    raise
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
    _built[key] = final
    return final


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m atb_plugin.testing.tiny",
        description="Write a tiny, seeded Hugging Face checkpoint (offline) for one model family.",
    )
    parser.add_argument("--family", required=True, choices=[*FAMILIES, "all"],
                        help="model family; 'all' writes one subdirectory per family under --out")
    parser.add_argument("--out", required=True, type=Path, help="output directory")
    parser.add_argument("--seed", type=int, default=0, help="weight seed (default 0)")
    args = parser.parse_args(argv)
    families = list(FAMILIES) if args.family == "all" else [args.family]
    for family in families:
        out = args.out / family if args.family == "all" else args.out
        make_tiny_checkpoint(family, out, args.seed)
        print(f"{family}: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
