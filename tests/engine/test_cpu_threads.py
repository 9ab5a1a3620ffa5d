"""The CPU thread count follows the CPUs a process may use: its affinity mask and its cgroup's CFS
quota (v2 and v1 layouts), unless OMP_NUM_THREADS chose it."""

from __future__ import annotations

import os

import pytest
import torch

from pagedserve.engine.cpu_threads import cgroup_cpu_limit, fit_threads_to_cpus, usable_cpus


@pytest.mark.parametrize(
    ("files", "expected"),
    [
        ({"cpu.max": "max 100000\n"}, None),
        ({"cpu.max": "200000 100000\n"}, 2),
        ({"cpu.max": "150000 100000\n"}, 1),  # 1.5 CPUs: one thread never waits on throttling
        ({"cpu.max": "50000 100000\n"}, 1),  # at least one
        ({"cpu/cpu.cfs_quota_us": "400000", "cpu/cpu.cfs_period_us": "100000"}, 4),
        ({"cpu,cpuacct/cpu.cfs_quota_us": "-1", "cpu,cpuacct/cpu.cfs_period_us": "100000"}, None),
        ({"cpu.max": "garbage"}, None),
        ({}, None),
    ],
)
def test_the_cgroup_quota_in_whole_cpus(tmp_path, files, expected):
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert cgroup_cpu_limit(tmp_path) == expected


def test_usable_cpus_is_the_affinity_mask_capped_by_the_quota(tmp_path):
    affinity = len(os.sched_getaffinity(0))
    assert usable_cpus(tmp_path) == affinity  # no quota
    (tmp_path / "cpu.max").write_text(f"{100000 * (affinity + 8)} 100000")
    assert usable_cpus(tmp_path) == affinity
    (tmp_path / "cpu.max").write_text("100000 100000")
    assert usable_cpus(tmp_path) == 1


@pytest.mark.parametrize(("omp_num_threads", "expected"), [(None, 1), ("2", 2)])
def test_threads_are_capped_at_the_quota_unless_omp_num_threads_is_set(
    tmp_path, monkeypatch, omp_num_threads, expected
):
    (tmp_path / "cpu.max").write_text("100000 100000")  # one CPU
    if omp_num_threads is None:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    else:
        monkeypatch.setenv("OMP_NUM_THREADS", omp_num_threads)
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        fit_threads_to_cpus(tmp_path)
        assert torch.get_num_threads() == expected
    finally:
        torch.set_num_threads(previous)
