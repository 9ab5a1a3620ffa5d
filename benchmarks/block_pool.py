"""Benchmark the block bookkeeping: allocate + free throughput at a steady 1,000 live requests.

Each step one random live request finishes (`free`) and a new one arrives: it looks up its cached
prefix, reserves its prompt block by block with `allocate_slots` (registering each computed block
in the prefix cache), then decodes a few tokens one `allocate_slots` call at a time. The same
seeded workload runs with prefix caching on and off (the baseline) in the same process.

    python -m pagedserve.benchmarks.block_pool [--live-requests 1000] [--steps 10000] [--block-size 16]
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import random
import time
from dataclasses import dataclass
from pathlib import Path

from pagedserve.cache.block_manager import BlockManager
from pagedserve.cache.block_table import ceil_div

DEFAULT_OUTPUT = Path(__file__).parent / "results" / "block_pool.json"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--live-requests", type=int, default=1000, help="steady-state requests")
    parser.add_argument("--steps", type=int, default=10_000, help="timed finish+arrive steps")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--min-prompt", type=int, default=64, help="prompt tokens, at least")
    parser.add_argument("--max-prompt", type=int, default=512, help="prompt tokens, at most")
    parser.add_argument("--max-decode", type=int, default=64, help="decoded tokens, at most")
    parser.add_argument("--num-system-prompts", type=int, default=16, help="shared prefixes")
    parser.add_argument("--system-prompt-tokens", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--repeats", type=int, default=3, help="rounds, on/off interleaved (median)"
    )
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT)
    return parser.parse_args(argv)


class Workload:
    """Seeded prompts: a shared system prompt (so prefix caching can hit) plus a random suffix."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.rng = random.Random(args.seed)
        self.system_prompts = [
            [self.rng.randrange(32_000) for _ in range(args.system_prompt_tokens)]
            for _ in range(args.num_system_prompts)
        ]

    def next_request(self) -> tuple[list[int], int]:
        """(prompt token ids, number of tokens to decode)."""
        args, rng = self.args, self.rng
        num_prompt_tokens = rng.randint(args.min_prompt, args.max_prompt)
        prompt = list(rng.choice(self.system_prompts))[:num_prompt_tokens]
        prompt += [rng.randrange(32_000) for _ in range(num_prompt_tokens - len(prompt))]
        return prompt, rng.randint(0, args.max_decode)


@dataclass(slots=True)
class Counters:
    allocate_calls: int = 0
    failed_allocations: int = 0
    free_calls: int = 0
    prefix_queried_tokens: int = 0
    prefix_hit_tokens: int = 0


def admit(
    manager: BlockManager, request_id: str, prompt: list[int], num_decode: int, counters: Counters
) -> None:
    """Run one request's whole life up to its last token, as the scheduler would, block by block."""
    block_size = manager.block_size
    num_computed = manager.allocate_cached_prefix(request_id, prompt)
    if manager.pool.enable_prefix_caching:
        counters.prefix_queried_tokens += len(prompt)
        counters.prefix_hit_tokens += num_computed
    token_ids = list(prompt)
    while num_computed < len(token_ids):
        num_new = min(block_size - num_computed % block_size, len(token_ids) - num_computed)
        counters.allocate_calls += 1
        if not manager.allocate_slots(request_id, num_new, num_computed):
            counters.failed_allocations += 1
            return
        num_computed += num_new
        manager.cache_computed_blocks(request_id, token_ids, num_computed)
    for token_id in range(num_decode):
        token_ids.append(token_id)
        counters.allocate_calls += 1
        if not manager.allocate_slots(request_id, 1, num_computed):
            counters.failed_allocations += 1
            return
        num_computed += 1
        manager.cache_computed_blocks(request_id, token_ids, num_computed)


def run(args: argparse.Namespace, enable_prefix_caching: bool) -> dict:
    workload = Workload(args)
    max_blocks_per_request = ceil_div(args.max_prompt + args.max_decode, args.block_size)
    num_blocks = args.live_requests * max_blocks_per_request  # never short: we time bookkeeping
    manager = BlockManager(num_blocks, args.block_size, enable_prefix_caching)
    counters = Counters()
    live: list[str] = []
    for index in range(args.live_requests):  # warm up to the steady state, untimed
        live.append(f"warm-{index}")
        admit(manager, live[-1], *workload.next_request(), counters)
    counters = Counters()
    requests = [workload.next_request() for _ in range(args.steps)]
    victims = [workload.rng.randrange(args.live_requests) for _ in range(args.steps)]
    gc.collect()  # start every round from the same garbage state
    start, cpu_start = time.perf_counter(), time.process_time()
    for step, ((prompt, num_decode), victim) in enumerate(zip(requests, victims, strict=True)):
        manager.free(live[victim])
        counters.free_calls += 1
        live[victim] = f"req-{step}"
        admit(manager, live[victim], prompt, num_decode, counters)
    elapsed = time.perf_counter() - start
    cpu_seconds = time.process_time() - cpu_start  # robust to a busy, shared machine
    manager.check_invariants()
    num_operations = counters.allocate_calls + counters.free_calls
    return {
        "prefix_caching": enable_prefix_caching,
        "num_blocks": num_blocks,
        "steps": args.steps,
        "seconds": elapsed,
        "steps_per_s": args.steps / elapsed,
        "allocate_slots_calls": counters.allocate_calls,
        "free_calls": counters.free_calls,
        "failed_allocations": counters.failed_allocations,
        "allocate_free_ops_per_s": num_operations / elapsed,
        "us_per_op": elapsed / num_operations * 1e6,
        "cpu_seconds": cpu_seconds,
        "allocate_free_ops_per_cpu_s": num_operations / cpu_seconds,
        "prefix_hit_rate": counters.prefix_hit_tokens / max(1, counters.prefix_queried_tokens),
        "final_usage": manager.pool.usage,
    }


def median_round(results: list[dict]) -> dict:
    """The round with the median time, plus every round's ops/s."""
    ordered = sorted(results, key=lambda row: row["seconds"])
    return {
        **ordered[len(ordered) // 2],
        "all_ops_per_s": [r["allocate_free_ops_per_s"] for r in results],
    }


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    rounds: dict[bool, list[dict]] = {True: [], False: []}
    for _ in range(args.repeats):  # interleaved, so machine noise hits both alike
        for enable_prefix_caching in (True, False):
            rounds[enable_prefix_caching].append(run(args, enable_prefix_caching))
    rows = [median_round(rounds[True]), median_round(rounds[False])]
    print(
        f"block bookkeeping: {args.live_requests} live requests, block size {args.block_size}, "
        f"{args.steps} finish+arrive steps, median of {args.repeats} rounds"
    )
    header = f"{'prefix cache':<13} {'ops/s':>10} {'us/op':>7} {'steps/s':>9} {'hit rate':>9} {'failed':>7} {'ops/cpu-s':>10}"
    print(header)
    for row in rows:
        print(
            f"{'on' if row['prefix_caching'] else 'off':<13} {row['allocate_free_ops_per_s']:>10,.0f} "
            f"{row['us_per_op']:>7.2f} {row['steps_per_s']:>9,.0f} {row['prefix_hit_rate']:>9.1%} "
            f"{row['failed_allocations']:>7} {row['allocate_free_ops_per_cpu_s']:>10,.0f}"
        )
    config = {
        key: str(value) if isinstance(value, Path) else value for key, value in vars(args).items()
    }
    config["python"] = platform.python_version()
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps({"config": config, "results": rows}, indent=2) + "\n")
    print(f"wrote {args.output}")
    return rows


if __name__ == "__main__":
    main()
