"""Offline throughput: the seeded workload through our `LLM`, against Hugging Face `generate` run
one request at a time and in static, left-padded batches, all in the same process and dtype.

    python -m pagedserve.benchmarks.throughput [--num-requests 64] [--dtype float32 bfloat16]
        [--baselines hf-single hf-static] [--hf-sample 4] [--hf-batches 0] [--num-threads 1]

HF one-at-a-time is slow (64 x 128 tokens take ~10 minutes), so `--hf-sample K` times it on the
first K requests only and extrapolates its per-output-token rate; the table says so.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import time
from dataclasses import dataclass
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
from pagedserve.engine.heap import thaw_startup_objects

BASELINES = ("hf-single", "hf-static", "vllm")
DEFAULT_MODEL = "SmolLM2-135M-Instruct"


@dataclass(frozen=True, slots=True)
class Measurement:
    """One system's timed run; `extrapolated` when it ran on a subset of the workload."""

    dtype: str
    system: str
    num_requests_timed: int
    num_prompt_tokens: int
    num_output_tokens: int
    seconds: float
    extrapolated: bool = False

    @property
    def output_tokens_per_s(self) -> float:
        return self.num_output_tokens / self.seconds

    @property
    def total_tokens_per_s(self) -> float:
        return (self.num_prompt_tokens + self.num_output_tokens) / self.seconds

    def to_dict(self, ours: Measurement) -> dict[str, Any]:
        return {
            "dtype": self.dtype,
            "system": self.system,
            "num_requests_timed": self.num_requests_timed,
            "num_prompt_tokens": self.num_prompt_tokens,
            "num_output_tokens": self.num_output_tokens,
            "seconds": self.seconds,
            "extrapolated": self.extrapolated,
            "output_tokens_per_s": self.output_tokens_per_s,
            "total_tokens_per_s": self.total_tokens_per_s,
            "ours_speedup_output": ours.output_tokens_per_s / self.output_tokens_per_s,
        }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_workload_args(parser)
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--dtype", nargs="+", default=["float32"], choices=["float32", "bfloat16"])
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument(
        "--kv-cache-memory",
        default="2GiB",
        help="KV budget: the default holds the whole workload at once",
    )
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--attention-backend", default="auto", choices=["auto", "cpu", "torch"])
    parser.add_argument(
        "--baselines",
        nargs="*",
        default=list(BASELINES),
        choices=BASELINES,
        help="baselines to run (none: give the flag alone)",
    )
    parser.add_argument(
        "--hf-sample",
        type=int,
        default=4,
        help="HF one-at-a-time: time the first K requests, extrapolate (0 = all)",
    )
    parser.add_argument("--hf-batch-size", type=int, default=16)
    parser.add_argument(
        "--hf-batches",
        type=int,
        default=0,
        help="HF static batching: time the first B batches, extrapolate (0 = all)",
    )
    parser.add_argument(
        "--num-threads", type=int, default=None, help="torch threads (default: torch's)"
    )
    parser.add_argument("--output", type=Path, default=RESULTS_DIR / "throughput.json")
    return parser.parse_args(argv)


def run_ours(args: argparse.Namespace, dtype: str, prompts: list[list[int]]) -> list[Measurement]:
    """The whole workload submitted together, then the first `--hf-sample` requests one at a
    time (single-request decode, comparable row for row with HF one-at-a-time)."""
    from pagedserve.configs import SamplingParams
    from pagedserve.engine.llm import LLM

    llm = LLM(
        model=args.model,
        dtype=dtype,
        block_size=args.block_size,
        kv_cache_memory=args.kv_cache_memory,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        attention_backend=args.attention_backend,
        enable_prefix_caching=False,  # the baselines have no prefix cache either
    )
    params = SamplingParams(temperature=0, max_tokens=args.output_tokens, ignore_eos=True)
    warmup = SamplingParams(temperature=0, max_tokens=2)
    llm.generate([prompts[0][:8]], warmup)  # untimed: builds or loads the attention kernel
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    seconds = time.perf_counter() - start
    num_output_tokens = sum(len(output.outputs[0].token_ids) for output in outputs)
    expected = len(prompts) * args.output_tokens
    if num_output_tokens != expected:
        raise RuntimeError(f"pagedserve produced {num_output_tokens} tokens, expected {expected}")
    batched = Measurement(
        dtype,
        "pagedserve (continuous batching)",
        len(prompts),
        sum(map(len, prompts)),
        num_output_tokens,
        seconds,
    )
    sample = prompts[: args.hf_sample or len(prompts)]
    start = time.perf_counter()
    for prompt in sample:
        llm.generate([prompt], params)
    single = Measurement(
        dtype,
        "pagedserve, one request at a time",
        len(sample),
        sum(map(len, sample)),
        len(sample) * args.output_tokens,
        time.perf_counter() - start,
        extrapolated=len(sample) < len(prompts),
    )
    return [batched, single]


def load_hf_model(model: str, dtype: str) -> tuple[Any, Any]:
    """A fresh HF model with its stock attention (not the instance the engine patches)."""
    from pagedserve.configs.engine import ModelConfig
    from pagedserve.engine.model_loader import load_model

    loaded = load_model(ModelConfig(model=model, dtype=dtype), "cpu", attn_implementation="sdpa")
    return loaded.model, loaded.tokenizer


