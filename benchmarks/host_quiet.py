"""Is the machine idle? CPU time from `/proc/stat`, including the time a hypervisor takes back.

On a VM, the vCPUs can lose time to the host ("steal"), and an engine timed then runs slow
through no fault of its own. The peer benchmark met it as a systematic bias: vLLM's defaults
touch ~20 GiB for their KV cache; after that process exits, the host spends the next ~20 s
reclaiming the memory and takes 10-15% of the guest's CPU time in bursts (a 1,024^2 float32
matmul loop on a 2-vCPU KVM guest, AMD EPYC Zen 4: 197 GFLOP/s before, 162-177 in the seconds
with steal, back to 197 after). Whichever engine ran next was timed on a machine that was not
idle. Waiting for a few quiet seconds before each timed run, and recording each run's steal,
makes "one system after the other on an idle machine" true and shows when it was not.

Linux only; elsewhere (no `/proc/stat`) the functions report nothing and never wait.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

# /proc/stat's aggregate "cpu" line: user nice system idle iowait irq softirq steal ...
IDLE_FIELDS = (3, 4)  # idle, iowait
STEAL_FIELD = 7


@dataclass(frozen=True)
class CpuTicks:
    busy: int  # ticks the guest spent running anything
    steal: int  # ticks the hypervisor ran something else on our vCPUs
    total: int


def read_cpu_ticks() -> CpuTicks | None:
    """The machine's cumulative CPU ticks, all cores together; None without `/proc/stat`."""
    try:
        with open("/proc/stat") as stat:
            fields = [int(value) for value in stat.readline().split()[1:9]]
    except (OSError, ValueError):
        return None
    if len(fields) < 8:
        return None
    idle = sum(fields[index] for index in IDLE_FIELDS)
    steal = fields[STEAL_FIELD]
    return CpuTicks(busy=sum(fields) - idle - steal, steal=steal, total=sum(fields))


def steal_share(before: CpuTicks | None, after: CpuTicks | None) -> float | None:
    """Fraction of the CPU time between two readings that the hypervisor took."""
    if before is None or after is None or after.total <= before.total:
        return None
    return (after.steal - before.steal) / (after.total - before.total)


def wait_for_quiet_host(
    quiet_rounds: int = 3,
    max_busy: float = 0.05,
    max_steal: float = 0.02,
    timeout: float = 180.0,
) -> float:
    """Block until `quiet_rounds` checks in a row find the machine idle and the host taking no
    time, or `timeout` passed; the seconds waited.

    A check is half a second of sleep (nothing else may run: guest busy <= max_busy of the CPU
    time) and then a second of matrix multiplies on every core (steal <= max_steal). The busy
    second is needed because a hypervisor can only take time from a vCPU that wants to run:
    on an idle guest the reclaim after a large process shows no steal at all."""
    start = time.monotonic()
    quiet = 0
    while quiet < quiet_rounds and time.monotonic() - start < timeout:  # timeout 0: no wait
        before = read_cpu_ticks()
        time.sleep(0.5)
        idle_end = read_cpu_ticks()
        _busy_for(1.0)
        busy_end = read_cpu_ticks()
        if before is None or idle_end is None or busy_end is None:
            return time.monotonic() - start  # no /proc/stat: nothing to wait for
        others_busy = (idle_end.busy - before.busy) / max(1, idle_end.total - before.total)
        steal = steal_share(idle_end, busy_end) or 0.0
        quiet = quiet + 1 if others_busy <= max_busy and steal <= max_steal else 0
    return time.monotonic() - start


def _busy_for(seconds: float) -> None:
    """Keep every core torch uses busy (small matrix multiplies) for about `seconds`."""
    import torch

    a = torch.ones(512, 512)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        torch.mm(a, a)
