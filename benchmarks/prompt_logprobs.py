"""What prompt logprobs cost: the same prefill-only workload (N prompts of L tokens, one output
token each, as an evaluation harness sends them) with and without `prompt_logprobs`, in one
process on one engine (prefix caching off, so neither run reuses the other's K/V).

    python -m pagedserve.benchmarks.prompt_logprobs [--num-requests 64] [--prompt-tokens 512]
        [--prompt-logprobs 1] [--rounds 8] [--num-threads 1]

With prompt logprobs every prompt row goes through the LM head and a log-softmax (49k columns on
the default model) instead of one row per prompt; the result is the ratio of the two times, wall
and CPU (the process's own, steadier on a shared machine). The prompts are split into rounds,
each run by both systems in alternating order, so a drifting load does not favour either.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from pagedserve.benchmarks.workload import (
    RESULTS_DIR,
    WorkloadConfig,
    build_prompts,
    load_tokenizer,
    set_num_threads,
    write_results,
)

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
MAX_RATIO = 1.5  # the budget the issue set: scoring a prompt costs at most 1.5x its prefill


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--prompt-logprobs", type=int, default=1, help="top alternatives")
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument(
        "--rounds", type=int, default=8, help="slices of the prompts, each run by both systems"
    )
    parser.add_argument("--num-threads", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", type=Path, default=RESULTS_DIR / "prompt_logprobs.json")
    return parser.parse_args(argv)


def _make_engine(args: argparse.Namespace) -> Any:
    from pagedserve.configs import load_engine_config
    from pagedserve.engine.llm_engine import LLMEngine

    num_blocks_per_prompt = -(-(args.prompt_tokens + 1) // 16)
    settings = {
        "model": args.model,
        "dtype": args.dtype,
        "device": "cpu",
        "block_size": 16,
        "enable_prefix_caching": False,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        # room for the prompts one step's budget spans, not the whole workload at once
        "num_kv_blocks": 4 * num_blocks_per_prompt,
    }
    return LLMEngine(load_engine_config(cli=settings, environ={}))


def _time_run(engine: Any, prompts: list[list[int]], params: Any, tag: str) -> tuple[float, float]:
    """Wall and CPU seconds to prefill every prompt (all queued first, then stepped to the end)."""
    for index, prompt in enumerate(prompts):
        engine.add_request(f"{tag}-{index}", prompt, params)
    start, start_cpu = time.perf_counter(), time.process_time()
    num_scored = 0
    while engine.has_unfinished_requests():
        for delta in engine.step():
            num_scored += delta.prompt_logprobs is not None
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - start_cpu
    expected = len(prompts) if params.prompt_logprobs is not None else 0
    if num_scored != expected:
        raise RuntimeError(f"{tag}: {num_scored} prompts scored, expected {expected}")
    return seconds, cpu_seconds


def _summary(wall: list[float], cpu: list[float], num_tokens: int) -> dict[str, Any]:
    return {
        "seconds_per_round": wall,
        "cpu_seconds_per_round": cpu,
        "seconds": sum(wall),
        "cpu_seconds": sum(cpu),
        "prompt_tokens_per_s": num_tokens / sum(wall),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    from pagedserve.configs import SamplingParams

    args = _parse(argv)
    set_num_threads(args.num_threads)
    workload = WorkloadConfig(
        args.num_requests, args.prompt_tokens, args.prompt_tokens, 1, args.seed
    )
    prompts = build_prompts(workload, load_tokenizer(args.model))
    engine = _make_engine(args)
    systems = {
        "prefill": SamplingParams(temperature=0.0, max_tokens=1),
        "prefill+prompt_logprobs": SamplingParams(
            temperature=0.0, max_tokens=1, prompt_logprobs=args.prompt_logprobs
        ),
    }
    for name, params in systems.items():  # warm-up: kernel build, allocator, caches
        _time_run(engine, prompts[:2], params, f"warmup-{name}")
    # Each round runs both systems on the same slice of the prompts, in alternating order: a
    # load that drifts over the run (a shared machine) then weighs on both alike.
    wall: dict[str, list[float]] = {name: [] for name in systems}
    cpu: dict[str, list[float]] = {name: [] for name in systems}
    num_rounds = max(1, min(args.rounds, len(prompts)))
    for round_idx in range(num_rounds):
        chunk = prompts[round_idx::num_rounds]
        order = list(systems) if round_idx % 2 == 0 else list(reversed(systems))
        for name in order:
            seconds, cpu_seconds = _time_run(engine, chunk, systems[name], f"{name}-{round_idx}")
            wall[name].append(seconds)
            cpu[name].append(cpu_seconds)
    num_tokens = args.num_requests * args.prompt_tokens
    results: dict[str, Any] = {
        name: _summary(wall[name], cpu[name], num_tokens) for name in systems
    }
    plain, scored = results["prefill"], results["prefill+prompt_logprobs"]
    results["ratio"] = scored["seconds"] / plain["seconds"]
    results["cpu_ratio"] = scored["cpu_seconds"] / plain["cpu_seconds"]
    results["within_budget"] = max(results["ratio"], results["cpu_ratio"]) <= MAX_RATIO
    for name in systems:
        print(
            f"{name:>24}: {results[name]['seconds']:.1f} s wall, "
            f"{results[name]['cpu_seconds']:.1f} s CPU "
            f"({results[name]['prompt_tokens_per_s']:.0f} prompt tokens/s)"
        )
    print(f"ratio {results['ratio']:.3f} wall, {results['cpu_ratio']:.3f} CPU (budget {MAX_RATIO})")
    write_results(args.output, args, results)
    return results


if __name__ == "__main__":
    main()
