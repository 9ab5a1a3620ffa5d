"""The CPU kernel's build cache survives a builder that was killed mid-build, and an unusable
cache directory is a clear error."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_a_stale_torch_build_lock_does_not_hang_the_next_start():
    from pagedserve.cache.attention.cpu import load_cpu_kernel

    build_dir = Path(load_cpu_kernel().__file__).parent  # built (or found) once
    stale_lock = build_dir / "lock"
    stale_lock.touch()  # what torch leaves behind when a builder is killed
    try:
        subprocess.run(
            [
                sys.executable,
                "-c",
                "from cache.attention.cpu import load_cpu_kernel; load_cpu_kernel()",
            ],
            cwd=ROOT,
            timeout=120,
            check=True,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
    finally:
        stale_lock.unlink(missing_ok=True)


def test_an_unusable_kernel_cache_is_a_clear_error_that_auto_can_fall_back_from(
    tmp_path, monkeypatch
):
    from pagedserve.cache.attention.cpu import load_cpu_kernel

    not_a_directory = tmp_path / "file"
    not_a_directory.write_text("")
    monkeypatch.setenv("PAGEDSERVE_CACHE", str(not_a_directory))
    # A RuntimeError (not an OSError) is what the `auto` backend falls back to torch on.
    with pytest.raises(RuntimeError, match="PAGEDSERVE_CACHE"):
        load_cpu_kernel.__wrapped__()  # past the per-process cache of the real build
