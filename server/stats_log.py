"""One log line of engine stats every few seconds while the engine works, as vLLM's
`LoggingStatLogger`: what an operator tailing the log reads to see load and throughput without a
Prometheus server.

    Avg prompt throughput: 812.4 tokens/s, Avg generation throughput: 96.0 tokens/s, Running: 12
    reqs, Waiting: 3 reqs, KV cache usage: 41.3%, Prefix cache hit rate: 62.5%

Throughputs are the interval's (counter deltas over the time between two lines): prompt tokens
computed (prefix-cache hits are not, a preempted request's recomputed ones are, as in vLLM's line;
/metrics' prompt_tokens counts every choice's whole prompt) and tokens generated. The hit rate is
the interval's too (vLLM's is over its last thousand requests), "n/a" when no prompt was looked
up. vLLM's line says "GPU KV cache usage"; this one "KV cache usage" (the cache may be on the
CPU). Preemptions and, with speculative decoding, the draft acceptance rate are added when the
interval had any. An idle engine logs nothing: a line is written while requests run or wait, or
tokens were processed since the last line, and once more when it falls idle, so the last line
shows it at rest. `--no-log-stats` (vLLM's `--disable-log-stats`) turns the lines off.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from pagedserve.engine.outputs import EngineStats

logger = logging.getLogger(__name__)
INTERVAL_S = 10.0  # vLLM's default (VLLM_LOG_STATS_INTERVAL)


class StatsLine:
    """Turns successive `EngineStats` snapshots into log lines (`next_line`)."""

    def __init__(self, first: EngineStats, now: float) -> None:
        self._last, self._last_time, self._was_busy = first, now, False

    def next_line(self, stats: EngineStats, now: float) -> str | None:
        """The line for the interval since the last call, or None where the engine stayed idle."""
        last, elapsed = self._last, max(now - self._last_time, 1e-9)
        self._last, self._last_time = stats, now
        prompt = stats.num_prefilled_tokens - last.num_prefilled_tokens
        generated = stats.num_generation_tokens - last.num_generation_tokens
        busy = bool(prompt or generated or stats.num_requests_running or stats.num_requests_waiting)
        if not busy and not self._was_busy:
            return None
        self._was_busy = busy
        queries = stats.prefix_cache_queries - last.prefix_cache_queries
        hits = stats.prefix_cache_hits - last.prefix_cache_hits
        parts = [
            f"Avg prompt throughput: {prompt / elapsed:.1f} tokens/s",
            f"Avg generation throughput: {generated / elapsed:.1f} tokens/s",
            f"Running: {stats.num_requests_running} reqs",
            f"Waiting: {stats.num_requests_waiting} reqs",
            f"KV cache usage: {stats.kv_cache_usage:.1%}",
            f"Prefix cache hit rate: {hits / queries:.1%}"
            if queries
            else "Prefix cache hit rate: n/a",
        ]
        if preempted := stats.num_preemptions - last.num_preemptions:
            parts.append(f"Preemptions: {preempted}")
        if drafted := stats.spec_num_draft_tokens - last.spec_num_draft_tokens:
            accepted = stats.spec_num_accepted_tokens - last.spec_num_accepted_tokens
            parts.append(f"Draft acceptance rate: {accepted / drafted:.1%}")
        return ", ".join(parts)


async def log_stats_forever(
    read_stats: Callable[[], EngineStats],
    interval_s: float = INTERVAL_S,
    clock: Callable[[], float] = time.monotonic,
) -> None:
    """Logs `StatsLine`'s lines every `interval_s` until cancelled (the app's lifespan task)."""
    line = StatsLine(read_stats(), clock())
    while True:
        await asyncio.sleep(interval_s)
        text = line.next_line(read_stats(), clock())
        if text is not None:
            logger.info(text)
