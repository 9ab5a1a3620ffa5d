"""The packed-linear benchmark times both paths on every shape and finds the outputs identical."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pagedserve.benchmarks import linear
from pagedserve.engine.packed_linear import can_pack


@pytest.mark.skipif(
    not can_pack(nn.Linear(1, 1).to(torch.bfloat16)), reason="no native bf16 on this CPU"
)
def test_linear_benchmark_times_every_shape_and_finds_identical_outputs(tmp_path):
    rows = linear.main(["--rows", "1", "5", "--repeats", "2", "--output", str(tmp_path / "l.json")])
    assert len(rows) == 2 * len(linear.SHAPES)
    assert all(row["bit_identical"] and row["packed_us"] > 0 for row in rows)
    assert (tmp_path / "l.json").exists()
