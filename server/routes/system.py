"""GET /health, /version and /metrics: for probes and scrapers, so no API key is needed."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from pagedserve.server.errors import APIError

router = APIRouter()


def _package_version() -> str:
    try:
        return version("pagedserve")
    except PackageNotFoundError:  # running from a source tree that was never installed
        return "unknown"


@router.get("/health")
async def health(request: Request) -> Response:
    if request.app.state.engine.is_alive:
        return JSONResponse({"status": "ok"})
    return APIError(
        503, "The engine is not running.", type="server_error", code="engine_dead"
    ).response()


@router.get("/version")
async def get_version() -> dict[str, str]:
    return {"version": _package_version()}


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    return Response(request.app.state.metrics.render(), media_type=CONTENT_TYPE_LATEST)
