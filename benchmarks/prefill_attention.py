"""Prefill attention: one chunk of new tokens attending causally over itself through the paged
cache, against the GFLOP/s the model's own matrix multiplies reach in the same run.

Each ISA build of the CPU kernel, SDPA on contiguous K/V (causal, GQA expanded) and the MLP's up
projection at the chunk's row count ([chunk, 576] @ [576, 1536] for the default model) are timed
round by round in one process; median of `--repeats`. The projection runs as the loader runs the
model's linears on this host: float32 by `F.linear` (MKL) or oneDNN (`--cpu-float32-linear auto`),
bfloat16 by oneDNN with packed weights where the CPU has native bf16 (AVX512_BF16 / AMX).
A build below the host's ISA is held to the matmul of the CPU it stands for: for bfloat16 on a
build without bf16 dot products (AVX2, AVX-512 without AVX512_BF16) that is the loader's widened
float32 linear (`matmul_widened`), not the host's native bf16 one, which such a CPU lacks (there
torch's own bf16 GEMM ran at 39 GFLOP/s against float32's 186, with oneDNN and MKL held to AVX2 on
a Zen 4). On a host with AVX-512 the AVX2 build is timed in a child process whose oneDNN and MKL
are held to AVX2 (`ONEDNN_MAX_CPU_ISA`, `MKL_ENABLE_INSTRUCTIONS`), interleaved there with that
matmul (rows `matmul_avx2`, `matmul_widened_avx2`): against the host's AVX-512 matmul it could
reach half the fraction at most (34% on a Sapphire Rapids, where the held matmul ran at half the
host's rate). The AVX-512 build's BLAS is the host's own.
`--dtype bfloat16` times a bfloat16 query over a bfloat16 cache (the AMX path of the kernel on
CPUs with AMX) against SDPA and the matmul in bfloat16.
Attention's FLOPs are the causal triangle's: 4 * heads * head_dim * chunk * (chunk + 1) / 2 (QK^T
and PV). The issue's goal: the kernel at >= 50% of the matmul's GFLOP/s for a 1,024-token chunk.

    python -m pagedserve.benchmarks.prefill_attention [--chunk 1024] [--dtype bfloat16] [--isa avx2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
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
from pagedserve.cache.attention.cpu_features import host_cpu_flags
from pagedserve.engine.packed_linear import PackedLinear, can_pack, can_pack_float32
from pagedserve.engine.widened_linear import WidenedLinear, can_widen_linears

# oneDNN and MKL held to AVX2 for the AVX2 build's child process (module docstring).
BLAS_HELD_TO_AVX2 = {"ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}


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
    isas = list(host_runnable_isas() if isas is None else isas)
    held_to_avx2: list[dict[str, Any]] = []
    if "avx2" in isas and blas_runs_above_avx2():
        isas.remove("avx2")
        held_to_avx2 = _avx2_rows_in_child(
            {
                "--chunk": chunk,
                "--num-heads": heads,
                "--num-kv-heads": kv_heads,
                "--head-dim": head_dim,
                "--block-size": block_size,
                "--repeats": repeats,
                "--intermediate-size": intermediate_size,
                "--dtype": str(dtype).removeprefix("torch."),
                "--threads": torch.get_num_threads(),
            }
        )
    kernels = {isa: CpuPagedAttention(isa) for isa in isas}
    candidates: dict[str, Callable[[], Any]] = {
        f"cpu_{isa}": lambda k=kernel: k.forward(query, key_cache, value_cache, meta, scale)
        for isa, kernel in kernels.items()
    }
    candidates["sdpa_contiguous"] = lambda: F.scaled_dot_product_attention(
        queries[None], keys, values, is_causal=True, scale=scale
    )
    baseline, linears = _baselines(list(kernels), hidden.shape[1], intermediate_size, dtype)
    for name, linear in linears.items():
        candidates[name] = lambda lin=linear: lin(hidden)
    times = time_interleaved(candidates, repeats)
    seconds = {name: statistics.median(wall) for name, (wall, _) in times.items()}
    attention_flops = 4 * heads * head_dim * chunk * (chunk + 1) / 2
    matmul_flops = 2 * chunk * hidden.shape[1] * intermediate_size
    rows = []
    for name, median in seconds.items():
        held_to = baseline.get(name.removeprefix("cpu_"), "matmul")
        flops = matmul_flops if name in linears else attention_flops
        rows.append(
            {
                "impl": name,
                "dtype": str(dtype).removeprefix("torch."),
                "chunk": chunk,
                "median_ms": median * 1e3,
                "gflop_per_s": flops / median / 1e9,
                "baseline": held_to,
                "fraction_of_matmul": flops / median / (matmul_flops / seconds[held_to]),
            }
        )
    return rows + held_to_avx2


def blas_runs_above_avx2() -> bool:
    """Whether torch's BLAS here runs AVX-512 (the host has it, and this process's oneDNN and MKL
    are not already held to AVX2)."""
    held = all(os.environ.get(name) == value for name, value in BLAS_HELD_TO_AVX2.items())
    return "avx512f" in host_cpu_flags() and not held


def _avx2_rows_in_child(flags: dict[str, object]) -> list[dict[str, Any]]:
    """The AVX2 build's row and its matmul's, timed by this module's command line (`flags`: its
    options but --isa and --output) in a child process with the BLAS held to AVX2; the matmul
    row renamed `<baseline>_avx2`."""
    with tempfile.TemporaryDirectory() as folder:
        output = Path(folder) / "avx2.json"
        command = [sys.executable, "-m", "pagedserve.benchmarks.prefill_attention", "--isa", "avx2"]
        command += [str(part) for flag in flags.items() for part in flag]
        command += ["--output", str(output)]
        env = os.environ | BLAS_HELD_TO_AVX2
        subprocess.run(command, env=env, check=True, stdout=subprocess.DEVNULL)
        rows = json.loads(output.read_text())["results"]
    kernel = next(row for row in rows if row["impl"] == "cpu_avx2")
    matmul = next(row for row in rows if row["impl"] == kernel["baseline"])
    kernel["baseline"] = matmul["impl"] = f"{kernel['baseline']}_avx2"
    matmul["baseline"], matmul["fraction_of_matmul"] = matmul["impl"], 1.0
    return [kernel, matmul]


def _baselines(
    isas: list[str], hidden_size: int, intermediate_size: int, dtype: torch.dtype
) -> tuple[dict[str, str], dict[str, nn.Module]]:
    """Which matmul each build is held to, and those matmuls by name: the matmul of the CPU the
    build stands for. A bfloat16 build without bf16 dot products is held to the widened float32
    linear such a CPU's loader runs, not to this host's native bf16 one; "matmul" is the host's."""
    baseline: dict[str, str] = {}
    linears = {"matmul": model_linear(hidden_size, intermediate_size, dtype, host_cpu_flags())}
    for isa in isas:
        linear = model_linear(hidden_size, intermediate_size, dtype, build_cpu_flags(isa))
        same = type(linear) is type(linears["matmul"])  # flags change only whether it widens
        baseline[isa] = "matmul" if same else "matmul_widened"
        linears.setdefault(baseline[isa], linear)
    return baseline, linears


