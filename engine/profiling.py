"""torch.profiler traces of the engine's steps, on demand (vLLM's and SGLang's /start_profile and
/stop_profile; server/routes/profile.py): started and stopped on the engine thread, between two
steps, so the trace holds whole steps: the model's ops, the paged attention kernel
(`pagedserve::paged_attention`), the sampler, and the scheduling around them. Saved as a Chrome
trace (chrome://tracing, Perfetto) in the folder `--profiler-dir` names."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from pagedserve.engine.llm_engine import LLMEngine


class ProfilingError(RuntimeError):
    """A profile was started twice, or stopped without one running."""


@dataclass(frozen=True, slots=True)
class FinishedProfile:
    """A trace ended on the engine thread, to be written off it (a large trace takes seconds)."""

    profile: torch.profiler.profile
    path: Path

    def write(self) -> Path:
        self.profile.export_chrome_trace(str(self.path))
        return self.path


class StepProfiler:
    """At most one trace at a time, of the engine thread. While one runs, every operator is
    recorded with its shapes: memory grows with the steps, so profile seconds, not hours."""

    def __init__(self) -> None:
        self._profile: torch.profiler.profile | None = None
        self._path: Path | None = None

    def start(self, engine: LLMEngine, folder: Path) -> None:
        if self._profile is not None:
            raise ProfilingError("a profile is already running; stop it first")
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise ProfilingError(f"cannot make the profile folder {folder}: {error}") from None
        activities = [torch.profiler.ProfilerActivity.CPU]
        if engine.cache_engine.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        profile = torch.profiler.profile(activities=activities, record_shapes=True)
        profile.__enter__()
        stamp = time.strftime("%Y%m%d-%H%M%S")
        self._profile = profile
        self._path = folder / f"pagedserve-trace-{stamp}-{uuid.uuid4().hex[:8]}.json"

    def stop(self) -> FinishedProfile:
        """End the trace (on the engine thread, where it was started)."""
        if self._profile is None or self._path is None:
            raise ProfilingError("no profile is running; start one first")
        profile, self._profile = self._profile, None
        profile.__exit__(None, None, None)
        return FinishedProfile(profile, self._path)
