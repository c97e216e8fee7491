"""OpenAI / vLLM wire protocol: request validation, SamplingParams mapping, response shapes."""

from __future__ import annotations

import json
import logging
import math

import pytest
from pydantic import ValidationError

from atb_plugin.engine.sampler import LogprobsEntry
from atb_plugin.frontend.errors import InvalidRequestError
from atb_plugin.frontend.input_processor import check_context_length, generation_defaults_from_config
from atb_plugin.server.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionResponseStreamChoice,
    ChatCompletionStreamResponse,
    ChatMessage,
    CompletionRequest,
    CompletionResponse,
    CompletionResponseChoice,
    CompletionStreamResponse,
    CompletionResponseStreamChoice,
    DeltaMessage,
    DetokenizeRequest,
    ModelCard,
    ModelList,
    TokenizeRequest,
    UsageInfo,
    chat_logprobs,
    completion_logprobs,
    error_response,
    format_validation_error,
)

USER = [{"role": "user", "content": "Hello"}]


def chat(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": USER, **fields})


def refused(cls, body) -> tuple[str, str | None]:
    with pytest.raises(ValidationError) as info:
        cls.model_validate(body)
    return format_validation_error(info.value)


def chat_refused(**fields) -> tuple[str, str | None]:
    return refused(ChatCompletionRequest, {"messages": USER, **fields})


# -- chat requests -----------------------------------------------------------------------------------


def test_unknown_role_is_named_with_the_value():
    message, param = refused(ChatCompletionRequest, {"messages": [{"role": "robot", "content": "hi"}]})
    assert message == ("messages.0.role: Input should be 'system', 'user', 'assistant', 'tool' or 'developer' "
                       "(got 'robot')")
    assert param == "messages.0.role"


@pytest.mark.parametrize("body, expected, param", [
    ({"messages": []}, "messages must contain at least one message", "messages"),
    ({}, "messages: Field required", "messages"),
    ({"messages": "hi"}, "messages: Input should be a valid list (got 'hi')", "messages"),
    ({"messages": ["hi"]}, "messages.0: Input should be a JSON object (got 'hi')", "messages.0"),
    ({"messages": [{"role": "user"}]}, "messages.0: content is required for a 'user' message", "messages.0"),
    ({"messages": [{"role": "user", "content": 5}]},
     "messages.0.content: content must be a string or a list of content parts, got int", "messages.0.content"),
    ({"messages": [{"role": "user", "content": [{"type": "file", "file": {}}]}]},
     "messages.0.content: part 0: content type 'file' is not supported",
     "messages.0.content"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image_url"}]}]},
     'messages.0.content: part 1: an image_url part needs {"image_url": {"url": "..."}}', "messages.0.content"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": 3}]}]},
     "messages.0.content: part 0: a text part needs a string 'text'", "messages.0.content"),
    ({"messages": [{"role": "user", "content": [{"foo": 1}]}]},
     "messages.0.content: part 0: unknown content part with keys ['foo']", "messages.0.content"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x", "detail": "max"}}]}]},
     "messages.0.content: part 0: image_url.detail must be one of auto, low, high, got 'max'", "messages.0.content"),
])
def test_malformed_messages(body, expected, param):
    message, got_param = refused(ChatCompletionRequest, body)
    assert message.startswith(expected), message
    assert got_param == param


def test_content_parts_in_both_spellings():
    request = ChatCompletionRequest.model_validate({"messages": [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA", "detail": "low"}},
            {"type": "image_url", "image_url": "/data/images/cat.png"},
            {"image": "/data/images/dog.png"},
            {"text": "What are these?"},
            {"type": "text", "text": " Briefly."},
        ]},
        {"role": "assistant", "content": None},
        {"role": "user", "content": {"type": "text", "text": "and?"}},  # a single part
    ]})
    conversation = request.to_conversation()
    assert [m["role"] for m in conversation] == ["system", "user", "assistant", "user"]
    assert conversation[1]["content"][2] == {"image": "/data/images/dog.png"}  # MindIE spelling kept
    assert conversation[2]["content"] == ""
    assert conversation[3]["content"] == [{"type": "text", "text": "and?"}]


