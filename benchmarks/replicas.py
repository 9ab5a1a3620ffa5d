"""Replicas: total serving throughput of N pagedserve replicas (an equal share of the cores each,
as `pagedserve replicas` pins them) against one replica on all the cores, on the same fixed,
seeded workload, sent through sglang-router in both cases (so the router's cost is in both).

Each configuration is started with `python -m pagedserve.server replicas -n N`, measured with
`benchmarks/serving.py`'s load generator (streamed requests, EOS ignored, text prompts: the router
accepts no token-id prompts), and stopped. `--repeats` alternates the configurations, so a drift
in this shared machine's load affects both alike.

    python -m pagedserve.benchmarks.replicas [--replicas 2 1] [--repeats 2] [--num-requests 32]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pagedserve.benchmarks import serving
from pagedserve.benchmarks.workload import RESULTS_DIR, add_workload_args, write_results


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_workload_args(parser)
    # A workload that takes a minute or two per configuration on 2 cores.
    parser.set_defaults(num_requests=32, max_prompt_tokens=256, output_tokens=64)
    parser.add_argument("--replicas", type=int, nargs="+", default=[2, 1], help="configurations")
    parser.add_argument("--repeats", type=int, default=1, help="rounds over the configurations")
    parser.add_argument("--policy", default="cache_aware", help="sglang-router policy")
    parser.add_argument(
        "--request-rate", type=float, default=float("inf"), help="requests/s (inf: all at once)"
    )
    parser.add_argument("--startup-timeout", type=float, default=600.0, help="seconds")
    parser.add_argument("--output", type=Path, default=RESULTS_DIR / "replicas.json")
    return parser.parse_args(argv)


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU time so far of these processes (all their threads), from /proc."""
    ticks_per_s = os.sysconf("SC_CLK_TCK")
    total = 0
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of stat)
    return total / ticks_per_s


@contextlib.contextmanager
def launched(num_replicas: int, policy: str) -> Iterator[tuple[str, list[int]]]:
    """`pagedserve replicas -n N` on a free port; yields the router's URL and the replicas' pids
    once everything is ready."""
    port = serving.free_port()
    log_dir = tempfile.mkdtemp(prefix=f"pagedserve-bench-replicas-{num_replicas}-")
    command = [sys.executable, "-m", "pagedserve.server", "replicas", "-n", str(num_replicas)]
    command += ["--port", str(port), "--policy", policy, "--log-dir", log_dir]
    command += ["--log-level", "warning"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True, env=dict(os.environ))
    try:
        assert process.stdout is not None
        pids = []
        for line in process.stdout:  # the launcher prints its table once everything is ready
            print(line, end="", flush=True)
            if line.startswith("replica "):
                pids.append(int(line.split(" pid ")[1].split()[0]))
            if line.startswith("logs in "):
                break
        else:
            raise RuntimeError(f"the launcher exited with {process.wait()}; logs in {log_dir}")
        yield f"http://127.0.0.1:{port}", pids
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def measure(num_replicas: int, args: argparse.Namespace) -> dict[str, Any]:
    serving_args = serving.parse_args(
        [
            "--num-requests",
            str(args.num_requests),
            "--min-prompt-tokens",
            str(args.min_prompt_tokens),
            "--max-prompt-tokens",
            str(args.max_prompt_tokens),
            "--output-tokens",
            str(args.output_tokens),
            "--seed",
            str(args.seed),
            "--request-rate",
            str(args.request_rate),
            "--prompt-format",
            "text",
        ]
    )
    with launched(num_replicas, args.policy) as (base_url, pids):
        cpu_before = cpu_seconds(pids)
        (row,) = serving.run_all(base_url, serving_args)
        replica_cpu_s = cpu_seconds(pids) - cpu_before
    num_output_tokens = row["output_tokens_per_s"] * row["duration_s"]
    return {
        "num_replicas": num_replicas,
        "num_cores": len(os.sched_getaffinity(0)),
        # CPU time the replicas spent: on a shared machine, tokens per CPU-second compare the
        # configurations' efficiency where wall-clock throughput mostly measures the neighbours.
        "replica_cpu_s": replica_cpu_s,
        "output_tokens_per_cpu_s": num_output_tokens / replica_cpu_s if replica_cpu_s else 0.0,
        **row,
    }


def print_table(rows: list[dict[str, Any]]) -> None:
    print(
        f"{'replicas':>8} {'ok':>4} {'err':>4} {'req/s':>6} {'out tok/s':>9} {'tot tok/s':>9} "
        f"{'cpu s':>7} {'out tok/cpu s':>13}"
    )
    for row in rows:
        print(
            f"{row['num_replicas']:>8} {row['num_completed']:>4} {row['num_errors']:>4} "
            f"{row['requests_per_s']:>6.2f} {row['output_tokens_per_s']:>9.1f} "
            f"{row['total_tokens_per_s']:>9.1f} {row['replica_cpu_s']:>7.1f} "
            f"{row['output_tokens_per_cpu_s']:>13.2f}"
        )


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    args = parse_args(argv)
    rows = [measure(n, args) for _ in range(args.repeats) for n in args.replicas]
    print(
        f"replicas: {args.num_requests} streamed requests at rate {args.request_rate}, prompts "
        f"{args.min_prompt_tokens}-{args.max_prompt_tokens} tokens, {args.output_tokens} output "
        f"tokens each, through sglang-router ({args.policy}); cores split equally"
    )
    print_table(rows)
    write_results(args.output, args, rows)
    return rows


if __name__ == "__main__":
    main()
