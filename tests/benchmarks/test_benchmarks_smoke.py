"""Smoke runs of every benchmark with tiny arguments, so none of them can silently rot.

The workload, memory and serving-statistics checks need no model and run in well under a second;
the ones that load the model (throughput, step, serving against our own server) are marked slow.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from pagedserve.benchmarks import (
    attention,
    engine_state,
    memory,
    prompt_logprobs,
    serving,
    step,
    throughput,
)
from pagedserve.benchmarks.workload import (
    WorkloadConfig,
    build_prompts,
    percentile,
    prompt_lengths,
    read_bandwidth,
    time_interleaved,
)

TINY_WORKLOAD = [
    "--num-requests",
    "2",
    "--min-prompt-tokens",
    "8",
    "--max-prompt-tokens",
    "24",
    "--output-tokens",
    "3",
]


class ByteTokenizer:
    """Stands in for the model's tokenizer: one token per UTF-8 byte."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode())


def read_results(path: Path) -> list[dict]:
    payload = json.loads(path.read_text())
    assert payload["machine"]["nproc"] >= 1
    return payload["results"]


def test_workload_is_seeded_and_within_the_length_bounds():
    config = WorkloadConfig(num_requests=50, min_prompt_tokens=32, max_prompt_tokens=64, seed=3)
    lengths = prompt_lengths(config)
    assert lengths == prompt_lengths(config)
    assert all(32 <= length <= 64 for length in lengths)
    prompts = build_prompts(config, ByteTokenizer())
    assert [len(prompt) for prompt in prompts] == lengths
    assert prompts == build_prompts(config, ByteTokenizer())


def test_read_bandwidth_is_a_plausible_rate():
    bytes_per_s = read_bandwidth(num_bytes=8 << 20, repeats=2)
    assert 1e8 < bytes_per_s < 1e13  # 0.1 GB/s .. 10 TB/s


def test_percentile_interpolates_between_samples():
    assert percentile([1.0, 2.0, 3.0, 4.0], 0.5) == 2.5
    assert percentile([5.0], 0.99) == 5.0
    assert math.isnan(percentile([], 0.5))


def test_memory_benchmark_fits_more_paged_requests_than_contiguous_with_sub_block_waste(tmp_path):
    output = tmp_path / "memory.json"
    memory.main(
        [
            "--num-requests",
            "48",
            "--kv-budget-tokens",
            "4096",
            "--max-model-len",
            "512",
            "--min-prompt-tokens",
            "16",
            "--max-prompt-tokens",
            "128",
            "--output-tokens",
            "16",
            "--system-prompt-tokens",
            "64",
            "--window-budget-gib",
            "6",
            "--window-prompt-tokens",
            "12288",
            "--window-num-requests",
            "8",
            "--output",
            str(output),
        ]
    )
    rows = {row["cache"]: row for row in read_results(output)}
    # Gemma-2 shape, 12288 + 16 tokens per request: keeping every block costs 12304 tokens of
    # all 42 layers; freeing, 12304 of 21 layers + ~4096 of the other 21: ~1.5x the requests.
    kept = rows["gemma2, all blocks kept"]["mean_concurrency"]
    freed = rows["gemma2, out-of-window freed"]["mean_concurrency"]
    assert freed > 1.2 * kept
    assert rows["contiguous"]["mean_concurrency"] == 8
    assert rows["paged"]["concurrency_vs_contiguous"] > 2
    assert all(
        row["max_waste_slots_per_request"] < 16
        for name, row in rows.items()
        if name.startswith("paged")
    )
    with_cache = rows["paged, system prompt, prefix cache"]["mean_concurrency"]
    assert with_cache > rows["paged, system prompt"]["mean_concurrency"]


def test_serving_summary_reports_latency_percentiles_and_errors():
    finished = serving.RequestResult(
        10, ok=True, ttft_s=0.1, e2e_s=0.4, chunk_times_s=[0.1, 0.2, 0.4], num_output_tokens=3
    )
    failed = serving.RequestResult(10, error="HTTP 500: boom")
    summary = serving.summarize([finished, failed], float("inf"), duration_s=1.0)
    assert summary["num_completed"] == 1 and summary["num_errors"] == 1
    assert summary["errors"] == ["HTTP 500: boom"]
    assert summary["ttft_ms_p50"] == pytest.approx(100)
    assert summary["itl_ms_p50"] == pytest.approx(150)
    assert summary["tpot_ms_p50"] == pytest.approx(150)
    assert summary["output_tokens_per_s"] == pytest.approx(3)


