"""The decode-linears benchmark: oneDNN's packed layers against the panel kernel (and the skinny
kernel for float32 batches it takes), every dtype the host can run, results written."""

from __future__ import annotations

import json

from pagedserve.benchmarks import decode_linears


def test_the_benchmark_times_each_implementation_per_row_count(tmp_path):
    output = tmp_path / "d.json"
    rows = decode_linears.main(
        ["--layers", "1", "--rows", "3", "40", "--repeats", "1", "--output", str(output)]
    )
    float32 = [row for row in rows if row["dtype"] == "float32"]
    assert [row["rows"] for row in float32] == [3, 40]
    assert all(row["onednn_ms"] > 0 and row["panel_ms"] > 0 for row in rows)
    assert "skinny_ms" in float32[0] and "skinny_ms" not in float32[1]  # 1-16 rows only
    assert {row["dtype"] for row in rows} <= {"float32", "bfloat16"}
    assert json.loads(output.read_text())["results"] == rows
