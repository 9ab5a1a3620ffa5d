"""GET /v1/engine/state (the block pool and the queues, as JSON) and GET /dashboard (a page that
draws them), both on only when `--enable-engine-state` resolves to on (default: loopback binds).

The state is behind the API key like every /v1 route. The page's static files are not:
they hold nothing but code, and the page sends the key itself when it fetches the state.
"""

from __future__ import annotations

import dataclasses
import json
from importlib.resources import files
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from pagedserve.engine import EngineClient, EngineState
from pagedserve.server.errors import APIError

router = APIRouter()

# URL path -> (file in server/static/, media type).
DASHBOARD_FILES = {
    "/dashboard": ("dashboard.html", "text/html; charset=utf-8"),
    "/dashboard/dashboard.css": ("dashboard.css", "text/css; charset=utf-8"),
    "/dashboard/dashboard.js": ("dashboard.js", "text/javascript; charset=utf-8"),
    "/dashboard/charts.js": ("charts.js", "text/javascript; charset=utf-8"),
    "/dashboard/util.js": ("util.js", "text/javascript; charset=utf-8"),
}
# Everything comes from this server: no CDN, no inline script, no framing by other sites.
_DASHBOARD_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
        "img-src 'self' data:; frame-ancestors 'none'; base-uri 'none'; form-action 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Cache-Control": "no-cache",
}


def _require_enabled(request: Request) -> None:
    if not request.app.state.config.server.engine_state_enabled:
        raise APIError(
            404,
            "The engine state is not served here: start the server with --enable-engine-state "
            "(it is on by default only for a loopback --host).",
            code="engine_state_disabled",
        )


def _fields(value: Any) -> dict[str, Any]:
    """A dataclass's fields, one level deep (its lists are the snapshot's own copies)."""
    return {field.name: getattr(value, field.name) for field in dataclasses.fields(value)}


def state_to_json(state: EngineState, model_name: str) -> bytes:
    """The JSON body (UTF-8), in one `json.dumps`.

    The pool goes out columnar, one list per field indexed by block id, as `EngineState` holds
    it: thousands of small objects at 2 Hz cost several times more to write (and their keys
    make the body three times larger), and that work holds the GIL the engine thread needs
    between its ops. The page rebuilds the per-block view (`dashboard.js: expandBlocks`).
    """
    plan = state.last_plan
    body = {
        "object": "engine.state",
        "model": model_name,
        "time": state.time,
        "num_steps": state.num_steps,
        "block_size": state.block_size,
        "num_blocks": state.num_blocks,
        "num_free_blocks": state.num_free_blocks,
        "enable_prefix_caching": state.enable_prefix_caching,
        "blocks": {
            "state": state.block_states,
            "ref_count": state.ref_counts,
            "owner_ids": state.owner_ids,
            "is_hashed": state.is_hashed,
        },
        "running": [_fields(request) for request in state.running],
        "waiting": [_fields(request) for request in state.waiting],
        "last_plan": None
        if plan is None
        else _fields(plan) | {"requests": [_fields(entry) for entry in plan.requests]},
        "stats": _fields(state.stats),
    }
    return json.dumps(body, separators=(",", ":"), allow_nan=False).encode()


@router.get("/v1/engine/state")
async def get_engine_state(request: Request) -> Response:
    _require_enabled(request)
    engine: EngineClient = request.app.state.engine
    state = await engine.engine_state()
    return Response(
        state_to_json(state, engine.model_name),
        media_type="application/json",
        headers={"Cache-Control": "no-store"},
    )


async def _dashboard_file(request: Request) -> Response:
    _require_enabled(request)
    name, media_type = DASHBOARD_FILES[request.scope["route"].path]
    content = (files("pagedserve.server") / "static" / name).read_bytes()
    return Response(content, media_type=media_type, headers=_DASHBOARD_HEADERS)


for _path in DASHBOARD_FILES:
    router.add_api_route(_path, _dashboard_file, methods=["GET"], include_in_schema=False)
