"""What OpenAI-API users send beyond plain chat, end to end with the official ``openai`` client:
sampling fields (penalties, logit_bias, min_p, allowed / bad words), n > 1, echo, prompt
logprobs, structured output, tool calling (auto with the hermes parser, required, named) and
reasoning content. A real server (tiny Qwen2.5 checkpoint: Qwen2.5's chat template with tools)
against the offline engine on the same prompts and params.

Random weights never call a tool or think on their own, so the auto-parser tests make the model
write the call (or the <think> block) through a regex constraint: the parsers then see exactly
what a real model would emit.
"""

from __future__ import annotations

import json

import openai
import pytest

from atb_plugin import LLM, SamplingParams
from atb_plugin.testing.tiny import tiny_checkpoint
from tests.server_helpers import ServerProcess

MODEL = "tiny-qwen2.5"
MESSAGES = [{"role": "user", "content": "Tell me about the cat on the mat."}]
PROMPT = "the cat sat on the mat and"
# The checkpoint's generation_config defaults (temperature 0.7, top_k 20, top_p 0.8, repetition
# penalty 1.05) off, so the server's output is comparable with the offline engine's.
GREEDY = {"temperature": 0, "top_p": 1.0, "top_k": 0, "repetition_penalty": 1.0}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}},
                   "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"utc": {"type": "boolean"}},
                                       "required": ["utc"], "additionalProperties": False}}}


@pytest.fixture(scope="module")
def server(serve):
    with serve(tiny_checkpoint("qwen2_5"), "--served-model-name", MODEL, "--enable-auto-tool-choice",
               "--tool-call-parser", "hermes", "--reasoning-parser", "qwen3", "--max-parallel-samples", "4") as server:
        yield server


@pytest.fixture(scope="module")
def client(server):
    return server.client()


@pytest.fixture(scope="module")
def llm():
    with LLM(tiny_checkpoint("qwen2_5"), block_size=16) as llm:
        yield llm


@pytest.fixture(scope="module")
def prompt_ids(server):
    return server.post("/tokenize", {"prompt": PROMPT}).json()["tokens"]


def complete(client, ignore_eos=True, **fields):
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 12, **GREEDY, **fields}
    extra = {k: body.pop(k) for k in list(body) if k not in ("model", "prompt", "max_tokens", "temperature", "seed",
                                                             "n", "logprobs", "echo", "stream", "presence_penalty",
                                                             "frequency_penalty", "logit_bias", "stop", "top_p")}
    return client.completions.create(**body, extra_body={"ignore_eos": ignore_eos, **extra})


def offline_text(llm, prompt_ids, **fields) -> str:
    params = SamplingParams(**{"max_tokens": 12, "ignore_eos": True, "temperature": 0, **fields})
    return llm.generate(prompt_ids, params)[0].outputs[0].text


# -- sampling fields ---------------------------------------------------------------------------------


@pytest.mark.parametrize("fields", [
    {"presence_penalty": 1.5},
    {"frequency_penalty": 2.0},
    {"repetition_penalty": 1.8},
    {"min_p": 0.3, "temperature": 1.0, "seed": 3},
], ids=lambda f: next(iter(f)))
def test_each_sampling_field_matches_the_offline_engine_and_changes_the_output(client, llm, prompt_ids, fields):
    served = complete(client, **fields).choices[0].text
    assert served == offline_text(llm, prompt_ids, **fields)
    plain = {k: v for k, v in fields.items() if k in ("temperature", "seed")}
    assert served != offline_text(llm, prompt_ids, **plain), f"{fields} changed nothing"


