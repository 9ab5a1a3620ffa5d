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

__all__ = [
    "AdmissionError",
    "ModelRunnerOutput",
    "Request",
    "RequestStatus",
    "RequestUpdate",
    "ScheduledRequest",
    "Scheduler",
    "SchedulerOutput",
]
