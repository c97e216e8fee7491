"""Structured output: sampling constrained to a grammar (JSON schema, JSON object, regex, choice,
EBNF), with xgrammar.

    server  check(params)               the grammar without a tokenizer: a bad spec is a 400
    core    StructuredOutputManager
              register(request)         compile against the vocabulary on a background thread
              is_ready(request)         the scheduler admits a structured request once compiled
              apply_bitmask(logits, requests)   before sampling: -inf for the tokens each
                                        request's grammar forbids next
              accept(request, token)    after sampling: advance the request's matcher
              remove(request_id)        when the request ends

The engine core has no tokenizer otherwise: the manager loads the checkpoint's on the first
structured request (on the compile thread), so a deployment that never asks for structured
output never imports transformers in the core. xgrammar itself is imported on first use for the
same reason (it imports transformers).
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import TYPE_CHECKING

import torch

from atb_plugin.engine.request import Request
from atb_plugin.engine.sampling_params import StructuredOutputsParams

if TYPE_CHECKING:
    import xgrammar

__all__ = ["check", "to_grammar", "GrammarViolation", "StructuredOutputManager"]

# OpenAI's json_object mode promises an object; xgrammar's builtin JSON grammar also allows a
# top-level array, so json_object is this schema (vLLM's choice too).
_JSON_OBJECT_SCHEMA = '{"type": "object"}'
# Whitespace between JSON tokens: any (vLLM's default), but at most this many characters in a row.
# Unbounded, a model that favours whitespace (small or weak ones, a known failure with vLLM) emits
# it until max_tokens; 16 still fits pretty-printing (a newline and 7 levels of 2-space indent).
_MAX_JSON_WHITESPACE = 16
# xgrammar prefixes its C++ errors with "[hh:mm:ss] /path/file.cc:123: " and sometimes a failed
# check's expression: noise to a client.
_XGRAMMAR_NOISE = re.compile(r"\[[\d:]+\] \S+:\d+: |Check failed: \(.*?\) is false: ")
# xgrammar's compiled-grammar cache, bounded in bytes (vLLM's default; a compiled grammar of a
# 150k vocabulary is a few MB).
_COMPILE_CACHE_BYTES = 512 * 2**20
_WHAT = {"json": "JSON schema", "regex": "regex", "choice": "choice", "grammar": "EBNF grammar",
         "json_object": "JSON object grammar"}


def _xgrammar():
    import xgrammar  # noqa: PLC0415 - on first use: it imports transformers (module docstring)

    return xgrammar


def to_grammar(params: StructuredOutputsParams) -> "xgrammar.Grammar":
    """The xgrammar ``Grammar`` of ``params`` (no tokenizer needed). ``ValueError`` naming the
    kind (``structured_outputs.regex: invalid regex: ...``) for a spec xgrammar refuses."""
    xgr = _xgrammar()
    kind, spec = params.kinds[0], getattr(params, params.kinds[0])
    try:
        if kind == "json":
            _check_schema_text(spec)
            # strict_mode: no properties or items beyond the schema's (vLLM's default).
            return xgr.Grammar.from_json_schema(spec, strict_mode=True, max_whitespace_cnt=_MAX_JSON_WHITESPACE)
        if kind == "json_object":
            return xgr.Grammar.from_json_schema(_JSON_OBJECT_SCHEMA, max_whitespace_cnt=_MAX_JSON_WHITESPACE)
        if kind == "regex":
            return xgr.Grammar.from_regex(spec)
        if kind == "choice":
            # Each choice a JSON-escaped EBNF literal; ensure_ascii=False because xgrammar reads a
            # "\ud83d\ude00" surrogate pair as two code points, not the emoji.
            return xgr.Grammar.from_ebnf("root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in spec))
        return xgr.Grammar.from_ebnf(spec)
    except (RuntimeError, ValueError) as error:
        message = _XGRAMMAR_NOISE.sub("", str(error)).strip()
        raise ValueError(f"structured_outputs.{kind}: invalid {_WHAT[kind]}: {message}") from None


def _check_schema_text(text: str) -> None:
    """A JSON schema must be JSON and an object (xgrammar also takes ``true``; clients mean a schema)."""
    try:
        schema = json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"is not JSON ({error})") from None
    if not isinstance(schema, dict):
        raise ValueError(f"must be a JSON object, got {type(schema).__name__} {text[:80]!r}")


def check(params: StructuredOutputsParams) -> None:
    """Refuse (``ValueError``) what can never compile, before the request is admitted. The engine
    core compiles the same ``to_grammar`` against the vocabulary later."""
    to_grammar(params)


class GrammarViolation(RuntimeError):
    """The sampled token is one the request's grammar refuses. With the bitmask applied this
    means the other constraints left no token the grammar allows (min_tokens holding back the
    EOS that ends the grammar, allowed_token_ids or bad words disjoint from it): the runner fails
    that request alone."""


class StructuredOutputManager:
    """Contract: one per engine core, driven from the engine loop's thread only (compiles run on
    one background thread). ``register(request)`` starts compiling a structured request's grammar
    (no-op for others; equal ``params.key`` compile once: an in-flight compile is shared, a done
    one is in xgrammar's compiler cache). ``is_ready(request)`` is True for an unstructured
    request and, once its grammar compiled, for a structured one, which then has a matcher;
    ``pop_compile_errors()`` hands the requests whose compile failed to the core (each fails
    alone, "error"). ``apply_bitmask(logits, requests)`` masks row i of ``logits`` in place to the
    tokens ``requests[i]``'s grammar allows next (rows of other requests untouched);
    ``accept(request, token)`` advances its matcher (``GrammarViolation`` if the grammar refuses
    the token); ``remove(request_id)`` forgets a finished request. A matcher that reached its
    stop token (a request that goes on after EOS: ignore_eos) no longer constrains the request.

    Preemption recomputes a request but keeps its output tokens, which its matcher has already
    accepted: the matcher needs no rollback."""

    def __init__(self, tokenizer_path: str, vocab_size: int, compile_threads: int = 8):
        self.tokenizer_path = tokenizer_path
        self.vocab_size = vocab_size
        self.compile_threads = compile_threads
        self._compiler = None  # made on the compile thread by the first structured request
        # One thread: compiles queue behind each other (xgrammar parallelises each one inside)
        # while the engine loop keeps stepping the other requests (xgrammar releases the GIL).
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-compile")
        self._in_flight: dict[tuple[str, str], Future] = {}  # params.key -> its compile, until it ends
        self._pending: dict[str, Future] = {}  # request id -> its compile, until it has a matcher
        self._matchers: dict[str, "xgrammar.GrammarMatcher"] = {}
        self._bitmask: torch.Tensor | None = None  # int32 (rows, ceil(vocab / 32)), grown as needed
        self._batch_matcher = None  # fills the rows of a step's matchers on several threads

    # -- requests --------------------------------------------------------------------------------

    @staticmethod
    def _params(request: Request) -> StructuredOutputsParams | None:
        params = request.sampling_params
        return None if params is None else params.structured_outputs

    def register(self, request: Request) -> None:
        params = self._params(request)
        if params is None:
            return
        key = params.key
        future = self._in_flight.get(key)
        if future is None:
            future = self._executor.submit(self._compile, params)
            self._in_flight[key] = future
            # After the insert, so the entry always goes (at once if the compile already ended).
            # Dict operations are atomic under the GIL: the compile thread may run this any time.
            future.add_done_callback(lambda _: self._in_flight.pop(key, None))
        self._pending[request.request_id] = future

    def is_ready(self, request: Request) -> bool:
        if request.request_id in self._matchers or self._params(request) is None:
            return True
        future = self._pending.get(request.request_id)
        if future is None or not future.done() or future.exception() is not None:
            return False  # compiling, or failed (pop_compile_errors reports it)
        del self._pending[request.request_id]
        params = request.sampling_params
        # A finished grammar allows only this request's own stop tokens (the tokenizer's default
        # EOS may not be what the frontend told the core).
        stop = [t for t in dict.fromkeys([*request.eos_token_ids, *params.stop_token_ids]) if t < self.vocab_size]
        self._matchers[request.request_id] = _xgrammar().GrammarMatcher(future.result(),
                                                                         override_stop_tokens=stop or None)
        return True

    def pop_compile_errors(self) -> dict[str, str]:
        """Request id -> why, for each request whose grammar failed to compile since the last call."""
        errors = {}
        for request_id, future in list(self._pending.items()):
            if future.done() and future.exception() is not None:
                del self._pending[request_id]
                errors[request_id] = str(future.exception())
        return errors

    def wait_for_compile(self, timeout: float) -> None:
        """Block until a pending compile finishes, at most ``timeout`` seconds: the engine calls
        it when a step had nothing to run, instead of spinning while the compile thread works."""
        futures = list(self._pending.values())
        if futures and not any(future.done() for future in futures):
            wait(futures, timeout=timeout, return_when=FIRST_COMPLETED)

    def remove(self, request_id: str) -> None:
        self._pending.pop(request_id, None)
        self._matchers.pop(request_id, None)

    # -- sampling --------------------------------------------------------------------------------

    def apply_bitmask(self, logits: torch.Tensor, requests: Sequence[Request]) -> None:
        """Row i of ``logits`` (B, V) belongs to ``requests[i]``: -inf, in place, for every token
        its grammar forbids next. Rows of unstructured requests are not touched."""
        if not self._matchers:
            return
        rows = [i for i, request in enumerate(requests) if self._constrains(request.request_id)]
        if not rows:
            return
        bitmask = self._bitmask_rows(len(requests))
        if self._batch_matcher is None:
            self._batch_matcher = _xgrammar().BatchGrammarMatcher()
        self._batch_matcher.batch_fill_next_token_bitmask([self._matchers[requests[i].request_id] for i in rows],
                                                          bitmask, indices=rows)
        if bitmask.device != logits.device:
            bitmask = bitmask[:len(requests)].to(logits.device, non_blocking=True)
        _xgrammar().apply_token_bitmask_inplace(logits, bitmask, vocab_size=self.vocab_size, indices=rows)

    def accept(self, request: Request, token_id: int) -> None:
        if not self._constrains(request.request_id):
            return
        if not self._matchers[request.request_id].accept_token(token_id):
            raise GrammarViolation(
                f"structured output: the grammar does not allow token {token_id} here: min_tokens, "
                "allowed_token_ids or bad_words left no token the grammar allows")

    def _constrains(self, request_id: str) -> bool:
        matcher = self._matchers.get(request_id)
        return matcher is not None and not matcher.is_terminated()

    def _bitmask_rows(self, rows: int) -> torch.Tensor:
        if self._bitmask is None or self._bitmask.shape[0] < rows:
            grown = max(rows, 2 * self._bitmask.shape[0] if self._bitmask is not None else 8)
            self._bitmask = _xgrammar().allocate_token_bitmask(grown, self.vocab_size)
        return self._bitmask

    # -- the compile thread ----------------------------------------------------------------------

    def _compile(self, params: StructuredOutputsParams) -> "xgrammar.CompiledGrammar":
        return self._grammar_compiler().compile_grammar(to_grammar(params))

    def _grammar_compiler(self) -> "xgrammar.GrammarCompiler":
        if self._compiler is None:
            from transformers import AutoTokenizer  # noqa: PLC0415 - the first structured request only

            xgr = _xgrammar()
            try:
                tokenizer = AutoTokenizer.from_pretrained(self.tokenizer_path)
            except (OSError, ValueError) as error:
                raise RuntimeError(f"structured output needs the tokenizer of {self.tokenizer_path}: {error}") from None
            info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self.vocab_size)
            self._compiler = xgr.GrammarCompiler(info, max_threads=self.compile_threads,
                                                 cache_limit_bytes=_COMPILE_CACHE_BYTES)
        return self._compiler
