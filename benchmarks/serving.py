"""Serving latency and throughput: a Poisson load generator for any OpenAI-compatible server.

Sends the shared workload to `/v1/completions` with `stream: true` and `ignore_eos`, at each
`--request-rate` (requests/s; `inf` sends all at once), and measures TTFT, inter-token latency
(between streamed chunks), TPOT, end-to-end latency (p50/p90/p99), request and token throughput,
and errors. Each rate sends its own seeded prompts, so no rate hits a prefix cache the previous
one filled. Without `--base-url` it starts our own server on a free 127.0.0.1 port
(`python -m pagedserve.server serve ...`) and stops it afterwards. The rates run against the same server in
one run, so they compare with each other.

    python -m pagedserve.benchmarks.serving [--base-url http://host:port] [--request-rate 2 inf]
        [--num-requests 64] [--prompt-format tokens|text]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import itertools
import json
import os
import random
import shlex
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from pagedserve.benchmarks.workload import (
    RESULTS_DIR,
    add_workload_args,
    build_prompts,
    load_tokenizer,
    percentile,
    workload_from_args,
    write_results,
)

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
PERCENTILES = (0.5, 0.9, 0.99)


@dataclass(slots=True)
class RequestResult:
    """One request's timeline, in seconds from when it was sent."""

    num_prompt_tokens: int
    ok: bool = False
    error: str | None = None
    ttft_s: float | None = None
    e2e_s: float | None = None
    chunk_times_s: list[float] = field(default_factory=list)
    num_output_tokens: int = 0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_workload_args(parser)
    parser.add_argument("--base-url", default=None, help="server to test (default: start ours)")
    parser.add_argument(
        "--model", default=None, help="model name to send (default: the server's first)"
    )
    parser.add_argument("--tokenizer", default=DEFAULT_MODEL, help="builds the workload's prompts")
    parser.add_argument("--api-key", default=None)
    parser.add_argument(
        "--request-rate",
        type=float,
        nargs="+",
        default=[2.0, float("inf")],
        help="Poisson arrival rates in requests/s; inf = all at once",
    )
    parser.add_argument(
        "--prompt-format",
        choices=["tokens", "text"],
        default="tokens",
        help="send token ids, or the same prompts decoded to text",
    )
    parser.add_argument("--dtype", default="float32", help="our server's dtype (when we start it)")
    parser.add_argument(
        "--server-threads",
        type=int,
        default=None,
        help="OMP_NUM_THREADS for our server (default: inherited)",
    )
    parser.add_argument("--server-args", default="", help="extra flags for `server serve`, quoted")
    parser.add_argument("--startup-timeout", type=float, default=600.0, help="seconds")
    parser.add_argument("--output", type=Path, default=RESULTS_DIR / "serving.json")
    return parser.parse_args(argv)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@contextlib.contextmanager
def own_server(args: argparse.Namespace) -> Iterator[str]:
    """Start `python -m pagedserve.server serve` on a free port, wait for /health, stop it on exit."""
    port = free_port()
    command = [
        sys.executable,
        "-m",
        "pagedserve.server",
        "serve",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        args.dtype,
        "--log-level",
        "warning",
        *shlex.split(args.server_args),
    ]
    environ = dict(os.environ)
    if args.server_threads is not None:
        environ["OMP_NUM_THREADS"] = str(args.server_threads)
    process = subprocess.Popen(command, env=environ)
    base_url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(base_url, process, args.startup_timeout)
        yield base_url
    finally:
        stop_process(process, timeout_s=30)


def stop_process(process: subprocess.Popen, timeout_s: float) -> None:
    """SIGTERM, then SIGKILL if it has not exited within `timeout_s`."""
    process.terminate()
    try:
        process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def wait_healthy(base_url: str, process: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with status {process.returncode} during startup")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{base_url}/health", timeout=2.0, trust_env=False).status_code == 200:
                return
        time.sleep(0.5)
    raise TimeoutError(f"the server at {base_url} was not healthy after {timeout_s:.0f} s")


def arrival_offsets(num_requests: int, rate: float, seed: int) -> list[float]:
    """Seconds after the start at which each request is sent: a Poisson process at `rate`."""
    if rate == float("inf"):
        return [0.0] * num_requests
    rng = random.Random(seed)
    offsets, now = [], 0.0
    for _ in range(num_requests):
        offsets.append(now)
        now += rng.expovariate(rate)
    return offsets


async def send_request(
    client: httpx.AsyncClient, payload: dict[str, Any], num_prompt_tokens: int
) -> RequestResult:
    """Stream one completion; every chunk with text is a token arrival."""
    result = RequestResult(num_prompt_tokens)
    start = time.perf_counter()
    try:
        async with client.stream("POST", "/v1/completions", json=payload) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                read_chunk(json.loads(line[6:]), time.perf_counter() - start, result)
    except httpx.HTTPError as error:
        result.error = f"{type(error).__name__}: {error}"
        return result
    result.e2e_s = time.perf_counter() - start
    result.ok = result.error is None and bool(result.chunk_times_s)
    if result.ok and not result.num_output_tokens:  # the server sent no usage: count chunks
        result.num_output_tokens = len(result.chunk_times_s)
    return result


def read_chunk(chunk: dict[str, Any], elapsed_s: float, result: RequestResult) -> None:
    if "error" in chunk:
        result.error = str(chunk["error"].get("message", chunk["error"]))
    if any(choice.get("text") for choice in chunk.get("choices") or ()):
        if result.ttft_s is None:
            result.ttft_s = elapsed_s
        result.chunk_times_s.append(elapsed_s)
    if chunk.get("usage"):
        result.num_output_tokens = chunk["usage"]["completion_tokens"]
        result.num_prompt_tokens = chunk["usage"]["prompt_tokens"]