def test_logit_bias_forces_a_token_and_allowed_ids_restrict_the_output(client, server):
    token = 300
    forced = complete(client, logit_bias={str(token): 100}, max_tokens=5, logprobs=0).choices[0]
    text = server.post("/detokenize", {"tokens": [token]}).json()["prompt"]
    assert forced.logprobs.tokens == [text] * 5
    allowed = [7, 301]
    texts = {server.post("/detokenize", {"tokens": [t]}).json()["prompt"] for t in allowed}
    restricted = complete(client, allowed_token_ids=allowed, max_tokens=8, temperature=1.0, seed=1, logprobs=0)
    assert set(restricted.choices[0].logprobs.tokens) <= texts


def test_bad_words_block_the_greedy_word(client, server):
    tokens = complete(client, logprobs=0).choices[0].logprobs.tokens
    # A generated token that is a word of its own (re-encodes to itself, with or without its space).
    word = next(t.strip() for t in tokens if t.strip().isalpha()
                and server.post("/tokenize", {"prompt": t, "add_special_tokens": False}).json()["count"] == 1)
    blocked = complete(client, bad_words=[word], logprobs=0).choices[0].logprobs.tokens
    assert word not in [t.strip() for t in blocked]


# -- n, echo, prompt logprobs ---------------------------------------------------------------------------


def test_n_choices_use_consecutive_seeds(client):
    many = complete(client, n=3, temperature=1.0, seed=11)
    assert [c.index for c in many.choices] == [0, 1, 2]
    singles = [complete(client, temperature=1.0, seed=11 + i).choices[0].text for i in range(3)]
    assert [c.text for c in many.choices] == singles
    assert len(set(singles)) > 1
    assert many.usage.completion_tokens == 3 * 12


def test_n_streams_every_choice_by_index(client):
    stream = client.chat.completions.create(model=MODEL, messages=MESSAGES, n=2, max_tokens=6, temperature=1.0,
                                            seed=5, stream=True, extra_body={"ignore_eos": True})
    texts, reasons = {0: "", 1: ""}, {}
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            reasons[choice.index] = choice.finish_reason or reasons.get(choice.index)
    whole = client.chat.completions.create(model=MODEL, messages=MESSAGES, n=2, max_tokens=6, temperature=1.0,
                                           seed=5, extra_body={"ignore_eos": True})
    assert texts == {c.index: c.message.content for c in whole.choices}
    assert reasons == {0: "length", 1: "length"}


def test_echo_puts_the_prompt_first_with_its_logprobs(client, prompt_ids):
    plain = complete(client).choices[0].text
    echoed = complete(client, echo=True, logprobs=1).choices[0]
    assert echoed.text == PROMPT + plain
    logprobs = echoed.logprobs
    assert len(logprobs.tokens) == len(prompt_ids) + 12
    assert logprobs.token_logprobs[0] is None and all(lp <= 0 for lp in logprobs.token_logprobs[1:])
    assert "".join(logprobs.tokens) == echoed.text
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, echo=True, stream=True,
        extra_body={"ignore_eos": True, "repetition_penalty": 1.0}) if c.choices)
    assert streamed == echoed.text


def test_prompt_logprobs_match_the_offline_engine(client, llm, prompt_ids, server):
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 1, "prompt_logprobs": 2, **GREEDY}
    served = server.post("/v1/completions", body).json()["choices"][0]["prompt_logprobs"]
    offline = llm.generate(prompt_ids, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=2))[0]
    assert len(served) == len(prompt_ids) and served[0] is None
    for position, entry in zip(served[1:], offline.prompt_logprobs[1:]):
        own = position[str(entry.token_id)]
        assert own["logprob"] == pytest.approx(entry.logprob, abs=1e-5) and own["rank"] == entry.rank
        assert set(map(int, position)) == {entry.token_id, *entry.top_token_ids}
    chat = server.post("/v1/chat/completions", {"model": MODEL, "messages": MESSAGES, "max_tokens": 1,
                                                "prompt_logprobs": 0}).json()
    assert chat["prompt_logprobs"][0] is None and len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"]


# -- structured output ------------------------------------------------------------------------------------

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "color": {"enum": ["red", "green", "blue"]}},
          "required": ["ok", "color"], "additionalProperties": False}


