"""Claim (endurance + faults): under hours-like mixed traffic the service stays flat — no growth
of its processes' memory, of its shared-memory segments or of /dev/shm — answers every request
the way it should (0 unexpected errors), and its metrics agree with what the clients saw; when
its engine core is killed it fails the requests in flight, exits non-zero by itself, and a
restart on the same port serves the rest of the run and leaves no segment of either incarnation.

What runs: the service itself (``python -m atb_plugin.server``, its own process group), started
and supervised by this script, and --clients streaming clients (asyncio + httpx) for --duration
seconds. Each client loops over a seeded mix of requests (``KIND_SHARES``):

  text            a streamed text chat
  image_shared    a streamed chat with one image of a small shared pool (the workers' cache hits)
  image_unique    a streamed chat with an image no one sent before (new segments, cache eviction)
  disconnect      a long streamed chat (text or image) the client closes after 2-6 events
  video           a streamed chat with one short video of a small shared pool (the media workers)
  video_many_frames  the decode bomb's shape (16x16 frames at 5,000 fps, one keyframe; 60 s here)
                  -> 400, over the default --max-video-decode-frames, refused from its header
  audio           a streamed chat with a short input_audio clip no one sent before
  bad_model       unknown model -> 404          bad_json        invalid JSON -> 400
  bad_max_tokens  max_tokens > max_model_len -> 400
  bad_image       a data: URL that holds no image -> 400

A kind the served model cannot take (images for a text-only model, video or audio for a model
without them: asked through /tokenize at start) gives its share to text.

Every outcome is one of: ok, expected_4xx, disconnect, fault (an error of a request in flight
when the engine core was killed: expected) or UNEXPECTED (a 5xx, a 4xx where success was
expected, a timeout, a broken stream: the goal is 0).

Sampled every second: RSS of the whole process group and of its parts (API process, engine
core, the rest: tokenizer workers), the service's live segments in /dev/shm (count and bytes) and
/dev/shm's used bytes. Each series is reported at the end of the warm-up (--warmup, 60 s, at most
half the run) and at the end, with its max and its least-squares slope over that window, plus a
10-second timeline. The verdict judges the group's RSS and the segments (count, bytes) flat when
the slope's growth over the window stays within ``series_tolerances`` (a window under 30 s is not
judged); the per-process series say which process grows.

At the end: wait until the service is idle, then compare its metrics with the clients' tallies
(``check_consistency``), SIGTERM it and check it exits 0 leaving no segment and no process.

``--kill-engine-at T``: the supervisor SIGKILLs the engine-core process T seconds in; the service
must exit non-zero on its own, is restarted on the same port, and the clients (which send only
while the supervisor has seen /health answer 200) carry on. Consistency is checked on the last
incarnation (the dead one's counters died with it), on the requests that began and ended there.

The default --shm-budget (16M) bounds the tokenizer workers' image cache (half the budget) so that
it fills during the warm-up and the run shows the steady state rather than a cache filling up
(by design, up to 1 GiB per worker without a budget). The last stdout line is one JSON object.

    python benchmarks/soak.py [--clients 64] [--duration 120] [--model DIR] [--server-args "..."]
                              [--kill-engine-at SECONDS] [--seed 0] [--max-tokens 32]
                              [--result-json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
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
from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np
from PIL import Image

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))  # run from anywhere in the repo

from shm.segment import SHM_DIR, list_segment_names, segment_path  # noqa: E402

# -- the traffic mix ------------------------------------------------------------------------------

KIND_SHARES: Mapping[str, float] = {
    "text": 0.35,
    "image_shared": 0.20,
    "image_unique": 0.15,
    "disconnect": 0.07,
    "video": 0.06,
    "video_many_frames": 0.03,
    "audio": 0.04,
    "bad_model": 0.025,
    "bad_json": 0.025,
    "bad_max_tokens": 0.025,
    "bad_image": 0.025,
}
IMAGE_KINDS = ("image_shared", "image_unique")
VIDEO_KINDS = ("video", "video_many_frames")
AUDIO_KINDS = ("audio",)
EXPECTED_STATUS: Mapping[str, int] = {"video_many_frames": 400, "bad_model": 404, "bad_json": 400,
                                      "bad_max_tokens": 400, "bad_image": 400}

OK, EXPECTED_4XX, DISCONNECT, FAULT, UNEXPECTED = "ok", "expected_4xx", "disconnect", "fault", "unexpected"
RESULTS = (OK, EXPECTED_4XX, DISCONNECT, FAULT, UNEXPECTED)


@dataclass(frozen=True)
class TrafficMix:
    """Which kind of request a client sends next: a seeded draw from fixed shares, so a run's
    request sequence is reproducible from --seed and the mix is the same whatever the run length."""

    shares: Mapping[str, float] = field(default_factory=lambda: dict(KIND_SHARES))

    def __post_init__(self):
        if any(share < 0 for share in self.shares.values()) or abs(sum(self.shares.values()) - 1) > 1e-9:
            raise ValueError(f"shares must be >= 0 and sum to 1, got {dict(self.shares)}")

    def pick(self, rng: random.Random) -> str:
        point, cumulative = rng.random(), 0.0
        for kind, share in self.shares.items():
            cumulative += share
            if point < cumulative:
                return kind
        return next(kind for kind, share in reversed(list(self.shares.items())) if share > 0)  # rounding

    def text_only(self) -> "TrafficMix":
        """The mix for a model that takes no images: the image kinds' shares go to text (bad_image
        stays: a text-only model answers it with a 400 too)."""
        return self.as_text(IMAGE_KINDS)

    def as_text(self, kinds: Sequence[str]) -> "TrafficMix":
        """The mix with the shares of ``kinds`` (what the model cannot take) given to text."""
        shares = {kind: share for kind, share in self.shares.items() if kind not in kinds}
        shares["text"] = shares.get("text", 0.0) + sum(self.shares.get(kind, 0.0) for kind in kinds)
        return TrafficMix(shares)

    def plan(self, seed: int, client: int, count: int) -> list[str]:
        """The first ``count`` kinds client ``client`` sends (what its loop draws)."""
        rng = kind_rng(seed, client)
        return [self.pick(rng) for _ in range(count)]


def kind_rng(seed: int, client: int) -> random.Random:
    """The stream of kinds of one client; kept apart from the request details' stream so the kind
    sequence does not depend on how many numbers a request's body drew."""
    return random.Random(f"soak-kinds-{seed}-{client}")