def test_serving_arrivals_are_seeded_poisson_or_all_at_once():
    offsets = serving.arrival_offsets(100, 10.0, seed=0)
    assert offsets == serving.arrival_offsets(100, 10.0, seed=0)
    assert offsets == sorted(offsets) and 5 < offsets[-1] < 20
    assert serving.arrival_offsets(3, float("inf"), seed=0) == [0.0, 0.0, 0.0]


@pytest.mark.slow
def test_throughput_benchmark_runs_ours_and_both_hf_baselines(tmp_path):
    output = tmp_path / "throughput.json"
    throughput.main(
        [
            *TINY_WORKLOAD,
            "--hf-sample",
            "1",
            "--hf-batch-size",
            "2",
            "--kv-cache-memory",
            "64MiB",
            "--output",
            str(output),
        ]
    )
    rows = read_results(output)
    assert [row["system"] for row in rows][:4] == [
        "pagedserve (continuous batching)",
        "pagedserve, one request at a time",
        "HF generate, one at a time",
        "HF generate, static batches of 2",
    ]
    assert rows[0]["num_output_tokens"] == 6 and rows[1]["extrapolated"] and rows[2]["extrapolated"]
    assert all(row["output_tokens_per_s"] > 0 for row in rows)


@pytest.mark.slow
def test_prompt_logprobs_benchmark_times_both_systems_on_the_same_prompts(tmp_path):
    output = tmp_path / "prompt_logprobs.json"
    results = prompt_logprobs.main(
        ["--num-requests", "2", "--prompt-tokens", "16", "--rounds", "2", "--output", str(output)]
    )
    assert read_results(output) == json.loads(json.dumps(results))
    for name in ("prefill", "prefill+prompt_logprobs"):
        assert len(results[name]["seconds_per_round"]) == 2 and results[name]["cpu_seconds"] > 0
    assert results["ratio"] > 0 and results["cpu_ratio"] > 0


@pytest.mark.slow
def test_step_benchmark_times_every_phase(tmp_path):
    output = tmp_path / "step.json"
    step.main(
        [
            "--batch-sizes",
            "1",
            "2",
            "--steps",
            "1",
            "--warmup-steps",
            "0",
            "--prompt-tokens",
            "16",
            "--output",
            str(output),
        ]
    )
    rows = read_results(output)
    assert [row["batch_size"] for row in rows] == [1, 2]
    assert set(rows[0]["phases_ms"]) == set(step.PHASES)
    assert 0 < rows[1]["overhead_fraction"] < 1
    assert 0 < rows[1]["attention_ms"] < rows[1]["phases_ms"]["forward"]
    assert 0 < rows[1]["attention_fraction"] < 1
    # Batch 2 with 16-token prompts reads >= 2 x 17 tokens of K/V per step, 30 layers x 3 kv heads
    # x 64 dims x K and V x 4 bytes each.
    assert rows[1]["kv_read_mb"] >= 2 * 17 * 30 * 3 * 64 * 2 * 4 / 1e6
    assert rows[1]["read_gb_per_s"] > 0
    assert 0 < rows[1]["attention_floor_fraction"] < 1


def test_attention_benchmark_times_kernel_reference_and_sdpa_per_cache_dtype(tmp_path):
    output = tmp_path / "attention.json"
    rows = attention.main(
        [
            "--batch",
            "2",
            "--context",
            "40",
            "--repeats",
            "1",
            "--dtype",
            "float32",
            "--kv-cache-dtype",
            "auto",
            "fp8_e4m3",
            "--isa",
            "--output",
            str(output),
        ]
    )
    assert [(row["impl"], row["kv_cache_dtype"]) for row in rows] == [
        (impl, kv)
        for kv in ("float32", "fp8_e4m3")
        for impl in (
            "cpu",
            "torch_ref",
            "sdpa_contiguous",
            "cpu_kv_in_l2",
            "read_kv_once",
            "read_kv_paged",
            "read_kv_paged_4_at_once",
        )
    ]
    assert all(row["kernel_max_abs_error_vs_ref"] < 1e-5 for row in rows)
    kernel_fp32, kernel_fp8 = (row for row in rows if row["impl"] == "cpu")
    # 2 requests x 40 tokens (3 blocks of 16 each) x 3 kv heads x 64 dims x K and V.
    assert kernel_fp32["kv_bytes"] == 2 * 3 * 16 * 3 * 64 * 2 * 4
    assert kernel_fp8["kv_bytes"] == kernel_fp32["kv_bytes"] // 4
    assert kernel_fp32["fraction_of_read_roofline"] > 0 and kernel_fp32["compute_bound_ms"] > 0
    assert kernel_fp32["times_paged_read"] > 0 and kernel_fp32["paged_read_gb_per_s"] > 0
    assert 1 <= kernel_fp32["cache_copies"] <= attention.MAX_CACHE_COPIES
    assert json.loads(output.read_text())["results"] == rows


