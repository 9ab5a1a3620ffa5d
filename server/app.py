"""`create_app`: the FastAPI application, its middleware, routes and the engine's lifespan."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI
from starlette.middleware.cors import CORSMiddleware

from pagedserve.configs import EngineConfig
from pagedserve.configs.engine import parse_bytes
from pagedserve.engine.client import EngineClient
from pagedserve.engine.heap import freeze_startup_objects, thaw_startup_objects
from pagedserve.server.background_responses import BackgroundResponses
from pagedserve.server.errors import install_exception_handlers
from pagedserve.server.metrics import ServerMetrics
from pagedserve.server.middleware import (
    ApiKeyMiddleware,
    BodyLimitMiddleware,
    RequestContextMiddleware,
)
from pagedserve.server.prompts import check_default_template_kwargs
from pagedserve.server.response_store import ResponseStore
from pagedserve.server.routes import (
    chat,
    classify,
    completions,
    control,
    embeddings,
    engine_state,
    generate,
    lora,
    models,
    profile,
    responses,
    router_support,
    sagemaker,
    scores,
    system,
    tokenize,
)
from pagedserve.server.stats_log import log_stats_forever


@asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    owns_engine = app.state.engine is None  # then this app is the process: `pagedserve serve`
    if owns_engine:
        # Imported here so that apps built around a fake engine (tests) never import torch.
        from pagedserve.engine.async_engine import AsyncEngine

        app.state.engine = AsyncEngine(app.state.config)
    engine: EngineClient = app.state.engine
    await engine.start()
    check_default_template_kwargs(
        engine.tokenizer, app.state.config.server.default_chat_template_kwargs
    )
    app.state.metrics = ServerMetrics(
        engine.model_name,
        engine.stats,
        engine.drain_step_token_counts,
        engine.max_model_len,
        engine.drain_grammar_mask_times,
    )
    app.state.started_at = int(time.time())
    server_config = app.state.config.server
    stats_lines = (
        asyncio.create_task(log_stats_forever(engine.stats, server_config.log_stats_interval))
        if server_config.log_stats
        else None
    )
    app.state.stop_requests = asyncio.Event()  # set by `begin_shutdown` once the grace is over
    if owns_engine:  # full GC passes would walk the whole model each time (engine/heap.py)
        freeze_startup_objects()
    try:
        yield
    finally:
        if stats_lines is not None:
            stats_lines.cancel()
        # Background responses first, stored as cancelled; then the engine aborts what is still
        # pending, so streams that are still open end with a final event.
        await app.state.background_responses.stop_all()
        await engine.shutdown()
        if owns_engine:
            thaw_startup_objects()


def begin_shutdown(app: FastAPI, grace_s: float) -> None:
    """Let open requests run `grace_s` more seconds, then abort them: streams end with a final
    error event and `[DONE]`, others get a 503. Call on the server's loop when shutdown starts."""
    asyncio.get_running_loop().call_later(grace_s, app.state.stop_requests.set)


def create_app(config: EngineConfig, engine: EngineClient | None = None) -> FastAPI:
    """The app serving `engine`, or an `AsyncEngine` built from `config` at startup."""
    # strict_content_type=False: a JSON body without a Content-Type header is still parsed.
    docs = (
        {} if config.server.fastapi_docs else dict(openapi_url=None, docs_url=None, redoc_url=None)
    )
    app = FastAPI(title="pagedserve", lifespan=_lifespan, strict_content_type=False, **docs)
    app.state.config, app.state.engine = config, engine
    # Each finished request's line (server/recorder.py), off with --no-log-requests
    request_log = logging.getLogger("pagedserve.server.recorder")
    request_log.setLevel(logging.NOTSET if config.server.log_requests else logging.WARNING)
    app.state.response_store = ResponseStore(parse_bytes(config.server.responses_store_memory))
    app.state.engine_requests = set()  # ids of the engine requests in flight (server/generation.py)
    app.state.background_responses = BackgroundResponses()
    generation = (completions, chat, responses, embeddings, scores, classify, generate)
    operation = (models, tokenize, system, router_support, control, sagemaker, engine_state)
    for family in (*generation, *operation):
        app.include_router(family.router)
    if config.model.allow_runtime_lora_updating:
        app.include_router(lora.router)
    if config.server.profiler_dir is not None:
        app.include_router(profile.router)
    install_exception_handlers(app)
    # Added innermost first: CORS (outermost, when on) -> context -> auth -> body limit -> app,
    # so that unauthenticated clients are turned away before their body is read.
    app.add_middleware(BodyLimitMiddleware, max_body_bytes=config.server.max_request_body_bytes)
    if config.server.api_key is not None:
        app.add_middleware(ApiKeyMiddleware, api_key=config.server.api_key)
    app.add_middleware(RequestContextMiddleware)
    if config.server.cors_origins:  # outermost: preflights are answered before auth
        app.add_middleware(
            CORSMiddleware,
            allow_origins=config.server.cors_origins,
            allow_methods=["GET", "POST", "OPTIONS"],
            allow_headers=["*"],  # Authorization and Content-Type among them
            expose_headers=["x-request-id"],
        )
    return app
