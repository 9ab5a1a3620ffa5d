"""Prefill attention: one chunk of new tokens attending causally over itself through the paged
cache, against the GFLOP/s the model's own matrix multiplies reach in the same run.

Each ISA build of the CPU kernel, SDPA on contiguous K/V (causal, GQA expanded) and the MLP's up
projection at the chunk's row count ([chunk, 576] @ [576, 1536] for the default model) are timed
round by round in one process; median of `--repeats`. The projection runs as the loader runs the
model's linears on this host: float32 by `F.linear` (MKL) or oneDNN (`--cpu-float32-linear auto`),
bfloat16 by oneDNN with packed weights where the CPU has native bf16 (AVX512_BF16 / AMX).
`--dtype bfloat16` times a bfloat16 query over a bfloat16 cache (the AMX path of the kernel on
CPUs with AMX) against SDPA and the matmul in bfloat16.
Attention's FLOPs are the causal triangle's: 4 * heads * head_dim * chunk * (chunk + 1) / 2 (QK^T
and PV). The issue's goal: the kernel at >= 50% of the matmul's GFLOP/s for a 1,024-token chunk.

    python -m pagedserve.benchmarks.prefill_attention [--chunk 1024] [--dtype bfloat16] [--isa avx2]
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.benchmarks.workload import (
    RESULTS_DIR,
    set_num_threads,
    time_interleaved,
    write_results,
)
from pagedserve.cache.attention import AttentionMetadata
from pagedserve.cache.attention.cpu import CpuPagedAttention, host_runnable_isas
from pagedserve.engine.packed_linear import PackedLinear, can_pack, can_pack_float32


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunk", type=int, default=1024, help="new tokens in the chunk")
    parser.add_argument("--num-heads", type=int, default=9)
    parser.add_argument("--num-kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--intermediate-size", type=int, default=1536, help="the matmul's N")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--repeats", type=int, default=9, help="timed rounds (median reported)")
    parser.add_argument(
        "--isa", nargs="+", default=None, help="kernel builds (default: all the host runs)"
    )
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: all)")
    parser.add_argument("--output", type=Path, default=RESULTS_DIR / "prefill_attention.json")
    return parser.parse_args(argv)


def bench_prefill(
    *,
    chunk: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    block_size: int,
    repeats: int,
    isas: list[str] | None = None,
    intermediate_size: int = 1536,
    dtype: torch.dtype = torch.float32,
) -> list[dict[str, Any]]:
    """One row per implementation: ms, GFLOP/s, and the fraction of the matmul's GFLOP/s.
    `isas`: the kernel builds to time (None: every one the host runs); `dtype`: of the query, the
    cache and the matmul."""
    num_blocks = -(-chunk // block_size)
    shape = (num_blocks + 4, block_size, kv_heads, head_dim)
    key_cache, value_cache = torch.randn(shape).to(dtype), torch.randn(shape).to(dtype)
    table = torch.randperm(num_blocks + 4)[:num_blocks].to(torch.int32)  # scattered, as served
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(chunk, dtype=torch.int64),
        block_tables=table[None],
        query_start_loc=torch.tensor([0, chunk], dtype=torch.int32),
        seq_lens=torch.tensor([chunk], dtype=torch.int32),
        max_query_len=chunk,
    )
    query, scale = torch.randn(chunk, heads, head_dim).to(dtype), head_dim**-0.5

    def contiguous(cache: torch.Tensor) -> torch.Tensor:  # [heads, chunk, head_dim], GQA expanded
        rows = cache[table.long()].reshape(-1, kv_heads, head_dim)[:chunk]
        return rows.transpose(0, 1).repeat_interleave(heads // kv_heads, dim=0)[None]

    keys, values, queries = contiguous(key_cache), contiguous(value_cache), query.transpose(0, 1)
    hidden = torch.randn(chunk, heads * head_dim).to(dtype)
    linear = nn.Linear(heads * head_dim, intermediate_size, bias=False).requires_grad_(False)
    linear = linear.to(dtype)
    if can_pack(linear) or can_pack_float32(linear):  # as the loader runs the model's linears
        linear = PackedLinear(linear)
    kernels = {isa: CpuPagedAttention(isa) for isa in isas or host_runnable_isas()}
    candidates: dict[str, Callable[[], Any]] = {
        f"cpu_{isa}": lambda k=kernel: k.forward(query, key_cache, value_cache, meta, scale)
        for isa, kernel in kernels.items()
    }
    candidates["sdpa_contiguous"] = lambda: F.scaled_dot_product_attention(
        queries[None], keys, values, is_causal=True, scale=scale
    )
    candidates["matmul"] = lambda: linear(hidden)
    times = time_interleaved(candidates, repeats)
    seconds = {name: statistics.median(wall) for name, (wall, _) in times.items()}
    attention_flops = 4 * heads * head_dim * chunk * (chunk + 1) / 2
    matmul_rate = 2 * chunk * hidden.shape[1] * intermediate_size / seconds["matmul"]
    rows = []
    for name, median in seconds.items():
        flops = attention_flops if name != "matmul" else matmul_rate * median
        rows.append(
            {
                "impl": name,
                "dtype": str(dtype).removeprefix("torch."),
                "chunk": chunk,
                "median_ms": median * 1e3,
                "gflop_per_s": flops / median / 1e9,
                "fraction_of_matmul": flops / median / matmul_rate,
            }
        )
    return rows


def print_prefill(rows: list[dict[str, Any]]) -> None:
    print(
        f"prefill attention, one {rows[0]['chunk']}-token chunk in {rows[0]['dtype']}, "
        f"threads {torch.get_num_threads()}"
    )
    print(f"{'impl':<16} {'median ms':>10} {'GFLOP/s':>9} {'of matmul':>10}")
    for row in rows:
        print(
            f"{row['impl']:<16} {row['median_ms']:>10.2f} {row['gflop_per_s']:>9.1f} "
            f"{row['fraction_of_matmul']:>9.0%}"
        )


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    args = parse_args(argv)
    set_num_threads(args.threads)
    rows = bench_prefill(
        chunk=args.chunk,
        heads=args.num_heads,
        kv_heads=args.num_kv_heads,
        head_dim=args.head_dim,
        block_size=args.block_size,
        repeats=args.repeats,
        isas=args.isa,
        intermediate_size=args.intermediate_size,
        dtype=getattr(torch, args.dtype),
    )
    print_prefill(rows)
    write_results(args.output, args, rows)
    return rows


if __name__ == "__main__":
    main()
