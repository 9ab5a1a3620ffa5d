"""KV memory efficiency: at a fixed KV budget, how many requests of the workload's lengths run at
once with the paged cache, against a contiguous cache that reserves `max_model_len` per request.

Drives the real `Scheduler` + `BlockManager` with fake sampled tokens (no model, no tensors) and
measures concurrent running requests and waste (reserved but unwritten KV slots) every step. The
contiguous baseline is arithmetic: `budget // max_model_len` requests, each wasting
`max_model_len - its length`. Also measures the gain from prefix caching when every prompt starts
with the same system prompt (token ids are seeded random: only lengths and sharing matter here),
and, for a Gemma-2-shaped cache (alternating sliding/full layers) at a fixed byte budget, the
concurrency with and without freeing the blocks that left the sliding window.

    python -m pagedserve.benchmarks.memory [--kv-budget-tokens 16384] [--max-model-len 2048] [--num-requests 256]
"""

from __future__ import annotations

import argparse
import random
from dataclasses import asdict, dataclass
from pathlib import Path

from pagedserve.benchmarks.workload import (
    RESULTS_DIR,
    add_workload_args,
    prompt_lengths,
    workload_from_args,
    write_results,
)
from pagedserve.cache.block_manager import BlockManager
from pagedserve.cache.cache_spec import CacheSpec, group_layers
from pagedserve.configs import SamplingParams
from pagedserve.configs.engine import SchedulerConfig
from pagedserve.scheduler import ModelRunnerOutput, Request, Scheduler

FAKE_TOKEN_ID = 1
VOCAB_SIZE = 32_000


@dataclass(frozen=True, slots=True)
class CacheResult:
    cache: str
    peak_concurrency: int
    mean_concurrency: float  # over the saturated steps (while requests were still waiting)
    waste_slots_per_request: float  # mean over steps and requests
    max_waste_slots_per_request: float  # the worst step's mean
    waste_fraction: float  # wasted / reserved slots, over all steps
    num_preemptions: int
    num_steps: int


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_workload_args(parser)
    parser.set_defaults(num_requests=256)  # enough to keep the cache saturated for a while
    parser.add_argument("--kv-budget-tokens", type=int, default=16_384, help="KV slots in all")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument(
        "--system-prompt-tokens",
        type=int,
        default=256,
        help="shared prefix for the prefix-caching comparison",
    )
    parser.add_argument("--window-budget-gib", type=float, default=16.0)
    parser.add_argument("--window-prompt-tokens", type=int, default=8192)
    parser.add_argument("--window-num-requests", type=int, default=32)
    parser.add_argument("--output", type=Path, default=RESULTS_DIR / "memory.json")
    return parser.parse_args(argv)


def make_prompts(args: argparse.Namespace, system_prompt_tokens: int) -> list[list[int]]:
    """Seeded random token ids of the workload's lengths, after a common system prompt."""
    rng = random.Random(args.seed)
    system_prompt = [rng.randrange(VOCAB_SIZE) for _ in range(system_prompt_tokens)]
    return [
        system_prompt + [rng.randrange(VOCAB_SIZE) for _ in range(length)]
        for length in prompt_lengths(workload_from_args(args))
    ]


def waste_slots(scheduler: Scheduler) -> tuple[int, int]:
    """(reserved, wasted) slots over the blocks held by running requests, each block counted once:
    a shared block is as full as its fullest holder says."""
    manager = scheduler.block_manager
    block_size = manager.block_size
    block_fill: dict[int, int] = {}
    for request in scheduler.running:
        for index, block_id in enumerate(manager.block_ids(request.sequence_id)):
            filled = min(block_size, max(0, request.num_computed_tokens - index * block_size))
            block_fill[block_id] = max(block_fill.get(block_id, 0), filled)
    reserved = len(block_fill) * block_size
    return reserved, reserved - sum(block_fill.values())


