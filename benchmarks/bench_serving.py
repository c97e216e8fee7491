"""Serving benchmark for any OpenAI-compatible server: ours, vLLM's ``vllm serve``, llama.cpp's.

Sends ``--num-prompts`` streaming requests (``/v1/chat/completions`` or ``/v1/completions``, always
``stream: true`` with ``stream_options.include_usage``) under one load shape, and measures each
request from the client's side:

- closed loop (``--concurrency N``, the default with N = 1): N clients, each sending its next
  request as soon as its previous one ends;
- open loop (``--request-rate R``): arrivals with gamma-distributed gaps of mean 1/R seconds and
  shape ``--burstiness`` (1.0 = Poisson, < 1 burstier, > 1 more regular; vLLM's benchmark's
  definition), optionally capped by ``--max-concurrency`` (a request waiting for a slot is not
  started yet: its clock starts when it is sent, as in vLLM's benchmark); ``--request-rate inf``
  sends everything at once.

Per request: the send time, the arrival of the first chunk carrying text (TTFT), the arrival of
every later text chunk, the end of the stream, the output and prompt token counts from the
server's usage chunk (output tokens fall back to the number of text chunks when a server sends
no usage), and on failure the kind of error: ``http_4xx:429`` (status class and code),
``timeout``, ``connection_error``, ``stream_error`` (an ``{"error": ...}`` event inside a 200
stream), ``parse_error`` (a data line that is not JSON), ``no_output``.

The formulas (over the successful requests; times reported in milliseconds):

- TTFT  = first text chunk - send time
- E2E   = end of stream - send time
- TPOT  = (E2E - TTFT) / (output tokens - 1), per request with more than one output token: the
  time per output token EXCLUDING the first, as vLLM's benchmark defines it
- ITL   = the gaps between consecutive text chunks, pooled over all requests (a chunk that
  carries several tokens is one gap, as in vLLM's benchmark)
- request throughput = completed / duration; output tok/s = output tokens / duration; total
  tok/s = (prompt + output tokens) / duration, where duration is the wall time from the first
  send to the last response's end (warm-up requests excluded)
- for each: mean, median (p50), p90 and p99 (linear interpolation between order statistics, as
  numpy's default)

The server's own ``/metrics`` (Prometheus text, vLLM's ``vllm:`` names) is scraped before and
after the timed run: counters (``vllm:prompt_tokens_total``, ``vllm:generation_tokens_total``,
``vllm:request_success_total`` by ``finished_reason``, ...) and histogram sums / counts become
deltas, and ``vllm:time_to_first_token_seconds`` / ``vllm:e2e_request_latency_seconds`` (also
inter-token latency, queue time) give the server-side means; gauges are ignored. A server without
``/metrics`` is reported as unavailable.

Prompts are random words, about one token each (``--input-len`` words), or, with ``--tokenizer
DIR``, random vocabulary words re-tokenized until the text is exactly ``--input-len`` tokens (the
chat template's own tokens come on top). ``--range-ratio r`` samples each request's input and
output lengths uniformly in [len * (1 - r), len * (1 + r)] as vLLM's random dataset does.
``--images-per-request K --image-size WxH`` adds K random RGB PNGs as base64 data URLs to each
chat request (seeded; the same K images for every request unless ``--unique-images``).

Output: a progress bar on stderr while it runs, a table on stdout, and as the LAST stdout line one
JSON object with every number (``--result-json FILE`` writes it too).

Examples (hold the benchmark lock on this shared machine)::

    # ours, started and stopped by the script on a free port
    flock /tmp/atb-bench.lock python benchmarks/bench_serving.py --start-server \\
        --server-args "--model $HOME/.cache/atb-plugin/models/SmolLM2-135M-Instruct" \\
        --num-prompts 64 --concurrency 8 --input-len 128 --output-len 64 --ignore-eos

    # a server already running (ours or any other), Poisson arrivals at 4 req/s
    python benchmarks/bench_serving.py --base-url http://127.0.0.1:8000 --endpoint completions \\
        --num-prompts 200 --request-rate 4 --max-concurrency 16 --range-ratio 0.25

    # vLLM, started by the script
    python benchmarks/bench_serving.py --start-server \\
        --server-cmd "vllm serve HuggingFaceTB/SmolLM2-135M-Instruct --port {port}" \\
        --num-prompts 64 --concurrency 8 --output-len 64 --ignore-eos

    # llama.cpp's server (llama-cpp-python[server]); it reads no ignore_eos, so leave it out
    python benchmarks/bench_serving.py --start-server \\
        --server-cmd "python -m llama_cpp.server --model X.gguf --port {port}" \\
        --num-prompts 32 --concurrency 1 --output-len 64

    # a vision-language model: two 448x448 images per request, fresh ones every request
    python benchmarks/bench_serving.py --base-url http://127.0.0.1:8000 --images-per-request 2 \\
        --image-size 448x448 --unique-images --num-prompts 16 --concurrency 4

Only httpx is needed to run it (Pillow for images, transformers for ``--tokenizer``), so the same
script runs in a peer's venv.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import codecs
import contextlib
import io
import json
import math
import os
import random
import re
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx

clock = time.perf_counter  # monotonic, the finest resolution: every timestamp below comes from it

REPO_ROOT = Path(__file__).resolve().parents[1]
ENDPOINT_PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}
PERCENTILES = (("median", 50.0), ("p90", 90.0), ("p99", 99.0))
# Short, common English words: about one token each in the usual BPE vocabularies, so N words make
# a prompt of roughly N tokens without a tokenizer.
WORDS = tuple("""the of and to in is you that it he was for on are as with his they at be this have
from or one had by word but not what all were we when your can said there use an each which she do
how their if will up other about out many then them these so some her would make like him into time
has look two more write go see number no way could people my than first water been call who oil its
now find long down day did get come made may part over new sound take only little work know place
year live me back give most very after thing our just name good sentence man think say great where
help through much before line right too mean old any same tell boy follow came want show also around
form three small set put end does another well large must big even such because turn here why ask
went men read need land different home us move try kind hand picture again change off play spell air
away animal house point page letter mother answer found study still learn should world""".split())


class BenchmarkError(RuntimeError):
    """A condition that ends the run with a message (not a traceback): bad setup, a server that
    does not start, a base URL that answers nothing."""


# -- per-request records and the metric arithmetic (pure) -------------------------------------------


@dataclass
class RequestRecord:
    """What one request did, in ``clock()`` seconds. ``error`` is None for a success."""

    start: float
    end: float = 0.0
    ttft: float | None = None  # seconds from start to the first text chunk; None: no text arrived
    chunk_times: list[float] = field(default_factory=list)  # arrival of every text chunk, first included
    output_tokens: int = 0
    prompt_tokens: int = 0
    usage_reported: bool = False  # token counts from the server's usage chunk (else estimated)
    error: str | None = None
    error_detail: str = ""

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def e2e(self) -> float:
        return self.end - self.start


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile with linear interpolation between order statistics (numpy's default,
    which vLLM's benchmark uses), so the numbers compare with its reports; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def summarize(values: Sequence[float]) -> dict[str, float | None]:
    """mean, median, p90, p99 of ``values`` (None each when there are none)."""
    stats = {"mean": sum(values) / len(values) if values else None}
    stats.update({name: percentile(values, q) for name, q in PERCENTILES})
    return stats


def request_tpot(record: RequestRecord) -> float | None:
    """Seconds per output token after the first: decode speed without the prefill that TTFT
    already counts. None for one token (no decode step) or no first-token time."""
    if record.ttft is None or record.output_tokens <= 1:
        return None
    return (record.e2e - record.ttft) / (record.output_tokens - 1)


def request_itls(record: RequestRecord) -> list[float]:
    """The gaps between consecutive text chunks of one request, in seconds."""
    times = record.chunk_times
    return [later - earlier for earlier, later in zip(times, times[1:])]


def per_second(amount: float, duration_s: float) -> float | None:
    return amount / duration_s if duration_s > 0 else None


def errors_by_kind(records: Iterable[RequestRecord]) -> dict[str, int]:
    return dict(sorted(Counter(r.error for r in records if not r.ok).items()))


def error_examples(records: Iterable[RequestRecord]) -> dict[str, str]:
    """The first message of each error kind: enough to see why, without one line per failure."""
    examples: dict[str, str] = {}
    for record in records:
        if not record.ok:
            examples.setdefault(record.error, record.error_detail)
    return dict(sorted(examples.items()))


def aggregate(records: Sequence[RequestRecord], duration_s: float) -> dict:
    """Every client-side number of the report from the per-request records (successes only, as
    vLLM's benchmark counts them; failures only by kind)."""
    ok = [r for r in records if r.ok]
    input_tokens = sum(r.prompt_tokens for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    to_ms = 1000.0
    return {
        "duration_s": duration_s,
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "usage_missing": sum(not r.usage_reported for r in ok),
        "request_throughput": per_second(len(ok), duration_s),
        "output_throughput": per_second(output_tokens, duration_s),
        "total_token_throughput": per_second(input_tokens + output_tokens, duration_s),
        "ttft_ms": summarize([r.ttft * to_ms for r in ok if r.ttft is not None]),
        "tpot_ms": summarize([t * to_ms for r in ok if (t := request_tpot(r)) is not None]),
        "itl_ms": summarize([gap * to_ms for r in ok for gap in request_itls(r)]),
        "e2e_ms": summarize([r.e2e * to_ms for r in ok]),
        "errors": errors_by_kind(records),
        "error_examples": error_examples(records),
    }


# -- arrivals (pure) --------------------------------------------------------------------------------


def inter_arrival_gaps(count: int, rate: float, burstiness: float, rng: random.Random) -> list[float]:
    """``count`` gaps in seconds between arrivals at ``rate`` requests/s: gamma with shape
    ``burstiness`` and scale 1 / (rate * burstiness), so the mean is always 1 / rate and the
    variance 1 / (rate^2 * burstiness) (shape 1 is the exponential, i.e. Poisson arrivals).
    An infinite rate gives zeros: everything at once."""
    if burstiness <= 0:
        raise ValueError(f"burstiness must be > 0, got {burstiness}")
    if rate <= 0:
        raise ValueError(f"request rate must be > 0, got {rate}")
    if math.isinf(rate):
        return [0.0] * count
    scale = 1.0 / (rate * burstiness)
    return [rng.gammavariate(burstiness, scale) for _ in range(count)]


def arrival_offsets(count: int, rate: float, burstiness: float, rng: random.Random) -> list[float]:
    """Send times relative to the start: the first request at 0, each next one a gap later."""
    offsets, now = [], 0.0
    for gap in [0.0] + inter_arrival_gaps(max(count - 1, 0), rate, burstiness, rng):
        now += gap
        offsets.append(now)
    return offsets[:count]


# -- Prometheus text -> samples -> deltas (pure) ----------------------------------------------------

SeriesKey = tuple[str, tuple[tuple[str, str], ...]]  # (sample name, sorted label pairs)

_SAMPLE_LINE = re.compile(r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?P<labels>.*)\})?\s+(?P<value>\S+)(?:\s+\S+)?\s*$")
_LABEL_PAIR = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"\s*,?')
_LABEL_ESCAPES = {"\\\\": "\\", '\\"': '"', "\\n": "\n"}
_FAMILY_SUFFIXES = ("_total", "_sum", "_count", "_bucket", "_created")


