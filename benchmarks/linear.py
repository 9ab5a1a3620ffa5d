"""Linear layers against `F.linear`: bfloat16 weights packed once for oneDNN (`PackedLinear`), or
float32 decode-sized batches through the skinny C++ kernel (`SkinnyLinear`, `--dtype float32`).

The default model's four weight shapes (q/o 576x576, k/v 192x576, gate/up 1536x576, down
576x1536, LM head 49152x576) at decode and prefill row counts, interleaved round by round in one
process so machine noise hits both alike; median of `--repeats`. Also checks the outputs are
bit-identical. bfloat16 runs only where `pack_linears` applies (a CPU with AVX512_BF16 or AMX).

float32 times cold weights, as a decode step meets them: each call cycles through 30 copies of the
layer's weight (the model's 30 layers; 2 of the LM head), against the host's float32 linear as the
loader runs it (`F.linear`, i.e. MKL, or oneDNN's packed linear where `--cpu-float32-linear auto`
picks it), and reports the largest error relative to the summed magnitudes (the kernel sums in
another order, so not bit-identical). The kernel's row range is forced to every row count here.

    python -m pagedserve.benchmarks.linear [--dtype bfloat16|float32] [--rows 1 16 64 512]
        [--threads 1] [--repeats 30]
"""

from __future__ import annotations

import argparse
import statistics
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
from pagedserve.engine.packed_linear import PackedLinear, can_pack, float32_linear_backend
from pagedserve.engine.skinny_linear import EVERY_LAYER_ROWS, SkinnyLinear

SHAPES = {  # name: (out_features, in_features), SmolLM2-135M
    "q_proj/o_proj": (576, 576),
    "k_proj/v_proj": (192, 576),
    "gate/up_proj": (1536, 576),
    "down_proj": (576, 1536),
    "lm_head": (49152, 576),
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--rows", type=int, nargs="+", default=None, help="default: per dtype")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: all)")
    parser.add_argument("--repeats", type=int, default=30, help="timed rounds (median reported)")
    parser.add_argument("--output", type=Path, default=RESULTS_DIR / "linear.json")
    return parser.parse_args(argv)


def bench_shape(out_features: int, in_features: int, rows: int, repeats: int) -> dict[str, Any]:
    linear = nn.Linear(in_features, out_features, bias=False).to(torch.bfloat16)
    packed = PackedLinear(linear)
    x = torch.randn(rows, in_features, dtype=torch.bfloat16)
    with torch.inference_mode():
        identical = torch.equal(linear(x), packed(x))
        candidates = {"linear": lambda: F.linear(x, linear.weight), "packed": lambda: packed(x)}
        times = time_interleaved(candidates, repeats)
    plain_s, packed_s = (statistics.median(times[name][0]) for name in ("linear", "packed"))
    return {
        "out_features": out_features,
        "in_features": in_features,
        "rows": rows,
        "linear_us": plain_s * 1e6,
        "packed_us": packed_s * 1e6,
        "speedup": plain_s / packed_s,
        "bit_identical": identical,
    }


def bench_skinny(
    out_features: int, in_features: int, rows: int, repeats: int, backend: str
) -> dict[str, Any]:
    from pagedserve.cache.attention.cpu import load_cpu_kernel

    copies = 2 if out_features * in_features > 10_000_000 else 30
    generator = torch.Generator().manual_seed(rows)
    linears = [nn.Linear(in_features, out_features, bias=False) for _ in range(copies)]
    baselines = [PackedLinear(linear) if backend == "onednn" else linear for linear in linears]
    kernel = load_cpu_kernel()
    skinny = [SkinnyLinear(linear, kernel, rows=EVERY_LAYER_ROWS) for linear in linears]
    x = torch.randn(rows, in_features, generator=generator)

    def run(modules: list[nn.Module]) -> None:
        for module in modules:
            module(x)

    with torch.inference_mode():
        candidates = {"linear": lambda: run(baselines), "skinny": lambda: run(skinny)}
        times = time_interleaved(candidates, repeats)
        scale = x.abs() @ linears[0].weight.abs().T
        error = ((skinny[0](x) - linears[0](x)).abs() / scale).max().item()
    plain_s, skinny_s = (statistics.median(times[name][0]) / copies for name in times)
    return {
        "out_features": out_features,
        "in_features": in_features,
        "rows": rows,
        "backend": backend,
        "linear_us": plain_s * 1e6,
        "skinny_us": skinny_s * 1e6,
        "speedup": plain_s / skinny_s,
        "weight_gb_per_s": out_features * in_features * 4 / skinny_s / 1e9,
        "max_relative_error": error,
    }


def main_float32(args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    backend = float32_linear_backend("auto")
    print(
        f"float32 linear, cold weights, threads={torch.get_num_threads()}, median of "
        f"{args.repeats}; the host's float32 linear ({backend}) against the skinny kernel"
    )
    print(
        f"{'layer':<14} {'shape':>11} {'rows':>5} {backend + ' us':>10} {'skinny us':>10} "
        f"{'x':>6} {'GB/s':>5} {'max rel err':>12}"
    )
    for name, (out_features, in_features) in SHAPES.items():
        for num_rows in args.rows or [1, 2, 4, 8, 12, 16]:
            result = bench_skinny(out_features, in_features, num_rows, args.repeats, backend)
            row = {"layer": name, **result}
            rows.append(row)
            print(
                f"{name:<14} {out_features:>5}x{in_features:<5} {num_rows:>5} "
                f"{row['linear_us']:>10.1f} {row['skinny_us']:>10.1f} {row['speedup']:>5.2f}x"
                f" {row['weight_gb_per_s']:>5.1f} {row['max_relative_error']:>12.1e}"
            )
    write_results(args.output, args, rows)
    return rows


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    args = parse_args(argv)
    set_num_threads(args.threads)
    if args.dtype == "float32":
        return main_float32(args)
    if not can_pack(nn.Linear(1, 1).to(torch.bfloat16)):
        print("linear: this CPU or torch build cannot pack bf16 linears (no native bf16); skipped")
        return []
    rows = []
    print(f"bfloat16 linear, threads={torch.get_num_threads()}, median of {args.repeats}")
    print(f"{'layer':<14} {'shape':>11} {'rows':>5} {'linear us':>10} {'packed us':>10} {'x':>6}")
    for name, (out_features, in_features) in SHAPES.items():
        for num_rows in args.rows or [1, 16, 64, 512]:
            row = {"layer": name, **bench_shape(out_features, in_features, num_rows, args.repeats)}
            rows.append(row)
            print(
                f"{name:<14} {out_features:>5}x{in_features:<5} {num_rows:>5} "
                f"{row['linear_us']:>10.1f} {row['packed_us']:>10.1f} {row['speedup']:>5.2f}x"
                + ("" if row["bit_identical"] else "  OUTPUT DIFFERS")
            )
    write_results(args.output, args, rows)
    return rows


if __name__ == "__main__":
    main()
