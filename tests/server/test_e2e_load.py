"""End to end under load: `python -m pagedserve.server serve` with the real default model on 127.0.0.1.

/metrics exposes every metric and its counters move; a streaming client that disconnects frees its
KV blocks (and counts as aborted); 64 concurrent streams all end with `[DONE]` and a finish reason
while /health keeps answering fast. One server per module, started without an API key; torch runs
one thread (`OMP_NUM_THREADS=1` unless set), see test_e2e_openai.py.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pagedserve.configs.engine import DEFAULT_MODEL
from tests.server_process import REPO_ROOT, ServerProcess

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

REQUEST_TIMEOUT_S = 120
NUM_KV_BLOCKS = 256
BLOCK_SIZE = 16
NUM_CONCURRENT_STREAMS = 64
MAX_HEALTH_LATENCY_S = 1.0
PREFIX = "pagedserve:"
# Every metric, by sample name (counters with `_total`, histograms by their family name).
METRIC_NAMES = (
    "num_requests_running",
    "num_requests_waiting",
    "num_requests_swapped",
    "kv_cache_usage_perc",
    "num_free_blocks",
    "num_preemptions_total",
    "prompt_tokens_total",
    "generation_tokens_total",
    "request_success_total",
    "prefix_cache_queries_total",
    "prefix_cache_hits_total",
    "request_aborted_total",
    "time_to_first_token_seconds",
    "inter_token_latency_seconds",
    "request_time_per_output_token_seconds",
    "e2e_request_latency_seconds",
    "request_queue_time_seconds",
    "request_prefill_time_seconds",
    "request_decode_time_seconds",
    "request_prompt_tokens",
    "request_generation_tokens",
    "iteration_tokens_total",
    "cache_config_info",
)


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    server = ServerProcess(
        "--max-model-len",
        "1024",
        "--num-kv-blocks",
        str(NUM_KV_BLOCKS),
        "--block-size",
        str(BLOCK_SIZE),
    )
    yield server.url
    server.stop()


def _scrape(url: str) -> dict[str, float]:
    """Every sample of /metrics as {'name{label=value,...}': value}, labels sorted, model omitted."""
    response = httpx.get(f"{url}/metrics", timeout=REQUEST_TIMEOUT_S)
    assert response.status_code == 200
    samples = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            labels = ",".join(
                f"{key}={value}"
                for key, value in sorted(sample.labels.items())
                if key != "model_name"
            )
            name = sample.name.removeprefix(PREFIX)
            samples[f"{name}{{{labels}}}" if labels else name] = sample.value
    return samples


def _wait_for(url: str, condition: Any, timeout_s: float) -> dict[str, float]:
    """Scrape until `condition(samples)` holds; fail with the last samples after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        samples = _scrape(url)
        if condition(samples):
            return samples
        assert time.monotonic() < deadline, {k: v for k, v in samples.items() if "bucket" not in k}
        time.sleep(0.2)


def _is_idle(samples: dict[str, float]) -> bool:
    return (
        samples["num_requests_running"] == 0
        and samples["num_requests_waiting"] == 0
        and samples["num_free_blocks"] == NUM_KV_BLOCKS
    )


def test_metrics_parse_and_expose_every_metric_with_the_cache_config(url):
    response = httpx.get(f"{url}/metrics", timeout=REQUEST_TIMEOUT_S)
    assert response.headers["content-type"].startswith("text/plain")
    families = list(text_string_to_metric_families(response.text))
    names = {family.name.removeprefix(PREFIX) for family in families} | {
        sample.name.removeprefix(PREFIX) for family in families for sample in family.samples
    }
    assert [name for name in METRIC_NAMES if name not in names] == []
    (info,) = [
        sample
        for family in families
        for sample in family.samples
        if sample.name == PREFIX + "cache_config_info"
    ]
    assert info.value == 1
    assert info.labels["block_size"] == str(BLOCK_SIZE)
    assert info.labels["num_blocks"] == str(NUM_KV_BLOCKS)
    assert info.labels["cache_dtype"] == "float32"  # auto: the weights' dtype
    assert all(
        sample.labels.get("model_name")
        for family in families
        for sample in family.samples
        if family.name.startswith(PREFIX)
    )


def test_a_completion_moves_the_token_and_success_counters(url):
    before = _wait_for(url, _is_idle, timeout_s=30)
    response = httpx.post(
        f"{url}/v1/completions",
        timeout=REQUEST_TIMEOUT_S,
        json={
            "prompt": "The capital of France is",
            "max_tokens": 4,
            "temperature": 0,
            "ignore_eos": True,
        },
    )
    usage = response.json()["usage"]
    after = _wait_for(url, _is_idle, timeout_s=30)

    def delta(name: str) -> float:
        return after[name] - before.get(name, 0)  # histograms have no samples until observed

    # The server is idle before and after: the counters moved by exactly this request's tokens.
    assert delta("generation_tokens_total") == usage["completion_tokens"] == 4
    assert delta("prompt_tokens_total") == usage["prompt_tokens"]
    assert delta("request_success_total{finished_reason=length}") == 1
    assert delta("prefix_cache_queries_total") == usage["prompt_tokens"]
    for histogram in (
        "time_to_first_token_seconds",
        "e2e_request_latency_seconds",
        "request_queue_time_seconds",
        "request_prefill_time_seconds",
        "request_decode_time_seconds",
        "request_prompt_tokens",
        "request_generation_tokens",
        "request_time_per_output_token_seconds",
    ):
        assert delta(f"{histogram}_count") == 1, histogram
    assert delta("inter_token_latency_seconds_count") == 3
    assert delta("request_generation_tokens_sum") == 4
    assert delta("iteration_tokens_total_count") >= 4  # one per engine step