@dataclass
class MetricsScrape:
    """One ``/metrics`` answer: each family's ``# TYPE`` and each series' value."""

    types: dict[str, str]
    samples: dict[SeriesKey, float]


def _parse_labels(text: str) -> tuple[tuple[str, str], ...]:
    pairs = [(name, re.sub(r'\\[\\"n]', lambda m: _LABEL_ESCAPES[m.group()], value))
             for name, value in _LABEL_PAIR.findall(text)]
    return tuple(sorted(pairs))


def parse_prometheus_text(text: str) -> MetricsScrape:
    """Prometheus text exposition (0.0.4, also OpenMetrics' sample lines) -> types and samples.
    Lines it cannot read are skipped: a scrape is an extra, never a reason to fail the run."""
    types: dict[str, str] = {}
    samples: dict[SeriesKey, float] = {}
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("# TYPE "):
            parts = line.split()
            if len(parts) >= 4:
                types[parts[2]] = parts[3]
            continue
        match = _SAMPLE_LINE.match(line)
        if not match or line.startswith("#"):
            continue
        try:
            value = float(match["value"])
        except ValueError:
            continue
        samples[(match["name"], _parse_labels(match["labels"] or ""))] = value
    return MetricsScrape(types, samples)


def family_type(name: str, types: dict[str, str]) -> str:
    """The ``# TYPE`` of the family a sample belongs to (``x_sum`` -> ``x``'s), else untyped."""
    if name in types:
        return types[name]
    for suffix in _FAMILY_SUFFIXES:
        if name.endswith(suffix) and name[: -len(suffix)] in types:
            return types[name[: -len(suffix)]]
    return "untyped"


