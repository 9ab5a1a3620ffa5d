"""Step time with and without a 2 Hz engine-state poller, on the fixed workload, in one run.

The seeded workload (64 requests, prompts of 32-512 tokens, 128 output tokens each, submitted
together) runs twice through an `AsyncEngine`, a fresh engine over the same loaded model each time
(the prefix cache starts empty). A poller asks for the engine state every 0.5 s and turns it into
the route's JSON, as a dashboard would, in alternate `--window-s` windows: the even ones in the
first run, the odd ones in the second (a crossover, so a machine that gets busier or quieter
between the runs shifts both arms alike). Every engine step is timed on the engine thread. Both
runs schedule the same steps (same prompts, released together, greedy, EOS ignored), so step i
of one run is paired with step i of the other where exactly one of them ran with the poller on:
the slowdown is the mean paired difference over the mean step time without it (goal: <= 2%),
with a 95% interval. Also reported: what one snapshot costs on the engine thread (the copy) and
off it (CPU time to classify the blocks and to write the JSON), the JSON's size, and the
poller's own work as a share of the engine's busy time, a bound that machine noise does not blur.

    python -m pagedserve.benchmarks.engine_state [--num-requests 64] [--repeats 1] [--poll-hz 2]
        [--window-s 4]
"""

from __future__ import annotations

import argparse
import asyncio
import math
import statistics
import threading
import time
from pathlib import Path
from typing import Any

from pagedserve.benchmarks.workload import (
    RESULTS_DIR,
    add_workload_args,
    build_prompts,
    load_tokenizer,
    set_num_threads,
    workload_from_args,
    write_results,
)

DEFAULT_MODEL = "SmolLM2-135M-Instruct"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_workload_args(parser)
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--kv-cache-memory", default="2GiB", help="holds the whole workload")
    parser.add_argument("--poll-hz", type=float, default=2.0)
    parser.add_argument("--window-s", type=float, default=4.0, help="poller on/off windows")
    parser.add_argument("--repeats", type=int, default=1, help="pairs of runs (crossed over)")
    parser.add_argument("--num-threads", type=int, default=None, help="torch threads")
    parser.add_argument("--output", type=Path, default=RESULTS_DIR / "engine_state.json")
    return parser.parse_args(argv)


def make_config(args: argparse.Namespace) -> Any:
    from pagedserve.configs import load_engine_config

    settings = {"model": args.model, "block_size": args.block_size}
    settings |= {"kv_cache_memory": args.kv_cache_memory, "device": "cpu"}
    return load_engine_config(cli=settings, environ={})


class TimedRun:
    """Times each step of `engine` and holds the first one until every request is queued.

    A step is "polled" when it starts in a window in which this run's poller is on.
    """

    def __init__(self, engine: Any, phase: int, window_s: float) -> None:
        self.step_seconds: list[float] = []
        self.step_polled: list[bool] = []
        self.snapshot_seconds: list[float] = []
        self.snapshot_cpu_seconds: list[float] = []
        self.build_cpu_seconds: list[float] = []  # classifying the blocks, on the event loop
        self.released = threading.Event()
        self.phase, self.window_s, self.start = phase, window_s, 0.0
        step = engine.step

        def timed_step() -> Any:
            if not self.released.is_set():
                self.released.wait()
                return []  # the loop applies the queued adds, then steps them all together
            start = time.perf_counter()
            deltas = step()
            self.step_seconds.append(time.perf_counter() - start)
            self.step_polled.append(self.is_on(start))
            return deltas

        engine.step = timed_step

    def release(self) -> None:
        self.start = time.perf_counter()
        self.released.set()

    def is_on(self, moment: float) -> bool:
        return int((moment - self.start) / self.window_s) % 2 == self.phase