def test_json_schema_output_validates(client):
    response = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=200, temperature=1.0, seed=2, n=3,
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA, "strict": True}})
    for choice in response.choices:
        value = json.loads(choice.message.content)
        assert set(value) == {"ok", "color"} and isinstance(value["ok"], bool) and value["color"] in ("red", "green", "blue")
        assert choice.finish_reason == "stop"


def test_choice_regex_and_json_object(client):
    # Without ignore_eos: a finished grammar allows only EOS, which ends the request.
    choice = complete(client, False, structured_outputs={"choice": ["yes", "no", "maybe"]}, max_tokens=10)
    assert choice.choices[0].text in ("yes", "no", "maybe")
    regex = complete(client, False, guided_regex=r"[0-9]{3}-[a-z]{2}", max_tokens=20)
    assert len(regex.choices[0].text) == 6 and regex.choices[0].text[3] == "-"
    obj = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=80, temperature=0,
                                         response_format={"type": "json_object"},
                                         extra_body={"repetition_penalty": 1.0})
    if obj.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(obj.choices[0].message.content), dict)
    else:  # cut by max_tokens: still a prefix the grammar accepted
        assert obj.choices[0].message.content.lstrip().startswith("{")


# -- tools -----------------------------------------------------------------------------------------------------

CALL_TEXT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
CALL_REGEX = CALL_TEXT.replace("{", r"\{").replace("}", r"\}")


def test_auto_tool_call_is_parsed_whole_and_streamed(client):
    kwargs = dict(model=MODEL, messages=MESSAGES, tools=[WEATHER, TIME], max_tokens=200, temperature=0,
                  extra_body={"guided_regex": "Let me check\\. " + CALL_REGEX, "repetition_penalty": 1.0})
    whole = client.chat.completions.create(**kwargs).choices[0]
    assert whole.finish_reason == "tool_calls" and whole.message.content.strip() == "Let me check."
    [call] = whole.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Oslo"}
    assert call.id.startswith("chatcmpl-tool-")
    content, names, arguments, reasons = "", [], "", []
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for delta in choice.delta.tool_calls or []:
                names += [delta.function.name] if delta.function and delta.function.name else []
                arguments += (delta.function.arguments or "") if delta.function else ""
            reasons.append(choice.finish_reason)
    assert content.strip() == "Let me check." and names == ["get_weather"]
    assert json.loads(arguments) == {"city": "Oslo"} and reasons[-1] == "tool_calls"


@pytest.mark.parametrize("stream", [False, True])
def test_forced_tool_calls_always_parse(client, stream):
    named = {"type": "function", "function": {"name": "get_time"}}
    for tool_choice, expected_reason in (("required", "tool_calls"), (named, "stop")):
        # One call: random weights never close an open-ended array of calls.
        kwargs = dict(model=MODEL, messages=MESSAGES, tools=[WEATHER, TIME], tool_choice=tool_choice, max_tokens=300,
                      temperature=1.0, seed=4, parallel_tool_calls=False)
        if not stream:
            choice = client.chat.completions.create(**kwargs).choices[0]
            calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]
            reason = choice.finish_reason
        else:
            calls, reason = {}, None
            for chunk in client.chat.completions.create(**kwargs, stream=True):
                for choice in chunk.choices:
                    for delta in choice.delta.tool_calls or []:
                        name, args = calls.get(delta.index, ("", ""))
                        calls[delta.index] = (name + (delta.function.name or ""), args + (delta.function.arguments or ""))
                    reason = choice.finish_reason or reason
            calls = [calls[i] for i in sorted(calls)]
        assert reason == expected_reason and calls, (tool_choice, calls)
        for name, arguments in calls:
            assert name in ("get_weather", "get_time")
            args = json.loads(arguments)
            assert args in ({"city": "Paris"}, {"city": "Oslo"}) if name == "get_weather" else isinstance(args["utc"], bool)
        if tool_choice is named:
            assert [name for name, _ in calls] == ["get_time"]