def is_cumulative(name: str, types: dict[str, str]) -> bool:
    """Counters, and histogram / summary sums and counts: the series whose difference over the run
    means something. Gauges, buckets and ``_created`` timestamps are not."""
    if name.endswith("_created"):
        return False
    kind = family_type(name, types)
    if kind == "counter":
        return True
    return kind in ("histogram", "summary") and name.endswith(("_sum", "_count"))


def metric_deltas(before: MetricsScrape, after: MetricsScrape) -> dict[SeriesKey, float]:
    """after - before for every cumulative series (one absent before started at 0)."""
    return {key: value - before.samples.get(key, 0.0) for key, value in after.samples.items()
            if is_cumulative(key[0], after.types)}


def series_name(key: SeriesKey) -> str:
    """``name{label="value",...}``: a series as Prometheus writes it, for the JSON report."""
    name, labels = key
    if not labels:
        return name
    return name + "{" + ",".join(f'{k}="{v}"' for k, v in labels) + "}"


def total_of(deltas: dict[SeriesKey, float], name: str) -> float | None:
    """The sum over all label sets of one sample name; None when the server has no such series."""
    values = [value for (sample, _), value in deltas.items() if sample == name]
    return sum(values) if values else None


def totals_by_label(deltas: dict[SeriesKey, float], name: str, label: str) -> dict[str, float]:
    result: dict[str, float] = {}
    for (sample, labels), value in deltas.items():
        if sample == name:
            key = dict(labels).get(label, "")
            result[key] = result.get(key, 0.0) + value
    return dict(sorted(result.items()))


def histogram_mean_ms(deltas: dict[SeriesKey, float], family: str) -> float | None:
    """Mean of what a seconds histogram observed during the run: delta sum / delta count."""
    count = total_of(deltas, family + "_count")
    total = total_of(deltas, family + "_sum")
    return 1000.0 * total / count if count and total is not None else None


def summarize_server_metrics(deltas: dict[SeriesKey, float]) -> dict:
    """The vLLM-named server-side numbers of the run, plus every non-zero delta."""
    return {
        "available": True,
        "prompt_tokens": total_of(deltas, "vllm:prompt_tokens_total"),
        "generation_tokens": total_of(deltas, "vllm:generation_tokens_total"),
        "request_success": totals_by_label(deltas, "vllm:request_success_total", "finished_reason"),
        "mean_ttft_ms": histogram_mean_ms(deltas, "vllm:time_to_first_token_seconds"),
        "mean_e2e_ms": histogram_mean_ms(deltas, "vllm:e2e_request_latency_seconds"),
        "mean_itl_ms": histogram_mean_ms(deltas, "vllm:inter_token_latency_seconds"),
        "mean_queue_ms": histogram_mean_ms(deltas, "vllm:request_queue_time_seconds"),
        "deltas": {series_name(key): value for key, value in sorted(deltas.items()) if value != 0},
    }


# -- server-sent events (pure) ----------------------------------------------------------------------


class StreamError(Exception):
    """A response that is not a usable stream; ``kind`` is its error kind in the report."""

    def __init__(self, kind: str, detail: str):
        super().__init__(detail)
        self.kind = kind
        self.detail = detail


class SSEDecoder:
    """Bytes as they arrive -> the ``data`` of each complete event (the SSE framing by hand).

    Chunks may split anything: a line, a ``data:`` prefix, a multi-byte UTF-8 character, a
    ``\\r\\n`` pair. An event ends at a blank line; several ``data:`` lines of one event are
    joined with newlines; comments (``:``) and other fields (``event:``, ``id:``) are skipped."""

    _LINE_END = re.compile(r"\r\n|\r|\n")

    def __init__(self):
        self._text = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._pending = ""  # the start of a line whose end has not arrived
        self._data: list[str] = []  # data lines of the event being read

    def feed(self, chunk: bytes) -> list[str]:
        self._pending += self._text.decode(chunk)
        # A trailing \r may be the first half of \r\n: wait for the next chunk to tell.
        cut = len(self._pending) - 1 if self._pending.endswith("\r") else len(self._pending)
        *lines, rest = self._LINE_END.split(self._pending[:cut])
        self._pending = rest + self._pending[cut:]
        return self._read_lines(lines)

    def close(self) -> list[str]:
        """The end of the body: whatever is left counts, even without a final blank line."""
        self._pending += self._text.decode(b"", final=True)
        lines = self._LINE_END.split(self._pending) if self._pending else []
        self._pending = ""
        return self._read_lines([*lines, ""])

    def _read_lines(self, lines: Iterable[str]) -> list[str]:
        events = []
        for line in lines:
            if not line:
                if self._data:
                    events.append("\n".join(self._data))
                    self._data = []
            elif line.startswith("data"):
                name, _, value = line.partition(":")
                if name == "data":
                    self._data.append(value[1:] if value.startswith(" ") else value)
        return events


@dataclass
class StreamEvent:
    """One data payload, interpreted: ``kind`` is "chunk", "done" or "error"."""

    kind: str
    text: str = ""
    usage: dict | None = None
    message: str = ""


