"""Prometheus metrics for ``/metrics``, under vLLM's names so vLLM's dashboards and alerts work.

Every series carries the label ``model_name`` (the served model name); under data parallelism the
engines' scheduler series and ``vllm:request_success_total`` also carry ``engine`` (the engine
core's index, as vLLM's do; a request no engine core answered, refused or aborted while its input
was prepared, counts under engine 0). Counters are exposed with
prometheus_client's ``_total`` suffix (``vllm:prompt_tokens`` -> ``vllm:prompt_tokens_total``,
as vLLM's are) plus its ``_created`` companion series. Histogram buckets are vLLM's.

``vllm:kv_cache_usage_perc`` is a fraction in [0, 1], as in vLLM despite its name.

Speculative decoding adds vLLM's ``vllm:spec_decode_num_drafts``, ``_num_draft_tokens``,
``_num_accepted_tokens`` and ``_num_accepted_tokens_per_pos`` (label ``position``), labelled
``engine``, from an engine's first verified drafts on.

Our own gauges use the ``atb_plugin:`` prefix: live shared-memory segments and bytes (the
multimodal transport), the tokenizer workers' queue depth, and the requests aborted by a timeout
(``atb_plugin:request_timeouts_total{kind="request"|"token"}``).
"""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4, generate_latest

__all__ = ["ServerMetrics", "FINISH_REASONS"]

# The engine's finish reasons (RequestStatus values); pre-created so rate() has data from the start.
FINISH_REASONS = ("stop", "length", "abort", "error")
TIMEOUT_KINDS = ("request", "token")

# vLLM's buckets (vllm/v1/metrics/loggers.py).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                           120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


def build_1_2_5_buckets(max_value: int) -> list[int]:
    """vLLM's token-count buckets: 1, 2, 5, 10, 20, 50, ... up to ``max_value``."""
    buckets, exponent = [], 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > max_value:
                return buckets
            buckets.append(value)
        exponent += 1