async def run_rate(
    base_url: str,
    model: str,
    prompts: list[Any],
    num_prompt_tokens: list[int],
    rate: float,
    args: argparse.Namespace,
) -> dict[str, Any]:
    """All requests at one arrival rate; returns the summary of their results."""
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(
        base_url=base_url, headers=headers, timeout=None, limits=limits, trust_env=False
    ) as client:
        start = time.perf_counter()

        async def scheduled(offset: float, prompt: Any, num_tokens: int) -> RequestResult:
            await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
            payload = {
                "model": model,
                "prompt": prompt,
                "max_tokens": args.output_tokens,
                "temperature": 0.0,
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            return await send_request(client, payload, num_tokens)

        offsets = arrival_offsets(len(prompts), rate, args.seed)
        results = await asyncio.gather(
            *(
                scheduled(offset, prompt, num_tokens)
                for offset, prompt, num_tokens in zip(
                    offsets, prompts, num_prompt_tokens, strict=True
                )
            )
        )
        duration = time.perf_counter() - start
    return summarize(list(results), rate, duration)


def summarize(results: list[RequestResult], rate: float, duration_s: float) -> dict[str, Any]:
    done = [r for r in results if r.ok]
    itl = [later - earlier for r in done for earlier, later in itertools.pairwise(r.chunk_times_s)]
    tpot = [
        (r.e2e_s - r.ttft_s) / (r.num_output_tokens - 1) for r in done if r.num_output_tokens > 1
    ]
    num_output = sum(r.num_output_tokens for r in done)
    summary: dict[str, Any] = {
        "request_rate": rate if rate != float("inf") else "inf",
        "num_requests": len(results),
        "num_completed": len(done),
        "num_errors": len(results) - len(done),
        "errors": sorted({r.error or "no tokens" for r in results if not r.ok})[:5],
        "duration_s": duration_s,
        "requests_per_s": len(done) / duration_s,
        "output_tokens_per_s": num_output / duration_s,
        "total_tokens_per_s": (num_output + sum(r.num_prompt_tokens for r in done)) / duration_s,
    }
    for name, values in (
        ("ttft_ms", [r.ttft_s for r in done]),
        ("itl_ms", itl),
        ("tpot_ms", tpot),
        ("e2e_ms", [r.e2e_s for r in done]),
    ):
        for fraction in PERCENTILES:
            summary[f"{name}_p{round(fraction * 100)}"] = percentile(values, fraction) * 1e3
    return summary


def discover_model(base_url: str, api_key: str | None) -> str:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    response = httpx.get(f"{base_url}/v1/models", headers=headers, timeout=30.0, trust_env=False)
    response.raise_for_status()
    return response.json()["data"][0]["id"]


def print_table(rows: list[dict[str, Any]]) -> None:
    print(
        f"{'rate':>6} {'ok':>4} {'err':>4} {'req/s':>6} {'out tok/s':>9} {'tot tok/s':>9} "
        + " ".join(f"{name + ' p50/p90/p99 ms':>26}" for name in ("TTFT", "ITL", "E2E"))
    )
    for row in rows:
        latencies = " ".join(
            f"{_percentiles_text(row, name):>26}" for name in ("ttft_ms", "itl_ms", "e2e_ms")
        )
        print(
            f"{row['request_rate']!s:>6} {row['num_completed']:>4} {row['num_errors']:>4} "
            f"{row['requests_per_s']:>6.2f} {row['output_tokens_per_s']:>9.1f} "
            f"{row['total_tokens_per_s']:>9.1f} {latencies}"
        )
    for row in rows:
        for error in row["errors"]:
            print(f"error at rate {row['request_rate']}: {error}")


def _percentiles_text(row: dict[str, Any], name: str) -> str:
    return "/".join(f"{row[f'{name}_p{round(p * 100)}']:.0f}" for p in PERCENTILES)


def run_all(base_url: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Each rate gets its own prompts (the workload's seed + the rate's index): with the same
    prompts, a later rate would find them all in the server's prefix cache."""
    tokenizer = load_tokenizer(args.tokenizer)
    model = args.model or discover_model(base_url, args.api_key)
    rows = []
    for index, rate in enumerate(args.request_rate):
        workload = dataclasses.replace(workload_from_args(args), seed=args.seed + index)
        token_prompts = build_prompts(workload, tokenizer)
        prompts: list[Any] = token_prompts
        if args.prompt_format == "text":
            prompts = [tokenizer.decode(ids) for ids in token_prompts]
        num_prompt_tokens = list(map(len, token_prompts))
        rows.append(asyncio.run(run_rate(base_url, model, prompts, num_prompt_tokens, rate, args)))
    return rows


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    args = parse_args(argv)
    if args.base_url:
        rows = run_all(args.base_url.rstrip("/"), args)
    else:
        with own_server(args) as base_url:
            rows = run_all(base_url, args)
    print(
        f"serving: {args.num_requests} streamed requests per rate, prompts "
        f"{args.min_prompt_tokens}-{args.max_prompt_tokens} tokens ({args.prompt_format}), "
        f"{args.output_tokens} output tokens each; ITL is between streamed chunks"
    )
    print_table(rows)
    write_results(args.output, args, rows)
    return rows


if __name__ == "__main__":
    main()
