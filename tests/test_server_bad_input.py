"""Bad input against the real service: every client mistake is a 4xx in OpenAI's error JSON
that says what was wrong, and none of them harms the service (it stays healthy, answers a greedy
request as before, and holds no request or image segment afterwards).

One server for the module: tiny Qwen2-VL (so images are accepted), an API key, a local media
directory, and small limits (2 images, 200 kB and 1 MP per image, 1.5 MP for a request's images
together, 2 MB per body, 512 tokens).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Callable

import httpx
import pytest
from PIL import Image
from prometheus_client.parser import text_string_to_metric_families

from atb_plugin.testing.tiny import tiny_checkpoint
from tests.helpers import write_test_images
from tests.server_helpers import data_url

API_KEY = "test-key"
MAX_IMAGE_BYTES = 200_000
MAX_IMAGE_PIXELS = 1_000_000
MAX_REQUEST_PIXELS = 1_500_000
MAX_BODY_BYTES = 2_000_000
MAX_MODEL_LEN = 512
VOCAB_SIZE = 526  # tiny Qwen2-VL's config.json
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
TEXT = [{"role": "user", "content": "Tell me about the cat on the mat."}]
IMAGE_URL = data_url()  # 64x96 random PNG, a few kB: the valid image every "valid image" request sends
ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError", 405: "MethodNotAllowed",
               413: "RequestEntityTooLarge"}


# -- the server ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def media(tmp_path_factory):
    """The allowed directory (good and bad images, a symlink out) and a directory beside it that
    holds a real image the server must not read."""
    allowed = tmp_path_factory.mktemp("allowed-media")
    outside = tmp_path_factory.mktemp("outside-media")
    image0, _ = write_test_images(allowed)
    secret = outside / "secret.png"
    Image.new("RGB", (32, 32), (200, 10, 10)).save(secret)
    (allowed / "notimage.png").write_text("I am a text file wearing a .png name.\n")
    encoded = image0.read_bytes()
    (allowed / "truncated.png").write_bytes(encoded[: len(encoded) // 2])
    # A decompression bomb: 25 MP of one colour compresses to ~35 kB, under max-image-bytes.
    Image.new("L", (5000, 5000), 7).save(allowed / "bomb.png", optimize=True)
    assert (allowed / "bomb.png").stat().st_size < MAX_IMAGE_BYTES
    os.symlink(secret, allowed / "link.png")
    # Each under the per-image cap (0.8 MP), the two together over the request's (1.6 MP).
    for name, shade in (("wide_a.png", 40), ("wide_b.png", 90)):
        Image.new("RGB", (1000, 800), (shade, 100, 160)).save(allowed / name)
    return SimpleNamespace(allowed=allowed, outside=outside, image0=image0, secret=secret,
                           missing=allowed / "missing.png", notimage=allowed / "notimage.png",
                           truncated=allowed / "truncated.png", bomb=allowed / "bomb.png",
                           link=allowed / "link.png", wide=(allowed / "wide_a.png", allowed / "wide_b.png"),
                           escape=f"{allowed}/../{outside.name}/{secret.name}")


@pytest.fixture(scope="module")
def server(serve, media):
    model = tiny_checkpoint("qwen2_vl")
    assert json.loads((model / "config.json").read_text())["max_position_embeddings"] >= MAX_MODEL_LEN
    with serve(model, "--allowed-local-media-path", str(media.allowed), "--limit-mm-per-prompt", "2",
               "--max-image-bytes", str(MAX_IMAGE_BYTES), "--max-image-pixels", str(MAX_IMAGE_PIXELS),
               "--max-request-pixels", str(MAX_REQUEST_PIXELS),
               "--max-request-body-bytes", str(MAX_BODY_BYTES), "--max-model-len", str(MAX_MODEL_LEN),
               api_key=API_KEY) as server:
        yield server


def metrics(server) -> dict[str, float]:
    values = {}
    for family in text_string_to_metric_families(server.get("/metrics").text):
        for sample in family.samples:
            values[sample.name] = values.get(sample.name, 0.0) + sample.value
    return values


def greedy_text(server) -> str:
    response = server.post(CHAT, {"messages": TEXT, "temperature": 0, "max_tokens": 8})
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["message"]["content"]


def image_answers(server, media) -> tuple:
    """One valid image chat through the openai client (data: URL), one with a path in the
    allowed directory (httpx); both greedy."""
    completion = server.client().chat.completions.create(
        model=str(tiny_checkpoint("qwen2_vl")), temperature=0, max_tokens=4,
        messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": IMAGE_URL}},
                                               {"type": "text", "text": "What is in the picture?"}]}])
    by_path = server.post(CHAT, {"temperature": 0, "max_tokens": 4, "messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": str(media.image0)}},
                                     {"type": "text", "text": "And here?"}]}]})
    assert by_path.status_code == 200, by_path.text
    return completion, by_path.json()


@pytest.fixture(scope="module")
def before(server, media):
    """What the service answers (and holds) before any bad input."""
    text = greedy_text(server)
    completion, by_path = image_answers(server, media)
    return SimpleNamespace(text=text, completion=completion, by_path=by_path,
                           segments=metrics(server)["atb_plugin:shm_live_segments"])


def test_valid_image_chat_with_the_openai_client(before):
    """The positive control: the same server answers a valid image request."""
    completion = before.completion
    choice = completion.choices[0]
    assert choice.message.role == "assistant" and choice.finish_reason in ("stop", "length")
    assert 1 <= completion.usage.completion_tokens <= 4
    # The image's tokens are in the prompt: far more than the short text alone would make.
    assert completion.usage.prompt_tokens > 20
    assert before.by_path["usage"]["prompt_tokens"] > 20
    assert before.segments >= 1  # the two images, now cached in shared memory


def test_health_needs_no_api_key(server):
    assert httpx.get(server.base_url + "/health", timeout=10).status_code == 200


# -- the matrix ------------------------------------------------------------------------------------


@dataclass
class Case:
    id: str
    status: int
    says: str | None  # a substring of the error message (None: status and shape only)
    body: Callable[[Any], Any] | None = None  # media -> the JSON body
    raw: Callable[[Any], Any] | None = None  # media -> bytes (or an iterator: chunked) sent as is
    path: str = CHAT
    method: str = "POST"
    auth: str | None = f"Bearer {API_KEY}"
    param: Any = ...  # the error's "param", when the case pins it


def chat(**fields):
    return lambda m: {"messages": TEXT, "max_tokens": 4, **fields}


def image_chat(*urls, text="Describe it.", **fields):
    """Chat with image parts; a url may be a function of the media namespace."""
    return lambda m: {"max_tokens": 4, **fields, "messages": [{"role": "user", "content": [
        *({"type": "image_url", "image_url": {"url": u(m) if callable(u) else u}} for u in urls),
        {"type": "text", "text": text}]}]}


def raw_chat(extra: str):
    """A chat body written by hand (for JSON that json.dumps would not write)."""
    return lambda m: ('{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, ' + extra + "}").encode()


def nested(depth: int) -> dict:
    value: dict = {}
    for _ in range(depth):
        value = {"a": value}
    return value


def chunked_body(m):
    chunk = b" " * 65536
    for _ in range(MAX_BODY_BYTES // len(chunk) + 2):
        yield chunk


OUTSIDE = "outside the allowed media directories"

CASES = [
    # -- the body is not a request
    Case("malformed-json", 400, "the body is not valid JSON", raw=lambda m: b'{"messages": [{"role": "user"'),
    Case("json-trailing-garbage", 400, "the body is not valid JSON: trailing characters",
         raw=lambda m: b'{"messages": []} {}'),
    Case("body-not-utf8", 400, "the body is not valid JSON", raw=lambda m: b"\xff\xfe\x00"),
    Case("empty-body", 400, "the body is not valid JSON", raw=lambda m: b""),
    Case("json-nested-too-deeply", 400, "nested too deeply", raw=lambda m: b"[" * 100_000),
    Case("body-is-a-list", 400, "the body must be a JSON object, got list", raw=lambda m: b"[1, 2]"),
    Case("body-is-a-string", 400, "the body must be a JSON object, got str", raw=lambda m: b'"hello"'),
    # -- wrong fields and types
    Case("messages-is-a-string", 400, "messages: Input should be a valid list", body=lambda m: {"messages": "hi"},
         param="messages"),
    Case("missing-messages", 400, "messages: Field required", body=lambda m: {"max_tokens": 4}, param="messages"),
    Case("empty-messages", 400, "messages must contain at least one message", body=lambda m: {"messages": []}),
    Case("unknown-role", 400, "messages.0.role: Input should be 'system', 'user', 'assistant', 'tool' or "
         "'developer' (got 'robot')", body=lambda m: {"messages": [{"role": "robot", "content": "hi"}]},
         param="messages.0.role"),
    Case("tool-call-arguments-not-json", 400, "the arguments of the call to 'f' must be the JSON text of an object",
         body=lambda m: {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None,
                         "tool_calls": [{"id": "c", "type": "function",
                                         "function": {"name": "f", "arguments": "not json"}}]}]}),
    Case("content-is-a-number", 400, "content must be a string or a list of content parts, got int",
         body=lambda m: {"messages": [{"role": "user", "content": 5}]}, param="messages.0.content"),
    Case("user-content-null", 400, "content is required for a 'user' message",
         body=lambda m: {"messages": [{"role": "user", "content": None}]}),
    Case("video-part-outside-the-allowed-directories", 400, "path x.mp4 is outside the allowed media directories",
         body=lambda m: {"messages": [{"role": "user", "content": [{"type": "video", "video": "x.mp4"}]}]}),
    Case("audio-to-an-image-model", 400, "serves a model without audio input",
         body=lambda m: {"messages": [{"role": "user", "content": [
             {"type": "input_audio", "input_audio": {"data": "UklGRiQAAABXQVZF", "format": "wav"}}]}]}),
    Case("image-detail-unknown", 400, "image_url.detail must be one of auto, low, high, got 'ultra'",
         body=lambda m: {"messages": [{"role": "user", "content": [
             {"type": "image_url", "image_url": {"url": IMAGE_URL, "detail": "ultra"}}]}]}),
    Case("max-tokens-is-a-word", 400, "max_tokens: Input should be a valid integer", body=chat(max_tokens="ten"),
         param="max_tokens"),
    Case("max-tokens-zero", 400, "max_tokens: Input should be greater than or equal to 1", body=chat(max_tokens=0)),
    Case("temperature-is-a-word", 400, "temperature: Input should be a valid number", body=chat(temperature="hot"),
         param="temperature"),
    Case("model-is-a-number", 400, "model: Input should be a valid string", body=chat(model=123)),
    Case("chat-template-kwargs-not-object", 400, "chat_template_kwargs: Input should be a JSON object",
         body=chat(chat_template_kwargs="x")),
    Case("unknown-model", 404, "The model `gpt-4` does not exist", body=chat(model="gpt-4"), param="model"),
    Case("unknown-model-completions", 404, "The model `davinci` does not exist", path=COMPLETIONS,
         body=lambda m: {"model": "davinci", "prompt": "hi"}),
    # -- images
    Case("image-missing-file", 400, "does not exist (paths are read on the server",
         body=image_chat(lambda m: str(m.missing))),
    Case("image-not-an-image", 400, "is not an image in a supported format",
         body=image_chat(lambda m: str(m.notimage))),
    Case("image-truncated-png", 400, "could not be decoded", body=image_chat(lambda m: str(m.truncated))),
    Case("image-over-max-bytes", 400, f"the limit is {MAX_IMAGE_BYTES} (--max-image-bytes)",
         body=image_chat(data_url(400, 400, seed=1))),
    Case("image-decompression-bomb", 400, f"5000x5000 = 25000000 pixels; the limit is {MAX_IMAGE_PIXELS} "
         "(--max-image-pixels)", body=image_chat(lambda m: str(m.bomb))),
    Case("images-over-max-request-pixels", 400, "the request's images come to 1600000 pixels with image 2 (",
         body=image_chat(lambda m: str(m.wide[0]), lambda m: str(m.wide[1]))),
    Case("images-over-max-request-pixels-names-the-flag", 400, "wide_b.png, 1000x800 = 800000 pixels); the limit for all images "
         f"of one request is {MAX_REQUEST_PIXELS} (--max-request-pixels); send fewer or smaller images",
         body=image_chat(lambda m: str(m.wide[0]), lambda m: str(m.wide[1]), stream=True)),
    Case("tokenize-images-over-max-request-pixels", 400, "(--max-request-pixels)", path="/tokenize",
         body=lambda m: {"messages": [{"role": "user", "content": [
             {"type": "image_url", "image_url": {"url": str(p)}} for p in m.wide]}]}),
    Case("image-etc-passwd", 400, f"path /etc/passwd is {OUTSIDE}", body=image_chat("/etc/passwd")),
    Case("image-file-url-etc-passwd", 400, f"path /etc/passwd is {OUTSIDE}", body=image_chat("file:///etc/passwd")),
    Case("image-dotdot-escape", 400, OUTSIDE, body=image_chat(lambda m: m.escape)),
    Case("image-symlink-out", 400, OUTSIDE, body=image_chat(lambda m: str(m.link))),
    Case("image-file-url-other-host", 400, "names host 'otherhost'",
         body=image_chat("file://otherhost/etc/passwd")),
    Case("image-http-not-allowed", 400, "fetching http(s) images is disabled (no allowed media domains); send the image inline as a data: "
         "URL, or start the server with --allowed-media-domains HOST",
         body=image_chat("http://example.com/cat.png")),
    Case("image-ftp-scheme", 400, "URL scheme 'ftp' is not supported", body=image_chat("ftp://example.com/cat.png")),
    Case("image-data-url-not-image", 400, "data: URL media type is 'text/plain'",
         body=image_chat("data:text/plain;base64,aGVsbG8=")),
    Case("image-data-url-bad-base64", 400, "data: URL is not valid base64",
         body=image_chat("data:image/png;base64,@@@@")),
    Case("too-many-images", 400, "the prompt has 3 images; this model takes at most 2 per prompt",
         body=image_chat(IMAGE_URL, IMAGE_URL, IMAGE_URL)),
    Case("image-error-before-stream", 400, "does not exist", body=image_chat(lambda m: str(m.missing), stream=True)),
    Case("tokenize-image-bomb", 400, "(--max-image-pixels)", path="/tokenize",
         body=lambda m: {"messages": [{"role": "user", "content": [
             {"type": "image_url", "image_url": {"url": str(m.bomb)}}]}]}),
    # -- lengths
    Case("prompt-over-max-model-len", 400, f"This model's maximum context length is {MAX_MODEL_LEN} tokens",
         body=lambda m: {"messages": [{"role": "user", "content": "word " * 600}]}, param="input_tokens"),
    Case("max-tokens-too-large", 400, "'max_tokens' or 'max_completion_tokens' is too large: 600",
         body=chat(max_tokens=600), param="max_tokens"),
    Case("max-completion-tokens-too-large", 400, "is too large: 600", body=chat(max_completion_tokens=600),
         param="max_completion_tokens"),
    Case("image-then-max-tokens-too-large", 400, "is too large: 600", body=image_chat(IMAGE_URL, max_tokens=600)),
    Case("token-ids-over-max-model-len", 400, f"maximum context length is {MAX_MODEL_LEN} tokens", path=COMPLETIONS,
         body=lambda m: {"prompt": [5] * 600}),
    # -- completions prompts and token ids
    Case("token-ids-negative", 400, "prompt token ids must be >= 0", path=COMPLETIONS,
         body=lambda m: {"prompt": [1, -2, 3]}, param="prompt"),
    Case("token-ids-out-of-vocab", 400, f"token ids [99999] are outside the vocabulary [0, {VOCAB_SIZE})",
         path=COMPLETIONS, body=lambda m: {"prompt": [1, 99999, 3]}, param="prompt"),
    Case("token-ids-mixed-types", 400, "prompt must be a string, a list of strings, a list of token ids",
         path=COMPLETIONS, body=lambda m: {"prompt": [1, "a", 3]}),
    Case("token-ids-floats", 400, "prompt must be a string, a list of strings, a list of token ids",
         path=COMPLETIONS, body=lambda m: {"prompt": [1.5, 2]}),
    Case("batch-of-two-prompts", 400, "got 2 prompts; only one prompt per request is supported", path=COMPLETIONS,
         body=lambda m: {"prompt": ["a", "b"]}),
    Case("empty-prompt", 400, "prompt must not be empty", path=COMPLETIONS, body=lambda m: {"prompt": ""}),
    Case("completions-logprobs-over-20", 400, "logprobs: Input should be less than or equal to 20", path=COMPLETIONS,
         body=lambda m: {"prompt": "hi", "logprobs": 21}),
    # -- sampling
    Case("temperature-negative", 400, "temperature must be", body=chat(temperature=-1), param="temperature"),
    Case("temperature-nan", 400, "temperature must be a finite number", raw=raw_chat('"temperature": NaN')),
    Case("top-p-zero", 400, "top_p must be in (0, 1], got 0.0", body=chat(top_p=0), param="top_p"),
    Case("top-p-over-one", 400, "top_p must be in (0, 1], got 1.5", body=chat(top_p=1.5)),
    Case("top-k-negative", 400, "top_k must be -1 or 0 (disabled) or in [1, 2147483647], got -5", body=chat(top_k=-5),
         param="top_k"),
    Case("n-too-many", 400, "above this server's limit of 16 parallel samples", body=chat(n=17), param="n"),
    Case("seed-negative", 400, "seed: Input should be greater than or equal to 0", body=chat(seed=-1), param="seed"),
    Case("seed-over-64-bits", 400, "seed: Input should be less than or equal to 18446744073709551615",
         body=chat(seed=2**64)),
    Case("top-logprobs-over-20", 400, "top_logprobs: Input should be less than or equal to 20",
         body=chat(logprobs=True, top_logprobs=50), param="top_logprobs"),
    Case("top-logprobs-without-logprobs", 400, "`logprobs` must be set to true", body=chat(top_logprobs=5)),
    Case("min-tokens-over-max-tokens", 400, "min_tokens must be in [0, max_tokens = 5], got 10",
         body=chat(min_tokens=10, max_tokens=5), param="min_tokens"),
    Case("stop-empty-string", 400, "stop cannot contain an empty string", body=chat(stop=["ok", ""])),
    Case("stop-not-strings", 400, "stop must be a string or a list of strings", body=chat(stop=5)),
    Case("beam-search-unsupported", 400, "use_beam_search=True is not supported yet; only false is accepted",
         body=chat(use_beam_search=True), param="use_beam_search"),
    Case("presence-penalty-out-of-range", 400, "presence_penalty must be in [-2, 2], got 2.5",
         body=chat(presence_penalty=2.5), param="presence_penalty"),
    Case("response-format-bad-schema", 400, "response_format",
         body=chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "bogus"}}}),
         param="response_format"),
    Case("stream-options-without-stream", 400, "Stream options can only be defined when `stream=True`",
         body=chat(stream_options={"include_usage": True}), param="stream_options"),
    # -- tokenize / detokenize
    Case("tokenize-prompt-and-messages", 400, "give exactly one of 'prompt' (text) or 'messages' (a chat)",
         path="/tokenize", body=lambda m: {"prompt": "hi", "messages": TEXT}),
    Case("detokenize-out-of-vocab", 400, f"token ids [99999] are outside the vocabulary [0, {VOCAB_SIZE})",
         path="/detokenize", body=lambda m: {"tokens": [1, 99999]}, param="tokens"),
    Case("detokenize-negative", 400, "tokens must be token ids >= 0", path="/detokenize",
         body=lambda m: {"tokens": [-1]}),
    # -- HTTP level: auth, size, routes
    Case("no-api-key", 401, "missing API key: send 'Authorization: Bearer <key>'", body=chat(), auth=None),
    Case("wrong-api-key", 401, "missing or wrong API key", body=chat(), auth="Bearer not-the-key"),
    Case("wrong-api-key-on-models", 401, "missing or wrong API key", path="/v1/models", method="GET",
         auth="Basic dXNlcjpwYXNz"),
    Case("body-over-limit-content-length", 413, f"the request body has {MAX_BODY_BYTES + 1} bytes; the limit is "
         f"{MAX_BODY_BYTES} (--max-request-body-bytes)", raw=lambda m: b" " * (MAX_BODY_BYTES + 1)),
    Case("body-over-limit-chunked", 413, f"the request body exceeds {MAX_BODY_BYTES} bytes", raw=chunked_body),
    Case("unknown-route", 404, "no route POST /v1/nope", path="/v1/nope", body=lambda m: {}),
    Case("get-on-chat", 405, "GET is not allowed on /v1/chat/completions", method="GET"),
    Case("post-on-models", 405, "POST is not allowed on /v1/models", path="/v1/models", body=lambda m: {}),
]

# Once server bugs (a client mistake answered 500, or a crashed engine core); now each is a 400
# that names the problem, and nothing stays tracked (the final test checks the queue depth).
CASES += [
    Case("lone-surrogate-in-content", 400, "unpaired UTF-16 surrogate", raw=lambda m: b'{"messages": [{"role": '
         b'"user", "content": "\\ud800"}], "max_tokens": 4}'),
    Case("lone-surrogate-in-stop", 400, "unpaired UTF-16 surrogate", raw=raw_chat('"stop": ["\\ud800"]')),
    Case("lone-trailing-surrogate", 400, "unpaired UTF-16 surrogate", raw=raw_chat('"stop": ["\\udc00x"]')),
    Case("surrogate-pair-then-lone", 400, "unpaired UTF-16 surrogate",
         raw=raw_chat('"stop": ["\\ud83d\\ude00", "\\ud83d"]')),
    Case("top-k-over-64-bits", 400, "top_k must be", body=chat(top_k=10**20)),
    Case("stop-token-ids-over-64-bits", 400, "stop_token_ids must be", body=chat(stop_token_ids=[2**70])),
    Case("chat-template-kwargs-nested-800-deep", 400, "nested too deeply",
         raw=raw_chat('"chat_template_kwargs": ' + json.dumps(nested(800)))),
    Case("top-k-2-pow-63", 400, "top_k must be", body=chat(top_k=2**63, temperature=1.0)),
]

PARAMS = [pytest.param(case, id=case.id) for case in CASES]


def send(server, case: Case, media) -> httpx.Response:
    headers = {"X-Request-Id": f"bad-input-{case.id}"}
    if case.auth is not None:
        headers["Authorization"] = case.auth
    kwargs: dict = {}
    if case.raw is not None:
        kwargs["content"] = case.raw(media)
        headers["Content-Type"] = "application/json"
    elif case.body is not None:
        kwargs["json"] = case.body(media)
    return httpx.request(case.method, server.base_url + case.path, headers=headers, timeout=30, **kwargs)


@pytest.mark.parametrize("case", PARAMS)
def test_bad_input_is_a_clear_4xx(server, media, before, case: Case):
    response = send(server, case, media)
    assert response.status_code == case.status, response.text
    assert response.headers["content-type"].startswith("application/json")
    assert response.headers.get("x-request-id") == f"bad-input-{case.id}"
    body = response.json()
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert error["code"] == case.status
    assert error["type"] == ERROR_TYPES[case.status]
    assert isinstance(error["message"], str) and error["message"]
    if case.says is not None:
        assert case.says in error["message"], error["message"]
    if case.param is not ...:
        assert error["param"] == case.param, error


def test_nothing_is_harmed_after_the_matrix(server, media, before):
    response = httpx.get(server.base_url + "/health", timeout=10)
    assert response.status_code == 200
    assert greedy_text(server) == before.text
    completion, by_path = image_answers(server, media)
    assert completion.choices[0].message.content == before.completion.choices[0].message.content
    assert by_path["choices"][0]["message"]["content"] == before.by_path["choices"][0]["message"]["content"]
    values = metrics(server)
    assert values["vllm:num_requests_running"] == 0
    assert values["vllm:num_requests_waiting"] == 0
    assert values["atb_plugin:tokenizer_queue_depth"] == 0  # no job left waiting for ever
    assert values["atb_plugin:shm_leased_segments"] == 0  # every lease ended with its request
    # The same two images as before: cached segments reused, nothing new left behind by the matrix.
    assert values["atb_plugin:shm_live_segments"] == before.segments