class ServerMetrics:
    """All of the service's metrics in a registry of its own (not prometheus_client's global
    one, so several servers or tests can live in one process).

    Token counts and latencies can be recorded as they happen (``add_tokens``,
    ``observe_time_to_first_token``, ``observe_inter_token_latencies``) or once per finished
    request through ``record_finished``'s arguments; a caller uses one way for each, not both."""

    def __init__(self, model_name: str, max_model_len: int = 4096, engines: int = 1):
        self.model_name = model_name
        self.registry = CollectorRegistry(auto_describe=True)
        labels = ["model_name"]
        r = self.registry

        # The label ``engine`` (as vLLM's) under data parallelism; one engine keeps the series
        # without it that dashboards already read. _engine_values[i]: engine i's label values.
        engine_label = [] if engines == 1 else ["engine"]
        self._engine_values = [[]] if engines == 1 else [[str(i)] for i in range(engines)]

        def per_engine(kind, name, doc) -> list:
            """One child per engine core."""
            metric = kind(name, doc, labels + engine_label, registry=r)
            return [metric.labels(model_name, *values) for values in self._engine_values]

        def gauge(name, doc):
            return Gauge(name, doc, labels, registry=r).labels(model_name)

        def counter(name, doc):
            return Counter(name, doc, labels, registry=r).labels(model_name)

        def histogram(name, doc, buckets):
            return Histogram(name, doc, labels, buckets=buckets, registry=r).labels(model_name)

        self.num_requests_running = per_engine(Gauge, "vllm:num_requests_running",
                                               "Number of requests in model execution batches.")
        self.num_requests_waiting = per_engine(Gauge, "vllm:num_requests_waiting",
                                               "Number of requests waiting to be processed.")
        self.kv_cache_usage = per_engine(Gauge, "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        self.prefix_cache_queries = per_engine(
            Counter, "vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.")
        self.prefix_cache_hits = per_engine(
            Counter, "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.")
        self.external_prefix_cache_queries = per_engine(
            Counter, "vllm:external_prefix_cache_queries",
            "External prefix cache queries from KV connector cross-instance cache sharing, in terms of number of "
            "queried tokens.")
        self.external_prefix_cache_hits = per_engine(
            Counter, "vllm:external_prefix_cache_hits",
            "External prefix cache hits from KV connector cross-instance cache sharing, in terms of number of "
            "cached tokens.")
        self._kv_transfer: dict | None = None  # add_kv_transfer's series, made with a connector's first stats
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens", "Number of generation tokens processed.")
        # vLLM labels it per engine too (issue 45).
        success = Counter("vllm:request_success", "Count of successfully processed requests.",
                          labels + ["finished_reason"] + engine_label, registry=r)
        self._request_success = success
        for reason in FINISH_REASONS:
            for values in self._engine_values:
                success.labels(model_name, reason, *values)
        self.time_to_first_token = histogram(
            "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", TTFT_BUCKETS)
        self.inter_token_latency = histogram(
            "vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", ITL_BUCKETS)
        self.e2e_request_latency = histogram(
            "vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", REQUEST_LATENCY_BUCKETS)
        self.request_queue_time = histogram(
            "vllm:request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.",
            REQUEST_LATENCY_BUCKETS)
        token_buckets = build_1_2_5_buckets(max(1, max_model_len))
        self.request_prompt_tokens = histogram(
            "vllm:request_prompt_tokens", "Number of prefill tokens processed.", token_buckets)
        self.request_generation_tokens = histogram(
            "vllm:request_generation_tokens", "Number of generation tokens processed.", token_buckets)
        self.shm_live_segments = gauge("atb_plugin:shm_live_segments", "Shared-memory segments alive in this instance.")
        self.shm_live_bytes = gauge("atb_plugin:shm_live_bytes",
                                    "Bytes held by this instance's live shared-memory segments.")
        self.shm_leased_segments = gauge(
            "atb_plugin:shm_leased_segments", "Live segments leased to running requests (the rest are cache).")
        self.tokenizer_queue_depth = gauge(
            "atb_plugin:tokenizer_queue_depth", "Requests waiting for or in the tokenizer workers.")
        timeouts = Counter("atb_plugin:request_timeouts", "Requests aborted by --request-timeout (kind request) or "
                           "--token-timeout (kind token).", labels + ["kind"], registry=r)
        self._request_timeouts = timeouts
        self._spec: dict | None = None  # add_spec_decoding's counters, made with the first drafts
        for kind in TIMEOUT_KINDS:
            timeouts.labels(model_name, kind)

    # -- engine state ------------------------------------------------------------------------------

    def set_scheduler_stats(self, running: int, waiting: int, kv_usage: float, engine: int = 0) -> None:
        """``kv_usage``: the fraction of KV-cache blocks in use, in [0, 1]."""
        self.num_requests_running[engine].set(running)
        self.num_requests_waiting[engine].set(waiting)
        self.kv_cache_usage[engine].set(kv_usage)

    def _engine_counters(self, prefix: str, docs) -> dict:
        """Counters ``prefix + name`` labelled ``engine``, made when an engine first reports them
        (an engine without the feature exposes none)."""
        return {name: Counter(f"{prefix}{name}", doc, ["model_name", "engine"], registry=self.registry)
                for name, doc in docs}

    def add_spec_decoding(self, stats, engine: int = 0) -> None:
        """Engine ``engine``'s speculative decoding since its last stats (a ``SpecDecodingStats``,
        or None: no drafts verified). vLLM's counters, registered with the first drafts (an
        engine without speculative decoding exposes none); per position, labelled ``position``."""
        if stats is None:
            return
        if self._spec is None:
            self._spec = self._engine_counters("vllm:spec_decode_", (
                ("num_drafts", "Number of spec decoding drafts."),
                ("num_draft_tokens", "Number of draft tokens."),
                ("num_accepted_tokens", "Number of accepted tokens.")))
            self._spec["num_accepted_tokens_per_pos"] = Counter(
                "vllm:spec_decode_num_accepted_tokens_per_pos", "Accepted tokens per draft position.",
                ["model_name", "engine", "position"], registry=self.registry)
        engine_label = str(engine)
        for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
            self._spec[name].labels(self.model_name, engine_label).inc(getattr(stats, name))
        per_pos = self._spec["num_accepted_tokens_per_pos"]
        for position, count in enumerate(stats.num_accepted_tokens_per_pos):
            per_pos.labels(self.model_name, engine_label, str(position)).inc(count)

    def add_kv_transfer(self, queries: int, hits: int, stats, engine: int = 0) -> None:
        """Engine ``engine``'s KV connector since its last stats: tokens asked of it and delivered
        (vLLM's external_prefix_cache_*), and its transfers (a ``KVTransferStats``; None: no
        connector, and then no ``atb_plugin:kv_*`` series at all)."""
        if queries:
            self.external_prefix_cache_queries[engine].inc(queries)
        if hits:
            self.external_prefix_cache_hits[engine].inc(hits)
        if stats is None:
            return
        if self._kv_transfer is None:
            self._kv_transfer = self._engine_counters("atb_plugin:kv_", (
                ("loads", "KV blocks loaded into the device cache by the KV connector (offload tier hits, PD pulls)."),
                ("saves", "KV blocks saved out of the device cache by the KV connector."),
                ("bytes_loaded", "Bytes of KV loaded into the device cache by the KV connector."),
                ("bytes_saved", "Bytes of KV saved out of the device cache by the KV connector."),
                ("load_seconds", "Seconds spent loading KV through the KV connector."),
                ("save_seconds", "Seconds spent saving KV through the KV connector."),
                ("failed_loads", "Requests whose KV load failed (recomputed or failed by kv_load_failure_policy).")))
            self._kv_transfer["tier_bytes"] = Gauge("atb_plugin:kv_offload_tier_bytes",
                                                    "Bytes of KV held by each offload tier now.",
                                                    ["model_name", "engine", "tier"], registry=self.registry)
        engine_label = str(engine)
        for name, field_name in (("loads", "num_loads"), ("saves", "num_saves"), ("bytes_loaded", "bytes_loaded"),
                                 ("bytes_saved", "bytes_saved"), ("load_seconds", "load_seconds"),
                                 ("save_seconds", "save_seconds"), ("failed_loads", "num_failed_loads")):
            value = getattr(stats, field_name)
            if value:
                self._kv_transfer[name].labels(self.model_name, engine_label).inc(value)
        for tier, nbytes in stats.tier_bytes.items():
            self._kv_transfer["tier_bytes"].labels(self.model_name, engine_label, tier).set(nbytes)

    def add_prefix_cache(self, queries: int, hits: int, engine: int = 0) -> None:
        """Tokens looked up in engine ``engine``'s prefix cache and tokens found, since its last call."""
        if queries:
            self.prefix_cache_queries[engine].inc(queries)
        if hits:
            self.prefix_cache_hits[engine].inc(hits)

    def set_shm(self, segments: int, nbytes: int, leased_segments: int = 0) -> None:
        self.shm_live_segments.set(segments)
        self.shm_live_bytes.set(nbytes)
        self.shm_leased_segments.set(leased_segments)

    def set_tokenizer_queue_depth(self, n: int) -> None:
        self.tokenizer_queue_depth.set(n)

    # -- requests ----------------------------------------------------------------------------------

    def add_tokens(self, prompt_tokens: int = 0, generation_tokens: int = 0) -> None:
        if prompt_tokens:
            self.prompt_tokens.inc(prompt_tokens)
        if generation_tokens:
            self.generation_tokens.inc(generation_tokens)

    def observe_time_to_first_token(self, seconds: float) -> None:
        self.time_to_first_token.observe(seconds)

    def observe_inter_token_latencies(self, seconds: Iterable[float]) -> None:
        for value in seconds:
            self.inter_token_latency.observe(value)

    def record_finished(self, finish_reason: str, *, e2e: float, queue_time: float | None = None,
                        prompt_tokens: int | None = None, generation_tokens: int | None = None,
                        ttft: float | None = None, itls: Iterable[float] = (), count_tokens: bool = True,
                        engine: int = 0) -> None:
        """One finished request: ``vllm:request_success_total{finished_reason}`` (and ``engine``,
        the engine core that ran it, under data parallelism), its end-to-end
        and queue times, and its prompt / output lengths (``vllm:request_*_tokens`` histograms).
        The lengths are also added to ``vllm:prompt_tokens`` / ``vllm:generation_tokens`` unless
        ``count_tokens`` is False (for a caller that counts them with ``add_tokens`` as they are
        processed); ``ttft`` / ``itls``, when given, go to their histograms."""
        values = self._engine_values[engine] if len(self._engine_values) > 1 else []
        self._request_success.labels(self.model_name, finish_reason, *values).inc()
        self.e2e_request_latency.observe(e2e)
        if queue_time is not None:
            self.request_queue_time.observe(queue_time)
        if prompt_tokens is not None:
            self.request_prompt_tokens.observe(prompt_tokens)
        if generation_tokens is not None:
            self.request_generation_tokens.observe(generation_tokens)
        if count_tokens:
            self.add_tokens(prompt_tokens or 0, generation_tokens or 0)
        if ttft is not None:
            self.observe_time_to_first_token(ttft)
        self.observe_inter_token_latencies(itls)

    def record_timeout(self, kind: str) -> None:
        """A request aborted for its time limit: ``kind`` "request" (the whole request) or "token"
        (the wait for a token); it is also counted as finished with reason "abort"."""
        self._request_timeouts.labels(self.model_name, kind).inc()

    # -- exposition --------------------------------------------------------------------------------

    def render(self, accept: str | None = None) -> tuple[bytes, str]:
        """``(body, content_type)`` for ``/metrics``, in the Prometheus text format 0.0.4 whatever
        the scraper's ``Accept`` header (``accept``) asks for: prometheus_client's OpenMetrics
        encoder rewrites the colon in sample names (``vllm:x`` -> ``vllm_x``) while keeping it in
        ``# TYPE`` lines, which breaks vLLM's names; every Prometheus version reads the text
        format."""
        return generate_latest(self.registry), CONTENT_TYPE_PLAIN_0_0_4