def run_paged(
    args: argparse.Namespace, prompts: list[list[int]], enable_prefix_caching: bool, name: str
) -> CacheResult:
    """Serve every prompt to completion with fake tokens; sample concurrency and waste each step."""
    manager = BlockManager(
        args.kv_budget_tokens // args.block_size, args.block_size, enable_prefix_caching
    )
    return run_scheduler(args, manager, prompts, args.max_model_len, name)


def run_scheduler(
    args: argparse.Namespace,
    manager: BlockManager,
    prompts: list[list[int]],
    max_model_len: int,
    name: str,
) -> CacheResult:
    """The real scheduler over `manager` until every prompt is served (waste: group 0 only)."""
    config = SchedulerConfig(
        max_num_seqs=100_000,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_waiting_requests=100_000,
    )
    scheduler = Scheduler(config, manager, max_model_len)
    params = SamplingParams(temperature=0, max_tokens=args.output_tokens, ignore_eos=True)
    for index, prompt in enumerate(prompts):
        scheduler.add_request(Request(f"mem-{index}", prompt, params, arrival_time=float(index)))
    saturated: list[int] = []
    step_waste: list[float] = []
    total_reserved = total_wasted = peak = num_steps = 0
    while scheduler.has_unfinished_requests():
        plan = scheduler.schedule()
        sampled = {s.sequence_id: FAKE_TOKEN_ID for s in plan.requests if s.needs_sample}
        scheduler.update_from_output(plan, ModelRunnerOutput(sampled))
        num_steps += 1
        peak = max(peak, scheduler.num_running)
        if scheduler.num_waiting:
            saturated.append(scheduler.num_running)
        reserved, wasted = waste_slots(scheduler)
        total_reserved, total_wasted = total_reserved + reserved, total_wasted + wasted
        if scheduler.num_running:
            step_waste.append(wasted / scheduler.num_running)
    manager.check_invariants()
    return CacheResult(
        name,
        peak,
        sum(saturated) / max(1, len(saturated)),
        sum(step_waste) / max(1, len(step_waste)),
        max(step_waste, default=0.0),
        total_wasted / max(1, total_reserved),
        scheduler.num_preemptions,
        num_steps,
    )


def contiguous(args: argparse.Namespace, prompts: list[list[int]], name: str) -> CacheResult:
    """Reserve max_model_len per request: concurrency and waste follow from the lengths alone."""
    concurrency = args.kv_budget_tokens // args.max_model_len
    # The slots a request finally uses: its prompt and every output token but the last.
    waste = [args.max_model_len - (len(prompt) + args.output_tokens - 1) for prompt in prompts]
    mean_waste = sum(waste) / len(waste)
    return CacheResult(
        name,
        concurrency,
        float(concurrency),
        mean_waste,
        float(max(waste)),
        mean_waste / args.max_model_len,
        0,
        0,
    )


def print_table(rows: list[CacheResult], baselines: dict[str, CacheResult]) -> None:
    print(
        f"{'cache':<34} {'peak':>5} {'mean':>7} {'vs contig':>10} {'waste/req':>10} "
        f"{'worst':>7} {'waste %':>8} {'preempt':>8}"
    )
    for row in rows:
        ratio = row.mean_concurrency / baselines[row.cache].mean_concurrency
        print(
            f"{row.cache:<34} {row.peak_concurrency:>5} {row.mean_concurrency:>7.1f} "
            f"{ratio:>9.1f}x {row.waste_slots_per_request:>10.1f} "
            f"{row.max_waste_slots_per_request:>7.1f} {row.waste_fraction:>8.1%} "
            f"{row.num_preemptions:>8}"
        )


def print_goals(args: argparse.Namespace, rows: list[CacheResult]) -> None:
    contiguous_plain, paged, _, paged_shared, paged_prefix = rows
    gain = paged.mean_concurrency / contiguous_plain.mean_concurrency
    worst_waste = max(
        row.max_waste_slots_per_request for row in (paged, paged_shared, paged_prefix)
    )
    print(
        f"goal: paged >= 4x contiguous concurrency: {gain:.1f}x "
        f"({'met' if gain >= 4 else 'NOT met'})"
    )
    print(
        f"goal: waste < one block ({args.block_size} slots) per request: worst step "
        f"{worst_waste:.1f} ({'met' if worst_waste < args.block_size else 'NOT met'})"
    )
    print(
        f"prefix caching with a shared {args.system_prompt_tokens}-token system prompt: "
        f"{paged_prefix.mean_concurrency / paged_shared.mean_concurrency:.2f}x the concurrency "
        f"of the same prompts without it"
    )


