"""engine/heap_retention.py: after it, memory a freed tensor held is reused without faulting its
pages in again; without it (glibc's defaults), the same allocation faults them in afresh. Each
case runs in a fresh interpreter, since the settings are process-wide."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

PROBE = """
import json, resource, sys
import torch
if sys.argv[1] == "retain":
    from pagedserve.engine.heap_retention import retain_freed_heap_memory
    assert retain_freed_heap_memory()
def faults_of_a_fresh_20_mib_tensor():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    tensor = torch.empty(5 << 20)  # 20 MiB of float32: above glibc's default mmap threshold
    tensor.fill_(1.0)  # touch every page
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    del tensor
    return faults
print(json.dumps([faults_of_a_fresh_20_mib_tensor() for _ in range(6)]))
"""
PAGES = (20 << 20) // 4096


def _faults(mode: str) -> list[int]:
    done = subprocess.run(
        [sys.executable, "-c", PROBE, mode],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    return json.loads(done.stdout.splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_freed_activation_memory_is_reused_without_page_faults():
    default = _faults("default")
    retained = _faults("retain")
    # glibc's defaults: such a block is mmapped, and unmapped when freed, so a later one faults
    # its pages in again (six rounds, as glibc's adaptive threshold lets one or two reuse memory).
    assert max(default[3:]) > PAGES // 2
    # Retained: the first allocation faults, and from the fourth on none does (one early repeat
    # was seen while the heap settles).
    assert retained[0] > PAGES // 2
    assert max(retained[3:]) < PAGES // 20


def test_users_own_malloc_settings_win():
    env = dict(os.environ, MALLOC_TRIM_THRESHOLD_="0")
    probe = "from pagedserve.engine.heap_retention import retain_freed_heap_memory as r; print(r())"
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, env=env
    )
    assert done.stdout.strip() == "False"
