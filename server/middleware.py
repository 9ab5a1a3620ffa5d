"""Pure ASGI middleware: request identity and arrival time, API-key auth, and the body size limit.

Pure ASGI (not BaseHTTPMiddleware) so that `receive` reaches the handlers untouched: they listen on
it for the client's `http.disconnect`.
"""

from __future__ import annotations

import hmac
import time
import uuid

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pagedserve.server.errors import APIError
from pagedserve.server.routes.engine_state import DASHBOARD_FILES

# Probes and scrapers must work without the key, and so must the dashboard's static files (a
# browser cannot send the key with a page load; the page sends it with its state requests).
# Everything else, unknown paths included, needs it.
UNGUARDED_PATHS = frozenset({"/health", "/ping", "/version", "/metrics", *DASHBOARD_FILES})


def route_path(scope: Scope) -> str:
    """The path the routes see: behind `--root-path`, uvicorn puts the prefix in front of the
    path (and in `root_path`); the routes, and these checks, are written without it."""
    path, root = scope["path"], scope.get("root_path", "")
    return path[len(root) :] or "/" if root and path.startswith(root) else path


class RequestContextMiddleware:
    """Gives each request an id (`request.state.request_id`, echoed as `x-request-id`) and its
    arrival time: `request.state.arrival_time` (monotonic), from which latency metrics count, and
    `request.state.created` (Unix seconds), a response's `created`."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = uuid.uuid4().hex
        state = scope.setdefault("state", {})
        state["request_id"], state["arrival_time"] = request_id, time.monotonic()
        state["created"] = int(time.time())

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [
                    *message.get("headers", []),
                    (b"x-request-id", request_id.encode()),
                ]
            await send(message)

        await self.app(scope, receive, send_with_id)


class ApiKeyMiddleware:
    """Rejects requests without `Authorization: Bearer <api_key>` before their body is read."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or route_path(scope) in UNGUARDED_PATHS:
            await self.app(scope, receive, send)
            return
        given = dict(scope["headers"]).get(b"authorization", b"")
        if not hmac.compare_digest(given, self.expected):  # constant time: no timing oracle
            error = APIError(
                401,
                "Missing or incorrect API key; send 'Authorization: Bearer <key>'.",
                code="invalid_api_key",
            )
            await error.response()(scope, receive, send)
            return
        await self.app(scope, receive, send)


class BodyLimitMiddleware:
    """413 for bodies over `max_body_bytes`: early from Content-Length, and again while reading,
    since Content-Length may be absent (chunked) or lie."""

    def __init__(self, app: ASGIApp, max_body_bytes: int) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes

    def _too_large(self) -> str:
        return f"The request body exceeds the limit of {self.max_body_bytes} bytes."

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_body_bytes:
            error = APIError(413, self._too_large(), code="request_too_large")
            await error.response()(scope, receive, send)
            return
        num_received_bytes = 0

        async def limited_receive() -> Message:
            nonlocal num_received_bytes
            message = await receive()
            if message["type"] == "http.request":
                num_received_bytes += len(message.get("body", b""))
                if num_received_bytes > self.max_body_bytes:
                    # An HTTPException passes through FastAPI's body parser to our 413 handler.
                    raise HTTPException(413, self._too_large())
            return message

        await self.app(scope, limited_receive, send)
