"""The peer benchmark's idle-host check: CPU ticks from /proc/stat, the hypervisor's share of
them, and the wait for a quiet machine before each timed run."""

from __future__ import annotations

import sys
import time

import pytest

from pagedserve.benchmarks import host_quiet
from pagedserve.benchmarks.host_quiet import CpuTicks, read_cpu_ticks, steal_share

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/stat")


@linux_only
def test_ticks_add_up_and_count_our_own_work_as_busy():
    before = read_cpu_ticks()
    host_quiet._busy_for(0.3)
    after = read_cpu_ticks()
    assert before is not None and after is not None
    assert 0 <= after.busy + after.steal <= after.total
    assert after.busy > before.busy  # our matmuls, at 100 ticks a second per core
    share = steal_share(before, after)
    assert share is not None and 0.0 <= share <= 1.0


def test_steal_share_is_the_hypervisors_part_of_the_elapsed_ticks():
    before = CpuTicks(busy=100, steal=10, total=1000)
    after = CpuTicks(busy=250, steal=30, total=1200)
    assert steal_share(before, after) == pytest.approx(20 / 200)
    assert steal_share(None, after) is None
    assert steal_share(after, after) is None  # no time passed: no share


def _scripted_host(monkeypatch, steal_per_check: list[int], other_busy: int = 0) -> list[int]:
    """Replace /proc/stat with a host whose busy second in check i loses steal_per_check[i] of
    its 200 ticks (then none), and whose idle half second shows other_busy ticks."""
    state = {"busy": 0, "steal": 0, "total": 0, "reads": 0}
    checks: list[int] = []

    def read() -> CpuTicks:
        state["reads"] += 1
        return CpuTicks(busy=state["busy"], steal=state["steal"], total=state["total"])

    def idle(seconds: float) -> None:
        state["busy"] += other_busy
        state["total"] += 100

    def busy(seconds: float) -> None:
        check = len(checks)
        stolen = steal_per_check[check] if check < len(steal_per_check) else 0
        checks.append(stolen)
        state["busy"] += 200 - stolen
        state["steal"] += stolen
        state["total"] += 200

    monkeypatch.setattr(host_quiet, "read_cpu_ticks", read)
    monkeypatch.setattr(host_quiet.time, "sleep", idle)
    monkeypatch.setattr(host_quiet, "_busy_for", busy)
    return checks


def test_waits_until_three_checks_in_a_row_see_no_steal(monkeypatch):
    checks = _scripted_host(monkeypatch, steal_per_check=[30, 0, 0, 25, 0, 0, 0])
    host_quiet.wait_for_quiet_host(quiet_rounds=3)
    assert checks == [30, 0, 0, 25, 0, 0, 0]  # the burst in check 4 restarted the count


def test_a_busy_machine_is_not_quiet_even_without_steal(monkeypatch):
    checks = _scripted_host(monkeypatch, steal_per_check=[], other_busy=50)
    start = time.monotonic()
    host_quiet.wait_for_quiet_host(quiet_rounds=3, timeout=0.05)
    assert time.monotonic() - start < 5 and len(checks) >= 1  # gave up at the timeout


def test_zero_timeout_does_not_wait(monkeypatch):
    checks = _scripted_host(monkeypatch, steal_per_check=[])
    assert host_quiet.wait_for_quiet_host(timeout=0) < 1.0
    assert checks == []


def test_no_proc_stat_means_no_wait(monkeypatch):
    monkeypatch.setattr(host_quiet, "read_cpu_ticks", lambda: None)
    monkeypatch.setattr(host_quiet, "_busy_for", lambda seconds: None)
    monkeypatch.setattr(host_quiet.time, "sleep", lambda seconds: None)
    assert host_quiet.wait_for_quiet_host(timeout=60) < 1.0