def build_cpu_flags(isa: str) -> frozenset[str]:
    """The CPU features of the machine an ISA build stands for: the host's, less what the build
    leaves out (AVX2: every AVX-512 and AMX feature; AVX-512: bf16 dot products and AMX)."""
    flags = host_cpu_flags()
    if isa == "avx2":
        return frozenset(f for f in flags if not f.startswith(("avx512", "amx")))
    if isa == "avx512":
        return frozenset(f for f in flags if f != "avx512_bf16" and not f.startswith("amx"))
    return flags


def model_linear(in_features: int, out_features: int, dtype: torch.dtype, flags) -> nn.Module:
    """A linear as the loader runs the model's on a CPU with `flags`: bfloat16 packed for oneDNN
    where the CPU has bf16 dot products, else widened to float32 (widened_linear.py); float32
    packed where oneDNN is the host's float32 path."""
    linear = nn.Linear(in_features, out_features, bias=False).requires_grad_(False).to(dtype)
    if can_widen_linears(linear, flags):
        linear = WidenedLinear(linear)
        if can_pack_float32(linear.inner):
            linear.inner = PackedLinear(linear.inner)
        return linear
    if can_pack(linear, flags) or can_pack_float32(linear):
        return PackedLinear(linear)
    return linear


def print_prefill(rows: list[dict[str, Any]]) -> None:
    print(
        f"prefill attention, one {rows[0]['chunk']}-token chunk in {rows[0]['dtype']}, "
        f"threads {torch.get_num_threads()}"
    )
    print(f"{'impl':<20} {'median ms':>10} {'GFLOP/s':>9} {'of matmul':>10}  held to")
    for row in rows:
        print(
            f"{row['impl']:<20} {row['median_ms']:>10.2f} {row['gflop_per_s']:>9.1f} "
            f"{row['fraction_of_matmul']:>9.0%}   {row['baseline']}"
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
