"""Structured output (xgrammar) on the tiny random-weight checkpoints: every output of a JSON
schema, regex, choice, EBNF or json_object request matches it and ends with "stop"; unstructured
requests in the same batch are untouched; a request waits (without blocking others) while its
grammar compiles; a compile error or a token the grammar refuses fails that request alone; bad
specs are refused up front by ``check``."""

from __future__ import annotations

import json
import re

import pytest
import torch

from atb_plugin import LLM, SamplingParams
from atb_plugin.engine.config import EngineConfig
from atb_plugin.engine.core import EngineCore
from atb_plugin.engine.kv_cache_manager import KVCacheManager
from atb_plugin.engine.messages import EngineCoreRequest
from atb_plugin.engine.request import Request
from atb_plugin.engine.sampling_params import StructuredOutputsParams
from atb_plugin.engine.scheduler import Scheduler, SchedulerConfig
from atb_plugin.engine.structured_output import GrammarViolation, StructuredOutputManager, check
from atb_plugin.testing.tiny import tiny_checkpoint

PROMPTS = ["hello world", "the cat sat on the mat and then", "a", "numbers: 1 2 3 4 5"]
COLORS = ["red", "green", "blue"]
SCHEMA = {"type": "object",
          "properties": {"color": {"enum": COLORS}, "n": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["color", "n"]}
EMAIL = r"[a-z]{1,5}@[0-9]{2}\.com"


def matches_schema(value) -> bool:
    """SCHEMA, checked by hand (strict: no other keys)."""
    return (isinstance(value, dict) and set(value) == {"color", "n"} and value["color"] in COLORS
            and type(value["n"]) is int and 0 <= value["n"] <= 99)


def settings(structured: StructuredOutputsParams, max_tokens: int) -> list[list[SamplingParams]]:
    """Per prompt: greedy, then seeded temperature 1.0 (a different seed per prompt)."""
    greedy = [SamplingParams(temperature=0, max_tokens=max_tokens, structured_outputs=structured)] * len(PROMPTS)
    seeded = [SamplingParams(temperature=1.0, seed=seed, max_tokens=max_tokens, structured_outputs=structured)
              for seed in range(len(PROMPTS))]
    return [greedy, seeded]


@pytest.fixture(scope="module")
def llm():
    with LLM(tiny_checkpoint("qwen2"), block_size=16) as engine:
        yield engine


def completions(llm, structured, max_tokens):
    return [o.outputs[0] for params in settings(structured, max_tokens) for o in llm.generate(PROMPTS, params)]


def test_json_schema_outputs_parse_and_validate(llm):
    # Random weights favour whitespace: up to 16 characters of it between JSON tokens.
    for out in completions(llm, StructuredOutputsParams(json=SCHEMA), max_tokens=200):
        assert out.finish_reason == "stop", out.text
        assert matches_schema(json.loads(out.text)), out.text


@pytest.mark.parametrize("structured, valid", [
    (StructuredOutputsParams(regex=EMAIL), lambda text: re.fullmatch(EMAIL, text)),
    # Quotes, a backslash and non-ASCII survive the choice -> EBNF literal escaping.
    (StructuredOutputsParams(choice=['say "hi"', "back\\slash", "café ☕"]),
     lambda text: text in ('say "hi"', "back\\slash", "café ☕")),
    (StructuredOutputsParams(grammar='root ::= "(" [a-c]* ")"'), lambda text: re.fullmatch(r"\([a-c]*\)", text)),
], ids=["regex", "choice", "grammar"])
def test_regex_choice_and_grammar_outputs_match(llm, structured, valid):
    for out in completions(llm, structured, max_tokens=40):
        assert out.finish_reason == "stop" and valid(out.text), out.text


def test_json_object_outputs_are_objects(llm):
    # Any object: random weights may write one key for ever, so only the finished ones are parsed
    # (with these seeds about half finish).
    params = [SamplingParams(temperature=1.0, seed=seed, max_tokens=80,
                             structured_outputs=StructuredOutputsParams(json_object=True)) for seed in range(16)]
    outs = [o.outputs[0] for o in llm.generate(["hello world"] * len(params), params)]
    finished = [out for out in outs if out.finish_reason == "stop"]
    assert len(finished) >= 4
    for out in finished:
        assert isinstance(json.loads(out.text), dict), out.text
    for out in outs:
        assert out.text.startswith("{"), out.text


def test_unstructured_requests_in_a_mixed_batch_are_untouched():
    plain = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    structured = SamplingParams(temperature=0, max_tokens=30, structured_outputs=StructuredOutputsParams(regex=EMAIL))
    with LLM(tiny_checkpoint("llama"), block_size=16) as llm:
        alone = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, plain)]
        mixed = llm.generate([p for prompt in PROMPTS for p in (prompt, prompt)], [plain, structured] * len(PROMPTS))
    assert [o.outputs[0].token_ids for o in mixed[::2]] == alone
    for out in mixed[1::2]:
        assert re.fullmatch(EMAIL, out.outputs[0].text), out.outputs[0].text