# Gemma-2-9B's cache shape: 42 layers alternating sliding (window 4096) / full attention,
# 8 KV heads of 256 dims in bfloat16.
GEMMA2_SHAPE = dict(num_layers=42, num_kv_heads=8, head_dim=256, dtype="bfloat16")
GEMMA2_WINDOW = 4096


def sliding_window_rows(args: argparse.Namespace) -> list[CacheResult]:
    """Gemma-2-shaped long requests at a fixed byte budget: one table for all layers (every
    block kept) against a table per layer group with out-of-window blocks released."""
    rng = random.Random(args.seed)
    prompts = [
        [rng.randrange(VOCAB_SIZE) for _ in range(args.window_prompt_tokens)]
        for _ in range(args.window_num_requests)
    ]
    max_model_len = args.window_prompt_tokens + args.output_tokens
    budget = int(args.window_budget_gib * 2**30)
    windows = [GEMMA2_WINDOW if layer % 2 == 0 else None for layer in range(42)]
    rows = []
    for name, groups in (
        ("gemma2, all blocks kept", ()),
        ("gemma2, out-of-window freed", group_layers(windows)),
    ):
        spec = CacheSpec(block_size=args.block_size, groups=groups, **GEMMA2_SHAPE)
        manager = BlockManager(
            spec.num_blocks_for_budget(budget), args.block_size, False, spec.sliding_windows
        )
        manager.max_step_tokens = args.max_num_batched_tokens
        rows.append(run_scheduler(args, manager, prompts, max_model_len, name))
    kept, freed = rows
    print(
        f"Gemma-2 shape at {args.window_budget_gib} GiB, {args.window_num_requests} requests of "
        f"{args.window_prompt_tokens} + {args.output_tokens} tokens (window {GEMMA2_WINDOW}): "
        f"mean concurrency {kept.mean_concurrency:.1f} keeping every block, "
        f"{freed.mean_concurrency:.1f} freeing out-of-window blocks "
        f"({freed.mean_concurrency / kept.mean_concurrency:.2f}x)"
    )
    return rows


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    plain, shared = make_prompts(args, 0), make_prompts(args, args.system_prompt_tokens)
    contiguous_plain = contiguous(args, plain, "contiguous")
    contiguous_shared = contiguous(args, shared, "contiguous, system prompt")
    rows = [
        contiguous_plain,
        run_paged(args, plain, False, "paged"),
        contiguous_shared,
        run_paged(args, shared, False, "paged, system prompt"),
        run_paged(args, shared, True, "paged, system prompt, prefix cache"),
    ]
    baselines = {
        row.cache: contiguous_shared if "system" in row.cache else contiguous_plain for row in rows
    }
    print(
        f"KV memory: budget {args.kv_budget_tokens} slots, max_model_len {args.max_model_len}, "
        f"block size {args.block_size}, {args.num_requests} requests, prompts "
        f"{args.min_prompt_tokens}-{args.max_prompt_tokens} (+{args.system_prompt_tokens} shared "
        f"in the system-prompt rows) + {args.output_tokens} output tokens"
    )
    print(
        "mean = running requests averaged over the steps where requests still waited; waste = "
        "reserved but unwritten slots per running request (worst = the worst step's mean); "
        "contiguous waste is at completion, its best moment"
    )
    print_table(rows, baselines)
    print_goals(args, rows)
    window_rows = sliding_window_rows(args)
    results = [
        asdict(row)
        | {
            "concurrency_vs_contiguous": row.mean_concurrency
            / baselines[row.cache].mean_concurrency
        }
        for row in rows
    ] + [asdict(row) for row in window_rows]
    write_results(args.output, args, results)
    return results


if __name__ == "__main__":
    main()
