"""`pagedserve generate` prints a completion for a one-off prompt from the shell."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.parametrize("extra", [[], ["--chat"]])
def test_generate_prints_text(extra):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pagedserve.server",
            "generate",
            "Hello",
            "--max-tokens",
            "8",
            "--temperature",
            "0",
            *extra,
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip(), "generate printed no text"
    # One sequence: the "auto" KV budget is one request at max_model_len, not gigabytes.
    assert "max concurrency at max_model_len 4096: 1.0 requests" in result.stderr