def test_structured_output_is_invariant_to_preemption():
    params = SamplingParams(temperature=0, max_tokens=20, structured_outputs=StructuredOutputsParams(regex=EMAIL))

    def run(**kwargs):
        with LLM(tiny_checkpoint("qwen2"), block_size=4, **kwargs) as llm:
            return [o.outputs[0].text for o in llm.generate(PROMPTS, params)], llm.engine.core.scheduler

    baseline, _ = run(kv_cache_blocks=256)
    preempting, scheduler = run(kv_cache_blocks=12)
    assert scheduler.num_preemptions > 0
    assert preempting == baseline


def test_a_finished_grammar_no_longer_constrains_an_ignore_eos_request(llm):
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True,
                            structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))
    for out in llm.generate(PROMPTS, params):
        assert out.outputs[0].finish_reason == "length" and len(out.outputs[0].token_ids) == 8
        assert out.outputs[0].text.startswith(("yes", "no"))


def test_a_token_the_grammar_refuses_fails_that_request_alone(llm):
    # min_tokens holds back the EOS that is all the finished grammar allows: no token is left.
    stuck = SamplingParams(temperature=0, max_tokens=10, min_tokens=8,
                           structured_outputs=StructuredOutputsParams(choice=["yes"]))
    plain = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    failed, fine = llm.generate(PROMPTS[:2], [stuck, plain])
    assert failed.outputs[0].finish_reason == "error" and "grammar" in failed.error
    assert fine.outputs[0].finish_reason == "length" and len(fine.outputs[0].token_ids) == 10


def test_a_compile_error_fails_that_request_alone(monkeypatch):
    core = EngineCore(EngineConfig(tiny_checkpoint("qwen2"), block_size=4, kv_cache_blocks=64))
    bad = SamplingParams(temperature=0, max_tokens=5, structured_outputs=StructuredOutputsParams(regex="a("))
    with pytest.raises(ValueError, match="structured_outputs.regex: invalid regex"):
        core.add_request(EngineCoreRequest("bad", [5, 6, 7], bad))  # the up-front check
    assert not core.has_unfinished_requests()
    # A compile that fails anyway (the check passed, the vocabulary-aware compile did not) fails
    # only its request.
    monkeypatch.setattr("atb_plugin.engine.core.check_structured_outputs", lambda params: None)
    core.add_request(EngineCoreRequest("bad", [5, 6, 7], bad))
    core.add_request(EngineCoreRequest("ok", [5, 6, 7], SamplingParams(temperature=0, max_tokens=3)))
    reasons, errors = {}, {}
    while core.has_unfinished_requests():
        for out in core.step():
            if out.finished:
                reasons[out.request_id], errors[out.request_id] = out.finish_reason, out.error
    assert reasons == {"bad": "error", "ok": "length"}
    assert errors["bad"].startswith("structured_outputs.regex: invalid regex")
    assert not core.structured_output._pending and not core.structured_output._matchers


def test_a_compiling_request_waits_without_blocking_the_queue():
    ready: set[str] = set()
    kv = KVCacheManager(64, 4, enable_prefix_caching=False)
    scheduler = Scheduler(SchedulerConfig(64, 8, 64), kv, is_ready=lambda request: request.request_id in ready)
    for request_id in ("first", "second", "third"):
        scheduler.add_request(Request(request_id, [1, 2, 3], SamplingParams(max_tokens=4)))
    ready.update({"second", "third"})
    assert list(scheduler.schedule().num_scheduled_tokens) == ["second", "third"]
    assert [r.request_id for r in scheduler.waiting] == ["first"]
    ready.add("first")
    assert list(scheduler.schedule().num_scheduled_tokens) == ["second", "third", "first"]


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_checkpoint("qwen2"))


