"""What a router in front of several replicas asks each of them (SGLang's worker API, which
sglang-router calls): `/server_info`, `/model_info` (and their older `/get_*` names), `/get_load`
for load-aware policies, and `/health_generate`, a health check that runs one real decode step.

Read-only views of the engine and its config; no state is kept here.
"""

from __future__ import annotations

import asyncio
import uuid
from contextlib import aclosing
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from pagedserve.configs import SamplingParams
from pagedserve.server.errors import APIError

router = APIRouter()
HEALTH_GENERATE_TIMEOUT_S = 20.0  # one token behind a full batch on a small CPU stays well under


def _package_version() -> str:
    try:
        return version("pagedserve")
    except PackageNotFoundError:  # a source tree that was never installed
        return "unknown"


def _server_info(request: Request) -> dict[str, Any]:
    config, engine = request.app.state.config, request.app.state.engine
    stats = engine.stats()
    # NOTE: no `model_path` / `tokenizer_path`: sglang-router would try to fetch a tokenizer for
    # them from the Hugging Face hub, which it does not need to route HTTP requests.
    return {
        "served_model_name": engine.model_name,
        "version": _package_version(),
        "dp_size": 1,  # one engine per replica: data parallelism is the router's job
        "max_running_requests": config.scheduler.max_num_seqs,
        "max_prefill_tokens": config.scheduler.for_model_len(
            engine.max_model_len
        ).max_num_batched_tokens,
        "max_total_tokens": stats.num_total_blocks * stats.block_size,
        "context_length": engine.max_model_len,
        "page_size": stats.block_size,
        "enable_prefix_caching": config.cache.enable_prefix_caching,
    }


@router.get("/server_info")
@router.get("/get_server_info")
async def server_info(request: Request) -> dict[str, Any]:
    return _server_info(request)


@router.get("/model_info")
@router.get("/get_model_info")
async def model_info(request: Request) -> dict[str, Any]:
    engine = request.app.state.engine
    return {  # no model path: see `_server_info`
        "served_model_name": engine.model_name,
        "is_generation": engine.classifier is None,  # a classifier does not generate
        "max_context_length": engine.max_model_len,
        "vocab_size": engine.vocab_size,
    }


@router.get("/get_load")
async def get_load(request: Request) -> list[dict[str, int]]:
    """SGLang's shape: one entry per data-parallel rank (here one). `num_tokens` counts the KV
    slots of the blocks in use, which is what a cache-pressure-aware policy compares."""
    stats = request.app.state.engine.stats()
    num_used_blocks = stats.num_total_blocks - stats.num_free_blocks
    return [
        {
            "dp_rank": 0,
            "num_reqs": stats.num_requests_running + stats.num_requests_waiting,
            "num_waiting_reqs": stats.num_requests_waiting,
            "num_tokens": num_used_blocks * stats.block_size,
        }
    ]


async def _one_token(engine: Any) -> bool:
    prompt_token_ids = engine.tokenizer.encode("ping", add_special_tokens=False)[:1] or [0]
    # A classifier does not generate: its probe is an embedding request, which still runs a
    # forward pass and produces (and drops) one token.
    params = SamplingParams(max_tokens=1, temperature=0.0, embed=engine.classifier is not None)
    stream = engine.generate(prompt_token_ids, params, f"health-{uuid.uuid4().hex}")
    async with aclosing(stream):
        async for delta in stream:
            if delta.finish_reason == "error":
                return False
            if delta.new_token_ids:
                return True
    return False


@router.get("/health_generate")
async def health_generate(request: Request) -> Response:
    """200 once the engine produced a token for a one-token request, else 503: catches an engine
    loop that is alive but stuck, which `/health` cannot see."""
    engine = request.app.state.engine
    try:
        if engine.is_alive and await asyncio.wait_for(
            _one_token(engine), HEALTH_GENERATE_TIMEOUT_S
        ):
            return JSONResponse({"status": "ok"})
        reason = "The engine is not running."
    except TimeoutError:
        reason = f"No token within {HEALTH_GENERATE_TIMEOUT_S:g} s."
    except Exception as exc:  # noqa: BLE001 (any failure of the probe is "unhealthy", with its type)
        reason = f"The probe request failed ({type(exc).__name__})."
    return APIError(503, reason, type="server_error", code="engine_unhealthy").response()