async def run_once(config: Any, loaded: Any, prompts: list[list[int]], args, phase: int) -> dict:
    from pagedserve.configs import SamplingParams
    from pagedserve.engine import between_steps as between_steps_module
    from pagedserve.engine.async_engine import AsyncEngine
    from pagedserve.engine.llm_engine import LLMEngine

    engine = LLMEngine(config, loaded=loaded)
    timed = TimedRun(engine, phase, args.window_s)
    async_engine = AsyncEngine(config)
    async_engine.engine = engine
    take_state = between_steps_module.take_engine_state  # timed where it runs: the engine thread

    def timed_take_state(running: Any) -> Any:
        start, start_cpu = time.perf_counter(), time.thread_time()
        raw = take_state(running)
        timed.snapshot_seconds.append(time.perf_counter() - start)
        timed.snapshot_cpu_seconds.append(time.thread_time() - start_cpu)
        return raw

    between_steps_module.take_engine_state = timed_take_state
    build = between_steps_module.build_engine_state  # timed where it runs: on the event loop

    def timed_build(raw: Any) -> Any:
        start_cpu = time.thread_time()
        state = build(raw)
        timed.build_cpu_seconds.append(time.thread_time() - start_cpu)
        return state

    between_steps_module.build_engine_state = timed_build
    await async_engine.start()
    params = SamplingParams(temperature=0, max_tokens=args.output_tokens, ignore_eos=True)

    async def consume(index: int) -> int:
        num_tokens = 0
        async for delta in async_engine.generate(prompts[index], params, f"r{index}"):
            num_tokens += len(delta.new_token_ids)
        return num_tokens

    tasks = [asyncio.create_task(consume(i)) for i in range(len(prompts))]
    await asyncio.sleep(0.2)  # every generate() has queued its add
    done = asyncio.Event()
    timed.release()
    poller = asyncio.create_task(poll_state(async_engine, args.poll_hz, timed, done))
    num_tokens = sum(await asyncio.gather(*tasks))
    seconds = time.perf_counter() - timed.start
    done.set()
    polls = await poller
    await async_engine.shutdown()
    between_steps_module.build_engine_state = build
    between_steps_module.take_engine_state = take_state
    if num_tokens != len(prompts) * args.output_tokens:
        raise RuntimeError(f"{num_tokens} tokens, expected {len(prompts) * args.output_tokens}")
    return {
        "phase": phase,
        "seconds": seconds,
        "step_seconds": timed.step_seconds,
        "step_polled": timed.step_polled,
        "snapshot_seconds": timed.snapshot_seconds,
        "snapshot_cpu_seconds": timed.snapshot_cpu_seconds,
        "build_cpu_seconds": timed.build_cpu_seconds,
        **polls,
    }


async def poll_state(
    async_engine: Any, poll_hz: float, timed: TimedRun, done: asyncio.Event
) -> dict[str, Any]:
    """What GET /v1/engine/state does, `poll_hz` times a second in the on-windows, until `done`."""
    from pagedserve.server.routes.engine_state import state_to_json

    interval, json_seconds, num_bytes = 1.0 / poll_hz, [], 0
    while not done.is_set():
        started = time.perf_counter()
        if timed.is_on(started):
            state = await async_engine.engine_state()
            json_start = time.thread_time()  # CPU time: what it holds the GIL for
            num_bytes = len(state_to_json(state, "bench"))
            json_seconds.append(time.thread_time() - json_start)
        await asyncio.sleep(max(0.0, interval - (time.perf_counter() - started)))
    return {"num_polls": len(json_seconds), "json_seconds": json_seconds, "bytes": num_bytes}


def paired_slowdown(first: dict[str, Any], second: dict[str, Any]) -> dict[str, Any]:
    """Mean (polled - alone) over step indices where exactly one run polled, over the mean alone."""
    if len(first["step_seconds"]) != len(second["step_seconds"]):
        raise RuntimeError("the two runs scheduled different numbers of steps: not paired")
    polled, alone = [], []
    for a, b, a_on, b_on in zip(
        first["step_seconds"],
        second["step_seconds"],
        first["step_polled"],
        second["step_polled"],
        strict=True,
    ):
        if a_on != b_on:
            polled.append(a if a_on else b)
            alone.append(b if a_on else a)
    differences = [p - a for p, a in zip(polled, alone, strict=True)]
    if len(differences) < 2:  # a run shorter than a window: nothing to compare
        nan = float("nan")
        return {"num_steps": len(first["step_seconds"]), "num_paired_steps": len(differences)} | {
            "mean_step_ms_alone": nan,
            "mean_step_ms_polled": nan,
            "slowdown": nan,
            "slowdown_ci95": [nan, nan],
        }
    mean_alone, mean_difference = statistics.fmean(alone), statistics.fmean(differences)
    half_width = 1.96 * statistics.stdev(differences) / math.sqrt(len(differences))
    return {
        "num_steps": len(first["step_seconds"]),
        "num_paired_steps": len(differences),
        "mean_step_ms_alone": 1e3 * mean_alone,
        "mean_step_ms_polled": 1e3 * statistics.fmean(polled),
        "slowdown": mean_difference / mean_alone,
        "slowdown_ci95": [
            (mean_difference - half_width) / mean_alone,
            (mean_difference + half_width) / mean_alone,
        ],
    }


