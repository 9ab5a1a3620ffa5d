"""Per-step breakdown of the engine's decode step at batch 1, 16 and 64, so the hot path shows.

Calls the engine's pieces directly, in `LLMEngine.step`'s order, and times each phase: schedule,
prepare (incl. copy-on-write copies), forward, sample, update (scheduler) and detokenize (the
engine's per-request deltas). The baseline is the forward pass itself: everything else is
overhead, reported as a share of the whole step (goal: <= 15% at batch 64). Inside the forward
pass, the time spent in the paged attention backend (K/V store + attention, all layers) is timed
separately and reported as its share of the step (goal: < 25% at 64 x 1,024 context), next to
its floor: the time to stream the step's K/V bytes at the machine's measured read bandwidth
(`read_bandwidth`), i.e. the share attention would have if the kernel ran at the memory roofline.

    python -m pagedserve.benchmarks.step [--batch-sizes 1 16 64] [--steps 10] [--prompt-tokens 128] [--profile]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from pagedserve.benchmarks.attention_timer import time_attention
from pagedserve.benchmarks.workload import (
    RESULTS_DIR,
    WorkloadConfig,
    build_prompts,
    read_bandwidth,
    set_num_threads,
    write_results,
)
from pagedserve.cache.cache_engine import KV_CACHE_DTYPES

PHASES = ("schedule", "prepare", "forward", "sample", "update", "detokenize")
DEFAULT_MODEL = "SmolLM2-135M-Instruct"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--attention-backend", default="auto", choices=["auto", "cpu", "torch"])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--prompt-tokens", type=int, default=128, help="context before decoding")
    parser.add_argument("--steps", type=int, default=10, help="timed decode steps per batch size")
    parser.add_argument("--warmup-steps", type=int, default=2)
    parser.add_argument(
        "--num-threads", type=int, default=None, help="torch threads (default: torch's)"
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="also write a torch profiler chrome trace of the largest batch",
    )
    parser.add_argument(
        "--kv-cache-dtype", default="auto", choices=["auto", *sorted(KV_CACHE_DTYPES)]
    )
    parser.add_argument(
        "--kv-cache-memory",
        default=None,
        help="KV budget (default: the engine's); 64 x 1,024 in fp32 needs ~4GiB",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", type=Path, default=RESULTS_DIR / "step.json")
    return parser.parse_args(argv)


class AttentionSeconds:
    """The seconds the engine's steps spent in attention (store + attend) so far."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def add(self, seconds: float) -> None:
        self.seconds += seconds


def make_engine(args: argparse.Namespace, max_batch_size: int) -> Any:
    from pagedserve.engine.llm import LLM

    engine = LLM(
        model=args.model,
        dtype=args.dtype,
        block_size=args.block_size,
        max_num_seqs=max_batch_size,
        attention_backend=args.attention_backend,
        max_num_batched_tokens=max(512, max_batch_size),
        enable_prefix_caching=False,
        kv_cache_dtype=args.kv_cache_dtype,
        **({"kv_cache_memory": args.kv_cache_memory} if args.kv_cache_memory else {}),
    ).engine
    return engine


def fill_to_decode(engine: Any, prompts: list[list[int]]) -> list[str]:
    """Queue one request per prompt and step until every one is decoding (prefills done).

    Their max_tokens is as large as the context allows: none finishes while being timed."""
    from pagedserve.configs import SamplingParams

    request_ids = [f"step-{index}" for index in range(len(prompts))]
    for request_id, prompt in zip(request_ids, prompts, strict=True):
        params = SamplingParams(
            temperature=0, max_tokens=engine.max_model_len - len(prompt), ignore_eos=True
        )
        engine.add_request(request_id, prompt, params)
    scheduler = engine.scheduler
    while scheduler.num_waiting or any(r.num_output_tokens == 0 for r in scheduler.running):
        engine.step()
    return request_ids


def drain(engine: Any, request_ids: list[str]) -> None:
    """Abort the batch, so the next measurement starts from an empty engine."""
    for request_id in request_ids:
        engine.abort_request(request_id)


def timed_step(engine: Any, attention: AttentionSeconds) -> dict[str, float]:
    """One decode step, phase by phase, as `LLMEngine.step` runs it; seconds per phase.

    NOTE: mirrors `step()` through its seams (the output processor's `sampling_rows` and
    `process`); the smoke test fails if they change, so this cannot drift from the real step."""
    from pagedserve.engine.sampler import SampledBatch
    from pagedserve.scheduler import ModelRunnerOutput

    runner, clock = engine.runner, time.perf_counter
    # Each decoding request attends over all its tokens: that many K/V rows, every layer.
    kv_bytes = sum(r.num_tokens for r in engine.scheduler.running) * (
        runner.cache_engine.spec.bytes_per_token
    )
    t0 = clock()
    plan = engine.scheduler.schedule()
    t1 = clock()
    runner.cache_engine.copy_blocks(plan.block_copies)
    batch = runner.prepare(plan)
    t2 = clock()
    attention_before = attention.seconds
    logits = runner.forward(batch)
    t3 = clock()
    attention_s = attention.seconds - attention_before
    rows = engine.outputs.sampling_rows(plan)
    sampled = SampledBatch.split(rows, engine.sampler.sample(logits, rows))
    t4 = clock()
    updates = engine.scheduler.update_from_output(plan, ModelRunnerOutput(sampled.token_ids))
    t5 = clock()
    engine.outputs.process(updates, sampled.logprobs)
    t6 = clock()
    if plan.num_batched_tokens != len(plan.requests):
        raise RuntimeError("a timed step was not a pure decode step")
    phases = dict(zip(PHASES, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4, t6 - t5), strict=True))
    return {**phases, "attention": attention_s, "kv_bytes": kv_bytes}


