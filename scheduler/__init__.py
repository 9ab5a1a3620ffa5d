"""Continuous batching: which requests run each step, with how many tokens; preemption; stops.

Pure Python (no torch). Grows block tables through `cache.BlockManager`, knows no tensors.
"""

from scheduler.output import ModelRunnerOutput, RequestUpdate, ScheduledRequest, SchedulerOutput
from scheduler.request import Request, RequestStatus
from scheduler.scheduler import AdmissionError, Scheduler

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
