"""Benchmark one decode step's paged attention: our kernel vs the gather reference vs SDPA.

All run in the same process on the same data, interleaved round by round so machine noise hits
them alike. SDPA gets pre-made contiguous K/V (the lower bound a paged kernel chases; on CUDA it is
torch's FlashAttention kernel); the kernel and the reference read a cache with shuffled block
tables, as a long-running server would. Roofline rows come with them: a pass that only reads
the K/V bytes (`read_kv_once`: the cache as one contiguous stream, the issue's memory roofline),
on the CPU a pass that only reads them through the block tables (`read_kv_paged`,
benchmarks/paged_read.py: the scattered blocks a paged kernel must read, so the gap between the
two read passes is what the paged layout costs the host, read block by block; and
`read_kv_paged_4_at_once`, four of a request's blocks at a time with no software prefetch, what the
hardware prefetchers make of the same blocks), and the kernel with K/V resident in L2.

    python -m pagedserve.benchmarks.attention [--batch 64] [--context 1024] [--dtype float32 bfloat16]
        [--kv-cache-dtype auto bfloat16 fp8_e4m3] [--device cpu|cuda] [--backend auto|cpu|triton]
        [--isa avx2 avx512] [--vllm-venv ~/venv-vllm]

`--isa` times those builds of the CPU kernel (PAGEDSERVE_CPU_ISA) beside the default one in the
same rounds, each against the same read roofline (default: every one the host can run).

`--backend auto` is the `cpu` kernel on the CPU and `triton` on CUDA (the GPU check runs
`--device cuda --batch 256 --context 4096`); `--backend triton` on the CPU runs Triton's
interpreter, which is for correctness at tiny sizes only.

`--vllm-venv ~/venv-vllm` adds vLLM-CPU's own kernel to the roofline rounds (`vllm_cpu`, with
its `_kv_in_l2` row; benchmarks/vllm_attention.py): the same K/V in vLLM's layout and its CPU
default block size (`--vllm-block-size`), timed against the same contiguous read, so the peer's
distance from the roofline is measured in the same run as ours.

`--dtype` is the model's (queries, outputs, SDPA's K/V); `--kv-cache-dtype` what the paged cache
stores (auto: the same), so e.g. float32 queries over a bfloat16 cache are timed as the engine
runs them with `--kv-cache-dtype bfloat16`.

On the CPU the kernel and the read pass take their K/V from `--cache-copies` copies of the caches
in turn (default: enough to hold twice the last-level cache), as a server's 30 layers do: a
single 50-100 MB copy stays in a large L3 (480 MiB on a Sapphire Rapids VM here, where the read
pass ran at 50 GB/s against 24 from memory), and the "memory roofline" would be the L3's.
Every copy sits on 2 MiB transparent huge pages where the engine's caches do (cache/
huge_pages.py): on 4 KiB pages both the kernel and the read pass pay a TLB miss per page, which
slowed the read pass more than the kernel (Sapphire Rapids VM: 22 against 28 GB/s) and so
understated the kernel's distance from the memory roofline.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
from dataclasses import fields, replace
from pathlib import Path

import torch
import torch.nn.functional as F

from pagedserve.benchmarks.paged_read import read_paged_kv
from pagedserve.benchmarks.prefill_attention import bench_prefill, print_prefill
from pagedserve.benchmarks.vllm_attention import (
    VLLM_CPU_BLOCK_SIZE,
    host_library,
    roofline_calls,
    vllm_version,
)
from pagedserve.benchmarks.workload import last_level_cache_bytes, time_interleaved
from pagedserve.cache import huge_pages
from pagedserve.cache.attention import AttentionMetadata, TorchPagedAttention, get_attention_backend
from pagedserve.cache.cache_engine import KV_CACHE_DTYPES
from pagedserve.cache.cache_engine import TORCH_DTYPES as DTYPES

DEFAULT_OUTPUT = Path(__file__).parent / "results" / "attention.json"
# A tiny step (a test's) is not worth thousands of copies: it is cache-resident either way.
MAX_CACHE_COPIES = 64


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64, help="decode requests in the step")
    parser.add_argument("--context", type=int, default=1024, help="context tokens per request")
    parser.add_argument(
        "--dtype", nargs="+", choices=sorted(DTYPES), default=["float32", "bfloat16"]
    )
    parser.add_argument(
        "--kv-cache-dtype", nargs="+", choices=["auto", *sorted(KV_CACHE_DTYPES)], default=["auto"]
    )
    # Defaults are the default model's shapes (SmolLM2-135M: 9 query heads, 3 kv heads, dim 64).
    parser.add_argument("--num-heads", type=int, default=9)
    parser.add_argument("--num-kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=15, help="timed rounds (median reported)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: all)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument(
        "--backend",
        choices=["auto", "cpu", "triton"],
        default="auto",
        help="the paged kernel to time (auto: cpu on the CPU, triton on CUDA)",
    )
    parser.add_argument(
        "--isa",
        nargs="*",
        default=None,
        help="CPU kernel ISA builds to time beside the default one, each against the same "
        "roofline (default: avx2 and avx512 where the host runs them; none: give the flag alone)",
    )
    parser.add_argument(
        "--prefill-chunk",
        type=int,
        default=1024,
        help="also time one causal prefill chunk of this many tokens against the matmul rate "
        "(benchmarks/prefill_attention.py; CPU only; 0: skip)",
    )
    parser.add_argument(
        "--cache-copies",
        type=int,
        default=None,
        help="copies of the K/V caches the kernel and the read pass take in turn (CPU; default: "
        "enough to hold twice the last-level cache, so they read from memory)",
    )
    parser.add_argument(
        "--vllm-venv",
        type=Path,
        default=None,
        help="also time vLLM-CPU's own kernel on the same step, in the roofline rounds, from this "
        "venv (benchmarks/vllm_attention.py; e.g. ~/venv-vllm, where benchmarks/peers.py installs "
        "it; CPU, a cache in the query's dtype)",
    )
    parser.add_argument(
        "--vllm-block-size",
        type=int,
        default=VLLM_CPU_BLOCK_SIZE,
        help="vLLM's block size (default: vLLM-CPU's own default)",
    )
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT)
    return parser.parse_args(argv)


def cache_copies(args: argparse.Namespace, kv_bytes: int, cache_bytes: int | None = None) -> int:
    """How many copies of the step's K/V the CPU rows rotate through: `--cache-copies`, else
    enough that together they are twice `cache_bytes` (default: the host's last-level cache), at
    most MAX_CACHE_COPIES and 8 GiB."""
    if args.cache_copies is not None or args.device != "cpu":
        return max(1, args.cache_copies or 1)
    cache_bytes = last_level_cache_bytes() if cache_bytes is None else cache_bytes
    wanted = -(-2 * cache_bytes // kv_bytes)
    return max(1, min(wanted, MAX_CACHE_COPIES, (8 << 30) // kv_bytes))


def isa_kernels(args: argparse.Namespace) -> dict[str, object]:
    """`cpu_<isa>` -> that ISA build of the CPU kernel, for the ISAs asked for (or runnable)."""
    if args.device != "cpu" or args.backend == "triton":
        return {}
    from pagedserve.cache.attention.cpu import CpuPagedAttention, host_runnable_isas

    runnable = [isa for isa in host_runnable_isas() if isa != "native"]
    isas = runnable if args.isa is None else args.isa
    return {f"cpu_{isa}": CpuPagedAttention(isa=isa) for isa in isas}


def make_decode_step(
    args: argparse.Namespace, dtype: torch.dtype, generator: torch.Generator, kv_dtype: torch.dtype
):
    """Random cache + metadata for `batch` decode tokens; returns (query, caches, meta, sdpa inputs).

    SDPA gets the same K/V values in the model's `dtype` (what a contiguous cache would hold).
    Values are drawn on the CPU (the same for every device), then moved to `args.device`."""
    num_blocks_per_req = -(-args.context // args.block_size)
    num_blocks = args.batch * num_blocks_per_req
    cache_shape = (num_blocks, args.block_size, args.num_kv_heads, args.head_dim)
    key_cache = torch.randn(cache_shape, generator=generator).to(kv_dtype)
    value_cache = torch.randn(cache_shape, generator=generator).to(kv_dtype)
    # Shuffled tables: each request's blocks are scattered across the cache.
    block_tables = torch.randperm(num_blocks, generator=generator).view(args.batch, -1).int()
    query = torch.randn(args.batch, args.num_heads, args.head_dim, generator=generator).to(dtype)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(args.batch, dtype=torch.int64),  # unused by forward
        block_tables=block_tables,
        query_start_loc=torch.arange(args.batch + 1, dtype=torch.int32),
        seq_lens=torch.full((args.batch,), args.context, dtype=torch.int32),
        max_query_len=1,
    )

    # SDPA's inputs: the same K/V gathered once, outside the timed region.
    def contiguous(cache: torch.Tensor) -> torch.Tensor:
        rows = cache[block_tables.long()]  # [batch, blocks_per_req, block_size, kv_heads, D]
        rows = rows.flatten(1, 2)[:, : args.context]  # [batch, context, kv_heads, D]
        return rows.transpose(1, 2).to(dtype).contiguous()  # [batch, kv_heads, context, D]

    sdpa_inputs = (query.unsqueeze(2), contiguous(key_cache), contiguous(value_cache))
    device = torch.device(args.device)
    meta = replace(
        meta,
        **{
            field.name: getattr(meta, field.name).to(device)
            for field in fields(meta)
            if isinstance(getattr(meta, field.name), torch.Tensor)
        },
    )
    key_cache, value_cache, query = (t.to(device) for t in (key_cache, value_cache, query))
    if device.type == "cpu":  # where the engine's CacheEngine puts its caches (and their copies)
        key_cache, value_cache = map(huge_pages.copy_to_huge_pages, (key_cache, value_cache))
    sdpa_inputs = tuple(t.to(device) for t in sdpa_inputs)
    return query, key_cache, value_cache, meta, sdpa_inputs


def _copy_of(cache: torch.Tensor) -> torch.Tensor:
    """Another copy of a cache, on huge pages where the engine's would be (CPU; a clone elsewhere)."""
    if cache.device.type != "cpu":
        return cache.clone()
    return huge_pages.empty(tuple(cache.shape), cache.dtype).copy_(cache)


def bench_dtype(args: argparse.Namespace, dtype_name: str, kv_dtype_name: str) -> list[dict]:
    dtype = DTYPES[dtype_name]
    kv_dtype_name = dtype_name if kv_dtype_name == "auto" else kv_dtype_name
    generator = torch.Generator().manual_seed(0)
    query, key_cache, value_cache, meta, (q4, k4, v4) = make_decode_step(
        args, dtype, generator, KV_CACHE_DTYPES[kv_dtype_name]
    )
    scale = args.head_dim**-0.5
    device = torch.device(args.device)
    name = args.backend if args.backend != "auto" else ("cpu" if device.type == "cpu" else "triton")
    kernel = get_attention_backend(name, device)
    reference = TorchPagedAttention()
    # The roofline, two ways. Memory: one pass that only reads every K/V byte the step needs (an
    # int32 max over the caches); no attention kernel can beat it from DRAM. Compute: the same
    # kernel with every table pointing into a few blocks that stay in L2, so it never waits
    # for DRAM.
    l2_blocks = max(1, (1 << 20) // (2 * key_cache[0].nbytes))
    l2_meta = replace(meta, block_tables=meta.block_tables % l2_blocks)
    # From memory, not from a cache: every call, whichever row makes it, takes the next of
    # `copies` copies of K/V, so a copy was last read `copies` - 1 calls earlier (one rotation per
    # row let the rows of a round read the same copy, all but the first from the cache).
    copies = [(key_cache, value_cache)]
    copies += [
        (_copy_of(key_cache), _copy_of(value_cache))
        for _ in range(cache_copies(args, key_cache.nbytes + value_cache.nbytes) - 1)
    ]
    rotation = itertools.cycle(copies)

    def ours() -> torch.Tensor:
        return kernel.forward(query, *next(rotation), meta, scale)

    def read_once() -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = next(rotation)
        return keys.view(torch.int32).amax(), values.view(torch.int32).amax()

    # Two sets of rounds. The roofline: our kernel(s) beside the read pass and the L2 runs only;
    # the other implementations allocate hundreds of MB per call (the reference gathers every
    # request's K/V), which slowed the kernel run after them by 1.2-1.6x (2-core Zen 3). Then the
    # comparison: our kernel against the reference and SDPA, in rounds of their own.
    roofline = {
        name: ours,
        f"{name}_kv_in_l2": lambda: kernel.forward(query, key_cache, value_cache, l2_meta, scale),
        "read_kv_once": read_once,
    }
    if device.type == "cpu":

        def read_paged() -> int:
            keys, values = next(rotation)
            return read_paged_kv(keys, values, meta.block_tables, meta.seq_lens)

        roofline["read_kv_paged"] = read_paged

        def read_paged_4_at_once() -> int:  # a tile's four 16-token blocks at a time, 8 streams
            keys, values = next(rotation)
            return read_paged_kv(keys, values, meta.block_tables, meta.seq_lens, blocks_at_once=4)

        roofline["read_kv_paged_4_at_once"] = read_paged_4_at_once
    for impl, isa_kernel in isa_kernels(args).items():
        roofline[impl] = lambda k=isa_kernel: k.forward(query, *next(rotation), meta, scale)
        roofline[f"{impl}_kv_in_l2"] = lambda k=isa_kernel: k.forward(
            query, key_cache, value_cache, l2_meta, scale
        )
    comparison = {
        name: ours,
        "torch_ref": lambda: reference.forward(query, key_cache, value_cache, meta, scale),
        "sdpa_contiguous": lambda: F.scaled_dot_product_attention(
            q4, k4, v4, scale=scale, enable_gqa=True
        ),
    }
    expected = comparison["torch_ref"]().float()
    max_error = (ours().float() - expected).abs().max().item()
    peer_error = None
    if _times_vllm(args, dtype_name, kv_dtype_name):
        peer, peer_output = roofline_calls(
            args.vllm_library,
            query,
            k4.transpose(1, 2),
            v4.transpose(1, 2),
            block_size=args.vllm_block_size,
            copies=len(copies),
            scale=scale,
            generator=generator,
        )
        roofline |= peer
        peer_error = (peer_output.float() - expected).abs().max().item()
    common = {"device": device.type, "dtype": dtype_name, "kv_cache_dtype": kv_dtype_name}
    common |= {"kernel_max_abs_error_vs_ref": max_error}
    common |= {"kv_bytes": key_cache.nbytes + value_cache.nbytes, "cache_copies": len(copies)}
    rows = _timed_rows(time_interleaved(roofline, args.repeats, device), name, common)
    if peer_error is not None:
        for row in rows:
            if row["impl"].startswith("vllm_cpu"):
                row |= {"kernel_max_abs_error_vs_ref": peer_error, "vllm": args.vllm_label}
    compared = _timed_rows(time_interleaved(comparison, args.repeats, device), name, common)
    rows[1:1] = compared[1:]  # the reference and SDPA, timed against the kernel in their rounds
    kernels = (i for i in roofline if i.startswith(("cpu_", "vllm_")) and "_kv_in_l2" not in i)
    for impl in [name, *kernels]:
        add_roofline(rows, kernel_name=impl)
    return rows


def _times_vllm(args: argparse.Namespace, dtype_name: str, kv_dtype_name: str) -> bool:
    """Whether this dtype's rounds time vLLM's kernel: asked for, on the CPU, over a cache in the
    query's dtype (vLLM's `auto`), with its library loadable (main() looked it up)."""
    if args.vllm_library is None or args.device != "cpu":
        return False
    if kv_dtype_name != dtype_name:
        print(f"vLLM: not timed over a {kv_dtype_name} cache under {dtype_name} queries")
        return False
    return True


def _timed_rows(times: dict, kernel_name: str, common: dict) -> list[dict]:
    """One row per implementation, with its speed relative to our kernel in the same rounds."""
    kernel_wall, kernel_cpu = (statistics.median(samples) for samples in times[kernel_name])
    return [
        {
            "impl": impl,
            **common,
            "median_ms": statistics.median(wall) * 1e3,
            "min_ms": min(wall) * 1e3,
            "median_cpu_time_ms": statistics.median(cpu) * 1e3,
            # > 1: our paged kernel (the first row) is faster than this implementation.
            "kernel_speedup": statistics.median(wall) / kernel_wall,
            "kernel_speedup_by_cpu_time": statistics.median(cpu) / kernel_cpu,
        }
        for impl, (wall, cpu) in times.items()
    ]


def add_roofline(rows: list[dict], kernel_name: str) -> None:
    """Puts the kernel's distance from the two bounds, timed in the same run, into its row."""
    kernel, read_once, in_l2 = (
        next(row for row in rows if row["impl"] == impl)
        for impl in (kernel_name, "read_kv_once", f"{kernel_name}_kv_in_l2")
    )
    kernel["kv_read_gb_per_s"] = kernel["kv_bytes"] / kernel["median_ms"] / 1e6
    kernel["stream_read_gb_per_s"] = read_once["kv_bytes"] / read_once["median_ms"] / 1e6
    # 1.0 = the kernel streams K/V as fast as a pass that does nothing else with them.
    kernel["fraction_of_read_roofline"] = read_once["median_ms"] / kernel["median_ms"]
    # The target: decode attention within 1.3x of the memory roofline.
    kernel["times_read_roofline"] = kernel["median_ms"] / read_once["median_ms"]
    # The kernel's time with K/V in L2: what it costs when memory is not the limit.
    kernel["compute_bound_ms"] = in_l2["median_ms"]
    paged = next((row for row in rows if row["impl"] == "read_kv_paged"), None)
    if paged is not None:  # the same bytes read through the block tables (CPU)
        kernel["paged_read_gb_per_s"] = paged["kv_bytes"] / paged["median_ms"] / 1e6
        kernel["times_paged_read"] = kernel["median_ms"] / paged["median_ms"]


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    _find_vllm(args)
    rows = [
        row
        for dtype_name in args.dtype
        for kv_dtype_name in args.kv_cache_dtype
        for row in bench_dtype(args, dtype_name, kv_dtype_name)
    ]
    print(
        f"decode step: {args.batch} requests x {args.context} context, heads {args.num_heads}/"
        f"{args.num_kv_heads}, head_dim {args.head_dim}, block {args.block_size}, "
        f"on {args.device} with {torch.get_num_threads()} CPU threads, median of {args.repeats}"
    )
    print(
        f"{'impl':<16} {'dtype':<9} {'kv cache':<9} {'median ms':>10} {'min ms':>8} {'cpu-time ms':>12} "
        f"{'paged kernel x faster (wall, cpu-time)':>40}"
    )
    for row in rows:
        print(
            f"{row['impl']:<16} {row['dtype']:<9} {row['kv_cache_dtype']:<9} {row['median_ms']:>10.2f} {row['min_ms']:>8.2f} "
            f"{row['median_cpu_time_ms']:>12.2f} {row['kernel_speedup']:>27.2f} "
            f"{row['kernel_speedup_by_cpu_time']:>12.2f}"
        )
    for row in rows:
        if "fraction_of_read_roofline" in row:
            print(
                f"{row['impl']} kernel, {row['dtype']} / {row['kv_cache_dtype']} cache: reads "
                f"{row['kv_bytes'] / 1e6:.0f} MB of K/V at {row['kv_read_gb_per_s']:.1f} GB/s = "
                f"{row['fraction_of_read_roofline']:.0%} of a plain read pass "
                f"({row['times_read_roofline']:.2f}x its time) "
                f"({row['stream_read_gb_per_s']:.1f} GB/s); with K/V in L2 it takes "
                f"{row['compute_bound_ms']:.2f} ms"
            )
            if "times_paged_read" in row:
                print(
                    f"    {row['times_paged_read']:.2f}x the time of a read through the block "
                    f"tables ({row['paged_read_gb_per_s']:.1f} GB/s)"
                )
    prefill = _prefill_rows(args)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    config = {key: value for key, value in vars(args).items() if key != "output"}
    config |= {key: config[key] and str(config[key]) for key in ("vllm_venv", "vllm_library")}
    config["threads"] = torch.get_num_threads()
    payload = {"config": config, "results": rows, "prefill": prefill}
    args.output.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"wrote {args.output}")
    return rows


def _find_vllm(args: argparse.Namespace) -> None:
    """Sets `args.vllm_library` (None: vLLM's kernel is not timed, with the reason printed) and
    `args.vllm_label` from `--vllm-venv`."""
    args.vllm_library, args.vllm_label = None, None
    if args.vllm_venv is None:
        return
    found = host_library(args.vllm_venv.expanduser())
    if isinstance(found, str):
        print(f"vLLM: {found}; its kernel is not timed")
        return
    try:  # registers vLLM's ops (torch.ops._C) in this process
        torch.ops.load_library(str(found))
    except (OSError, RuntimeError) as error:
        print(f"vLLM: {found} does not load here ({error}); its kernel is not timed")
        return
    args.vllm_library = found
    args.vllm_label = f"vLLM-CPU {vllm_version(found)} {found.name}, block {args.vllm_block_size}"
    print(f"vLLM: timing {args.vllm_label}")


def _prefill_rows(args: argparse.Namespace) -> list[dict]:
    """The prefill chunk's rows (printed), each dtype and ISA build this run times; [] when
    skipped."""
    if not args.prefill_chunk or args.device != "cpu":
        return []
    rows = []
    for dtype_name in args.dtype:  # bfloat16: a bfloat16 cache (AMX tiles where the CPU has them)
        dtype_rows = bench_prefill(
            chunk=args.prefill_chunk,
            heads=args.num_heads,
            kv_heads=args.num_kv_heads,
            head_dim=args.head_dim,
            block_size=args.block_size,
            repeats=args.repeats,
            isas=None if args.isa is None else ["native", *args.isa],
            dtype=DTYPES[dtype_name],
        )
        print_prefill(dtype_rows)
        rows += dtype_rows
    return rows


if __name__ == "__main__":
    main()
