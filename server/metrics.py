"""Prometheus metrics under `pagedserve:`, named and meant as vLLM's V1 metrics, each labelled with
`model_name`, in a registry owned by one app (never the process-global one).

Engine gauges and counters are read from `engine.stats()` at scrape time by a custom collector, so
they can never go stale (e.g. after cancellations). Per-request histograms and the finish-reason
counters are observed by the server as requests run (see `server.recorder`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    InfoMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from pagedserve.engine.outputs import EngineStats, RequestTimings
from pagedserve.server.metrics_aliases import VllmAliasCollector

PREFIX = "pagedserve:"
FINISH_REASONS = ("stop", "length", "abort", "error")

# Buckets as vLLM's, so dashboards built for it read ours.
_TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
_GRAMMAR_MASK_BUCKETS = (0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1)
_TOKEN_LATENCY_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
_REQUEST_LATENCY_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)


def _token_count_buckets(max_value: int) -> tuple[float, ...]:
    """1, 2, 5, 10, 20, 50, ... up to `max_value` (vLLM's build_1_2_5_buckets)."""
    buckets: list[float] = []
    exponent = 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > max_value:
                return tuple(buckets)
            buckets.append(value)
        exponent += 1


class EngineStatsCollector(Collector):
    """Engine gauges, counters and the cache-config info, from one stats snapshot per scrape."""

    _GAUGES = (
        ("num_requests_running", "Number of requests in model execution batches."),
        ("num_requests_waiting", "Number of requests waiting to be processed."),
        ("num_requests_swapped", "Number of requests swapped to host memory."),
        ("kv_cache_usage_perc", "KV-cache usage; 1 means 100 percent usage."),
        ("num_free_blocks", "Number of free KV-cache blocks."),
        ("num_used_blocks", "Number of KV-cache blocks held by requests."),  # for dashboards
    )
    _COUNTERS = (
        ("num_preemptions", "Cumulative number of preemptions from the engine."),
        ("prompt_tokens", "Number of prefill tokens processed."),
        ("generation_tokens", "Number of generation tokens processed."),
        ("prefix_cache_queries", "Prefix-cache queries, in number of queried tokens."),
        ("prefix_cache_hits", "Prefix-cache hits, in number of cached tokens."),
        ("structured_output_requests", "Requests admitted with an output constraint."),
        ("spec_decode_num_drafts", "Number of spec decoding drafts."),
        ("spec_decode_num_draft_tokens", "Number of draft tokens."),
        ("spec_decode_num_accepted_tokens", "Number of accepted tokens."),
    )

    def __init__(self, read_stats: Callable[[], EngineStats], model_name: str) -> None:
        self.read_stats = read_stats
        self.model_name = model_name

    @staticmethod
    def _values(stats: EngineStats) -> dict[str, float]:
        return {
            "num_requests_running": stats.num_requests_running,
            "num_requests_waiting": stats.num_requests_waiting,
            "num_requests_swapped": stats.num_requests_swapped,
            "kv_cache_usage_perc": stats.kv_cache_usage,
            "num_free_blocks": stats.num_free_blocks,
            "num_used_blocks": stats.num_total_blocks - stats.num_free_blocks,
            "num_preemptions": stats.num_preemptions,
            "prompt_tokens": stats.num_prompt_tokens,
            "generation_tokens": stats.num_generation_tokens,
            "prefix_cache_queries": stats.prefix_cache_queries,
            "prefix_cache_hits": stats.prefix_cache_hits,
            "structured_output_requests": stats.num_structured_requests,
            "spec_decode_num_drafts": stats.spec_num_drafts,
            "spec_decode_num_draft_tokens": stats.spec_num_draft_tokens,
            "spec_decode_num_accepted_tokens": stats.spec_num_accepted_tokens,
        }

    def collect(self) -> Iterator[Metric]:
        stats = self.read_stats()
        values = self._values(stats)
        labels = [self.model_name]
        for name, documentation in self._GAUGES:
            gauge = GaugeMetricFamily(PREFIX + name, documentation, labels=["model_name"])
            gauge.add_metric(labels, values[name])
            yield gauge
        for name, documentation in self._COUNTERS:  # exposed as <name>_total
            counter = CounterMetricFamily(PREFIX + name, documentation, labels=["model_name"])
            counter.add_metric(labels, values[name])
            yield counter
        per_position = CounterMetricFamily(
            PREFIX + "spec_decode_num_accepted_tokens_per_pos",
            "Accepted tokens per draft position.",
            labels=["model_name", "position"],
        )
        for position, count in enumerate(stats.spec_num_accepted_per_position):
            per_position.add_metric([self.model_name, str(position)], count)
        yield per_position
        info = InfoMetricFamily(
            PREFIX + "cache_config", "Information of the KV-cache config.", labels=["model_name"]
        )
        info.add_metric(
            labels,
            {
                "block_size": str(stats.block_size),
                "num_blocks": str(stats.num_total_blocks),
                "cache_dtype": stats.cache_dtype,
            },
        )
        yield info


class ServerMetrics:
    """All metrics of one app; `render()` produces the /metrics body."""

    def __init__(
        self,
        model_name: str,
        read_stats: Callable[[], EngineStats],
        drain_step_token_counts: Callable[[], list[int]],
        max_model_len: int,
        drain_grammar_mask_times: Callable[[], list[float]] = list,
    ) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(EngineStatsCollector(read_stats, model_name))
        self.registry.register(VllmAliasCollector(read_stats, model_name))  # for routers, HPAs
        self.drain_step_token_counts = drain_step_token_counts
        self.drain_grammar_mask_times = drain_grammar_mask_times
        self.model_name = model_name

        def histogram(name: str, documentation: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(
                PREFIX + name,
                documentation,
                ["model_name"],
                buckets=buckets,
                registry=self.registry,
            )

        token_buckets = _token_count_buckets(max_model_len)
        self._histograms = {
            "ttft": histogram(
                "time_to_first_token_seconds",
                "Time from arrival at the server (tokenization included) to the first token.",
                _TTFT_BUCKETS,
            ),
            "itl": histogram(
                "inter_token_latency_seconds",
                "Time between consecutive tokens.",
                _TOKEN_LATENCY_BUCKETS,
            ),
            "tpot": histogram(
                "request_time_per_output_token_seconds",
                "Mean time per output token after the first, per request.",
                _TOKEN_LATENCY_BUCKETS,
            ),
            "e2e": histogram(
                "e2e_request_latency_seconds",
                "End-to-end request latency.",
                _REQUEST_LATENCY_BUCKETS,
            ),
            "queue": histogram(
                "request_queue_time_seconds",
                "Time spent waiting to be scheduled.",
                _REQUEST_LATENCY_BUCKETS,
            ),
            "prefill": histogram(
                "request_prefill_time_seconds", "Time spent in prefill.", _REQUEST_LATENCY_BUCKETS
            ),
            "decode": histogram(
                "request_decode_time_seconds", "Time spent in decode.", _REQUEST_LATENCY_BUCKETS
            ),
            "prompt_tokens": histogram(
                "request_prompt_tokens", "Prompt tokens per request.", token_buckets
            ),
            "generation_tokens": histogram(
                "request_generation_tokens", "Generated tokens per request.", token_buckets
            ),
            "iteration_tokens": histogram(
                "iteration_tokens_total",
                "Tokens scheduled per step.",
                _token_count_buckets(max(16384, max_model_len)),
            ),
            "grammar_mask": histogram(
                "grammar_bitmask_seconds",
                "Time per step filling and applying structured-output token masks.",
                _GRAMMAR_MASK_BUCKETS,
            ),
        }
        success = Counter(
            PREFIX + "request_success",
            "Finished requests, by finish reason.",
            ["model_name", "finished_reason"],
            registry=self.registry,
        )
        # Every reason is exported from the start, so rate() works before the first abort.
        self._success = {reason: success.labels(model_name, reason) for reason in FINISH_REASONS}
        self._aborted = Counter(
            PREFIX + "request_aborted",
            "Requests aborted before finishing.",
            ["model_name"],
            registry=self.registry,
        ).labels(model_name)

    def observe(self, name: str, value: float) -> None:
        self._histograms[name].labels(self.model_name).observe(value)

    def count_finished(self, finish_reason: str) -> None:
        reason = finish_reason if finish_reason in self._success else "error"
        self._success[reason].inc()
        if reason == "abort":
            self._aborted.inc()

    def observe_timings(self, timings: RequestTimings) -> None:
        """Queue, prefill and decode times from the engine's timestamps of one request."""
        if timings.first_scheduled_time is not None:
            self.observe("queue", timings.first_scheduled_time - timings.arrival_time)
            if timings.first_token_time is not None:
                self.observe("prefill", timings.first_token_time - timings.first_scheduled_time)
        if timings.first_token_time is not None:
            self.observe("decode", timings.finished_time - timings.first_token_time)

    def render(self) -> bytes:
        for num_tokens in self.drain_step_token_counts():
            self.observe("iteration_tokens", num_tokens)
        for seconds in self.drain_grammar_mask_times():
            self.observe("grammar_mask", seconds)
        return generate_latest(self.registry)