def test_unknown_fields_are_ignored_and_logged(caplog):
    with caplog.at_level(logging.WARNING, logger="atb_plugin.server.protocol"):
        request = chat(store=True, metadata={"a": "b"}, user="u1")
    assert not hasattr(request, "store")
    assert "ignoring unknown fields metadata, store" in caplog.text


@pytest.mark.parametrize("field, bad, good", [
    ("use_beam_search", True, False),
    ("length_penalty", 0.5, 1.0),
    ("continue_final_message", True, False),
    ("functions", [{"name": "f"}], None),
])
def test_unsupported_sampling_fields_only_at_their_neutral_value(field, bad, good):
    message, param = chat_refused(**{field: bad})
    assert message.startswith(f"{field}=") and "is not supported yet" in message, message
    assert param == field
    chat(**{field: good}).to_sampling_params(100)  # neutral: accepted


def test_several_problems_are_reported_together():
    message, param = chat_refused(temperature="hot", stop=5, use_beam_search=True)
    assert "temperature: Input should be a valid number" in message and "(got 'hot')" in message
    assert "stop must be a string or a list of strings, got 5" in message
    assert "use_beam_search=True is not supported yet" in message
    assert param == "temperature"


def test_penalties_bias_and_min_p_reach_the_sampling_params():
    params = chat(presence_penalty=0.5, frequency_penalty=-1.0, repetition_penalty=1.1, logit_bias={"42": 5.0},
                  min_p=0.1, allowed_token_ids=[1, 2], prompt_logprobs=3).to_sampling_params(100)
    assert (params.presence_penalty, params.frequency_penalty, params.repetition_penalty, params.min_p) == (
        0.5, -1.0, 1.1, 0.1)
    assert params.logit_bias == {42: 5.0} and params.allowed_token_ids == [1, 2] and params.prompt_logprobs == 3
    neutral = chat().to_sampling_params(100)
    assert (neutral.presence_penalty, neutral.frequency_penalty, neutral.repetition_penalty, neutral.min_p) == (
        0.0, 0.0, 1.0, 0.0)
    for fields, param in [({"presence_penalty": 2.5}, "presence_penalty"), ({"repetition_penalty": 0}, "repetition_penalty"),
                          ({"min_p": -0.1}, "min_p"), ({"logit_bias": {"x": 1}}, "logit_bias")]:
        with pytest.raises(InvalidRequestError) as info:
            chat(**fields).to_sampling_params(100)
        assert info.value.param == param, fields


def test_structured_output_fields_resolve_to_one_constraint():
    assert chat().structured_outputs_params() is None
    assert chat(response_format={"type": "text"}).structured_outputs_params() is None
    spec, name = chat(response_format={"type": "json_object"}).structured_outputs_params()
    assert spec.json_object and name == "response_format"
    spec, name = chat(response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "object"}}}
                      ).structured_outputs_params()
    assert json.loads(spec.json) == {"type": "object"} and name == "response_format"
    assert chat(guided_choice=["a", "b"]).structured_outputs_params()[0].choice == ["a", "b"]
    assert chat(structured_outputs={"regex": "a+"}).structured_outputs_params()[0].regex == "a+"
    with pytest.raises(InvalidRequestError, match="send only one of them") as info:
        chat(guided_regex="a", response_format={"type": "json_object"}).structured_outputs_params()
    assert info.value.param == "response_format"
    with pytest.raises(InvalidRequestError, match="unknown keys") as info:
        chat(structured_outputs={"jsn": {}}).structured_outputs_params()
    assert info.value.param == "structured_outputs"
    assert chat_refused(response_format={"type": "json_schema"})[1] == "response_format"