def hf_generate(model: Any, tokenizer: Any, batch: list[list[int]], num_output_tokens: int) -> int:
    """Greedy HF generate of one left-padded batch; exactly `num_output_tokens` each (EOS banned)."""
    import torch

    width = max(map(len, batch))
    pad_id = (
        tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    )
    input_ids = torch.tensor([[pad_id] * (width - len(ids)) + ids for ids in batch])
    attention_mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in batch])
    with torch.inference_mode():
        output = model.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            do_sample=False,
            max_new_tokens=num_output_tokens,
            min_new_tokens=num_output_tokens,
            pad_token_id=pad_id,
        )
    return (output.shape[1] - width) * len(batch)


def run_hf(
    args: argparse.Namespace,
    dtype: str,
    prompts: list[list[int]],
    hf: tuple[Any, Any],
    batch_size: int,
    limit: int,
) -> Measurement:
    """HF `generate` over batches of `batch_size` prompts (1 = one at a time); the first
    `limit` batches only when limit > 0, extrapolated by per-output-token rate."""
    model, tokenizer = hf
    batches = [prompts[i : i + batch_size] for i in range(0, len(prompts), batch_size)]
    timed = batches[:limit] if limit > 0 else batches
    hf_generate(model, tokenizer, [prompts[0][:8]], 2)  # warm-up: first-call allocations
    start = time.perf_counter()
    num_output_tokens = sum(
        hf_generate(model, tokenizer, batch, args.output_tokens) for batch in timed
    )
    seconds = time.perf_counter() - start
    system = (
        "HF generate, one at a time"
        if batch_size == 1
        else f"HF generate, static batches of {batch_size}"
    )
    return Measurement(
        dtype,
        system,
        sum(map(len, timed)),
        sum(len(p) for b in timed for p in b),
        num_output_tokens,
        seconds,
        extrapolated=len(timed) < len(batches),
    )


def run_vllm(args: argparse.Namespace, dtype: str, prompts: list[list[int]]) -> Measurement:
    from vllm import LLM as VllmLLM
    from vllm import SamplingParams as VllmSamplingParams

    from pagedserve.engine.model_loader import resolve_model_path

    llm = VllmLLM(model=str(resolve_model_path(args.model)[0]), dtype=dtype)
    params = VllmSamplingParams(temperature=0, max_tokens=args.output_tokens, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompts], params)
    seconds = time.perf_counter() - start
    return Measurement(
        dtype,
        "vLLM",
        len(prompts),
        sum(map(len, prompts)),
        sum(len(o.outputs[0].token_ids) for o in outputs),
        seconds,
    )


def run_dtype(args: argparse.Namespace, dtype: str, prompts: list[list[int]]) -> list[Measurement]:
    measurements = run_ours(args, dtype, prompts)
    thaw_startup_objects()  # LLM froze its engine (engine/heap.py): collectable again
    gc.collect()
    if {"hf-single", "hf-static"} & set(args.baselines):
        hf = load_hf_model(args.model, dtype)
        if "hf-single" in args.baselines:
            measurements.append(run_hf(args, dtype, prompts, hf, 1, args.hf_sample))
        if "hf-static" in args.baselines:
            measurements.append(
                run_hf(args, dtype, prompts, hf, args.hf_batch_size, args.hf_batches)
            )
    if "vllm" in args.baselines and importlib.util.find_spec("vllm") is not None:
        measurements.append(run_vllm(args, dtype, prompts))
    return measurements


def print_table(rows: list[dict[str, Any]], num_requests: int) -> None:
    print(
        f"{'dtype':<9} {'system':<38} {'timed':>9} {'out tok':>8} {'s':>8} "
        f"{'out tok/s':>10} {'total tok/s':>12} {'ours/this':>10}"
    )
    for row in rows:
        timed = f"{row['num_requests_timed']}/{num_requests}" + ("*" if row["extrapolated"] else "")
        print(
            f"{row['dtype']:<9} {row['system']:<38} {timed:>9} {row['num_output_tokens']:>8} "
            f"{row['seconds']:>8.1f} {row['output_tokens_per_s']:>10.1f} "
            f"{row['total_tokens_per_s']:>12.1f} {row['ours_speedup_output']:>9.2f}x"
        )
    if any(row["extrapolated"] for row in rows):
        print(
            "* timed on the first requests/batches only; tokens/s is that subset's rate, "
            "extrapolated to the whole workload"
        )


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    args = parse_args(argv)
    set_num_threads(args.num_threads)
    workload = workload_from_args(args)
    prompts = build_prompts(workload, load_tokenizer(args.model))
    rows = []
    for dtype in args.dtype:
        measurements = run_dtype(args, dtype, prompts)
        rows.extend(m.to_dict(measurements[0]) for m in measurements)
    print(
        f"offline throughput: {workload.num_requests} requests, prompts "
        f"{workload.min_prompt_tokens}-{workload.max_prompt_tokens} tokens, "
        f"{workload.output_tokens} output tokens each, greedy, threads={args.num_threads or 'default'}"
    )
    print_table(rows, workload.num_requests)
    if "vllm" in args.baselines and importlib.util.find_spec("vllm") is None:
        print("vLLM baseline: skipped (vllm is not importable in this environment)")
    write_results(args.output, args, rows)
    return rows


if __name__ == "__main__":
    main()