def _choice_text(choice: dict) -> str:
    """The generated text of one streamed choice: completions' ``text``, chat's delta content
    (and reasoning, which is output too)."""
    delta = choice.get("delta") or {}
    parts = (choice.get("text"), delta.get("content"), delta.get("reasoning_content"), delta.get("reasoning"))
    return "".join(part for part in parts if isinstance(part, str))


def _error_message(data: dict) -> str:
    error = data.get("error", data)
    if isinstance(error, dict):
        return str(error.get("message") or error)
    return str(error)


def parse_event(payload: str) -> StreamEvent:
    """One event's data -> StreamEvent; a payload that is not a JSON object raises a parse error."""
    if payload.strip() == "[DONE]":
        return StreamEvent("done")
    try:
        data = json.loads(payload)
    except json.JSONDecodeError as error:
        raise StreamError("parse_error", f"{error}: {payload[:200]!r}") from None
    if not isinstance(data, dict):
        raise StreamError("parse_error", f"not a JSON object: {payload[:200]!r}")
    if "error" in data or data.get("object") == "error":
        return StreamEvent("error", message=_error_message(data))
    text = "".join(_choice_text(c) for c in data.get("choices") or () if isinstance(c, dict))
    usage = data.get("usage") if isinstance(data.get("usage"), dict) else None
    return StreamEvent("chunk", text=text, usage=usage)


def apply_event(record: RequestRecord, event: StreamEvent, now: float) -> bool:
    """Fold one event into ``record`` (times, usage); True when the stream says it is done."""
    if event.kind == "error":
        raise StreamError("stream_error", event.message)
    if event.kind == "done":
        return True
    if event.text:
        record.chunk_times.append(now)
        if record.ttft is None:
            record.ttft = now - record.start
    if event.usage:
        completion, prompt = event.usage.get("completion_tokens"), event.usage.get("prompt_tokens")
        if isinstance(completion, int):
            record.output_tokens, record.usage_reported = completion, True
        if isinstance(prompt, int):
            record.prompt_tokens = prompt
    return False


def finish_record(record: RequestRecord, planned_prompt_tokens: int) -> None:
    """Fill in what the server did not say: output tokens = text chunks, prompt tokens = the
    planned length; a stream with no output at all is a failure."""
    if not record.usage_reported:
        record.output_tokens = len(record.chunk_times)
    if not record.prompt_tokens:
        record.prompt_tokens = planned_prompt_tokens
    if record.ok and not record.chunk_times and record.output_tokens == 0:
        record.error, record.error_detail = "no_output", "the stream carried no text and no output tokens"


def http_error_kind(status: int) -> str:
    """``http_4xx:429``: the status class (who is at fault) and the exact code."""
    return f"http_{status // 100}xx:{status}"


# -- the dataset ------------------------------------------------------------------------------------


@dataclass
class RequestSpec:
    """One request to send: its prompt text, images, planned input and output lengths."""

    prompt: str
    input_len: int
    output_len: int
    images: list[str] = field(default_factory=list)  # data URLs


def sample_lengths(count: int, length: int, range_ratio: float, rng: random.Random) -> list[int]:
    """Uniform integers in [length * (1 - r), length * (1 + r)] (vLLM's random dataset), at least 1."""
    low = max(1, int(length * (1 - range_ratio)))
    high = max(low, int(length * (1 + range_ratio)))
    return [rng.randint(low, high) for _ in range(count)]


class WordPrompts:
    """Without a tokenizer: random common words, about one token each."""

    def make(self, length: int, rng: random.Random) -> tuple[str, int]:
        return " ".join(rng.choice(WORDS) for _ in range(length)), length