def test_disconnecting_a_stream_frees_its_blocks_and_counts_an_abort(url):
    before = _wait_for(url, _is_idle, timeout_s=30)
    body = {"prompt": "Once upon a time", "max_tokens": 900, "ignore_eos": True, "stream": True}
    with httpx.stream(
        "POST", f"{url}/v1/completions", json=body, timeout=REQUEST_TIMEOUT_S
    ) as response:
        lines = response.iter_lines()
        events = [line for line in (next(lines) for _ in range(8)) if line.startswith("data: ")]
        assert len(events) >= 3 and "[DONE]" not in events[-1]
        during = _scrape(url)
        assert during["num_requests_running"] == 1
        assert during["num_free_blocks"] < NUM_KV_BLOCKS
    # Closing the response closed the connection mid-stream.
    disconnected_at = time.monotonic()
    after = _wait_for(url, _is_idle, timeout_s=10)
    assert time.monotonic() - disconnected_at < 10
    assert after["request_aborted_total"] - before["request_aborted_total"] == 1
    assert (
        after["request_success_total{finished_reason=abort}"]
        - before["request_success_total{finished_reason=abort}"]
    ) == 1
    assert after["kv_cache_usage_perc"] == 0


def _check_raw_sse(text: str) -> str:
    """Checks one raw SSE body; returns the finish reason of its (single) choice."""
    events = [event for event in text.split("\n\n") if event]
    assert events and all(event.startswith("data: ") for event in events), text[-500:]
    assert events[-1] == "data: [DONE]", text[-500:]
    assert text.endswith("data: [DONE]\n\n")
    finish_reasons = []
    for event in events[:-1]:
        payload = json.loads(event.removeprefix("data: "))
        assert "error" not in payload, payload
        finish_reasons += [
            choice["finish_reason"]
            for choice in payload["choices"]
            if choice["finish_reason"] is not None
        ]
    assert len(finish_reasons) == 1, finish_reasons
    return finish_reasons[0]


async def _raw_stream(http: httpx.AsyncClient, url: str, index: int) -> str:
    if index % 4 == 0:
        path, body = (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": f"Tell me about the number {index}."}]},
        )
    else:
        path, body = "/v1/completions", {"prompt": f"Request {index}: once upon a time"}
    body |= {"max_tokens": 16 + index % 9, "temperature": 0.8, "seed": index, "stream": True}
    response = await http.post(url + path, json=body)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/event-stream")
    return _check_raw_sse(response.text)


async def _openai_stream(client: openai.AsyncOpenAI, index: int) -> str:
    stream = await client.completions.create(
        model=DEFAULT_MODEL,
        prompt=f"Story {index}:",
        max_tokens=16 + index % 9,
        temperature=0.8,
        seed=index,
        stream=True,
    )
    finish_reasons = [
        choice.finish_reason
        async for chunk in stream
        for choice in chunk.choices
        if choice.finish_reason is not None
    ]
    assert len(finish_reasons) == 1, finish_reasons
    return finish_reasons[0]


async def _run_streams(url: str) -> list[Any]:
    limits = httpx.Limits(max_connections=NUM_CONCURRENT_STREAMS)
    timeout = httpx.Timeout(REQUEST_TIMEOUT_S)
    async with (
        httpx.AsyncClient(limits=limits, timeout=timeout) as http,
        openai.AsyncOpenAI(
            base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=REQUEST_TIMEOUT_S
        ) as client,
    ):
        return await asyncio.gather(
            *[
                _raw_stream(http, url, index) if index % 2 == 0 else _openai_stream(client, index)
                for index in range(NUM_CONCURRENT_STREAMS)
            ],
            return_exceptions=True,
        )


def test_64_concurrent_streams_end_with_done_while_health_stays_fast(url):
    before = _wait_for(url, _is_idle, timeout_s=30)
    # /health is polled from a process of its own (tests/health_prober.py says why).
    prober = subprocess.Popen(
        [sys.executable, "-m", "tests.health_prober", url],
        cwd=REPO_ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert prober.stdout is not None and prober.stdout.readline() == "ready\n"
    started = time.monotonic()
    try:
        results = asyncio.run(_run_streams(url))
        elapsed_s = time.monotonic() - started
    finally:
        output, _ = prober.communicate(timeout=30)  # closing its stdin stops it
    assert prober.returncode == 0, output
    health_latencies = json.loads(output)
    print(
        f"{NUM_CONCURRENT_STREAMS} streams in {elapsed_s:.1f}s; /health: "
        f"{len(health_latencies)} polls, max {max(health_latencies, default=0):.3f}s"
    )
    errors = [result for result in results if isinstance(result, BaseException)]
    assert errors == [], errors[:3]
    assert set(results) <= {"stop", "length"}, results
    assert len(health_latencies) >= 5
    assert max(health_latencies) < MAX_HEALTH_LATENCY_S, sorted(health_latencies)[-5:]
    after = _wait_for(url, _is_idle, timeout_s=30)  # every block back: nothing leaked
    finished = sum(
        after[f"request_success_total{{finished_reason={reason}}}"]
        - before[f"request_success_total{{finished_reason={reason}}}"]
        for reason in ("stop", "length")
    )
    assert finished == NUM_CONCURRENT_STREAMS
    assert after["request_aborted_total"] == before["request_aborted_total"]