def measure(
    engine: Any,
    attention: AttentionSeconds,
    args: argparse.Namespace,
    prompts: list[list[int]],
    read_bytes_per_s: float,
) -> dict[str, Any]:
    """Median of each phase over `args.steps` decode steps at batch `len(prompts)`."""
    request_ids = fill_to_decode(engine, prompts)
    if engine.scheduler.num_running != len(prompts):
        raise RuntimeError(f"only {engine.scheduler.num_running} of {len(prompts)} requests fit")
    for _ in range(args.warmup_steps):
        timed_step(engine, attention)
    samples = [timed_step(engine, attention) for _ in range(args.steps)]
    phases = {phase: _median([s[phase] for s in samples]) for phase in PHASES}
    step_s = sum(phases.values())
    overhead_s = step_s - phases["forward"]
    attention_s = _median([s["attention"] for s in samples])
    kv_bytes = _median([s["kv_bytes"] for s in samples])
    attention_floor_s = kv_bytes / read_bytes_per_s
    drain(engine, request_ids)
    return {
        "batch_size": len(prompts),
        "phases_ms": {k: v * 1e3 for k, v in phases.items()},
        "step_ms": step_s * 1e3,
        "overhead_fraction": overhead_s / step_s,
        # Part of "forward": the attention backend's K/V stores and paged attention, all layers.
        "attention_ms": attention_s * 1e3,
        "attention_fraction": attention_s / step_s,
        # At the memory roofline: the step's K/V bytes read once at `read_gb_per_s`.
        "kv_read_mb": kv_bytes / 1e6,
        "attention_floor_ms": attention_floor_s * 1e3,
        "attention_floor_fraction": attention_floor_s / (step_s - attention_s + attention_floor_s),
        "decode_tokens_per_s": len(prompts) / step_s,
    }


def profile_steps(engine: Any, args: argparse.Namespace, prompts: list[list[int]]) -> Path:
    """Chrome trace of a few whole decode steps at batch `len(prompts)`; prints the top ops."""
    from torch.profiler import ProfilerActivity, profile, record_function

    request_ids = fill_to_decode(engine, prompts)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as profiler:
        for _ in range(min(3, args.steps)):
            with record_function("LLMEngine.step"):
                engine.step()
    drain(engine, request_ids)
    trace = args.output.parent / f"step_trace_batch{len(prompts)}.json"
    trace.parent.mkdir(parents=True, exist_ok=True)
    profiler.export_chrome_trace(str(trace))
    print(profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))
    print(f"wrote {trace}")
    return trace


def print_table(rows: list[dict[str, Any]]) -> None:
    print(
        f"{'batch':>5} "
        + " ".join(f"{phase + ' ms':>13}" for phase in PHASES)
        + f" {'step ms':>9} {'overhead':>9} {'attn ms':>8} {'attn':>6} {'floor ms':>8} {'floor':>6} {'tok/s':>8}"
    )
    for row in rows:
        print(
            f"{row['batch_size']:>5} "
            + " ".join(f"{row['phases_ms'][phase]:>13.2f}" for phase in PHASES)
            + f" {row['step_ms']:>9.2f} {row['overhead_fraction']:>9.1%}"
            + f" {row['attention_ms']:>8.2f} {row['attention_fraction']:>6.1%}"
            + f" {row['attention_floor_ms']:>8.2f} {row['attention_floor_fraction']:>6.1%}"
            + f" {row['decode_tokens_per_s']:>8.1f}"
        )


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    args = parse_args(argv)
    set_num_threads(args.num_threads)
    engine = make_engine(args, max(args.batch_sizes))
    attention = AttentionSeconds()  # the engine's store and attention calls (attention_timer.py)
    time_attention(engine, attention.add)
    workload = WorkloadConfig(
        num_requests=max(args.batch_sizes),
        min_prompt_tokens=args.prompt_tokens,
        max_prompt_tokens=args.prompt_tokens,
        seed=args.seed,
    )
    prompts = build_prompts(workload, engine.tokenizer)
    read_bytes_per_s = read_bandwidth()
    rows = [
        measure(engine, attention, args, prompts[:batch_size], read_bytes_per_s)
        for batch_size in args.batch_sizes
    ]
    for row in rows:
        row["read_gb_per_s"] = read_bytes_per_s / 1e9
    print(
        f"decode step breakdown: {args.dtype}, KV cache {args.kv_cache_dtype}, context {args.prompt_tokens}+ tokens, "
        f"median of {args.steps} steps, threads={args.num_threads or 'default'}; "
        f"floor = attention at the {read_bytes_per_s / 1e9:.1f} GB/s read roofline"
    )
    print_table(rows)
    if args.profile:
        rows[-1]["trace"] = str(profile_steps(engine, args, prompts[: max(args.batch_sizes)]))
    write_results(args.output, args, rows)
    return rows


if __name__ == "__main__":
    main()