class TokenizerPrompts:
    """With the model's tokenizer: random vocabulary words, re-tokenized until the text is exactly
    ``length`` tokens (decode -> encode can merge or split pieces, so it takes a few rounds)."""

    MAX_ROUNDS = 10

    def __init__(self, path: str):
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.pool = self._word_ids()

    def _word_ids(self) -> list[int]:
        """Ids that decode to a plain ASCII word: they re-tokenize stably, unlike byte fragments."""
        special = set(self.tokenizer.all_special_ids)
        ids = [i for i in range(len(self.tokenizer)) if i not in special]
        texts = self.tokenizer.batch_decode([[i] for i in ids])
        words = [i for i, text in zip(ids, texts) if text.strip().isascii() and text.strip().isalpha()]
        return words or ids

    def _count(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def make(self, length: int, rng: random.Random) -> tuple[str, int]:
        ids = rng.choices(self.pool, k=length)
        text = self.tokenizer.decode(ids)
        for _ in range(self.MAX_ROUNDS):
            actual = self._count(text)
            if len(actual) == length:
                break
            ids = actual[:length] if len(actual) > length else actual + rng.choices(self.pool, k=length - len(actual))
            text = self.tokenizer.decode(ids)
        return text, len(self._count(text))


def random_png_data_url(width: int, height: int, rng: random.Random) -> str:
    """A noise RGB PNG as a base64 data URL (noise does not compress: the bytes are the worst case)."""
    from PIL import Image

    buffer = io.BytesIO()
    Image.frombytes("RGB", (width, height), rng.randbytes(width * height * 3)).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


class ImageSource:
    """The images of each request: fresh ones per request (``unique``), or the same K every time
    (what a server's image cache would see with a fixed picture)."""

    def __init__(self, per_request: int, size: tuple[int, int], unique: bool, rng: random.Random):
        self.per_request, self.size, self.unique, self.rng = per_request, size, unique, rng
        self._shared = None if unique else self._draw()

    def _draw(self) -> list[str]:
        return [random_png_data_url(*self.size, self.rng) for _ in range(self.per_request)]

    def next(self) -> list[str]:
        return self._draw() if self.unique else list(self._shared)


def build_specs(args: argparse.Namespace, count: int, purpose: str, prompts) -> list[RequestSpec]:
    """``count`` requests from seeded generators of their own (lengths, words, images), one set
    per ``purpose``: warm-up requests differ from the timed ones, and changing --warmup does not
    change what is timed."""
    def rng(part: str) -> random.Random:
        return random.Random(f"{args.seed}:{purpose}:{part}")

    input_lens = sample_lengths(count, args.input_len, args.range_ratio, rng("input"))
    output_lens = sample_lengths(count, args.output_len, args.range_ratio, rng("output"))
    words = rng("prompt")
    images = ImageSource(args.images_per_request, args.image_size, args.unique_images, rng("images")) \
        if args.images_per_request else None
    specs = []
    for input_len, output_len in zip(input_lens, output_lens):
        text, actual_len = prompts.make(input_len, words)
        specs.append(RequestSpec(text, actual_len, output_len, images.next() if images else []))
    return specs


def request_body(spec: RequestSpec, args: argparse.Namespace, model: str) -> dict:
    """The JSON body: streaming with usage, the output cap under both names a chat server may
    read, ``ignore_eos`` only when asked (a strict OpenAI server rejects unknown fields)."""
    body: dict = {"model": model, "stream": True, "stream_options": {"include_usage": True},
                  "max_tokens": spec.output_len}
    if args.endpoint == "chat":
        content = [{"type": "image_url", "image_url": {"url": url}} for url in spec.images]
        content = content + [{"type": "text", "text": spec.prompt}] if content else spec.prompt
        body["messages"] = [{"role": "user", "content": content}]
        body["max_completion_tokens"] = spec.output_len
    else:
        body["prompt"] = spec.prompt
    if args.ignore_eos:
        body["ignore_eos"] = True
    if args.ban_token_ids:
        body["logit_bias"] = {str(token_id): -100 for token_id in args.ban_token_ids}
    if args.temperature is not None:
        body["temperature"] = args.temperature
    return body


# -- sending requests -------------------------------------------------------------------------------


async def read_stream(response: httpx.Response, record: RequestRecord) -> None:
    """Fold the SSE body into ``record``; the end time is the ``[DONE]`` event (or the end of the
    body), and whatever follows ``[DONE]`` is read but ignored so the connection can be reused."""
    decoder, done, saw_event = SSEDecoder(), False, False
    async for chunk in response.aiter_bytes():
        now = clock()
        for payload in decoder.feed(chunk):
            saw_event = True
            if not done and apply_event(record, parse_event(payload), now):
                done, record.end = True, now
    for payload in decoder.close():
        saw_event = True
        if not done:
            apply_event(record, parse_event(payload), clock())
    if not done:
        record.end = clock()
    if not saw_event:
        raise StreamError("parse_error", "the response carried no server-sent events")


async def stream_request(client: httpx.AsyncClient, path: str, body: bytes, record: RequestRecord) -> None:
    async with client.stream("POST", path, content=body, headers={"content-type": "application/json"}) as response:
        if response.status_code != 200:
            detail = (await response.aread()).decode(errors="replace")[:300]
            raise StreamError(http_error_kind(response.status_code), detail)
        await read_stream(response, record)


async def send_request(client: httpx.AsyncClient, path: str, body: dict, timeout: float,
                       planned_prompt_tokens: int) -> RequestRecord:
    """One request, timed; every failure becomes the record's error kind, never an exception, so
    one bad response cannot end the run. The body is encoded before the clock starts: JSON
    encoding is this client's own work (milliseconds for a 1280x720 PNG data URL in httpx:
    RESULTS.md, bench_multiturn_image's fifth round), not the server's, and it would otherwise be
    inside every TTFT."""
    content = json.dumps(body, separators=(",", ":")).encode()
    record = RequestRecord(start=clock())
    try:
        await asyncio.wait_for(stream_request(client, path, content, record), timeout)
    except StreamError as error:
        record.error, record.error_detail = error.kind, error.detail
    except (TimeoutError, httpx.TimeoutException) as error:
        record.error, record.error_detail = "timeout", f"no complete answer in {timeout}s ({type(error).__name__})"
    except httpx.TransportError as error:
        record.error, record.error_detail = "connection_error", f"{type(error).__name__}: {error}"
    except Exception as error:  # noqa: BLE001 - a response this client cannot handle: report it, go on
        record.error, record.error_detail = "client_error", f"{type(error).__name__}: {error}"
    if not record.end:
        record.end = clock()
    finish_record(record, planned_prompt_tokens)
    return record


async def run_closed_loop(specs: Sequence[RequestSpec], concurrency: int, send) -> list[RequestRecord]:
    """``concurrency`` clients sharing one queue: each sends its next request when its last ends."""
    pending = iter(specs)
    records: list[RequestRecord] = []

    async def one_client():
        for spec in pending:  # a shared iterator: each next() hands a request to one client only
            records.append(await send(spec))

    await asyncio.gather(*(one_client() for _ in range(max(1, min(concurrency, len(specs))))))
    return records


async def run_open_loop(specs: Sequence[RequestSpec], offsets: Sequence[float], max_concurrency: int | None,
                        send) -> list[RequestRecord]:
    """Each request sent at its arrival offset, whether or not earlier ones have finished; with
    ``max_concurrency`` an arrival waits for a free slot (its clock starts when it is sent)."""
    slots = asyncio.Semaphore(max_concurrency) if max_concurrency else contextlib.nullcontext()

    async def arrive(spec):
        async with slots:
            return await send(spec)

    start, tasks = clock(), []
    for spec, offset in zip(specs, offsets):
        delay = start + offset - clock()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(arrive(spec)))
    return list(await asyncio.gather(*tasks))


async def scrape_metrics(client: httpx.AsyncClient) -> MetricsScrape | None:
    """The server's ``/metrics``, or None when it has none (or it does not answer)."""
    try:
        response = await client.get("/metrics", timeout=10)
    except httpx.HTTPError:
        return None
    if response.status_code != 200:
        return None
    return parse_prometheus_text(response.text)


async def settled_metrics(client: httpx.AsyncClient, before: MetricsScrape, completed: int,
                          patience_s: float = 2.0) -> MetricsScrape | None:
    """The after-run scrape, taken again for up to ``patience_s`` while the server has counted
    fewer successes than the client saw: a server may record a request a moment after its last
    byte went out."""
    deadline = clock() + patience_s
    while True:
        after = await scrape_metrics(client)
        if after is None:
            return None
        successes = total_of(metric_deltas(before, after), "vllm:request_success_total")
        if successes is None or successes >= completed or clock() > deadline:
            return after
        await asyncio.sleep(0.1)