def test_logprob_fields():
    assert chat_refused(top_logprobs=21)[0] == "top_logprobs: Input should be less than or equal to 20 (got 21)"
    assert chat_refused(top_logprobs=-1)[1] == "top_logprobs"
    message, param = chat_refused(top_logprobs=3)
    assert "`logprobs` must be set to true" in message and param == "top_logprobs"
    assert chat(logprobs=True, top_logprobs=5).to_sampling_params(100).logprobs == 5
    assert chat(logprobs=True).to_sampling_params(100).logprobs == 0
    assert chat(logprobs=False).to_sampling_params(100).logprobs is None


def test_stream_options():
    message, param = chat_refused(stream_options={"include_usage": True})
    assert "Stream options can only be defined when `stream=True`" in message and param == "stream_options"
    assert chat(stream=True, stream_options={"include_usage": True}).include_usage
    assert chat(stream=True,
                stream_options={"include_usage": True, "continuous_usage_stats": True}).continuous_usage_stats
    assert not chat(stream=True).include_usage
    assert not chat(stream_options={}).include_usage


def test_stop_forms():
    assert chat(stop="###").to_sampling_params(10).stop == ["###"]
    assert chat(stop=["a", "b"], stop_token_ids=[7]).to_sampling_params(10).stop_token_ids == [7]
    assert chat(stop=None).to_sampling_params(10).stop == []
    assert chat_refused(stop=["a", ""])[0] == "stop cannot contain an empty string"
    assert chat_refused(stop_token_ids=[-1])[1] == "stop_token_ids"
    assert chat_refused(seed=-1)[1] == "seed"
    assert chat(seed=2**64 - 1).to_sampling_params(10).seed == 2**64 - 1


# -- to_sampling_params ------------------------------------------------------------------------------


def test_generation_defaults_apply_only_to_unset_fields():
    config = {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05, "do_sample": True,
              "bos_token_id": 1}
    params = chat().to_sampling_params(100, config)
    assert (params.temperature, params.top_p, params.top_k, params.repetition_penalty) == (0.7, 0.8, 20, 1.05)
    params = chat(temperature=0, top_p=1.0, top_k=-1, repetition_penalty=1.0).to_sampling_params(100, config)
    assert (params.temperature, params.top_p, params.top_k, params.repetition_penalty) == (0, 1.0, -1, 1.0)
    params = chat().to_sampling_params(100)
    assert (params.temperature, params.top_p, params.top_k) == (1.0, 1.0, 0)


def test_generation_defaults_from_config():
    defaults, unsupported = generation_defaults_from_config(
        {"temperature": 0.6, "top_k": 50, "top_p": 1.0, "max_new_tokens": 256, "repetition_penalty": 1.05,
         "min_p": 0.0, "eos_token_id": [1, 2]})
    # transformers' own defaults (top_k 50, top_p 1.0) are dropped, as vLLM's to_diff_dict() does.
    assert defaults == {"temperature": 0.6, "max_tokens": 256, "repetition_penalty": 1.05, "min_p": 0.0}
    assert unsupported == []
    assert generation_defaults_from_config(None) == ({}, [])
    assert generation_defaults_from_config({"top_k": "x"}) == ({}, ["top_k='x'"])
    # Idempotent: the filtered dict works as generation_defaults too.
    assert chat().to_sampling_params(1000, defaults).max_tokens == 256


def test_max_tokens():
    assert chat().to_sampling_params(300).max_tokens == 300
    assert chat(max_tokens=5, max_completion_tokens=7).to_sampling_params(300).max_tokens == 7
    assert chat(max_tokens=5).to_sampling_params(300).max_tokens == 5
    assert chat(max_tokens=5).to_sampling_params(300, {"max_new_tokens": 3}).max_tokens == 3
    with pytest.raises(InvalidRequestError) as info:
        chat(max_completion_tokens=301).to_sampling_params(300)
    assert info.value.param == "max_completion_tokens" and "too large: 301" in str(info.value)
    with pytest.raises(InvalidRequestError) as info:
        chat().to_sampling_params(0)
    assert info.value.param == "input_tokens"
    assert chat_refused(max_tokens=0)[1] == "max_tokens"