def detail_rng(seed: int, client: int) -> random.Random:
    return random.Random(f"soak-details-{seed}-{client}")


# -- request bodies -------------------------------------------------------------------------------

PROMPTS = ("Tell me about the cat on the mat.", "Write a haiku about the sea.", "What is two plus two?",
           "List three colours.", "Describe a quiet morning in the mountains.", "Why is the sky blue?")
SHARED_IMAGES = 8
DISCONNECT_EVENTS = (2, 6)  # a disconnecting client closes after this many SSE events (inclusive)
NOT_AN_IMAGE = "data:image/png;base64," + base64.b64encode(b"these bytes are not an image at all").decode()
BAD_JSON = b'{"messages": [{"role": "user", "content": "unterminated'


def png_data_url(entropy: Sequence[int], width: int, height: int) -> str:
    """A random-noise PNG as a data URL; the same entropy gives the same bytes (a cache hit)."""
    rng = np.random.default_rng(list(entropy))
    buffer = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def image_size(rng: random.Random) -> tuple[int, int]:
    return rng.randint(32, 160), rng.randint(32, 160)


SHARED_VIDEOS = 4
MANY_FRAMES = 300_000  # 60 s at 5,000 fps: over the default --max-video-decode-frames (216,000)


def video_data_url(seed: int) -> str:
    """A short video (4 frames of 64x96 at 2 fps: 4 sampled, ~1.4 MB in shared memory, so the pool's
    segments fit a media worker's share of the default --shm-budget) as a data URL."""
    from atb_plugin.testing.videos import video_bytes

    return "data:video/mp4;base64," + base64.b64encode(video_bytes(4, 2, seed=seed)).decode()


def many_frames_data_url() -> str:
    from atb_plugin.testing.videos import many_frames_video_bytes

    return "data:video/mp4;base64," + base64.b64encode(many_frames_video_bytes(MANY_FRAMES)).decode()


def wav_base64(rng: random.Random) -> str:
    """A 1-3 s tone at 16 kHz as base64 WAV (input_audio's data); each draw a new clip."""
    import wave

    seconds, pitch = rng.uniform(1.0, 3.0), rng.uniform(200.0, 800.0)
    samples = np.sin(2 * np.pi * pitch * np.arange(int(seconds * 16000)) / 16000) * 8000
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(16000)
        out.writeframes(samples.astype("<i2").tobytes())
    return base64.b64encode(buffer.getvalue()).decode()


@dataclass(frozen=True)
class RequestSpec:
    kind: str
    body: bytes
    expect_status: int = 200
    close_after_events: int | None = None  # a disconnect: close the stream after this many events