async def detect_model(client: httpx.AsyncClient) -> str:
    """The first model ``/v1/models`` lists: what to send as ``model`` when --model is not given."""
    try:
        response = await client.get("/v1/models", timeout=30)
        response.raise_for_status()
        return response.json()["data"][0]["id"]
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as error:
        reason = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise BenchmarkError(f"could not read the model name from /v1/models ({reason}); pass --model") from None


class ProgressBar:
    """``[#####.....] 12/64 requests, 0 failed, 3.2s`` on stderr, redrawn in place with ``\\r``
    at most every ``min_interval`` seconds (stderr keeps stdout clean for the table and JSON)."""

    WIDTH = 30

    def __init__(self, total: int, stream=None, enabled: bool = True, min_interval: float = 0.1):
        self.total, self.enabled, self.min_interval = total, enabled and total > 0, min_interval
        self.stream = stream or sys.stderr
        self.done = self.failed = 0
        self.started = self._drawn = clock()
        if self.enabled:
            self._draw()

    def update(self, record: RequestRecord) -> None:
        self.done += 1
        self.failed += not record.ok
        if self.enabled and (clock() - self._drawn >= self.min_interval or self.done == self.total):
            self._draw()

    def _draw(self) -> None:
        self._drawn = clock()
        filled = self.WIDTH * self.done // self.total
        self.stream.write(f"\r[{'#' * filled}{'.' * (self.WIDTH - filled)}] {self.done}/{self.total} requests, "
                          f"{self.failed} failed, {self._drawn - self.started:.1f}s")
        self.stream.flush()

    def close(self) -> None:
        if self.enabled:
            self.stream.write("\n")
            self.stream.flush()


# -- the run ----------------------------------------------------------------------------------------


def pool_size(args: argparse.Namespace) -> int:
    """Connections needed at once: the clients of a closed loop, the cap of an open one, else all."""
    if args.request_rate is None:
        return args.concurrency
    return args.max_concurrency or max(1, args.num_prompts)


def load_description(args: argparse.Namespace) -> dict:
    if args.request_rate is None:
        return {"mode": "closed", "concurrency": args.concurrency}
    return {"mode": "open", "request_rate": args.request_rate, "burstiness": args.burstiness,
            "max_concurrency": args.max_concurrency}


async def run_benchmark(args: argparse.Namespace, base_url: str) -> dict:
    """Warm up, scrape /metrics, run the timed load, scrape again: the whole result but the server."""
    prompts = TokenizerPrompts(args.tokenizer) if args.tokenizer else WordPrompts()
    specs = build_specs(args, args.num_prompts, "timed", prompts)
    warmup_specs = build_specs(args, args.warmup, "warmup", prompts)
    pool = pool_size(args)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=pool, max_keepalive_connections=pool)
    async with httpx.AsyncClient(base_url=base_url, headers=headers, limits=limits,
                                 timeout=httpx.Timeout(args.timeout)) as client:
        model = args.model or await detect_model(client)
        path = ENDPOINT_PATHS[args.endpoint]

        async def send(spec: RequestSpec) -> RequestRecord:
            return await send_request(client, path, request_body(spec, args, model), args.timeout, spec.input_len)

        if warmup_specs:
            await run_closed_loop(warmup_specs, min(pool, len(warmup_specs)), send)
        before = await scrape_metrics(client)
        progress = ProgressBar(len(specs), enabled=not args.no_progress)

        async def send_and_show(spec: RequestSpec) -> RequestRecord:
            record = await send(spec)
            progress.update(record)
            return record

        started = clock()
        try:
            if args.request_rate is None:
                records = await run_closed_loop(specs, args.concurrency, send_and_show)
            else:
                offsets = arrival_offsets(len(specs), args.request_rate, args.burstiness,
                                          random.Random(f"{args.seed}:arrivals"))
                records = await run_open_loop(specs, offsets, args.max_concurrency, send_and_show)
            duration = clock() - started
        finally:
            progress.close()
        result = aggregate(records, duration)
        after = await settled_metrics(client, before, result["completed"]) if before else None
    result["server_metrics"] = (summarize_server_metrics(metric_deltas(before, after)) if before and after
                                else {"available": False, "reason": "no /metrics answer (HTTP 200) from the server"})
    return {"base_url": base_url, "model": model, "endpoint": args.endpoint, "load": load_description(args),
            "config": run_config(args), **result}


def run_config(args: argparse.Namespace) -> dict:
    return {"num_prompts": args.num_prompts, "input_len": args.input_len, "output_len": args.output_len,
            "range_ratio": args.range_ratio, "ignore_eos": args.ignore_eos,
            "ban_token_ids": list(args.ban_token_ids), "temperature": args.temperature,
            "seed": args.seed, "tokenizer": args.tokenizer, "images_per_request": args.images_per_request,
            "image_size": "x".join(map(str, args.image_size)), "unique_images": args.unique_images,
            "warmup": args.warmup, "timeout_s": args.timeout}


# -- a server started for the run -------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def server_command(args: argparse.Namespace, port: int) -> list[str]:
    """``--server-cmd`` with {port} filled in (a peer), else our service with ``--server-args``."""
    if args.server_cmd:
        return shlex.split(args.server_cmd.replace("{port}", str(port)))
    return [sys.executable, "-m", "atb_plugin.server", "--port", str(port), *shlex.split(args.server_args)]


