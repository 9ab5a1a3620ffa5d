"""The CPU kernel's build cache survives a builder that was killed mid-build, a second load in
one process reuses the build, and an unusable cache directory is a clear error."""

from __future__ import annotations

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
                "from pagedserve.cache.attention.cpu import load_cpu_kernel; load_cpu_kernel()",
            ],
            cwd=ROOT,
            timeout=120,
            check=True,
        )
    finally:
        stale_lock.unlink(missing_ok=True)


def test_an_unusable_kernel_cache_is_a_clear_error_that_auto_can_fall_back_from(
    tmp_path, monkeypatch
):
    from pagedserve.cache.attention import cpu

    not_a_directory = tmp_path / "file"
    not_a_directory.write_text("")
    monkeypatch.setenv("PAGEDSERVE_CACHE", str(not_a_directory))
    # A RuntimeError (not an OSError) is what the `auto` backend falls back to torch on.
    with pytest.raises(RuntimeError, match="PAGEDSERVE_CACHE"):
        cpu._load_cpu_kernel.__wrapped__("native")  # past the per-process cache of the real build


def test_loading_the_kernel_again_in_one_process_reuses_the_build():
    """torch rebuilds (as `<name>_v1`, `_v2`, ...) whenever a load's flags differ from the previous
    load of that name in the process: a flag list that grew between loads once cost every engine
    start in a process a full compile."""
    from pagedserve.cache.attention import cpu

    first = cpu.load_cpu_kernel()
    again = cpu._load_cpu_kernel.__wrapped__(cpu.requested_isa())  # past the per-process cache
    assert again.__name__ == first.__name__
    assert not again.__name__.rsplit("_", 1)[-1].startswith("v")
    assert cpu.load_cpu_kernel() is first
