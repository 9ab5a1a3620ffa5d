"""The engine: step loop, model runner, sampling, detokenization, offline and async APIs.

The server imports only this package's public surface (and `configs`). Ids: a caller's
`request_id` names one request (one prompt); `index` one of its `n` choices; the scheduler's
`sequence_id` ("<request_id>#<index>") one choice's sequence (README: "Ids").
"""

from pagedserve.configs import SamplingParams
from pagedserve.engine.client import EngineClient
from pagedserve.engine.errors import (
    EngineDeadError,
    EngineError,
    EngineOverloadedError,
    InvalidRequestError,
    RequestFailedError,
)
from pagedserve.engine.outputs import (
    CompletionOutput,
    EngineStats,
    RequestDelta,
    RequestOutput,
    TokenLogprob,
)
from pagedserve.engine.state import BLOCK_STATES, BlockInfo, EngineState

__all__ = [
    "BLOCK_STATES",
    "BlockInfo",
    "CompletionOutput",
    "EngineClient",
    "EngineDeadError",
    "EngineError",
    "EngineOverloadedError",
    "EngineState",
    "EngineStats",
    "InvalidRequestError",
    "RequestDelta",
    "RequestFailedError",
    "RequestOutput",
    "SamplingParams",
    "TokenLogprob",
]
