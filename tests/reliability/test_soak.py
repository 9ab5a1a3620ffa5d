"""Load/soak: concurrent clients (streaming or not, random lengths, random disconnects and aborts)
against a real server with a tiny KV pool, for `PAGEDSERVE_SOAK_SECONDS` (default 60, CI's share
of a suite kept near 20 minutes; set it higher for a release's soak). At the end: zero leaked
blocks, every completed response well-formed, /health answered within 1 s throughout, and the
server's RSS growth bounded. Prints the FIGURES for the release note."""

from __future__ import annotations

import asyncio
import json
import os
import random
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.reliability.support import (
    ServerProcess,
    assert_completion,
    parse_sse,
    rss_kib,
    total_blocks,
    wait_for_idle_pool,
)

pytestmark = pytest.mark.slow

SOAK_SECONDS = float(os.environ.get("PAGEDSERVE_SOAK_SECONDS", "60"))
NUM_CLIENTS = 6
MAX_HEALTH_LATENCY_S = 1.0
MAX_RSS_GROWTH_MIB = 200
WORDS = [
    "the",
    "a",
    "cat",
    "dog",
    "ran",
    "over",
    "under",
    "blue",
    "green",
    "sky",
    "sea",
    "stone",
    "river",
    "light",
    "night",
    "day",
]


@pytest.fixture(scope="module")
def soak_server() -> Iterator[ServerProcess]:
    server = ServerProcess(
        "--num-kv-blocks",
        "24",
        "--block-size",
        "4",
        "--max-model-len",
        "128",
        "--max-num-seqs",
        "8",
        "--max-num-batched-tokens",
        "64",
    )
    yield server
    server.stop()


def _body(rng: random.Random, stream: bool) -> tuple[str, dict[str, Any]]:
    prompt = " ".join(rng.choices(WORDS, k=rng.randint(1, 30)))
    common = {
        "max_tokens": rng.randint(1, 16),
        "stream": stream,
        "temperature": rng.choice([0.0, 0.8]),
        "seed": rng.randint(0, 1000),
    }
    if rng.random() < 0.5:
        return "/v1/completions", {"prompt": prompt, **common}
    return "/v1/chat/completions", {"messages": [{"role": "user", "content": prompt}], **common}


def _check_stream(lines: list[str]) -> None:
    events, done = parse_sse(lines)
    assert done, lines[-3:]
    assert not [event for event in events if "error" in event], lines[-3:]
    reasons = [
        choice["finish_reason"]
        for event in events
        for choice in event["choices"]
        if choice.get("finish_reason")
    ]
    assert reasons and set(reasons) <= {"stop", "length"}, events[-2:]


async def _client(
    client: httpx.AsyncClient, rng: random.Random, deadline: float, counts: Counter[str]
) -> None:
    while time.monotonic() < deadline:
        action = rng.choices(["complete", "disconnect", "abort"], weights=[70, 15, 15])[0]
        stream = action == "disconnect" or rng.random() < 0.5
        path, body = _body(rng, stream)
        if action == "disconnect":
            body["max_tokens"] = 16
        counts["requests"] += 1
        try:
            if action == "abort":  # give up after a random moment: queued, prefilling or decoding
                await asyncio.wait_for(client.post(path, json=body), rng.uniform(0.05, 1.5))
                counts["completed"] += 1  # finished before the client gave up
                continue
            async with client.stream("POST", path, json=body) as response:
                assert response.status_code == 200, await response.aread()
                lines: list[str] = []
                async for line in response.aiter_lines():
                    lines.append(line)
                    if action == "disconnect" and len(lines) >= rng.randint(1, 6):
                        break
                if action == "disconnect":
                    counts["disconnects"] += 1
                    continue
            if stream:
                _check_stream(lines)
            else:
                assert_completion(json.loads("".join(lines)))
            counts["completed"] += 1
        except asyncio.TimeoutError:
            counts["aborts"] += 1


async def _poll_health(
    url: str, deadline: float, latencies: list[float], pid: int, rss_samples: list[int]
) -> None:
    async with httpx.AsyncClient(timeout=10) as client:
        while time.monotonic() < deadline:
            started = time.monotonic()
            response = await client.get(f"{url}/health")
            latencies.append(time.monotonic() - started)
            assert response.status_code == 200
            rss_samples.append(rss_kib(pid))
            await asyncio.sleep(0.25)


async def _soak(server: ServerProcess) -> dict[str, Any]:
    rng = random.Random(20251129)
    counts: Counter[str] = Counter()
    latencies: list[float] = []
    rss_samples: list[int] = []
    limits = httpx.Limits(max_connections=NUM_CLIENTS * 2)
    async with httpx.AsyncClient(base_url=server.url, timeout=120, limits=limits) as client:
        for _ in range(2):  # warm up (first-use allocations), then take the RSS baseline
            await client.post("/v1/completions", json={"prompt": "warm up", "max_tokens": 4})
        baseline_kib = rss_kib(server.pid)
        deadline = time.monotonic() + SOAK_SECONDS
        clients = [
            _client(client, random.Random(rng.random()), deadline, counts)
            for _ in range(NUM_CLIENTS)
        ]
        await asyncio.gather(
            _poll_health(server.url, deadline, latencies, server.pid, rss_samples), *clients
        )
    return {
        "counts": counts,
        "latencies": latencies,
        "baseline_kib": baseline_kib,
        "rss_samples": rss_samples,
    }


def test_soak_leaks_no_blocks_keeps_health_fast_and_memory_bounded(soak_server):
    idle_free_blocks = total_blocks(soak_server.url)
    started = time.monotonic()
    result = asyncio.run(_soak(soak_server))
    samples = wait_for_idle_pool(soak_server.url, idle_free_blocks, timeout_s=60)
    leaked_blocks = idle_free_blocks - int(samples["pagedserve:num_free_blocks"])
    final_kib = rss_kib(soak_server.pid)
    counts = result["counts"]
    peak_growth_mib = (max([*result["rss_samples"], final_kib]) - result["baseline_kib"]) / 1024
    max_health_s = max(result["latencies"])
    print(
        f"\nFIGURE soak: {time.monotonic() - started:.0f} s, {NUM_CLIENTS} clients, "
        f"{counts['requests']} requests ({counts['completed']} completed), "
        f"{counts['disconnects']} disconnects + {counts['aborts']} aborts injected, "
        f"leaked blocks {leaked_blocks}, peak RSS growth {peak_growth_mib:.1f} MiB "
        f"(baseline {result['baseline_kib'] / 1024:.0f} MiB), "
        f"max /health latency {max_health_s * 1000:.0f} ms over {len(result['latencies'])} "
        f"polls, aborted_total {samples['pagedserve:request_aborted_total']:.0f}"
    )
    assert leaked_blocks == 0
    assert samples["pagedserve:num_requests_running"] == 0
    assert counts["completed"] > 0 and counts["disconnects"] + counts["aborts"] > 0
    assert max_health_s < MAX_HEALTH_LATENCY_S
    assert peak_growth_mib < MAX_RSS_GROWTH_MIB
    assert soak_server.process.poll() is None