def test_attention_benchmark_reads_from_memory_by_rotating_copies_past_the_last_level_cache():
    # A 50 MB step on a VM with a 480 MiB L3 would be read from the L3 every call: 20 copies
    # (twice the cache) are read in turn instead. --cache-copies overrides; a GPU reads one.
    args = attention.parse_args([])
    assert attention.cache_copies(args, 50 << 20, cache_bytes=480 << 20) == 20
    assert attention.cache_copies(args, 50 << 20, cache_bytes=32 << 20) == 2
    assert (
        attention.cache_copies(args, 1 << 10, cache_bytes=480 << 20) == attention.MAX_CACHE_COPIES
    )
    assert attention.cache_copies(args, 4 << 30, cache_bytes=480 << 20) == 1  # larger alone
    assert attention.cache_copies(attention.parse_args(["--cache-copies", "1"]), 50 << 20) == 1
    assert attention.cache_copies(attention.parse_args(["--device", "cuda"]), 50 << 20) == 1


def test_attention_benchmark_times_the_triton_kernel_too(tmp_path):
    # On this CPU the Triton kernel runs interpreted: correctness of the benchmark's triton path
    # (the one the GPU check runs with --device cuda), not a speed.
    output = tmp_path / "attention.json"
    rows = attention.main(
        [
            "--batch",
            "2",
            "--context",
            "20",
            "--repeats",
            "1",
            "--dtype",
            "float32",
            "--backend",
            "triton",
            "--prefill-chunk",  # the CPU kernel's prefill rows have their own test below
            "0",
            "--output",
            str(output),
        ]
    )
    assert [row["impl"] for row in rows] == [
        "triton",
        "torch_ref",
        "sdpa_contiguous",
        "triton_kv_in_l2",
        "read_kv_once",
        "read_kv_paged",  # the CPU's reads through the block tables: the interpreter's caches
        "read_kv_paged_4_at_once",
    ]
    assert rows[0]["kernel_max_abs_error_vs_ref"] < 1e-5 and rows[0]["device"] == "cpu"
    assert rows[0]["fraction_of_read_roofline"] > 0


@pytest.mark.slow
def test_serving_benchmark_streams_from_its_own_server(tmp_path):
    output = tmp_path / "serving.json"
    serving.main(
        [
            *TINY_WORKLOAD,
            "--request-rate",
            "inf",
            "--server-args",
            "--num-kv-blocks 64 --max-model-len 512",
            "--output",
            str(output),
        ]
    )
    (row,) = read_results(output)
    assert row["num_completed"] == 2 and row["num_errors"] == 0
    assert row["ttft_ms_p50"] > 0 and row["e2e_ms_p99"] >= row["ttft_ms_p50"]


@pytest.mark.slow
def test_engine_state_benchmark_pairs_steps_with_and_without_the_poller(tmp_path):
    output = tmp_path / "engine_state.json"
    engine_state.main(
        [*TINY_WORKLOAD, "--output-tokens", "12", "--kv-cache-memory", "32MiB"]
        + ["--poll-hz", "20", "--window-s", "0.05", "--output", str(output)]
    )
    results = read_results(output)
    (pair,) = results["pairs"]
    assert pair["num_steps"] >= 12  # both runs scheduled the same steps, or it raises
    assert 0 <= pair["num_paired_steps"] <= pair["num_steps"]
    assert all(num_polls >= 1 for num_polls in results["num_polls"])
    assert (
        0
        < results["snapshot_on_engine_thread_ms_mean"]
        <= results["snapshot_on_engine_thread_ms_max"]
    )
    assert results["classify_cpu_ms_mean"] > 0 and results["json_cpu_ms_mean"] > 0
    assert 0 < results["cost_share_max"] < 1
    assert results["json_bytes"] > 1000


def test_attention_benchmark_times_each_isa_build_against_the_same_roofline(tmp_path):
    from pagedserve.cache.attention.cpu import host_runnable_isas

    isas = [isa for isa in host_runnable_isas() if isa != "native"]
    if not isas:
        pytest.skip("this CPU runs no explicit ISA build (no AVX2)")
    rows = attention.main(
        ["--batch", "2", "--context", "40", "--repeats", "1", "--dtype", "float32"]
        + ["--isa", *isas, "--output", str(tmp_path / "attention.json")]
    )
    by_impl = {row["impl"]: row for row in rows}
    for isa in isas:
        kernel = by_impl[f"cpu_{isa}"]
        assert f"cpu_{isa}_kv_in_l2" in by_impl
        assert kernel["times_read_roofline"] == pytest.approx(
            kernel["median_ms"] / by_impl["read_kv_once"]["median_ms"]
        )


