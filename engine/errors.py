"""Errors the engine raises to its callers; the server maps each to an HTTP status."""


class EngineError(Exception):
    """Base class of every error the engine reports to a caller."""


class InvalidRequestError(EngineError):
    """The request can never be served as asked (too long, bad token ids...): HTTP 400.

    Raised by `add_request` before anything is queued. `param` names the offending field.
    """

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class EngineOverloadedError(EngineError):
    """Too many requests are already waiting: HTTP 429, retry later."""


class EngineDeadError(EngineError):
    """The engine loop has stopped (crash or shutdown): HTTP 503."""


class RequestFailedError(EngineError):
    """This one request failed inside the engine; the others go on (HTTP 500 / an error event)."""
