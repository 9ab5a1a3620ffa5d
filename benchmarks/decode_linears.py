"""A decode step's linears as the loader can run them: oneDNN's packed linear against the panel
kernel (`PanelLinear`, engine/panel_linear.py), and for float32 the skinny kernel too.

The default model's 120 decoder linears, each with weights of its own (30 layers of [q; k; v]
960x576, o 576x576, [gate; up] 3072x576 and down 576x1536), so the weights come from memory as in
a real step rather than from cache; one pass over all of them per round, the implementations
interleaved round by round in one process (machine noise hits them alike); median of `--repeats`.
The panel kernel is called at every row count here, whatever range the loader gives it. Prints
the ms per pass and the ratio to oneDNN's; writes JSON to benchmarks/results/.

    python -m pagedserve.benchmarks.decode_linears [--dtype bfloat16 float32]
        [--rows 1 16 64 128] [--repeats 9] [--threads N] [--isa native|avx2|avx512]
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from torch import nn

from pagedserve.benchmarks.workload import (
    RESULTS_DIR,
    set_num_threads,
    time_interleaved,
    write_results,
)
from pagedserve.cache.attention.cpu import load_cpu_kernel
from pagedserve.engine.packed_linear import PackedLinear, can_pack
from pagedserve.engine.panel_linear import PanelLinear
from pagedserve.engine.skinny_linear import EVERY_LAYER_ROWS

LAYER_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # (out, in), fused as loaded
NUM_LAYERS = 30


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--dtype", nargs="+", default=["bfloat16", "float32"], choices=["bfloat16", "float32"]
    )
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64, 128])
    parser.add_argument("--layers", type=int, default=NUM_LAYERS, help="decoder layers")
    parser.add_argument("--repeats", type=int, default=9, help="timed rounds (median reported)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: all)")
    parser.add_argument(
        "--isa", default="native", help="the kernel build to time: native, avx2 or avx512"
    )
    parser.add_argument("--output", type=Path, default=RESULTS_DIR / "decode_linears.json")
    return parser.parse_args(argv)


def build_layers(
    dtype: torch.dtype, num_layers: int, kernel: ModuleType
) -> list[tuple[nn.Linear, PackedLinear, PanelLinear]]:
    layers = []
    for _ in range(num_layers):
        for out_features, in_features in LAYER_SHAPES:
            linear = nn.Linear(in_features, out_features, bias=False).to(dtype)
            layers.append((linear, PackedLinear(linear), PanelLinear(linear, kernel, 1 << 30)))
    return layers


@torch.inference_mode()
def bench_rows(
    layers: list, dtype: torch.dtype, rows: int, repeats: int, kernel: ModuleType
) -> dict[str, Any]:
    inputs = {k: torch.randn(rows, k).to(dtype) for k in {lin.in_features for lin, _, _ in layers}}
    candidates = {
        "onednn": lambda: [packed(inputs[lin.in_features]) for lin, packed, _ in layers],
        "panel": lambda: [panel(inputs[lin.in_features]) for lin, _, panel in layers],
    }
    if dtype == torch.float32 and rows <= EVERY_LAYER_ROWS[1]:
        candidates["skinny"] = lambda: [
            kernel.skinny_linear_fp32(inputs[lin.in_features], lin.weight) for lin, _, _ in layers
        ]
    times = {
        name: statistics.median(wall)
        for name, (wall, _) in time_interleaved(candidates, repeats).items()
    }
    return {
        "dtype": str(dtype).removeprefix("torch."),
        "rows": rows,
        **{f"{name}_ms": seconds * 1e3 for name, seconds in times.items()},
        "panel_speedup": times["onednn"] / times["panel"],
    }


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    args = parse_args(argv)
    set_num_threads(args.threads)
    kernel = load_cpu_kernel(args.isa)
    results = []
    print(
        f"{args.layers} layers' decoder linears, cold weights, threads={torch.get_num_threads()}, "
        f"median of {args.repeats}; kernel build: {args.isa}, {kernel.vector_lanes} lanes"
    )
    print(f"{'dtype':<9} {'rows':>5} {'onednn ms':>10} {'panel ms':>9} {'x':>6} {'skinny ms':>10}")
    for name in args.dtype:
        dtype = getattr(torch, name)
        if dtype == torch.bfloat16 and not (
            kernel.panel_bf16 and can_pack(nn.Linear(1, 1).to(dtype))
        ):
            print("bfloat16: this CPU or kernel build has no AVX512_BF16; skipped")
            continue
        layers = build_layers(dtype, args.layers, kernel)
        for rows in args.rows:
            row = bench_rows(layers, dtype, rows, args.repeats, kernel)
            results.append(row)
            skinny = f"{row['skinny_ms']:>10.1f}" if "skinny_ms" in row else ""
            print(
                f"{name:<9} {rows:>5} {row['onednn_ms']:>10.1f} {row['panel_ms']:>9.1f} "
                f"{row['panel_speedup']:>5.2f}x {skinny}"
            )
    write_results(args.output, args, results)
    return results


if __name__ == "__main__":
    main()