def test_a_tool_round_trip_renders_through_the_template(server):
    history = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]
    body = {"model": MODEL, "messages": history, "tools": [WEATHER], "tool_choice": "none", "max_tokens": 4}
    answer = server.post("/v1/chat/completions", body)
    assert answer.status_code == 200, answer.text
    without_tools = server.post("/v1/chat/completions", {**body, "messages": MESSAGES, "tools": None}).json()
    # The tools block, the call and the tool's answer are all in the prompt.
    assert answer.json()["usage"]["prompt_tokens"] > without_tools["usage"]["prompt_tokens"] + 40


# -- reasoning ----------------------------------------------------------------------------------------------


def test_reasoning_content_is_split_whole_and_streamed(client):
    kwargs = dict(model=MODEL, messages=MESSAGES, max_tokens=60, temperature=0,
                  extra_body={"guided_regex": "<think>[a-z ]{3,12}</think>[a-z ]{2,10}", "repetition_penalty": 1.0})
    whole = client.chat.completions.create(**kwargs).choices[0].message
    reasoning = whole.model_extra["reasoning_content"]
    assert reasoning and whole.content and "<think>" not in whole.content + reasoning
    streamed = {"reasoning_content": "", "content": ""}
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        for choice in chunk.choices:
            streamed["content"] += choice.delta.content or ""
            streamed["reasoning_content"] += (choice.delta.model_extra or {}).get("reasoning_content") or ""
    assert streamed == {"reasoning_content": reasoning, "content": whole.content}


# -- bad input --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("body, message, param", [
    ({"presence_penalty": 2.5}, "presence_penalty must be in [-2, 2]", "presence_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty must be in (0, 2]", "repetition_penalty"),
    ({"min_p": 1.5}, "min_p must be in [0, 1]", "min_p"),
    ({"logit_bias": {"99999": 1}}, "outside the vocabulary", "logit_bias"),
    ({"logit_bias": {"5": 101}}, "logit_bias values must be in [-100, 100]", "logit_bias"),
    ({"logit_bias": {"cat": 1}}, "logit_bias keys must be token ids", "logit_bias"),
    ({"allowed_token_ids": [1, 10**6]}, "outside the vocabulary", "allowed_token_ids"),
    ({"n": 5}, "above this server's limit of 4", "n"),
    ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs is not available when stream", "prompt_logprobs"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "bogus"}}}},
     "response_format", "response_format"),
    ({"guided_regex": "(unclosed"}, "guided_regex", "guided_regex"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "send only one of them", "guided_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "nope", "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
     "cannot be combined", "response_format"),
    ({"tool_choice": "required"}, "tools", "tool_choice"),
])
def test_bad_values_are_400_naming_the_field(server, body, message, param):
    response = server.post("/v1/chat/completions", {"model": MODEL, "messages": MESSAGES, "max_tokens": 2, **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert message in error["message"] and error["param"] == param, error


@pytest.mark.server
def test_auto_tool_choice_needs_the_server_flags():
    plain = ServerProcess(tiny_checkpoint("qwen2_5"), "--served-model-name", MODEL)
    try:
        with pytest.raises(openai.BadRequestError, match="--enable-auto-tool-choice"):
            plain.client().chat.completions.create(model=MODEL, messages=MESSAGES, tools=[WEATHER], max_tokens=2)
        # tool_choice "none" needs no parser: the tools are rendered, nothing is parsed.
        none = plain.client().chat.completions.create(model=MODEL, messages=MESSAGES, tools=[WEATHER],
                                                      tool_choice="none", max_tokens=2)
        assert none.choices[0].message.tool_calls in (None, [])
    finally:
        assert plain.stop() == 0, plain.log()