def test_sampling_params_errors_name_their_field():
    for fields, param in [({"n": 0}, "n"), ({"temperature": -0.5}, "temperature"), ({"top_p": 0}, "top_p"),
                          ({"top_k": -3}, "top_k"), ({"min_tokens": 50, "max_tokens": 10}, "min_tokens")]:
        with pytest.raises(InvalidRequestError) as info:
            chat(**fields).to_sampling_params(100)
        assert info.value.param == param, fields
        assert isinstance(info.value, ValueError)
    assert chat(n=3).to_sampling_params(100).n == 3  # the server caps it (--max-parallel-samples)


def test_chat_sampling_params_carry_every_field():
    params = chat(temperature=0.5, top_p=0.9, top_k=40, seed=1234, max_tokens=20, min_tokens=2, stop=["x"],
                  stop_token_ids=[3], ignore_eos=True, skip_special_tokens=False, n=1).to_sampling_params(100)
    assert params == type(params)(n=1, temperature=0.5, top_p=0.9, top_k=40, seed=1234, max_tokens=20, min_tokens=2,
                                  stop=["x"], stop_token_ids=[3], ignore_eos=True, logprobs=None,
                                  skip_special_tokens=False)


def test_check_context_length():
    check_context_length(10, 100, 90)
    with pytest.raises(InvalidRequestError, match="maximum context length is 100 tokens. However, your request has "
                                                  "100 input tokens") as info:
        check_context_length(100, 100)
    assert info.value.param == "input_tokens"
    with pytest.raises(InvalidRequestError, match=r"too large: 91.*\(91 > 100 - 10\)") as info:
        check_context_length(10, 100, 91, max_tokens_param="max_completion_tokens")
    assert info.value.param == "max_completion_tokens"
    with pytest.raises(InvalidRequestError, match="limit of 8 input tokens"):
        check_context_length(10, 100, max_input_tokens=8)


# -- completion requests -----------------------------------------------------------------------------


@pytest.mark.parametrize("prompt, normalised", [
    ("Once upon", "Once upon"),
    (["Once upon"], "Once upon"),
    ([1, 2, 3], [1, 2, 3]),
    ([[1, 2, 3]], [1, 2, 3]),
])
def test_completion_prompt_forms(prompt, normalised):
    assert CompletionRequest.model_validate({"prompt": prompt}).prompt == normalised


@pytest.mark.parametrize("prompt, expected", [
    (["a", "b"], "got 2 prompts; only one prompt per request is supported"),
    ([[1], [2], [3]], "got 3 prompts; only one prompt per request is supported"),
    ("", "prompt must not be empty"),
    ([], "prompt must be a non-empty string"),
    ([[]], "prompt must not be an empty list of token ids"),
    ([1, "a"], "prompt must be a string, a list of strings, a list of token ids"),
    ([True, False], "prompt must be a string, a list of strings, a list of token ids"),
    ([1, -5], "prompt token ids must be >= 0"),
    (None, "prompt must be a non-empty string"),
])
def test_completion_prompt_errors(prompt, expected):
    message, param = refused(CompletionRequest, {"prompt": prompt})
    assert expected in message and param == "prompt", message


