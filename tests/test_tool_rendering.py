"""Tool calling in the prompt: ``tools``, assistant ``tool_calls`` and ``role: tool`` messages through
the input builders, on the tiny Qwen2.5 checkpoint (whose template renders them) and on Qwen2 (whose
template does not), plus the tokenizer worker's chat job forwarding ``tools``."""

from __future__ import annotations

import copy

import pytest
from jinja2 import TemplateSyntaxError

from atb_plugin.engine.config import EngineConfig
from atb_plugin.frontend.input_processor import InputProcessor
from atb_plugin.frontend.tokenizer_pool import ChatJob, run_job
from atb_plugin.testing.tiny import tiny_checkpoint
from input_builders import InputBuilderError, UnsupportedContentError
from input_builders.conversation import ChatTemplateError, ConversationError, parse_conversation
from routers import get_router

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]

ROUND_TRIP = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"},
    {"role": "assistant", "content": "It is 18 C and sunny."},
    {"role": "user", "content": "Thanks"},
]

# Qwen2.5-Instruct's published layout for ROUND_TRIP with TOOLS.
EXPECTED_QWEN2_5 = (
    "<|im_start|>system\nBe brief.\n\n# Tools\n\nYou may call one or more functions to assist with the user "
    "query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    '{"type": "function", "function": {"name": "get_weather", "description": "Current weather of a city", '
    '"parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}\n'
    "</tools>\n\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
    "<|im_start|>user\nWeather in Paris?<|im_end|>\n"
    '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
    "</tool_call><|im_end|>\n"
    "<|im_start|>user\n<tool_response>\n18 C, sunny\n</tool_response><|im_end|>\n"
    "<|im_start|>assistant\nIt is 18 C and sunny.<|im_end|>\n"
    "<|im_start|>user\nThanks<|im_end|>\n<|im_start|>assistant\n"
)


@pytest.fixture(scope="module")
def qwen2_5():
    return get_router(tiny_checkpoint("qwen2_5"))


@pytest.fixture(scope="module")
def qwen2():
    return get_router(tiny_checkpoint("qwen2"))


def rendered(router, conversation, tools=None) -> str:
    return router.tokenizer.decode(router.input_builder.make_context(0, conversation, tools=tools, request_id="r"))


def test_qwen2_5_router_is_the_text_router_of_qwen2(qwen2_5):
    assert type(qwen2_5).__name__ == "TextRouter"
    tokenizer = qwen2_5.tokenizer
    # <tool_call> / </tool_call> are single, non-special tokens after ChatML, as in the real vocabulary.
    ids = tokenizer("<tool_call></tool_call>", add_special_tokens=False)["input_ids"]
    assert ids == [len(tokenizer) - 2, len(tokenizer) - 1]
    assert tokenizer.decode(ids, skip_special_tokens=True) == "<tool_call></tool_call>"


def test_tool_round_trip_renders_the_published_layout(qwen2_5):
    builder = qwen2_5.input_builder
    ids = builder.make_context(0, ROUND_TRIP, tools=TOOLS, request_id="r")
    assert qwen2_5.tokenizer.decode(ids) == EXPECTED_QWEN2_5
    # The builder's ids are the template text tokenised as is: the tags are single tokens there too.
    assert ids == qwen2_5.tokenizer(EXPECTED_QWEN2_5, add_special_tokens=False)["input_ids"]
    assert ids.count(qwen2_5.tokenizer.convert_tokens_to_ids("<tool_call>")) == 3  # 2 in the instructions + the call


def test_spellings_of_the_same_round_trip_render_alike(qwen2_5):
    variant = copy.deepcopy(ROUND_TRIP)
    variant[2]["content"] = ""  # empty instead of null
    variant[2]["tool_calls"][0]["function"]["arguments"] = {"city": "Paris"}  # a mapping, as some clients send
    del variant[2]["tool_calls"][0]["type"]
    variant[3]["content"] = [{"type": "text", "text": "18 C, "}, {"text": "sunny"}]  # OpenAI + MindIE parts
    variant[0]["content"] = [{"type": "text", "text": "Be brief."}]
    assert rendered(qwen2_5, variant, TOOLS) == EXPECTED_QWEN2_5


