"""torch.profiler traces of the engine's steps, on demand (vLLM's and SGLang's /start_profile and
/stop_profile; server/routes/profile.py): started and stopped on the engine thread, between two
steps, so the trace holds whole steps: the model's ops, the paged attention kernel
(`pagedserve::paged_attention`), the sampler, and the scheduling around them. Saved as a Chrome
trace (chrome://tracing, Perfetto) in the folder `--profiler-dir` names."""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from pagedserve.engine.llm_engine import LLMEngine


class ProfilingError(RuntimeError):
    """A profile was started twice, or stopped without one running."""


class StepProfiler:
    """At most one trace at a time, of the engine thread."""

    def __init__(self) -> None:
        self._profile: torch.profiler.profile | None = None

    @property
    def running(self) -> bool:
        return self._profile is not None

    def start(self, engine: LLMEngine) -> None:
        if self._profile is not None:
            raise ProfilingError("a profile is already running; stop it first")
        activities = [torch.profiler.ProfilerActivity.CPU]
        if engine.cache_engine.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        profile = torch.profiler.profile(activities=activities, record_shapes=True)
        profile.__enter__()
        self._profile = profile

    def stop(self, engine: LLMEngine, folder: Path) -> Path:
        """End the trace and write it; returns its file."""
        if self._profile is None:
            raise ProfilingError("no profile is running; start one first")
        profile, self._profile = self._profile, None
        profile.__exit__(None, None, None)
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"pagedserve-trace-{time.strftime('%Y%m%d-%H%M%S')}-{engine.num_steps}.json"
        profile.export_chrome_trace(str(path))
        return path
