"""The CPU kernel's build cache survives a builder that was killed mid-build."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_a_stale_torch_build_lock_does_not_hang_the_next_start():
    from cache.attention.cpu import load_cpu_kernel

    build_dir = Path(load_cpu_kernel().__file__).parent  # built (or found) once
    stale_lock = build_dir / "lock"
    stale_lock.touch()  # what torch leaves behind when a builder is killed
    try:
        subprocess.run(
            [sys.executable, "-c", "from cache.attention.cpu import load_cpu_kernel; load_cpu_kernel()"],
            cwd=ROOT, timeout=120, check=True, env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
    finally:
        stale_lock.unlink(missing_ok=True)