def test_consecutive_tool_messages_share_one_user_turn(qwen2_5):
    conversation = ROUND_TRIP[:3] + [{"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
                                     {"role": "tool", "tool_call_id": "call_2", "content": "rain"}]
    text = rendered(qwen2_5, conversation)
    assert text.endswith("<|im_start|>user\n<tool_response>\n18 C\n</tool_response>\n<tool_response>\nrain\n"
                         "</tool_response><|im_end|>\n<|im_start|>assistant\n")
    assert "<tools>" not in text  # no tools given: Qwen's plain system prompt


def test_qwen2_plain_chat_renders_as_before(qwen2):
    conversation = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"},
                    {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Bye"}]
    expected = ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n"
                "<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\nBye<|im_end|>\n<|im_start|>assistant\n")
    ids = qwen2.input_builder.make_context(0, conversation)
    assert ids == qwen2.tokenizer(expected, add_special_tokens=False)["input_ids"]
    # A template without tools support renders without them (as transformers does).
    assert qwen2.input_builder.make_context(0, conversation, tools=TOOLS) == ids


def test_qwen2_template_renders_tool_messages_by_role(qwen2):
    text = rendered(qwen2, ROUND_TRIP, TOOLS)
    assert "<|im_start|>tool\n18 C, sunny<|im_end|>\n" in text
    assert "<tools>" not in text


def test_a_template_that_refuses_tool_messages_gives_a_client_error():
    router = get_router(tiny_checkpoint("qwen2"))  # its own tokenizer: the template is changed below
    router.tokenizer.chat_template = (
        "{%- for m in messages -%}{%- if m.role not in ['system', 'user', 'assistant'] -%}"
        "{{ raise_exception('Unexpected role ' + m.role) }}{%- endif -%}{{ m.content }}{%- endfor -%}"
    )
    builder = router.input_builder
    builder.make_context(0, ROUND_TRIP[:2])  # what it supports still renders
    with pytest.raises(ChatTemplateError, match="Unexpected role tool.*tool calls or tool messages") as caught:
        builder.make_context(0, ROUND_TRIP)
    assert isinstance(caught.value, InputBuilderError) and isinstance(caught.value, ValueError)


def test_a_broken_template_is_not_blamed_on_the_request():
    router = get_router(tiny_checkpoint("qwen2"))
    router.tokenizer.chat_template = "{%- for m in messages -%}{{ m.content }"
    with pytest.raises(TemplateSyntaxError):  # the server's fault: not turned into a 400
        router.input_builder.make_context(0, ROUND_TRIP[:2])


@pytest.mark.parametrize("message, error, text", [
    ({"role": "assistant", "content": None, "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": "city=Paris"}}]},
     ConversationError, r"message 2, tool call 0: the arguments of the call to 'f' must be the JSON text of an object"),
    ({"role": "assistant", "content": None, "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": "[1, 2]"}}]},
     ConversationError, r"message 2, tool call 0: .*JSON text of an object"),
    ({"role": "assistant", "content": None, "tool_calls": [{"type": "function", "function": {"arguments": "{}"}}]},
     ConversationError, r"message 2, tool call 0: a tool call needs a non-empty function name"),
    ({"role": "assistant", "content": None, "tool_calls": [{"name": "f"}]},
     ConversationError, r"message 2, tool call 0: expected"),
    ({"role": "assistant", "content": None, "tool_calls": {"name": "f"}},
     ConversationError, "tool_calls must be a list"),
    ({"role": "user", "content": "hi", "tool_calls": [{"function": {"name": "f"}}]},
     ConversationError, r"message 2: only an assistant message can have tool_calls"),
    ({"role": "user", "content": "hi", "tool_call_id": "call_1"},
     ConversationError, r"message 2: only a tool message can have a tool_call_id"),
    ({"role": "tool", "content": None}, ConversationError, r"message 2: expected a dict with 'role' and 'content'"),
    ({"role": "tool", "content": "x", "tool_call_id": 7}, ConversationError, "tool_call_id must be a string"),
    ({"role": "tool", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}]},
     UnsupportedContentError, r"message 2: a tool message's content must be text"),
])
def test_malformed_tool_messages(qwen2_5, message, error, text):
    with pytest.raises(error, match=text):
        qwen2_5.input_builder.make_context(0, ROUND_TRIP[:2] + [message], request_id="r")


def test_tools_must_be_a_list_of_objects(qwen2_5):
    with pytest.raises(InputBuilderError, match="tools must be a list"):
        qwen2_5.input_builder.make_context(0, ROUND_TRIP[:2], tools={"type": "function"})


def test_parsed_message_keeps_the_calls_and_the_answered_id():
    messages = parse_conversation(ROUND_TRIP)
    (call,) = messages[2].tool_calls
    assert (call.id, call.name, call.arguments_object) == ("call_1", "get_weather", {"city": "Paris"})
    assert messages[2].parts == ()
    assert messages[3].tool_call_id == "call_1" and messages[3].text == "18 C, sunny"


def test_the_worker_chat_job_forwards_tools(qwen2_5, store):
    processor = InputProcessor(EngineConfig(model=str(tiny_checkpoint("qwen2_5"))), qwen2_5, shm_store=store)
    reply = run_job(1, ChatJob("r", ROUND_TRIP, tools=TOOLS), processor, store)
    assert reply.ok == qwen2_5.input_builder.make_context(0, ROUND_TRIP, tools=TOOLS, request_id="r")
    assert qwen2_5.tokenizer.decode(reply.ok) == EXPECTED_QWEN2_5
    bad = copy.deepcopy(ROUND_TRIP)
    bad[2]["tool_calls"][0]["function"]["arguments"] = "not json"
    reply = run_job(1, ChatJob("r", bad, tools=TOOLS), processor, store)
    assert reply.kind == "client" and "message 2, tool call 0" in reply.error
