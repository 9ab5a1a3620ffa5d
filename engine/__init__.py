"""The engine: step loop, model runner, sampling, detokenization, offline and async APIs.

The server imports only this package's public surface (and `configs`).
"""

from configs import SamplingParams
from engine.client import EngineClient
from engine.errors import (
    EngineDeadError,
    EngineError,
    EngineOverloadedError,
    InvalidRequestError,
    RequestFailedError,
)
from engine.outputs import CompletionOutput, EngineStats, RequestDelta, RequestOutput, TokenLogprob

__all__ = [
    "CompletionOutput",
    "EngineClient",
    "EngineDeadError",
    "EngineError",
    "EngineOverloadedError",
    "EngineStats",
    "InvalidRequestError",
    "RequestDelta",
    "RequestFailedError",
    "RequestOutput",
    "SamplingParams",
    "TokenLogprob",
]