class RequestFactory:
    """Turns a kind into the request a client sends. Knows the served model's name and length
    limit (from /v1/models) and holds the shared image pool.

    The exact rule behind "every disconnect is an abort": a disconnect request asks for
    ``disconnect_tokens`` (half the model's length, at most 2048) with ignore_eos, so it is still
    generating when the client closes after a few events; a client that nevertheless saw its
    finish_reason reads the stream to the end and counts a success, never a disconnect."""

    def __init__(self, model: str, max_model_len: int, max_tokens: int, seed: int, takes_images: bool = True,
                 takes_video: bool = True):
        self.model, self.max_model_len, self.max_tokens = model, max_model_len, max_tokens
        self.takes_images, self.takes_video = takes_images, takes_video
        self.shared_videos = [video_data_url(seed * 100 + i) for i in range(SHARED_VIDEOS)] if takes_video else []
        self.many_frames = many_frames_data_url() if takes_video else None
        self.disconnect_tokens = max(max_tokens + 1, min(2048, max_model_len // 2))
        pool_rng = random.Random(f"soak-shared-images-{seed}")
        self.shared_images = [png_data_url((seed, 1_000_000 + i), *image_size(pool_rng)) for i in range(SHARED_IMAGES)]
        self.seed = seed

    def build(self, kind: str, rng: random.Random, client: int, sequence: int) -> RequestSpec:
        if kind == "bad_json":
            return RequestSpec(kind, BAD_JSON, EXPECTED_STATUS[kind])
        fields = {"model": self.model, "stream": True, "max_tokens": self.max_tokens}
        content: list | str = rng.choice(PROMPTS)
        if kind == "image_shared":
            content = image_content(rng.choice(self.shared_images), content)
        elif kind == "image_unique":
            content = image_content(png_data_url((self.seed, client, sequence), *image_size(rng)), content)
        elif kind == "disconnect":
            if rng.random() < 0.5 and self.takes_images:
                content = image_content(png_data_url((self.seed, client, sequence), *image_size(rng)), content)
            fields.update(max_tokens=self.disconnect_tokens, ignore_eos=True)
        elif kind == "video":
            content = video_content(rng.choice(self.shared_videos), content)
        elif kind == "video_many_frames":
            content = video_content(self.many_frames, content)
        elif kind == "audio":
            content = [{"type": "input_audio", "input_audio": {"data": wav_base64(rng), "format": "wav"}},
                       {"type": "text", "text": content}]
        elif kind == "bad_model":
            fields["model"] = "no-such-model"
        elif kind == "bad_max_tokens":
            fields["max_tokens"] = self.max_model_len + 1
        elif kind == "bad_image":
            content = image_content(NOT_AN_IMAGE, content)
        elif kind != "text":
            raise ValueError(f"unknown request kind {kind!r}")
        body = json.dumps({**fields, "messages": [{"role": "user", "content": content}]}).encode()
        close_after = rng.randint(*DISCONNECT_EVENTS) if kind == "disconnect" else None
        return RequestSpec(kind, body, EXPECTED_STATUS.get(kind, 200), close_after)


def image_content(url: str, text: str) -> list:
    return [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": text}]


def video_content(url: str, text: str) -> list:
    return [{"type": "video_url", "video_url": {"url": url}}, {"type": "text", "text": text}]


# -- one request: what the client saw, and what that means ----------------------------------------


@dataclass
class Observation:
    """What one request looked like from the client's side."""

    status: int | None = None
    events: int = 0
    finish_reason: str | None = None
    done: bool = False  # saw "data: [DONE]"
    error_event: str | None = None  # an {"error": ...} event inside a 200 stream
    closed_early: bool = False  # the client closed the stream on purpose (a disconnect)
    failure: str | None = None  # a transport error or timeout, by name


async def perform(http: httpx.AsyncClient, spec: RequestSpec) -> Observation:
    """Send one request and read its SSE stream (or its error body), closing early if asked."""
    seen = Observation()
    try:
        async with http.stream("POST", "/v1/chat/completions", content=spec.body,
                               headers={"Content-Type": "application/json"}) as response:
            seen.status = response.status_code
            if response.status_code != 200:
                await response.aread()
                return seen
            async for line in response.aiter_lines():
                if line.startswith("data: ") and _read_event(seen, line[6:], spec.close_after_events):
                    break  # leaving the block closes the connection mid-stream
    except httpx.TimeoutException as error:
        seen.failure = f"timeout ({type(error).__name__})"
    except (httpx.HTTPError, json.JSONDecodeError) as error:
        seen.failure = f"{type(error).__name__}: {error}"
    return seen


def _read_event(seen: Observation, data: str, close_after: int | None) -> bool:
    """Record one SSE event; True when the client should close the stream now."""
    seen.events += 1
    if data == "[DONE]":
        seen.done = True
        return False
    event = json.loads(data)
    if "error" in event:
        seen.error_event = json.dumps(event["error"])[:300]
    for choice in event.get("choices", ()):
        seen.finish_reason = choice.get("finish_reason") or seen.finish_reason
    if close_after is not None and seen.events >= close_after and seen.finish_reason is None:
        seen.closed_early = True
        return True
    return False


def classify(spec: RequestSpec, seen: Observation, disturbed: bool) -> tuple[str, str]:
    """(result, what was wrong). ``disturbed``: the engine core was killed while this request was
    in flight, so a failure is the expected fault rather than an unexpected error."""
    if spec.expect_status != 200:
        if seen.status == spec.expect_status:
            return EXPECTED_4XX, ""
        problem = f"expected {spec.expect_status}, got {seen.failure or seen.status}"
    else:
        problem = stream_problem(seen)
        if problem is None:
            return (DISCONNECT if seen.closed_early else OK), ""
    return (FAULT if disturbed else UNEXPECTED), f"{spec.kind}: {problem}"


def stream_problem(seen: Observation) -> str | None:
    """Why a stream that should have succeeded did not (None: it did, or was closed on purpose)."""
    if seen.failure:
        return seen.failure
    if seen.status != 200:
        return f"HTTP {seen.status}"
    if seen.error_event:
        return f"error event {seen.error_event}"
    if seen.closed_early:
        return None
    if seen.finish_reason not in ("stop", "length"):
        return f"stream ended without a finish_reason (after {seen.events} events)"
    if not seen.done:
        return "stream ended without [DONE]"
    return None


class Tally:
    """Outcomes by kind, and — for the consistency check — by the incarnation that served them
    (only requests that began and ended with the same, undisturbed incarnation)."""

    MAX_EXAMPLES = 20

    def __init__(self):
        self.by_kind: dict[str, Counter] = defaultdict(Counter)
        self.by_incarnation: dict[int, Counter] = defaultdict(Counter)
        self.unexpected_examples: list[str] = []

    def add(self, kind: str, result: str, incarnation: int | None, detail: str = "") -> None:
        self.by_kind[kind][result] += 1
        if incarnation is not None:
            self.by_incarnation[incarnation][result] += 1
        if result == UNEXPECTED and len(self.unexpected_examples) < self.MAX_EXAMPLES:
            self.unexpected_examples.append(detail)

    def totals(self) -> dict[str, int]:
        total = Counter()
        for counts in self.by_kind.values():
            total.update(counts)
        return {result: total[result] for result in RESULTS}


# -- the service's metrics, and whether they agree with the clients -------------------------------


@dataclass(frozen=True)
class CoreMetrics:
    """The few /metrics values the check reads (summed over the model_name label)."""

    finished: Mapping[str, float]  # vllm:request_success_total by finished_reason
    running: float
    waiting: float
    leased_segments: float
    tokenizer_queue: float

    @classmethod
    def from_text(cls, text: str) -> "CoreMetrics":
        from prometheus_client.parser import text_string_to_metric_families

        finished: Counter = Counter()
        values: Counter = Counter()
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == "vllm:request_success_total":
                    finished[sample.labels.get("finished_reason", "")] += sample.value
                else:
                    values[sample.name] += sample.value
        return cls(dict(finished), values["vllm:num_requests_running"], values["vllm:num_requests_waiting"],
                   values["atb_plugin:shm_leased_segments"], values["atb_plugin:tokenizer_queue_depth"])

    def count(self, *reasons: str) -> float:
        return sum(self.finished.get(reason, 0.0) for reason in reasons)

    def idle(self) -> bool:
        return self.running == 0 and self.waiting == 0 and self.leased_segments == 0 and self.tokenizer_queue == 0


def check_consistency(successes: int, disconnects: int, before: CoreMetrics, after: CoreMetrics) -> dict:
    """Do the service's counters (``after`` - ``before``, one incarnation) agree with the clients?
    Every client disconnect is one abort in the core; every client success one stop/length
    finish; nothing finished with an error; nothing runs, waits or holds a lease any more."""
    aborts = after.count("abort") - before.count("abort")
    server_successes = after.count("stop", "length") - before.count("stop", "length")
    errors = after.count("error") - before.count("error")
    checks = {
        "aborts_equal_disconnects": aborts == disconnects,
        "successes_equal_client_successes": server_successes == successes,
        "no_error_finishes": errors == 0,
        "nothing_running": after.running == 0 and after.waiting == 0,
        "no_leased_segments": after.leased_segments == 0,
    }
    return {**checks, "consistent": all(checks.values()),
            "numbers": {"client_successes": successes, "client_disconnects": disconnects,
                        "server_successes": server_successes, "server_aborts": aborts, "server_errors": errors,
                        "running": after.running, "waiting": after.waiting,
                        "leased_segments": after.leased_segments}}


# -- per-second samples, and whether they stay flat -----------------------------------------------

MIN_JUDGED_WINDOW_S = 30.0  # a shorter post-warm-up window gives flat = None (too short to judge)


@dataclass(frozen=True)
class Tolerance:
    """How much growth over the judged window still counts as flat: ``relative`` x the start value
    + ``absolute``. Noise (requests in flight, allocator churn) stays inside it; a leak of a
    little per request, over minutes, does not."""

    relative: float
    absolute: float


def slope(times: Sequence[float], values: Sequence[float]) -> float:
    """Least-squares slope (units per second); 0 for fewer than two distinct times."""
    n = len(times)
    if n < 2:
        return 0.0
    mean_t, mean_v = sum(times) / n, sum(values) / n
    spread = sum((t - mean_t) ** 2 for t in times)
    if spread == 0:
        return 0.0
    return sum((t - mean_t) * (v - mean_v) for t, v in zip(times, values)) / spread


def summarize_series(times: Sequence[float], values: Sequence[float], window_start: float,
                     tolerance: Tolerance, min_window: float = MIN_JUDGED_WINDOW_S) -> dict:
    """Start (first sample at or after ``window_start``, i.e. after warm-up), end, max and min (over
    every sample) and the slope over the window. Flat when the growth the slope predicts across
    the window stays within ``tolerance`` (a trend, not the endpoints, so one noisy sample does not
    decide); None when the window is shorter than ``min_window`` or empty."""
    if not values:
        return {"start": None, "end": None, "max": None, "min": None, "slope_per_min": None, "growth": None,
                "flat": None}
    window = [(t, v) for t, v in zip(times, values) if t >= window_start] or [(times[-1], values[-1])]
    window_t, window_v = [t for t, _ in window], [v for _, v in window]
    per_second = slope(window_t, window_v)
    span = window_t[-1] - window_t[0]
    growth = per_second * span
    flat = None
    if span >= min_window:
        flat = growth <= tolerance.relative * abs(window_v[0]) + tolerance.absolute
    return {"start": window_v[0], "end": window_v[-1], "max": max(values), "min": min(values),
            "slope_per_min": per_second * 60, "growth": growth, "flat": flat}


@dataclass(frozen=True)
class Sample:
    t: float  # seconds since the clients started
    incarnation: int
    rss_group: int  # the API process and every process of its group
    rss_api: int
    rss_engine: int  # the engine-core process
    rss_workers: int  # the rest of the group: tokenizer workers (and multiprocessing's resource tracker)
    segments: int
    segment_bytes: int
    dev_shm_used: int


def series_tolerances(clients: int) -> dict[str, Tolerance]:
    """Per series: RSS may wander by a few % (allocator arenas); the segment count by the images
    of the requests in flight (about one per client); bytes by 10% + a few MiB."""
    mib = 1 << 20
    rss = Tolerance(0.03, 16 * mib)
    return {"rss_group": rss, "rss_api": rss, "rss_engine": rss, "rss_workers": rss,
            "segments": Tolerance(0.10, max(8, clients)), "segment_bytes": Tolerance(0.10, 2 * mib),
            "dev_shm_used": Tolerance(0.10, 4 * mib)}


JUDGED_SERIES = ("rss_group", "segments", "segment_bytes")  # per process: to find the culprit;
# dev_shm_used: the whole machine's


def process_group(pgid: int) -> list[int]:
    """Live processes of a process group (read from /proc, so orphans count too)."""
    members = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) "
        if int(fields[2]) == pgid and fields[0] != "Z":
            members.append(int(entry))
    return members


def rss_bytes(pid: int) -> int:
    """Resident set size of one process (psutil if installed, else /proc/<pid>/status); 0 if gone."""
    try:
        import psutil
    except ImportError:
        psutil = None
    try:
        if psutil is not None:
            return psutil.Process(pid).memory_info().rss
        match = re.search(r"^VmRSS:\s+(\d+) kB", Path(f"/proc/{pid}/status").read_text(), re.M)
        return int(match.group(1)) * 1024 if match else 0
    except Exception:  # noqa: BLE001 - the process exited between listing and reading
        return 0


def segment_usage(instances: Sequence[str]) -> tuple[int, int]:
    """(count, bytes) of the live segments (instance markers included) of these shm instances."""
    prefixes = tuple("psm_" + instance for instance in instances)
    count = size = 0
    for name in list_segment_names():
        if prefixes and name.startswith(prefixes):
            try:
                size += os.stat(segment_path(name)).st_size
                count += 1
            except FileNotFoundError:
                pass  # unlinked while we looked
    return count, size


def dev_shm_used() -> int:
    stat = os.statvfs(SHM_DIR)
    return (stat.f_blocks - stat.f_bfree) * stat.f_frsize


# -- the service and its supervisor ---------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Service:
    """One incarnation of the service: ``python -m atb_plugin.server`` in its own process group
    (the API process's pid is the group id, so the engine core and workers are found by group),
    its output in a log file that names the engine core's and workers' pids and shm instances."""

    PID_LINE = re.compile(r"(engine core|tokenizer worker \d+) pid (\d+)")
    INSTANCE_LINE = re.compile(r"shm instance (\w+)")

    def __init__(self, command: list[str], log_path: Path):
        self.command, self.log_path = command, log_path
        self.pids: dict[str, int] = {}
        self.instances: list[str] = []
        self._offset, self._partial = 0, ""
        env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
        env.pop("ATB_PLUGIN_API_KEY", None)
        with open(log_path, "w") as log_file:  # the child keeps its own descriptor
            self.process = subprocess.Popen(command, stdout=log_file, stderr=log_file, cwd=REPO_ROOT, env=env,
                                            start_new_session=True)

    @property
    def pid(self) -> int:
        return self.process.pid

    def poll(self) -> int | None:
        return self.process.poll()

    def scan_log(self) -> None:
        """Read the log's new lines for pids and shm instances (incrementally: it grows all run)."""
        with open(self.log_path, errors="replace") as log:
            log.seek(self._offset)
            text = self._partial + log.read()
            self._offset = log.tell()
        *lines, self._partial = text.split("\n")
        for line in lines:
            if match := self.PID_LINE.search(line):
                self.pids[match.group(1)] = int(match.group(2))
            if (match := self.INSTANCE_LINE.search(line)) and match.group(1) not in self.instances:
                self.instances.append(match.group(1))

    def pid_of(self, role: str) -> int:
        self.scan_log()
        if role not in self.pids:
            raise LookupError(f"the log names no {role} pid: {self.log_path}")
        return self.pids[role]

    def log_tail(self, chars: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:]

    def members(self) -> list[int]:
        return process_group(self.pid)


@dataclass
class Incarnation:
    number: int
    service: Service
    up_at: float | None = None  # seconds since the clients started (negative: before)
    baseline: CoreMetrics | None = None  # metrics when healthy, before any client request
    killed_at: float | None = None
    exit_code: int | None = None
    exited_by_itself: bool | None = None
    leftover_pids: list[int] = field(default_factory=list)
    segments_at_exit: int | None = None
    segments_after_restart: int | None = None


class StartError(RuntimeError):
    pass


class Supervisor:
    """Starts the service and restarts it when it exits on its own, as systemd or Kubernetes would;
    kills its engine core when asked. Clients send only while ``up`` is set (set once /health
    answered 200, cleared just before a kill); ``epoch`` counts kills, so a client can tell whether
    a fault happened while its request was in flight."""

    HEALTH_TIMEOUT_S = 180.0
    STARTUP_FAILED = "Application startup failed"
    EXIT_TIMEOUT_S = 60.0
    GROUP_EXIT_TIMEOUT_S = 15.0

    def __init__(self, command: list[str], port: int, log_dir: Path):
        self.command, self.port, self.log_dir = command, port, log_dir
        self.origin = time.monotonic()  # the run's time zero (moved to when the clients start)
        self.base_url = f"http://127.0.0.1:{port}"
        self.http = httpx.AsyncClient(base_url=self.base_url, timeout=30)
        self.incarnations: list[Incarnation] = []
        self.up = asyncio.Event()
        self.epoch = 0
        self.gave_up = False  # a restart failed: the clients stop waiting for it
        self.down_since: float | None = None
        self.downtime = 0.0  # seconds without a healthy service after a kill (not counted as traffic time)
        self.notes: list[str] = []

    def clock(self) -> float:
        return time.monotonic() - self.origin

    def downtime_so_far(self) -> float:
        return self.downtime + (time.monotonic() - self.down_since if self.down_since is not None else 0.0)

    async def wait_serving(self) -> bool:
        """Until the service is up (True) or its restart failed (False): how clients retry."""
        while not self.up.is_set() and not self.gave_up:
            await asyncio.sleep(0.1)
        return self.up.is_set()

    @property
    def current(self) -> Incarnation:
        return self.incarnations[-1]

    def all_instances(self) -> list[str]:
        for incarnation in self.incarnations:
            incarnation.service.scan_log()
        return [i for incarnation in self.incarnations for i in incarnation.service.instances]

    async def start(self) -> Incarnation:
        number = len(self.incarnations)
        service = Service(self.command, self.log_dir / f"service-{number}.log")
        incarnation = Incarnation(number, service)
        self.incarnations.append(incarnation)
        await self._wait_healthy(service)
        service.scan_log()
        incarnation.baseline = await self.metrics()
        incarnation.up_at = self.clock()
        if self.down_since is not None:
            self.downtime, self.down_since = self.downtime_so_far(), None
        self.up.set()
        return incarnation

    async def _wait_healthy(self, service: Service) -> None:
        deadline = time.monotonic() + self.HEALTH_TIMEOUT_S
        while time.monotonic() < deadline:
            if service.poll() is not None:
                raise StartError(f"the service exited with {service.poll()} while starting:\n{service.log_tail()}")
            if self.STARTUP_FAILED in service.log_tail(400):
                raise StartError(f"the service failed to start (and has not exited):\n{service.log_tail()}")
            try:
                if (await self.http.get("/health", timeout=2)).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.25)
        raise StartError(f"the service was not healthy after {self.HEALTH_TIMEOUT_S}s:\n{service.log_tail()}")

    async def metrics(self) -> CoreMetrics:
        response = await self.http.get("/metrics")
        response.raise_for_status()
        return CoreMetrics.from_text(response.text)

    async def served_model(self) -> tuple[str, int]:
        """(the name clients send as ``model``, max_model_len) from /v1/models."""
        model = (await self.http.get("/v1/models")).json()["data"][0]
        return model["id"], int(model["max_model_len"])

    async def takes_images(self, model: str) -> bool:
        """Whether the served model accepts images (a text-only one answers them with 400). Asked
        through /tokenize, which builds the input without generating: no request counter moves."""
        return await self.takes(model, image_content(png_data_url((0,), 32, 32), "hi"))

    async def takes(self, model: str, content: list) -> bool:
        """Whether the served model accepts a message of ``content`` (asked through /tokenize)."""
        body = {"model": model, "messages": [{"role": "user", "content": content}]}
        response = await self.http.post("/tokenize", json=body)
        if response.status_code not in (200, 400):
            raise StartError(f"/tokenize of {content[0]['type']} answered {response.status_code}: "
                             f"{response.text[:300]}")
        return response.status_code == 200

    async def kill_engine_and_restart(self) -> None:
        """The fault: SIGKILL the engine core, expect the service to exit non-zero by itself,
        check what its process group and segments left, restart it on the same port."""
        dead = self.current
        self.up.clear()
        self.epoch += 1
        self.down_since = time.monotonic()
        engine_pid = dead.service.pid_of("engine core")
        dead.killed_at = self.clock()
        log(f"t={dead.killed_at:.1f}s: SIGKILL engine core pid {engine_pid}")
        os.kill(engine_pid, signal.SIGKILL)
        dead.exit_code, dead.exited_by_itself = await self._wait_exit(dead.service, self.EXIT_TIMEOUT_S)
        dead.leftover_pids = await self._wait_group_gone(dead.service)
        dead.segments_at_exit = segment_usage(dead.service.instances)[0]
        log(f"the service exited with {dead.exit_code}; restarting it on port {self.port}")
        try:
            restarted = await self.start()
        except StartError as error:
            self.notes.append(f"the restart failed: {error}")
            self.gave_up = True
            return
        dead.segments_after_restart = segment_usage(dead.service.instances)[0]
        log(f"t={restarted.up_at:.1f}s: healthy again (incarnation {restarted.number})")

    async def _wait_exit(self, service: Service, timeout: float) -> tuple[int, bool]:
        """(exit code, whether it exited within ``timeout``); past it the group is SIGKILLed."""
        deadline = time.monotonic() + timeout
        while service.poll() is None and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        if service.poll() is not None:
            return service.poll(), True
        self.notes.append(f"incarnation did not exit within {timeout}s; SIGKILLed its group")
        os.killpg(service.pid, signal.SIGKILL)
        return service.process.wait(10), False

    async def _wait_group_gone(self, service: Service) -> list[int]:
        """The group's processes still alive after a grace period (the workers exit on their own)."""
        deadline = time.monotonic() + self.GROUP_EXIT_TIMEOUT_S
        while service.members() and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        return service.members()

    async def stop(self) -> None:
        """SIGTERM the current incarnation: it should drain, unlink every segment and exit 0."""
        last = self.current
        self.up.clear()
        if last.service.poll() is None:
            last.service.process.send_signal(signal.SIGTERM)
        last.exit_code, last.exited_by_itself = await self._wait_exit(last.service, self.EXIT_TIMEOUT_S)
        last.leftover_pids = await self._wait_group_gone(last.service)
        last.segments_at_exit = segment_usage(last.service.instances)[0]
        await self.http.aclose()

    async def wait_idle(self, timeout: float = 60.0) -> CoreMetrics | None:
        """The metrics once nothing runs, waits or is leased and the finish counters stopped
        moving (aborts of closed streams land a moment after the close); None on timeout."""
        deadline, previous = time.monotonic() + timeout, None
        while time.monotonic() < deadline:
            try:
                current = await self.metrics()
            except httpx.HTTPError:
                return None
            if current.idle() and previous is not None and current.finished == previous.finished:
                return current
            previous = current if current.idle() else None
            await asyncio.sleep(0.5)
        return None

    def cleanup(self) -> None:
        """Last resort on an error: no incarnation outlives the script."""
        for incarnation in self.incarnations:
            if incarnation.service.poll() is None:
                try:
                    os.killpg(incarnation.service.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                incarnation.service.process.wait(10)


def log(message: str) -> None:
    print(f"[soak] {message}", file=sys.stderr, flush=True)


# -- the run --------------------------------------------------------------------------------------


@dataclass
class Run:
    """Everything the clients, the sampler and the supervisor share during one run."""

    args: argparse.Namespace
    supervisor: Supervisor
    factory: RequestFactory
    mix: TrafficMix
    tally: Tally = field(default_factory=Tally)
    samples: list[Sample] = field(default_factory=list)
    ended: float | None = None  # seconds since the start when the last client stopped

    @property
    def started(self) -> float:
        """time.monotonic() when the clients started: the run's time zero."""
        return self.supervisor.origin

    @property
    def deadline(self) -> float:
        """--duration seconds of traffic: time without a healthy service after a kill is added."""
        return self.started + self.args.duration + self.supervisor.downtime_so_far()


def new_client(run: Run) -> httpx.AsyncClient:
    timeout = httpx.Timeout(run.args.request_timeout, connect=10)
    return httpx.AsyncClient(base_url=run.supervisor.base_url, timeout=timeout)


async def client_loop(run: Run, client: int) -> None:
    """One client: send, classify, repeat until the deadline; wait while the service is down."""
    kinds, details = kind_rng(run.args.seed, client), detail_rng(run.args.seed, client)
    http, sequence, supervisor = new_client(run), 0, run.supervisor
    try:
        while time.monotonic() < run.deadline:
            if not supervisor.up.is_set():
                if not await supervisor.wait_serving():
                    break
                continue
            kind = run.mix.pick(kinds)
            spec = run.factory.build(kind, details, client, sequence)
            sequence += 1
            incarnation, epoch = supervisor.current.number, supervisor.epoch
            seen = await perform(http, spec)
            disturbed = supervisor.epoch != epoch or not supervisor.up.is_set()
            result, detail = classify(spec, seen, disturbed)
            run.tally.add(kind, result, None if disturbed else incarnation, detail)
            if result in (FAULT, UNEXPECTED):
                await http.aclose()  # no pooled connection to a dead process survives
                http = new_client(run)
                await asyncio.sleep(0.05 if result == FAULT else 0.2)
    finally:
        await http.aclose()


def take_sample(run: Run) -> Sample | None:
    service = run.supervisor.current.service
    if service.poll() is not None:
        return None  # down: nothing to measure
    service.scan_log()
    rss = {pid: rss_bytes(pid) for pid in service.members()}
    api, engine = rss.get(service.pid, 0), rss.get(service.pids.get("engine core"), 0)
    count, size = segment_usage(service.instances)
    return Sample(run.supervisor.clock(), run.supervisor.current.number, sum(rss.values()), api, engine,
                  sum(rss.values()) - api - engine, count, size, dev_shm_used())


async def sampler(run: Run, stop: asyncio.Event) -> None:
    """One sample a second, on the second, until ``stop``."""
    tick = 0
    while not stop.is_set():
        if (sample := take_sample(run)) is not None:
            run.samples.append(sample)
        tick += 1
        try:
            await asyncio.wait_for(stop.wait(), max(0.0, run.started + tick - time.monotonic()))
        except asyncio.TimeoutError:
            pass


async def inject_fault(run: Run) -> None:
    if run.args.kill_engine_at is None:
        return
    if run.args.kill_engine_at >= run.args.duration:
        run.supervisor.notes.append(f"--kill-engine-at {run.args.kill_engine_at} is not within the run: no kill")
        return
    await asyncio.sleep(max(0.0, run.started + run.args.kill_engine_at - time.monotonic()))
    await run.supervisor.kill_engine_and_restart()


def server_command(args: argparse.Namespace, port: int) -> list[str]:
    command = [sys.executable, "-m", "atb_plugin.server", "--model", args.model, "--host", "127.0.0.1",
               "--port", str(port), "--shutdown-timeout", "10"]
    if args.shm_budget and args.shm_budget != "0":
        command += ["--shm-budget-bytes", args.shm_budget]
    return command + shlex.split(args.server_args)


async def soak(args: argparse.Namespace) -> dict:
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="atb-soak-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    supervisor = Supervisor(server_command(args, port), port, log_dir)
    try:
        log(f"starting the service on port {port} (logs in {log_dir})")
        await supervisor.start()
        model, max_model_len = await supervisor.served_model()
        images = await supervisor.takes_images(model)
        video = await supervisor.takes(model, video_content(video_data_url(0), "hi"))
        audio = await supervisor.takes(model, [{"type": "input_audio", "input_audio": {
            "data": wav_base64(random.Random(0)), "format": "wav"}}])
        factory = RequestFactory(model, max_model_len, args.max_tokens, args.seed, takes_images=images,
                                 takes_video=video)
        mix = TrafficMix() if images else TrafficMix().text_only()
        untaken = (() if video else VIDEO_KINDS) + (() if audio else AUDIO_KINDS)
        run = Run(args, supervisor, factory, mix.as_text(untaken))
        if not images:
            log(f"{model} takes no images: the image kinds' share goes to text")
        if untaken:
            log(f"{model} takes no {' or '.join(k for k, taken in (('video', video), ('audio', audio)) if not taken)}: "
                "that share goes to text")
        supervisor.origin, supervisor.current.up_at = time.monotonic(), 0.0
        log(f"{args.clients} clients for {args.duration}s" +
            (f", engine core killed at {args.kill_engine_at}s" if args.kill_engine_at is not None else ""))
        stop_sampling = asyncio.Event()
        sampling = asyncio.create_task(sampler(run, stop_sampling))
        fault = asyncio.create_task(inject_fault(run))
        await asyncio.gather(*(client_loop(run, client) for client in range(args.clients)))
        await fault  # a restart under way finishes first
        run.ended = supervisor.clock()
        serving = supervisor.current.up_at is not None and supervisor.current.service.poll() is None
        idle = await supervisor.wait_idle() if serving else None
        stop_sampling.set()
        await sampling
        await supervisor.stop()
        return report(run, model, log_dir, idle)
    finally:
        supervisor.cleanup()


def report(run: Run, model: str, log_dir: Path, idle: CoreMetrics | None) -> dict:
    """Every number of the run as one JSON-ready dict, ``passed`` its verdict. ``idle``: the last
    incarnation's metrics once idle (None: it never got there)."""
    args, supervisor = run.args, run.supervisor
    final = supervisor.current
    outcomes = run.tally.by_incarnation[final.number]
    consistency = ({"idle_reached": False, "consistent": False} if idle is None else
                   {"idle_reached": True,
                    **check_consistency(outcomes[OK], outcomes[DISCONNECT], final.baseline, idle)})
    series = summarize_samples(run.samples, final, args.warmup, run.ended, series_tolerances(args.clients))
    service = service_report(supervisor)
    totals = run.tally.totals()
    checks = {
        "no_unexpected": totals[UNEXPECTED] == 0,
        "consistent": consistency["consistent"],
        **service_checks(supervisor, service),
        "flat": all(series[name]["flat"] is not False for name in JUDGED_SERIES),
    }
    return {
        "clients": args.clients, "duration_s": args.duration, "seed": args.seed, "model": model,
        "max_tokens": args.max_tokens, "kill_engine_at_s": args.kill_engine_at, "log_dir": str(log_dir),
        "takes_images": run.factory.takes_images, "takes_video": run.factory.takes_video,
        "mix": dict(run.mix.shares),
        "requests": {kind: {r: counts[r] for r in RESULTS} for kind, counts in sorted(run.tally.by_kind.items())},
        "totals": totals, "unexpected": totals[UNEXPECTED], "unexpected_examples": run.tally.unexpected_examples,
        "samples": len(run.samples), "series": series, "timeline": timeline(run.samples),
        "consistency": consistency, "service": service, "checks": checks, "passed": all(checks.values()),
    }


def service_report(supervisor: Supervisor) -> dict:
    """What happened to each incarnation, and what all of them left behind."""
    incarnations = supervisor.incarnations
    killed = [i for i in incarnations if i.killed_at is not None]
    instances = tuple("psm_" + i for i in supervisor.all_instances())
    return {
        "incarnations": len(incarnations), "restarts": len(incarnations) - 1,
        "engine_kills": len(killed), "engine_killed_at_s": [round(i.killed_at, 2) for i in killed],
        "exit_codes": [i.exit_code for i in incarnations],
        "exited_by_itself": [i.exited_by_itself for i in incarnations],
        "restarted_up_at_s": [None if i.up_at is None else round(i.up_at, 2) for i in incarnations[1:]],
        "dead_segments_at_exit": [i.segments_at_exit for i in killed],
        "dead_segments_after_restart": [i.segments_after_restart for i in killed],
        "leftover_processes": [pid for i in incarnations for pid in i.leftover_pids],
        "leftover_segments": [name for name in list_segment_names() if instances and name.startswith(instances)],
        "notes": supervisor.notes,
    }


def service_checks(supervisor: Supervisor, service: dict) -> dict[str, bool]:
    """A killed engine core: the service exits non-zero by itself and is restarted; the last
    incarnation exits 0 on SIGTERM; nothing of any incarnation is left."""
    final = supervisor.current
    killed = [i for i in supervisor.incarnations if i.killed_at is not None]
    return {
        "final_exit_0": final.exit_code == 0,
        "killed_exit_nonzero_by_itself": all(i.exit_code not in (0, None) and i.exited_by_itself for i in killed),
        "restarted_after_each_kill": len(supervisor.incarnations) == len(killed) + 1 and final.up_at is not None,
        "no_leftover_segments": not service["leftover_segments"],
        "no_leftover_processes": not service["leftover_processes"],
    }


def summarize_samples(samples: Sequence[Sample], final: Incarnation, warmup: float, ended: float,
                      tolerances: Mapping[str, Tolerance]) -> dict:
    """Each series' flatness over the final incarnation, from the end of its warm-up (``warmup``
    seconds after it came up, at most half of its share of the run) to the end."""
    mine = [s for s in samples if s.incarnation == final.number]
    up_at = final.up_at or 0.0
    window_start = up_at + min(warmup, max(0.0, ended - up_at) / 2)
    times = [s.t for s in mine]
    return {name: {**summarize_series(times, [getattr(s, name) for s in mine], window_start, tolerance),
                   "window_start_s": round(window_start, 1)}
            for name, tolerance in tolerances.items()}


def timeline(samples: Sequence[Sample], every_s: float = 10.0) -> list[dict]:
    """One sample per ``every_s`` seconds (the first at or after each mark, the last sample too):
    the shape of each series, small enough for the JSON line."""
    picked, mark = [], 0.0
    for sample in samples:
        if sample.t >= mark:
            picked.append(sample)
            mark = (sample.t // every_s + 1) * every_s
    if samples and (not picked or picked[-1] is not samples[-1]):
        picked.append(samples[-1])
    return [{**vars(sample), "t": round(sample.t, 1)} for sample in picked]


# -- output ---------------------------------------------------------------------------------------


def format_summary(result: dict) -> str:
    lines = [f"soak: {result['clients']} clients x {result['duration_s']} s, model {result['model']}, "
             f"seed {result['seed']}, max_tokens {result['max_tokens']}"
             + (f", engine core killed at {result['kill_engine_at_s']} s" if result["kill_engine_at_s"] is not None
                else ""),
             "", f"{'requests':<16}" + "".join(f"{r:>14}" for r in RESULTS)]
    for kind, counts in result["requests"].items():
        lines.append(f"{kind:<16}" + "".join(f"{counts[r]:>14}" for r in RESULTS))
    lines.append(f"{'total':<16}" + "".join(f"{result['totals'][r]:>14}" for r in RESULTS))
    lines += [f"  unexpected: {example}" for example in result["unexpected_examples"]]
    lines += ["", f"{'series':<16}{'start':>12}{'end':>12}{'max':>12}{'slope/min':>12}  flat   "
              f"(window from {next(iter(result['series'].values()))['window_start_s']} s, {result['samples']} samples)"]
    for name, s in result["series"].items():
        scale, unit = (1 << 20, " MiB") if name != "segments" else (1, "")
        cells = [s[key] / scale if s[key] is not None else float("nan")
                 for key in ("start", "end", "max", "slope_per_min")]
        lines.append(f"{name + unit:<16}" + "".join(f"{v:>12.1f}" for v in cells) + f"  {s['flat']}")
    names = list(result["series"])
    lines += ["", f"{'timeline t (s)':<16}" + "".join(f"{name:>14}" for name in names) + "  (MiB but segments)"]
    for point in result["timeline"]:
        cells = [point[name] if name == "segments" else point[name] / (1 << 20) for name in names]
        lines.append(f"{point['t']:<16}" + "".join(f"{cell:>14.1f}" for cell in cells)
                     + f"  incarnation {point['incarnation']}")
    c = result["consistency"]
    lines += ["", "consistency (last incarnation): " + ("idle not reached" if not c["idle_reached"] else
              ", ".join(f"{k}={v}" for k, v in c.items() if k not in ("numbers", "idle_reached")))]
    if c.get("numbers"):
        lines.append("  " + ", ".join(f"{k} {v:g}" for k, v in c["numbers"].items()))
    s = result["service"]
    lines += [f"service: {s['incarnations']} incarnation(s), exit codes {s['exit_codes']}, restarts {s['restarts']}, "
              f"dead segments at exit / after restart {s['dead_segments_at_exit']} / "
              f"{s['dead_segments_after_restart']}, leftover segments {len(s['leftover_segments'])}, "
              f"leftover processes {len(s['leftover_processes'])}"]
    lines += [f"note: {note}" for note in s["notes"]]
    failed = [name for name, ok in result["checks"].items() if not ok]
    lines.append("PASSED" if result["passed"] else f"FAILED: {', '.join(failed)}")
    return "\n".join(lines)


def default_model() -> str:
    from atb_plugin.testing.tiny import tiny_checkpoint

    return str(tiny_checkpoint("qwen2_vl"))


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--clients", type=int, default=64, help="concurrent streaming clients")
    p.add_argument("--duration", type=float, default=120.0, help="seconds of traffic")
    p.add_argument("--model", help="checkpoint directory; default: the tiny Qwen2-VL test checkpoint (it takes "
                                   "images; for a text-only model such as SmolLM2 the image kinds become text)")
    p.add_argument("--server-args", default="", help="extra flags for the service, one shell-quoted string")
    p.add_argument("--kill-engine-at", type=float, help="SIGKILL the engine core this many seconds in, then "
                                                        "restart the service (fault mode)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-tokens", type=int, default=32, help="max_tokens of the ordinary requests")
    p.add_argument("--warmup", type=float, default=60.0, help="seconds before the flatness window starts "
                                                               "(at most half the run)")
    p.add_argument("--shm-budget", default="16M", help="--shm-budget-bytes for the service (its image cache is "
                                                        "half of it); 0: the service's default (no budget)")
    p.add_argument("--request-timeout", type=float, default=120.0, help="seconds a request may take")
    p.add_argument("--log-dir", help="where the service's logs go (default: a new temp directory)")
    p.add_argument("--result-json", help="also write the result object to this file")
    args = p.parse_args(argv)
    if args.clients < 1 or args.duration <= 0 or args.max_tokens < 1:
        p.error("--clients, --duration and --max-tokens must be positive")
    args.model = args.model or default_model()
    return args


def main(argv: Sequence[str] | None = None) -> dict:
    """Run the soak, print the summary and (last line) the JSON object; returns the object."""
    args = parse_args(argv)
    try:
        result = asyncio.run(soak(args))
    except StartError as error:
        print(f"soak: {error}")
        result = {"passed": False, "error": str(error)[-2000:]}
        print(json.dumps(result), flush=True)
        return result
    print(format_summary(result))
    line = json.dumps(result)
    if args.result_json:
        Path(args.result_json).write_text(line + "\n")
    print(line, flush=True)
    return result


if __name__ == "__main__":
    sys.exit(0 if main()["passed"] else 1)
