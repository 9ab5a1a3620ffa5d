"""Continuous batching: which requests run each step, with how many tokens; preemption; stops.

Pure Python (no torch). Grows block tables through `cache.BlockManager`, knows no tensors.
"""

from pagedserve.scheduler.admission import AdmissionError
from pagedserve.scheduler.output import (
    ModelRunnerOutput,
    RequestUpdate,
    ScheduledRequest,
    SchedulerOutput,
)
from pagedserve.scheduler.request import Request, RequestStatus
from pagedserve.scheduler.scheduler import Scheduler
from pagedserve.scheduler.snapshot import (
    PlannedRequest,
    PlanSnapshot,
    RequestSnapshot,
    SchedulerSnapshot,
    snapshot_plan,
    snapshot_scheduler,
)

__all__ = [
    "AdmissionError",
    "ModelRunnerOutput",
    "PlanSnapshot",
    "PlannedRequest",
    "Request",
    "RequestSnapshot",
    "RequestStatus",
    "RequestUpdate",
    "ScheduledRequest",
    "Scheduler",
    "SchedulerOutput",
    "SchedulerSnapshot",
    "snapshot_plan",
    "snapshot_scheduler",
]
