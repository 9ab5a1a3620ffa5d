"""Smoke run of `benchmarks/replicas.py`: one replica behind the router, a two-request workload."""

from __future__ import annotations

import json

import pytest

from pagedserve.benchmarks import replicas


@pytest.mark.slow
def test_the_replicas_benchmark_measures_each_configuration_through_the_router(tmp_path):
    output = tmp_path / "replicas.json"
    rows = replicas.main(
        ["--replicas", "1", "--num-requests", "2", "--min-prompt-tokens", "8"]
        + ["--max-prompt-tokens", "16", "--output-tokens", "3", "--output", str(output)]
    )
    (row,) = rows
    assert row["num_replicas"] == 1 and row["num_completed"] == 2 and row["num_errors"] == 0
    assert row["output_tokens_per_s"] > 0
    assert row["replica_cpu_s"] > 0 and row["output_tokens_per_cpu_s"] > 0
    assert json.loads(output.read_text())["results"][0]["num_replicas"] == 1


def test_the_default_workload_is_fixed_and_compares_two_replicas_with_one():
    args = replicas.parse_args([])
    assert args.replicas == [2, 1]
    assert (args.num_requests, args.max_prompt_tokens, args.output_tokens) == (32, 256, 64)