def cost_shares(run: dict[str, Any]) -> dict[str, float]:
    """The poller's own work as a share of the engine's busy time while it was on: the copy on
    the engine thread (which steps wait for), and the CPU the event loop's thread spent building
    the JSON (the most it can take from the engine thread through the GIL)."""
    busy = sum(s for s, on in zip(run["step_seconds"], run["step_polled"], strict=True) if on)
    return {
        "engine_thread_share": sum(run["snapshot_seconds"]) / busy,
        "loop_thread_cpu_share": (sum(run["build_cpu_seconds"]) + sum(run["json_seconds"])) / busy,
    }


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    pairs = [paired_slowdown(runs[i], runs[i + 1]) for i in range(0, len(runs), 2)]
    weights = [pair["num_paired_steps"] if pair["num_paired_steps"] > 1 else 0 for pair in pairs]
    snapshots = [s for run in runs for s in run["snapshot_seconds"]]
    snapshots_cpu = [s for run in runs for s in run["snapshot_cpu_seconds"]]
    builds = [s for run in runs for s in run["build_cpu_seconds"]]
    jsons = [s for run in runs for s in run["json_seconds"]]
    shares = [cost_shares(run) for run in runs]
    slowdowns = [p["slowdown"] * w for p, w in zip(pairs, weights, strict=True) if w]
    return {
        "pairs": pairs,
        "slowdown": sum(slowdowns) / sum(weights) if slowdowns else float("nan"),
        "cost_shares": shares,
        "cost_share_max": max(
            s["engine_thread_share"] + s["loop_thread_cpu_share"] for s in shares
        ),
        "wall_seconds": [run["seconds"] for run in runs],
        "num_polls": [run["num_polls"] for run in runs],
        "snapshot_on_engine_thread_ms_mean": 1e3 * statistics.fmean(snapshots),
        "snapshot_on_engine_thread_ms_max": 1e3 * max(snapshots),
        "snapshot_on_engine_thread_cpu_ms_mean": 1e3 * statistics.fmean(snapshots_cpu),
        "classify_cpu_ms_mean": 1e3 * statistics.fmean(builds),
        "json_cpu_ms_mean": 1e3 * statistics.fmean(jsons),
        "json_bytes": max(run["bytes"] for run in runs),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    from pagedserve.engine.heap import freeze_startup_objects, thaw_startup_objects
    from pagedserve.engine.memory import resolve_device
    from pagedserve.engine.model_loader import load_model

    args = parse_args(argv)
    set_num_threads(args.num_threads)
    config = make_config(args)
    prompts = build_prompts(workload_from_args(args), load_tokenizer(args.model))
    loaded = load_model(config.model, resolve_device(config.model.device))
    warmup = argparse.Namespace(**{**vars(args), "output_tokens": 2})
    asyncio.run(run_once(config, loaded, prompts[:2], warmup, phase=0))  # builds the kernel
    freeze_startup_objects()  # as the server does once its engine is up
    runs = []
    for repeat in range(args.repeats):
        for phase in (repeat % 2, 1 - repeat % 2):
            runs.append(asyncio.run(run_once(config, loaded, prompts, args, phase)))
            print(
                f"run {len(runs)}: poller on in the {'odd' if phase else 'even'} windows, "
                f"{runs[-1]['seconds']:.1f} s, {runs[-1]['num_polls']} polls"
            )
    thaw_startup_objects()
    summary = summarize(runs)
    for pair in summary["pairs"]:
        low, high = pair["slowdown_ci95"]
        print(
            f"{pair['num_paired_steps']} of {pair['num_steps']} steps paired: "
            f"{pair['mean_step_ms_alone']:.1f} ms alone, {pair['mean_step_ms_polled']:.1f} ms "
            f"polled at {args.poll_hz:g} Hz: slowdown {100 * pair['slowdown']:+.2f}% "
            f"(95% CI {100 * low:+.2f}% .. {100 * high:+.2f}%)"
        )
    print(
        f"snapshot {summary['snapshot_on_engine_thread_ms_mean']:.3f} ms on the engine thread "
        f"({summary['snapshot_on_engine_thread_cpu_ms_mean']:.3f} ms CPU, max "
        f"{summary['snapshot_on_engine_thread_ms_max']:.3f} ms wall), "
        f"{summary['classify_cpu_ms_mean']:.2f} ms CPU to classify the blocks and "
        f"{summary['json_cpu_ms_mean']:.2f} ms to write the JSON "
        f"({summary['json_bytes']} bytes); the poller's own work is at most "
        f"{100 * summary['cost_share_max']:.2f}% of the engine's busy time"
    )
    write_results(args.output, args, summary)
    return summary


if __name__ == "__main__":
    main()
