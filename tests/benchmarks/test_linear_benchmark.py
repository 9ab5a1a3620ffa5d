"""The linear benchmark: bfloat16 packed against plain, bit-identical; float32 skinny against the
host's float32 linear, within rounding."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pagedserve.benchmarks import linear
from pagedserve.engine.packed_linear import can_pack, float32_linear_backend


@pytest.mark.skipif(
    not can_pack(nn.Linear(1, 1).to(torch.bfloat16)), reason="no native bf16 on this CPU"
)
def test_linear_benchmark_times_every_shape_and_finds_identical_outputs(tmp_path):
    rows = linear.main(["--rows", "1", "5", "--repeats", "2", "--output", str(tmp_path / "l.json")])
    assert len(rows) == 2 * len(linear.SHAPES)
    assert all(row["bit_identical"] and row["packed_us"] > 0 for row in rows)
    assert (tmp_path / "l.json").exists()


def test_float32_benchmark_times_the_skinny_kernel_against_the_hosts_linear(tmp_path):
    output = tmp_path / "l.json"
    rows = linear.main(
        ["--dtype", "float32", "--rows", "3", "--repeats", "1", "--output", str(output)]
    )
    assert [row["layer"] for row in rows] == list(linear.SHAPES)
    assert {row["backend"] for row in rows} == {float32_linear_backend("auto")}
    assert all(row["linear_us"] > 0 and row["skinny_us"] > 0 for row in rows)
    assert all(row["max_relative_error"] < 1e-5 for row in rows)  # float32 rounding, no more
    assert output.exists()
