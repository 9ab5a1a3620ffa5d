"""POST /start_profile and /stop_profile (vLLM's and SGLang's, with --profiler-dir): a
torch.profiler trace of the engine's steps between the two calls, written as a Chrome trace into
that folder (engine/profiling.py). A profile costs time on every step while it runs: profile a
few seconds of load, not a production server's day."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request

from pagedserve.engine.profiling import ProfilingError
from pagedserve.server.errors import invalid_request

router = APIRouter()


@router.post("/start_profile")
async def start_profile(request: Request) -> dict[str, Any]:
    folder = Path(request.app.state.config.server.profiler_dir).expanduser()
    try:
        await request.app.state.engine.start_profile(folder)
    except ProfilingError as error:
        raise invalid_request(f"{error}.") from None
    return {"status": "profiling"}


@router.post("/stop_profile")
async def stop_profile(request: Request) -> dict[str, Any]:
    try:
        trace = await request.app.state.engine.stop_profile()
    except ProfilingError as error:
        raise invalid_request(f"{error}.") from None
    return {"status": "stopped", "trace": str(trace)}