def test_completion_fields():
    request = CompletionRequest.model_validate({"prompt": "x"})
    assert request.max_tokens == 16 and request.add_special_tokens
    assert request.to_sampling_params(10).max_tokens == 10  # the implicit 16 is clamped, not refused
    with pytest.raises(InvalidRequestError) as info:
        CompletionRequest.model_validate({"prompt": "x", "max_tokens": 16}).to_sampling_params(10)
    assert info.value.param == "max_tokens"
    assert CompletionRequest.model_validate({"prompt": "x", "logprobs": 3}).to_sampling_params(100).logprobs == 3
    assert CompletionRequest.model_validate({"prompt": "x"}).to_sampling_params(100).logprobs is None
    assert refused(CompletionRequest, {"prompt": "x", "logprobs": 21})[1] == "logprobs"
    for field, value in [("suffix", "end"), ("best_of", 2)]:
        message, param = refused(CompletionRequest, {"prompt": "x", field: value})
        assert "is not supported yet" in message and param == field
    for field, value in [("echo", True), ("suffix", None), ("best_of", 1)]:
        CompletionRequest.model_validate({"prompt": "x", field: value})


# -- tokenize / detokenize ---------------------------------------------------------------------------


def test_tokenize_forms():
    text = TokenizeRequest.model_validate({"model": "m", "prompt": "hi"})
    assert not text.is_chat and text.effective_add_special_tokens
    chat_form = TokenizeRequest.model_validate({"messages": USER, "add_generation_prompt": False,
                                                "chat_template_kwargs": {"enable_thinking": False}})
    assert chat_form.is_chat and not chat_form.effective_add_special_tokens
    assert chat_form.to_conversation() == USER
    no_special = TokenizeRequest.model_validate({"prompt": "x", "add_special_tokens": False})
    assert no_special.effective_add_special_tokens is False
    for body in ({"model": "m"}, {"prompt": "x", "messages": USER}):
        assert "exactly one of 'prompt'" in refused(TokenizeRequest, body)[0]
    assert refused(TokenizeRequest, {"messages": [{"role": "bot", "content": "x"}]})[1] == "messages.0.role"
    assert DetokenizeRequest.model_validate({"tokens": [1, 2]}).tokens == [1, 2]
    assert refused(DetokenizeRequest, {"tokens": [1, -2]})[1] == "tokens"
    assert refused(DetokenizeRequest, {"tokens": "abc"})[1] == "tokens"


# -- errors ------------------------------------------------------------------------------------------


def test_error_json_matches_vllm():
    assert error_response("bad", param="temperature").model_dump() == {
        "error": {"message": "bad", "type": "BadRequestError", "param": "temperature", "code": 400}}
    assert error_response("The model `x` does not exist.", 404, param="model").error.type == "NotFoundError"
    assert error_response("boom", 500).error.type == "InternalServerError"
    assert error_response("slow down", 429).error.type == "RateLimitError"
    assert error_response("gone", 410).error.type == "Gone"


def test_format_fastapi_request_validation_error():
    from fastapi.exceptions import RequestValidationError

    exc = RequestValidationError([
        {"type": "json_invalid", "loc": ("body", 12), "msg": "JSON decode error", "input": {},
         "ctx": {"error": "Expecting value"}},
    ])
    assert format_validation_error(exc) == ("Invalid JSON body: Expecting value", None)
    exc = RequestValidationError([
        {"type": "literal_error", "loc": ("body", "messages", 0, "role"), "msg": "Input should be 'user'",
         "input": "bot"},
    ])
    assert format_validation_error(exc) == ("messages.0.role: Input should be 'user' (got 'bot')", "messages.0.role")


def test_format_limits_the_number_of_problems():
    body = {"messages": [{"role": f"r{i}", "content": "x"} for i in range(8)]}
    message, _ = refused(ChatCompletionRequest, body)
    assert message.count("Input should be") == 5 and message.endswith("and 3 more")


# -- responses ---------------------------------------------------------------------------------------


