"""Every HTTP error the server sends, in OpenAI's shape `{"error": {message, type, param, code}}`.

The one place that maps exceptions (ours, the engine's, pydantic's, Starlette's) to a status and a
body. Responses never contain a stack trace; unexpected errors are logged with the request id.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagedserve.configs import SamplingParamsError
from pagedserve.engine.errors import (
    EngineDeadError,
    EngineOverloadedError,
    InvalidRequestError,
    RequestFailedError,
)

logger = logging.getLogger(__name__)

# nginx's "client closed request": logged, never seen by the (gone) client.
STATUS_CLIENT_CLOSED_REQUEST = 499


class APIError(Exception):
    """An error with its HTTP status and OpenAI error fields; raise it anywhere in a handler."""

    def __init__(
        self,
        status_code: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict[str, dict[str, str | None]]:
        # Messages quote client input, which may hold lone surrogates ("\ud800" in JSON) that
        # cannot be encoded as UTF-8: they are shown escaped rather than failing the response.
        message = self.message.encode("utf-8", "backslashreplace").decode("utf-8")
        return {
            "error": {"message": message, "type": self.type, "param": self.param, "code": self.code}
        }

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status_code)


class ClientDisconnectedError(Exception):
    """The client went away before the response was complete; its engine requests are aborted."""


class ServerShuttingDownError(APIError):
    """The shutdown grace period ended before the request finished; its engine requests are
    aborted and the client gets this as a final event (or a 503)."""

    def __init__(self) -> None:
        super().__init__(
            503, "The server is shutting down.", type="server_error", code="shutting_down"
        )


def invalid_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


def model_not_found(model: str) -> APIError:
    return APIError(
        404, f"The model `{model}` does not exist.", param="model", code="model_not_found"
    )


def to_api_error(exc: Exception) -> APIError:
    """The API error for an exception raised while serving (also used for in-stream errors)."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, (InvalidRequestError, SamplingParamsError)):
        return invalid_request(str(exc), param=exc.param)
    if isinstance(exc, EngineOverloadedError):
        return APIError(
            429,
            str(exc) or "The server is overloaded; retry later.",
            type="rate_limit_error",
            code="engine_overloaded",
        )
    if isinstance(exc, EngineDeadError):
        return APIError(
            503, str(exc) or "The engine is not running.", type="server_error", code="engine_dead"
        )
    if isinstance(exc, RequestFailedError):
        return APIError(500, str(exc) or "The request failed in the engine.", type="server_error")
    return APIError(500, "Internal server error.", type="server_error", code="internal_error")


def _param_from_location(location: tuple[int | str, ...]) -> str | None:
    """('messages', 0, 'role') -> 'messages[0].role'."""
    param = ""
    for part in location:
        param += f"[{part}]" if isinstance(part, int) else f".{part}" if param else part
    return param or None


def _validation_error(exc: RequestValidationError) -> APIError:
    errors = exc.errors()
    if errors[0].get("type") == "json_invalid":
        detail = errors[0].get("ctx", {}).get("error", "JSON decode error")
        return invalid_request(f"The request body is not valid JSON: {detail}.")
    # A union field reports one error per member type, each under a tag such as 'list[int]';
    # the location they share is the field the client got wrong.
    location = tuple(errors[0].get("loc", ()))[1:]  # drop the leading 'body'
    same_field = [error for error in errors if tuple(error["loc"])[1:2] == location[:1]]
    for error in same_field:
        other = tuple(error["loc"])[1:]
        while other[: len(location)] != location:
            location = location[:-1]
    param = _param_from_location(location)
    if param is None:
        return invalid_request(
            "The request body must be a JSON object (sent with Content-Type: application/json)."
        )
    messages = "; ".join(dict.fromkeys(error.get("msg", "invalid") for error in same_field))
    return invalid_request(f"Invalid value for '{param}': {messages}.", param)


def _http_error(request: Request, exc: StarletteHTTPException) -> APIError:
    if exc.status_code == 404:
        return APIError(
            404, f"Invalid URL ({request.method} {request.url.path}).", code="not_found"
        )
    if exc.status_code == 405:
        return APIError(
            405,
            f"Method {request.method} is not allowed for {request.url.path}.",
            code="method_not_allowed",
        )
    if exc.status_code == 413:
        return APIError(413, str(exc.detail), code="request_too_large")
    if exc.status_code == 400:  # Starlette/FastAPI's body parser: invalid UTF-8, deep nesting
        return invalid_request(
            "The request body could not be parsed: it must be UTF-8 JSON, nested less than "
            "about 1,000 levels deep."
        )
    return APIError(exc.status_code, str(exc.detail), type="invalid_request_error")


def install_exception_handlers(app: FastAPI) -> None:
    """Register handlers so that every error leaves the server as an OpenAI error body."""

    async def on_api_error(request: Request, exc: Exception) -> Response:
        return to_api_error(exc).response()

    async def on_validation_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, RequestValidationError)
        return _validation_error(exc).response()

    async def on_http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, StarletteHTTPException)
        return _http_error(request, exc).response()

    async def on_disconnect(request: Request, exc: Exception) -> Response:
        logger.info("request %s: client disconnected", request.state.request_id)
        return Response(status_code=STATUS_CLIENT_CLOSED_REQUEST)

    async def on_unexpected(request: Request, exc: Exception) -> Response:
        request_id = getattr(request.state, "request_id", "-")
        logger.exception("request %s failed with an unexpected error", request_id)
        response = to_api_error(exc).response()
        # Starlette re-raises the error after this response and uvicorn then drops the connection:
        # a keep-alive client must not send its next request on it.
        response.headers["connection"] = "close"
        return response

    for known in (
        APIError,
        InvalidRequestError,
        SamplingParamsError,
        EngineOverloadedError,
        EngineDeadError,
        RequestFailedError,
    ):
        app.add_exception_handler(known, on_api_error)
    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(StarletteHTTPException, on_http_error)
    app.add_exception_handler(ClientDisconnectedError, on_disconnect)
    app.add_exception_handler(Exception, on_unexpected)
