"""benchmarks/spec_decode runs both workloads with and without speculation and reports them."""

from __future__ import annotations

import json

import pytest

from pagedserve.benchmarks import spec_decode


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_spec_decode_benchmark_reports_speedup_acceptance_and_identical_output(tmp_path):
    output = tmp_path / "spec_decode.json"
    spec_decode.main(
        [
            *("--batches", "1", "2", "--num-prompts", "2", "--prompt-tokens", "80"),
            *("--output-tokens", "12", "--throughput-requests", "2"),
            *("--throughput-output-tokens", "4", "--num-threads", "1", "--output", str(output)),
        ]
    )
    rows = json.loads(output.read_text())["results"]
    assert [row["workload"] for row in rows] == [
        "copy-heavy, batch 1",
        "copy-heavy, batch 2",
        "throughput workload, batch 2",
    ]
    assert all(row["identical_output"] and row["speedup"] > 0 for row in rows)
    assert rows[0]["acceptance_rate"] is not None  # copying a prompt drafts