def test_attention_benchmark_times_a_prefill_chunk_against_the_matmul_rate(tmp_path):
    output = tmp_path / "attention.json"
    attention.main(
        ["--batch", "2", "--context", "40", "--repeats", "1", "--dtype", "float32", "--isa"]
        + ["--prefill-chunk", "48", "--output", str(output)]
    )
    prefill = json.loads(output.read_text())["prefill"]
    by_impl = {row["impl"]: row for row in prefill}
    assert set(by_impl) == {"cpu_native", "sdpa_contiguous", "matmul"}
    assert by_impl["matmul"]["fraction_of_matmul"] == pytest.approx(1.0)
    kernel = by_impl["cpu_native"]
    # 4 * 9 heads * 64 dims * 48 * 49 / 2 FLOPs in the causal triangle
    assert kernel["gflop_per_s"] == pytest.approx(
        4 * 9 * 64 * 48 * 49 / 2 / (kernel["median_ms"] / 1e3) / 1e9
    )
    assert kernel["fraction_of_matmul"] > 0


def test_a_lower_isa_build_is_held_to_the_matmul_of_the_cpu_it_stands_for():
    import torch

    from pagedserve.benchmarks.prefill_attention import build_cpu_flags, model_linear
    from pagedserve.engine.widened_linear import WidenedLinear

    avx2, avx512 = build_cpu_flags("avx2"), build_cpu_flags("avx512")
    assert not any(f.startswith(("avx512", "amx")) for f in avx2)
    assert "avx512_bf16" not in avx512 and not any(f.startswith("amx") for f in avx512)
    # A bfloat16 model on a CPU without bf16 dot products multiplies in float32 (as its loader
    # runs it); a native-bf16 CPU keeps bfloat16; float32 never widens.
    no_bf16 = frozenset({"avx2", "fma", "avx512f"})
    assert isinstance(model_linear(8, 16, torch.bfloat16, no_bf16), WidenedLinear)
    native = frozenset({"avx2", "fma", "avx512f", "avx512_bf16"})
    assert not isinstance(model_linear(8, 16, torch.bfloat16, native), WidenedLinear)
    assert not isinstance(model_linear(8, 16, torch.float32, no_bf16), WidenedLinear)


def test_the_prefill_benchmark_names_each_rows_baseline():
    import torch

    from pagedserve.benchmarks.prefill_attention import bench_prefill
    from pagedserve.cache.attention.cpu import host_runnable_isas
    from pagedserve.cache.attention.cpu_features import host_cpu_flags, missing_native_bf16

    kwargs = dict(chunk=32, heads=9, kv_heads=3, head_dim=64, block_size=16, repeats=1)
    rows = bench_prefill(**kwargs, isas=host_runnable_isas(), dtype=torch.bfloat16)
    by_impl = {row["impl"]: row for row in rows}
    assert by_impl["matmul"]["baseline"] == "matmul"
    assert by_impl["sdpa_contiguous"]["baseline"] == "matmul"
    host_has_bf16 = not missing_native_bf16(host_cpu_flags())
    for isa in host_runnable_isas():
        baseline = by_impl[f"cpu_{isa}"]["baseline"]
        # Below a native-bf16 host's ISA a build stands for a CPU that widens; else the host's.
        # On an AVX-512 host the AVX2 build's matmul ran in a process whose BLAS is held to AVX2.
        expected = "matmul_widened" if host_has_bf16 and isa != "native" else "matmul"
        if isa == "avx2" and "avx512f" in host_cpu_flags():
            expected += "_avx2"
        assert baseline == expected
        if baseline.endswith("_avx2"):  # timed in the child: its own baseline there
            assert by_impl[baseline]["baseline"] == baseline
            assert by_impl[baseline]["fraction_of_matmul"] == pytest.approx(1.0)
        kernel = by_impl[f"cpu_{isa}"]
        assert kernel["fraction_of_matmul"] == pytest.approx(
            by_impl[baseline]["median_ms"]
            / kernel["median_ms"]
            * 4
            * 9
            * 64
            * 32
            * 33
            / 2
            / (2 * 32 * 576 * 1536)
        )


def test_interleaved_timing_runs_every_candidate_once_a_round_in_shuffled_orders():
    calls: list[str] = []
    candidates = {name: (lambda name=name: calls.append(name)) for name in "abcd"}
    times = time_interleaved(candidates, repeats=20)
    assert {name: len(wall) for name, (wall, _) in times.items()} == dict.fromkeys("abcd", 20)
    rounds = [tuple(calls[i : i + 4]) for i in range(4, len(calls), 4)]  # after the warm-up
    assert all(sorted(order) == list("abcd") for order in rounds)
    assert len(set(rounds)) > 5  # not one fixed order: a call's predecessor changes its time
    assert {order[0] for order in rounds} == set("abcd")