def ready_manager(request: Request) -> StructuredOutputManager:
    config = EngineConfig(tiny_checkpoint("qwen2"))
    manager = StructuredOutputManager(config.model, config.vocab_size)
    manager.register(request)
    while not manager.is_ready(request):
        assert not manager.pop_compile_errors()
        manager.wait_for_compile(1.0)
    return manager


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bitmask_masks_structured_rows_only_and_accept_follows_the_grammar(tokenizer, dtype):
    eos = tokenizer.eos_token_id
    digits = Request("digits", [1, 2], SamplingParams(structured_outputs=StructuredOutputsParams(regex="[0-9]+")),
                     eos_token_ids=(eos,))
    plain = Request("plain", [1, 2], SamplingParams())
    manager = ready_manager(digits)
    vocab = len(tokenizer)
    logits = torch.randn(3, vocab).to(dtype)
    before = logits.clone()
    # The core makes the masks of the step's sampling requests; each rank applies them by request id.
    mask = manager.grammar_bitmask([plain, digits, plain])
    assert mask.request_ids == ["digits"]
    mask.apply(logits, ["plain", "digits", "plain"])
    assert torch.equal(logits[0], before[0]) and torch.equal(logits[2], before[2])
    allowed = set(torch.isfinite(logits[1]).nonzero().flatten().tolist())
    all_digits = {t for t in range(vocab) if re.fullmatch("[0-9]+", tokenizer.decode([t]))}
    assert allowed == all_digits and eos not in allowed  # at least one digit before EOS
    with pytest.raises(GrammarViolation):
        manager.accept(digits, tokenizer.convert_tokens_to_ids("a"))
    manager.accept(digits, min(all_digits))
    logits = torch.zeros(1, vocab).to(dtype)
    manager.grammar_bitmask([digits]).apply(logits, ["digits"])
    assert torch.isfinite(logits[0, eos])
    manager.remove("digits")
    assert manager.is_ready(plain) and not manager._matchers


@pytest.mark.parametrize("structured", [
    StructuredOutputsParams(json=SCHEMA),
    StructuredOutputsParams(json_object=True),
    StructuredOutputsParams(regex=EMAIL),
    StructuredOutputsParams(choice=["a", 'b"c']),
    StructuredOutputsParams(grammar='root ::= "x" root | "y"'),
], ids=["json", "json_object", "regex", "choice", "grammar"])
def test_check_accepts_valid_specs(structured):
    check(structured)


@pytest.mark.parametrize("structured, message", [
    (StructuredOutputsParams(json='{"type": "foo"}'),
     'structured_outputs.json: invalid JSON schema: Unsupported type "foo"'),
    (StructuredOutputsParams(json="{not json"), "structured_outputs.json: invalid JSON schema: is not JSON"),
    (StructuredOutputsParams(json="[1, 2]"), "structured_outputs.json: invalid JSON schema: must be a JSON object"),
    (StructuredOutputsParams(regex="a("), "structured_outputs.regex: invalid regex: "),
    (StructuredOutputsParams(grammar="root ::= undefined_rule"), "structured_outputs.grammar: invalid EBNF grammar: "),
    (StructuredOutputsParams(grammar='start ::= "x"'), "structured_outputs.grammar: invalid EBNF grammar: "),
], ids=["unsupported-type", "not-json", "not-an-object", "regex", "undefined-rule", "no-root"])
def test_check_refuses_bad_specs_naming_the_kind(structured, message):
    with pytest.raises(ValueError) as error:
        check(structured)
    assert str(error.value).startswith(message)
    assert ".cc:" not in str(error.value)  # xgrammar's source locations are stripped


def test_without_xgrammar_a_structured_request_is_a_501_naming_the_extra(monkeypatch):
    """An installation without the optional grammar engine (issue 45, item 2): the check says
    what to install, and the server's answer is a 501 with that text, never a 500."""
    import asyncio
    import sys

    from atb_plugin.engine.structured_output import StructuredOutputUnavailable
    from atb_plugin.frontend.async_llm import AsyncLLM
    from atb_plugin.frontend.errors import RequestError

    monkeypatch.setitem(sys.modules, "xgrammar", None)  # `import xgrammar` now fails as if it were absent
    with pytest.raises(StructuredOutputUnavailable, match=r"pip install 'atb-plugin\[structured\]'"):
        check(StructuredOutputsParams(json_object=True))
    params = SamplingParams(structured_outputs=StructuredOutputsParams(json=SCHEMA))
    with pytest.raises(RequestError) as error:
        asyncio.run(AsyncLLM.check_grammar(None, params, "tool_choice"))  # uses nothing of the instance
    assert error.value.status == 501 and error.value.param == "tool_choice"
    assert error.value.message.startswith("tool_choice: structured output") and "atb-plugin[structured]" in error.value.message