def test_responses_parse_with_the_openai_sdk():
    from openai.types import Completion, Model
    from openai.types.chat import ChatCompletion, ChatCompletionChunk

    usage = UsageInfo.from_counts(prompt_tokens=5, completion_tokens=3, cached_tokens=4)
    assert usage.total_tokens == 8 and usage.prompt_tokens_details.cached_tokens == 4
    response = ChatCompletionResponse(model="m", usage=usage, choices=[ChatCompletionResponseChoice(
        index=0, message=ChatMessage(role="assistant", content="Hi!"), finish_reason="stop")])
    body = response.model_dump()
    assert body["id"].startswith("chatcmpl-") and body["object"] == "chat.completion"
    parsed = ChatCompletion.model_validate(body)
    assert parsed.choices[0].message.content == "Hi!" and parsed.usage.prompt_tokens_details.cached_tokens == 4

    chunk = ChatCompletionStreamResponse(id="chatcmpl-1", model="m", choices=[ChatCompletionResponseStreamChoice(
        index=0, delta=DeltaMessage(role="assistant", content=""))])
    assert chunk.model_dump(exclude_unset=True)["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert ChatCompletionChunk.model_validate(chunk.model_dump()).object == "chat.completion.chunk"

    completion = CompletionResponse(model="m", usage=usage, choices=[CompletionResponseChoice(
        index=0, text=" there", finish_reason="length")])
    assert completion.model_dump()["object"] == "text_completion"
    assert Completion.model_validate(completion.model_dump()).choices[0].text == " there"
    stream = CompletionStreamResponse(model="m", choices=[CompletionResponseStreamChoice(index=0, text="x")])
    assert stream.model_dump()["usage"] is None

    models = ModelList(data=[ModelCard(id="m", root="/models/m", max_model_len=4096)]).model_dump()
    assert models["object"] == "list" and models["data"][0]["owned_by"] == "atb-plugin"
    assert Model.model_validate(models["data"][0]).id == "m"


TEXT = {1: "Hello", 2: ",", 3: " world", 4: "é"}


def entries():
    return [
        LogprobsEntry(token_id=1, logprob=-0.1, rank=1, top_token_ids=[1, 3], top_logprobs=[-0.1, -2.5]),
        LogprobsEntry(token_id=4, logprob=-math.inf, rank=9, top_token_ids=[2, 3], top_logprobs=[-0.5, -0.7]),
    ]


def test_chat_logprobs_format():
    result = chat_logprobs(entries(), TEXT.__getitem__).model_dump()
    first, second = result["content"]
    assert first == {"token": "Hello", "logprob": -0.1, "bytes": list(b"Hello"), "top_logprobs": [
        {"token": "Hello", "logprob": -0.1, "bytes": list(b"Hello")},
        {"token": " world", "logprob": -2.5, "bytes": list(b" world")}]}
    assert second["logprob"] == -9999.0 and second["bytes"] == [0xC3, 0xA9]
    assert [t["token"] for t in second["top_logprobs"]] == [",", " world"]
    from openai.types.chat.chat_completion import ChoiceLogprobs

    ChoiceLogprobs.model_validate(result)


def test_completion_logprobs_format():
    result = completion_logprobs(entries(), TEXT.__getitem__).model_dump()
    assert result == {
        "tokens": ["Hello", "é"],
        "token_logprobs": [-0.1, -9999.0],
        "top_logprobs": [{"Hello": -0.1, " world": -2.5}, {"é": -9999.0, ",": -0.5, " world": -0.7}],
        "text_offset": [0, 5],
    }
    assert completion_logprobs(entries(), TEXT.__getitem__, initial_text_offset=12).text_offset == [12, 17]
    assert completion_logprobs([], TEXT.__getitem__).tokens == []


def test_requested_max_tokens_for_the_context_check():
    assert chat().requested_max_tokens is None
    request = chat(max_tokens=5, max_completion_tokens=7)
    assert (request.requested_max_tokens, request.max_tokens_param) == (7, "max_completion_tokens")
    assert chat(max_tokens=5).max_tokens_param == "max_tokens"
    assert CompletionRequest.model_validate({"prompt": "x"}).requested_max_tokens is None  # the implicit 16
    request = CompletionRequest.model_validate({"prompt": "x", "max_tokens": 30})
    assert (request.requested_max_tokens, request.max_tokens_param) == (30, "max_tokens")
