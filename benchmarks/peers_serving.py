"""Serving latency side by side: the same Poisson arrivals against `vllm serve` and our server.

    python -m pagedserve.benchmarks.peers_serving [--request-rate 1] [--num-requests 32]
        [--dtype float32] [--kv-cache-gib 4] [--threads N] [--vllm-venv ~/venv-vllm]

One server after the other on the same machine in one run, each with the same model folder, dtype,
KV budget (`VLLM_CPU_KVCACHE_SPACE` / `--kv-cache-memory`) and cores (`VLLM_CPU_OMP_THREADS_BIND`
/ `OMP_NUM_THREADS`). The load is `benchmarks/serving.py`'s: streamed `/v1/completions` with
token-id prompts and `ignore_eos`, the same seeded prompts and arrival times for both servers.
Reported per server: TTFT and TPOT p50/p99 and output tok/s; and our p50s over vLLM's (below 1:
pagedserve is faster). Every other flag is serving.py's. vLLM is installed as `peers.py` does it.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pagedserve.benchmarks import peers, serving
from pagedserve.benchmarks.workload import RESULTS_DIR, write_results

LATENCIES = ("ttft_ms", "tpot_ms")


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, argparse.Namespace]:
    """(this benchmark's options, serving.py's load options with the servers' settings in)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--kv-cache-gib", type=int, default=4, help="equal budget for both")
    parser.add_argument("--threads", type=int, default=None, help="cores per server (all)")
    parser.add_argument("--vllm-venv", type=Path, default=Path.home() / "venv-vllm")
    parser.add_argument("--no-install-vllm", action="store_true", help="skip vLLM if missing")
    parser.add_argument("--startup-timeout", type=float, default=900.0, help="seconds a server")
    parser.add_argument("--output", type=Path, default=RESULTS_DIR / "peers_serving.json")
    ours, rest = parser.parse_known_args(argv)
    load = serving.parse_args(["--request-rate", "1", "--num-requests", "32", *rest])
    load.dtype, load.server_threads = ours.dtype, ours.threads
    load.server_args = f"--kv-cache-memory {ours.kv_cache_gib}GiB"
    load.startup_timeout = ours.startup_timeout
    return ours, load


@contextlib.contextmanager
def vllm_server(python: Path, model_dir: Path, ours: argparse.Namespace) -> Iterator[str]:
    """`vllm serve` (its OpenAI server module) on a free port; its log beside the results."""
    port = serving.free_port()
    num_cores = ours.threads or os.cpu_count() or 1
    env = dict(
        os.environ,
        VLLM_CPU_KVCACHE_SPACE=str(ours.kv_cache_gib),
        VLLM_CPU_OMP_THREADS_BIND=f"0-{num_cores - 1}",
    )
    command = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir)]
    command += ["--host", "127.0.0.1", "--port", str(port), "--dtype", ours.dtype, "--seed", "0"]
    log_path = ours.output.with_name("peers_serving_vllm.log")
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
        base_url = f"http://127.0.0.1:{port}"
        try:
            print(f"vLLM: starting `vllm serve` on {base_url} (log: {log_path})", flush=True)
            serving.wait_healthy(base_url, process, ours.startup_timeout)
            yield base_url
        finally:
            serving.stop_process(process, timeout_s=60)


def run(ours: argparse.Namespace, load: argparse.Namespace) -> list[dict[str, Any]]:
    """vLLM's rows (when it is usable), then ours, each row tagged with its system."""
    from pagedserve.engine.model_loader import resolve_model_path

    rows: list[dict[str, Any]] = []
    python = peers.vllm_python(ours)
    if python is not None:
        model_dir, _ = resolve_model_path(peers.DEFAULT_MODEL)  # an HF folder both can load
        with vllm_server(python, model_dir, ours) as base_url:
            rows += [{"system": "vLLM-CPU", **row} for row in serving.run_all(base_url, load)]
    print("pagedserve: starting our server", flush=True)
    with serving.own_server(load) as base_url:
        rows += [{"system": "pagedserve", **row} for row in serving.run_all(base_url, load)]
    add_ratios(rows)
    return rows


def add_ratios(rows: list[dict[str, Any]]) -> None:
    """On each of our rows: our p50 over vLLM's at the same rate (below 1: we are faster)."""
    for row in rows:
        peer = next(
            (
                other
                for other in rows
                if other["system"] != "pagedserve" and other["request_rate"] == row["request_rate"]
            ),
            None,
        )
        if row["system"] == "pagedserve" and peer is not None:
            for name in LATENCIES:
                row[f"{name}_p50_vs_vllm"] = row[f"{name}_p50"] / peer[f"{name}_p50"]


def print_report(rows: list[dict[str, Any]], ours: argparse.Namespace) -> None:
    cpu = peers.cpu_description()
    print(f"CPU: {cpu['cpu_model']}, {cpu['nproc']} cores, vector ISA {cpu['vector_isa']}")
    print(
        f"dtype {ours.dtype}, KV budget {ours.kv_cache_gib} GiB each, cores {ours.threads or 'all'}"
    )
    header = f"{'system':<11} {'rate':>5} {'ok':>4} {'err':>4} {'out tok/s':>9}"
    print(header + "".join(f" {name + ' p50/p99':>18}" for name in LATENCIES) + "  p50 vs vLLM")
    for row in rows:
        latencies = "".join(
            f" {row[f'{name}_p50']:>8.0f}/{row[f'{name}_p99']:<9.0f}" for name in LATENCIES
        )
        ratios = " ".join(
            f"{name.split('_')[0]} {row[f'{name}_p50_vs_vllm']:.2f}x"
            for name in LATENCIES
            if f"{name}_p50_vs_vllm" in row
        )
        print(
            f"{row['system']:<11} {row['request_rate']!s:>5} {row['num_completed']:>4} "
            f"{row['num_errors']:>4} {row['output_tokens_per_s']:>9.1f}{latencies}  {ratios or '-'}"
        )


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    ours, load = parse_args(argv)
    rows = run(ours, load)
    print(
        f"serving side by side: {load.num_requests} streamed requests per rate, prompts "
        f"{load.min_prompt_tokens}-{load.max_prompt_tokens} tokens, {load.output_tokens} output "
        "tokens each"
    )
    print_report(rows, ours)
    config = argparse.Namespace(**{**vars(load), **vars(ours)})  # the load's and the servers'
    write_results(ours.output, config, {"cpu": peers.cpu_description(), "runs": rows})
    return rows


if __name__ == "__main__":
    main()