def our_server_env() -> dict[str, str]:
    """This checkout first on the path, so ``-m atb_plugin.server`` is the code next to this script
    (a peer's command gets the environment as it is: our packages must not shadow its own)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    return env


class ManagedServer:
    """A server process this run owns: its own process group (so its children go with it), its
    output in a log file (stdout stays the report's), ready when ``/health`` or ``/v1/models``
    answers 200, and stopped on every way out: SIGTERM to the group, SIGKILL after
    ``stop_timeout``."""

    def __init__(self, command: list[str], port: int, log_path: Path, ready_timeout: float,
                 stop_timeout: float, api_key: str | None = None, env: dict[str, str] | None = None):
        self.command, self.port, self.log_path, self.env = command, port, log_path, env
        self.ready_timeout, self.stop_timeout = ready_timeout, stop_timeout
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.base_url = f"http://127.0.0.1:{port}"
        self.process: subprocess.Popen | None = None
        self.killed = False

    def __enter__(self) -> ManagedServer:
        with open(self.log_path, "w") as log:
            self.process = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, env=self.env, start_new_session=True)
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def _answers(self) -> bool:
        for path in ("/health", "/v1/models"):
            try:
                if httpx.get(self.base_url + path, headers=self.headers, timeout=2).status_code == 200:
                    return True
            except httpx.HTTPError:
                pass
        return False

    def wait_ready(self) -> None:
        deadline = clock() + self.ready_timeout
        while clock() < deadline:
            if self.process.poll() is not None:
                raise BenchmarkError(f"the server exited with code {self.process.returncode} before answering; "
                                     f"log {self.log_path}:\n{self.log_tail()}")
            if self._answers():
                return
            time.sleep(0.25)
        raise BenchmarkError(f"the server did not answer /health or /v1/models in {self.ready_timeout}s; "
                             f"log {self.log_path}:\n{self.log_tail()}")

    def _group_alive(self) -> bool:
        try:
            os.killpg(self.process.pid, 0)
            return True
        except (ProcessLookupError, PermissionError):
            return False

    def stop(self) -> None:
        """SIGTERM to the group; SIGKILL to whatever of it is left after ``stop_timeout``."""
        if self.process is None or (self.process.poll() is not None and not self._group_alive()):
            return  # never started, or it and all its children are gone already
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGTERM)
        deadline = clock() + self.stop_timeout
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(self.stop_timeout)
        while self._group_alive() and clock() < deadline:
            time.sleep(0.1)
        if self._group_alive():
            self.killed = True
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(10)

    def describe(self) -> dict:
        return {"command": shlex.join(self.command), "port": self.port, "log": str(self.log_path),
                "exit_code": self.process.poll() if self.process else None, "killed": self.killed}


@contextlib.contextmanager
def sigterm_as_exit():
    """Turn SIGTERM into SystemExit while a server is ours, so the ``finally`` that stops it runs
    when this benchmark is itself terminated (Ctrl-C already raises KeyboardInterrupt)."""
    def exit_now(signum, frame):
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, exit_now)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


# -- the report -------------------------------------------------------------------------------------


def _fmt(value, digits: int = 2) -> str:
    if value is None:
        return "-"
    return f"{value:.{digits}f}" if isinstance(value, float) else str(value)


def format_report(result: dict) -> str:
    """The human-readable table (the JSON line after it has the same numbers and more)."""
    load = result["load"]
    shape = (f"closed loop, concurrency {load['concurrency']}" if load["mode"] == "closed" else
             f"open loop, {load['request_rate']} req/s, burstiness {load['burstiness']}, "
             f"max concurrency {load['max_concurrency'] or 'none'}")
    rows = [("Server", f"{result['base_url']} ({result['endpoint']})"), ("Model", result["model"]),
            ("Load", shape), ("Successful requests", result["completed"]), ("Failed requests", result["failed"]),
            ("Benchmark duration (s)", result["duration_s"]), ("Total input tokens", result["total_input_tokens"]),
            ("Total output tokens", result["total_output_tokens"]),
            ("Request throughput (req/s)", result["request_throughput"]),
            ("Output throughput (tok/s)", result["output_throughput"]),
            ("Total throughput (tok/s)", result["total_token_throughput"])]
    if result["usage_missing"]:
        rows.append(("Requests without usage", f"{result['usage_missing']} (tokens counted as chunks)"))
    lines = [" Serving benchmark ".center(72, "="), *(f"{name:<32}{_fmt(value)}" for name, value in rows),
             "-" * 72, f"{'latency (ms)':<16}" + "".join(f"{h:>14}" for h in ("mean", "median", "p90", "p99"))]
    for label, key in (("TTFT", "ttft_ms"), ("TPOT", "tpot_ms"), ("ITL", "itl_ms"), ("E2E", "e2e_ms")):
        stats = result[key]
        lines.append(f"{label:<16}" + "".join(f"{_fmt(stats[h]):>14}" for h in ("mean", "median", "p90", "p99")))
    lines.append("-" * 72)
    lines += [f"error {kind}: {count}  e.g. {result['error_examples'][kind][:120]}"
              for kind, count in result["errors"].items()] or ["errors: none"]
    lines += server_metrics_lines(result["server_metrics"])
    server = result.get("server")
    if server:
        lines.append(f"server command: {server['command']}  (log {server['log']})")
    lines.append("=" * 72)
    return "\n".join(lines)


def _fmt_counts(counts: dict[str, float]) -> str:
    return ", ".join(f"{name} {value:g}" for name, value in counts.items()) or "-"


def server_metrics_lines(metrics: dict) -> list[str]:
    if not metrics["available"]:
        return [f"server /metrics: unavailable ({metrics['reason']})"]
    return [f"server /metrics delta: prompt tokens {_fmt(metrics['prompt_tokens'], 0)}, "
            f"generation tokens {_fmt(metrics['generation_tokens'], 0)}, "
            f"successes by finish reason: {_fmt_counts(metrics['request_success'])}",
            f"server-side mean (ms): TTFT {_fmt(metrics['mean_ttft_ms'])}, E2E {_fmt(metrics['mean_e2e_ms'])}, "
            f"ITL {_fmt(metrics['mean_itl_ms'])}, queue {_fmt(metrics['mean_queue_ms'])}"]


# -- command line -----------------------------------------------------------------------------------


def _image_size(text: str) -> tuple[int, int]:
    match = re.fullmatch(r"(\d+)[xX](\d+)", text.strip())
    if not match or 0 in (int(match[1]), int(match[2])):
        raise argparse.ArgumentTypeError(f"{text!r} is not WIDTHxHEIGHT, e.g. 448x448")
    return int(match[1]), int(match[2])


def _token_ids(text: str) -> tuple[int, ...]:
    try:
        ids = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated token ids, got {text!r}") from None
    if not ids or min(ids) < 0:
        raise argparse.ArgumentTypeError(f"expected non-negative token ids, got {text!r}")
    return ids


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    target = p.add_argument_group("server")
    target.add_argument("--base-url", help="e.g. http://127.0.0.1:8000 (a trailing /v1 is fine)")
    target.add_argument("--model", help="the model name to send (default: the first of /v1/models)")
    target.add_argument("--api-key", help="sent as 'Authorization: Bearer KEY'")
    target.add_argument("--endpoint", choices=sorted(ENDPOINT_PATHS), default="chat")
    target.add_argument("--start-server", action="store_true",
                        help="start the server on a free port, benchmark it, stop it")
    target.add_argument("--server-args", default="", help="extra flags for our `python -m atb_plugin.server`")
    target.add_argument("--server-cmd", help="a peer's command instead, with {port} in it")
    target.add_argument("--server-timeout", type=float, default=600.0, help="seconds to wait for it to answer")
    target.add_argument("--server-stop-timeout", type=float, default=30.0,
                        help="seconds between SIGTERM and SIGKILL")
    target.add_argument("--server-log", help="its output (default: a file in the temp directory)")
    load = p.add_argument_group("load")
    shape = load.add_mutually_exclusive_group()
    shape.add_argument("--concurrency", type=int, help="closed loop: N clients back to back (default 1)")
    shape.add_argument("--request-rate", type=float, help="open loop: mean arrivals per second (inf: all at once)")
    load.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the gaps (1: Poisson)")
    load.add_argument("--max-concurrency", type=int, help="with --request-rate: requests in flight at most")
    load.add_argument("--num-prompts", type=int, default=16)
    load.add_argument("--warmup", type=int, default=0, help="requests sent first and not counted")
    load.add_argument("--timeout", type=float, default=600.0, help="seconds one request may take in all")
    data = p.add_argument_group("requests")
    data.add_argument("--input-len", type=int, default=128, help="prompt words (tokens with --tokenizer)")
    data.add_argument("--output-len", type=int, default=64, help="max_tokens")
    data.add_argument("--range-ratio", type=float, default=0.0,
                      help="lengths uniform in [len*(1-r), len*(1+r)]")
    data.add_argument("--tokenizer", help="a tokenizer directory: prompts of exactly --input-len tokens")
    data.add_argument("--ignore-eos", action="store_true", help="send ignore_eos: true (vLLM, ours)")
    data.add_argument("--ban-token-ids", type=_token_ids, default=(),
                      help="comma-separated ids sent as logit_bias -100 each: the EOS ids here make every "
                           "server (llama.cpp's reads no ignore_eos) produce exactly max_tokens")
    data.add_argument("--temperature", type=float, help="sent when given (default: the server's)")
    data.add_argument("--seed", type=int, default=0)
    data.add_argument("--images-per-request", type=int, default=0, help="random PNGs per chat request")
    data.add_argument("--image-size", type=_image_size, default=(448, 448), help="WIDTHxHEIGHT")
    data.add_argument("--unique-images", action="store_true",
                      help="fresh images per request (else one set reused); all are made before the run, "
                           "about 4/3 * W*H*3 bytes each")
    out = p.add_argument_group("output")
    out.add_argument("--result-json", help="also write the result JSON here")
    out.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    return p


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    problems = []
    if args.start_server == bool(args.base_url):
        problems.append("give exactly one of --base-url and --start-server")
    if args.server_cmd and "{port}" not in args.server_cmd:
        problems.append("--server-cmd must contain {port}")
    if args.request_rate is None:
        args.concurrency = args.concurrency or 1
        if args.max_concurrency:
            problems.append("--max-concurrency caps an open loop: use it with --request-rate")
    elif args.request_rate <= 0 or args.burstiness <= 0:
        problems.append("--request-rate and --burstiness must be > 0")
    if args.concurrency is not None and args.concurrency < 1:
        problems.append("--concurrency must be >= 1")
    if not 0 <= args.range_ratio < 1:
        problems.append("--range-ratio must be in [0, 1)")
    if min(args.num_prompts, args.input_len, args.output_len) < 1 or args.warmup < 0 or args.timeout <= 0:
        problems.append("--num-prompts, --input-len and --output-len must be >= 1, --warmup >= 0, --timeout > 0")
    if args.images_per_request and args.endpoint != "chat":
        problems.append("images need --endpoint chat")
    if problems:
        parser.error("; ".join(problems))
    if args.base_url:
        args.base_url = args.base_url.rstrip("/").removesuffix("/v1")
    return args


def start_server(args: argparse.Namespace) -> ManagedServer:
    port = free_port()
    log = Path(args.server_log) if args.server_log else Path(tempfile.gettempdir()) / f"bench-serving-server-{port}.log"
    return ManagedServer(server_command(args, port), port, log, args.server_timeout, args.server_stop_timeout,
                         args.api_key, env=None if args.server_cmd else our_server_env())


def emit(result: dict, args: argparse.Namespace) -> None:
    """The table, then the JSON as the very last stdout line (what scripts read)."""
    line = json.dumps(result)
    print(format_report(result))
    if args.result_json:
        Path(args.result_json).write_text(line + "\n")
    print(line, flush=True)


def main(argv: list[str] | None = None) -> int:
    """0: the run finished (failures are in the report); 1: nothing succeeded or it could not run;
    130: interrupted."""
    args = parse_args(argv)
    try:
        if args.start_server:
            with sigterm_as_exit(), start_server(args) as server:
                result = asyncio.run(run_benchmark(args, server.base_url))
            result["server"] = server.describe()
        else:
            result = asyncio.run(run_benchmark(args, args.base_url))
            result["server"] = None
    except KeyboardInterrupt:
        print("\nbench_serving: interrupted", file=sys.stderr)
        return 130
    except BenchmarkError as error:
        print(f"bench_serving: {error}", file=sys.stderr)
        return 1
    emit(result, args)
    return 0 if result["completed"] else 1


if __name__ == "__main__":
    sys.exit(main())
