"""`pagedserve run-batch -i requests.jsonl -o results.jsonl`: a file of requests in OpenAI's
batch format (vLLM's `run-batch`), answered offline by the same app `serve` runs, in process.

Each input line is `{"custom_id", "method": "POST", "url", "body"}`; each output line, in input
order, `{"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error"}`. A line
is sent to the route its `url` names (`SUPPORTED_URLS`), through the app's middleware and
handlers over an in-process ASGI transport, so validation, templates, parsers and errors are
exactly the server's. A request the server refuses (a 4xx) becomes that line's `error`, with its
status; the run goes on. The envelope of every line is checked before the model loads: a
malformed line or a repeated `custom_id` stops the run with the line's number and writes nothing.

Requests run concurrently, as many as the server admits at once (`--max-waiting-requests`; a
429 is retried), answers are written in input order as they complete into a temporary file
renamed over the output at the end, and progress is logged every `PROGRESS_EVERY_S` seconds.

Either file may be an http(s) URL, as in vLLM: the input is downloaded (GET) before the model
loads, and the output, once every line is answered, uploaded with a PUT (e.g. to a presigned
object-store URL; redirects followed), tried `UPLOAD_TRIES` times where the failure may pass (a
connection error, a 5xx, 408 or 429); when it does not, the run stops with the error and the
answers stay in a local file whose path the error names.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import httpx
from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from pagedserve.server.errors import invalid_request

logger = logging.getLogger(__name__)

SUPPORTED_URLS = (
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/embeddings",
    "/v1/responses",
    "/classify",
    "/generate",
    *("/score", "/v1/score", "/rerank", "/v1/rerank", "/v2/rerank"),
)
PROGRESS_EVERY_S = 10.0
URL_TIMEOUT_S = 300.0  # a download or an upload
UPLOAD_TRIES = 3
UPLOAD_RETRY_S = 1.0  # the wait before the second try; twice that before the third
RETRY_AFTER_S = 0.2  # a 429: the server's in-flight cap is full; another line will finish soon
RETRY_FOR_S = 600.0  # then the line gets its 429


class BatchInputError(ValueError):
    """The input file cannot be run; the message names the line."""


class BatchRequestInput(BaseModel):
    """One input line (OpenAI's batch format). Unknown keys are ignored, as vLLM does."""

    model_config = ConfigDict(extra="ignore", strict=True)

    custom_id: str = Field(min_length=1)
    method: Literal["POST"]
    url: str
    body: dict[str, Any]


@dataclass
class _Progress:
    total: int
    done: int = 0
    failed: int = 0
    started: float = 0.0
    last_report: float = 0.0

    def count(self, status_code: int) -> None:
        self.done += 1
        self.failed += status_code != 200
        now = time.monotonic()
        if now - self.last_report >= PROGRESS_EVERY_S or self.done == self.total:
            self.last_report = now
            rate = self.done / max(now - self.started, 1e-9)
            logger.info(
                "run-batch: %d/%d requests done (%.0f%%, %.2f req/s, %d failed)",
                self.done,
                self.total,
                100.0 * self.done / self.total,
                rate,
                self.failed,
            )


def read_batch(path: str) -> list[BatchRequestInput]:
    """Every request of the file (blank lines skipped); raises BatchInputError naming the first
    line that is not a request, or a `custom_id` given twice."""
    requests, seen = [], set()
    try:
        # "\n" only: JSON text may hold U+2028 and others that str.splitlines() also splits at
        lines = _read_text(path).split("\n")
    except (OSError, UnicodeDecodeError, httpx.HTTPError, httpx.InvalidURL) as exc:
        raise BatchInputError(f"cannot read {path}: {exc}") from None
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            request = BatchRequestInput.model_validate_json(line)
        except ValidationError as exc:
            error = exc.errors()[0]
            where = ".".join(str(part) for part in error["loc"]) or "the line"
            raise BatchInputError(f"{path}:{number}: {where}: {error['msg']}") from None
        if request.custom_id in seen:
            raise BatchInputError(f"{path}:{number}: custom_id {request.custom_id!r} repeats")
        seen.add(request.custom_id)
        requests.append(request)
    return requests


def encoded_body(request: BatchRequestInput) -> bytes:
    """The bytes a line's body is sent as: as the line had it (NaN and Infinity reach the server,
    which answers them with a 400)."""
    return json.dumps(request.body, ensure_ascii=False).encode()


def is_url(path: str) -> bool:
    return path.startswith(("http://", "https://"))


def _read_text(path: str) -> str:
    if not is_url(path):
        return Path(path).read_text(encoding="utf-8")
    response = httpx.get(path, follow_redirects=True, timeout=URL_TIMEOUT_S)
    response.raise_for_status()
    return response.text  # the charset the server names, UTF-8 by default (as vLLM's read)


class UploadError(RuntimeError):
    """The answers could not be uploaded; they are in `kept` (a local file)."""


async def upload(path: Path, url: str) -> None:
    """PUT the file's bytes to `url` (module docstring); raises UploadError, the file kept."""
    data = path.read_bytes()
    async with httpx.AsyncClient(follow_redirects=True, timeout=URL_TIMEOUT_S) as client:
        for attempt in range(1, UPLOAD_TRIES + 1):
            try:
                response = await client.put(url, content=data)
                response.raise_for_status()
                return
            except httpx.HTTPError as error:
                status = getattr(getattr(error, "response", None), "status_code", None)
                passing = status is None or status >= 500 or status in (408, 429)
                reason = (str(error).splitlines() or [type(error).__name__])[0]
                if attempt == UPLOAD_TRIES or not passing:
                    raise UploadError(
                        f"cannot upload the answers to {url} ({reason}); they are in {path}"
                    ) from None
                logger.warning("run-batch: upload to %s failed (%s); trying again", url, reason)
                await asyncio.sleep(attempt * UPLOAD_RETRY_S)


def _output_line(
    request: BatchRequestInput, status_code: int, request_id: str | None, answer: Any
) -> str:
    ok = status_code == 200
    return json.dumps(
        {
            "id": f"batch_req_{uuid.uuid4().hex}",
            "custom_id": request.custom_id,
            "response": {
                "status_code": status_code,
                "request_id": request_id,
                "body": answer if ok else None,
            },
            "error": None if ok else answer,
        },
        ensure_ascii=False,
    )


class _Batch:
    """One run: the in-process client, the lines in flight, progress."""

    def __init__(self, app: FastAPI, client: httpx.AsyncClient, api_key: str | None, total: int):
        self.app = app
        self.client = client
        self.headers = {"Content-Type": "application/json"}
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"
        self.admitted = asyncio.Semaphore(app.state.engine.max_waiting_requests)
        self.in_flight = 0  # lines holding the semaphore
        self.progress = _Progress(total, started=time.monotonic(), last_report=time.monotonic())

    async def line(self, request: BatchRequestInput) -> str:
        async with self.admitted:
            self.in_flight += 1
            try:
                status, request_id, answer = await self._answer(request)
            finally:
                self.in_flight -= 1
        self.progress.count(status)
        return _output_line(request, status, request_id, answer)

    async def _answer(self, request: BatchRequestInput) -> tuple[int, str, Any]:
        """(status, the server's request id, the body or the error) for one request."""
        refusal = _refusal(request)
        if refusal is not None:  # in the server's error shape, as every refused line's
            return 400, uuid.uuid4().hex, invalid_request(*refusal).body()
        content = encoded_body(request)
        give_up = time.monotonic() + RETRY_FOR_S
        while True:
            response = await self.client.post(request.url, content=content, headers=self.headers)
            # A 429: the server's in-flight cap is full; lines running beside this one free it.
            if response.status_code != 429 or self.in_flight <= 1 or time.monotonic() > give_up:
                break
            await asyncio.sleep(RETRY_AFTER_S)
        if response.status_code == 503 and not self.app.state.engine.is_alive:
            raise RuntimeError(f"the engine stopped: {response.text}")  # every line would fail
        try:
            answer = response.json()
        except ValueError:
            answer = response.text
        return response.status_code, response.headers.get("x-request-id", ""), answer


def _refusal(request: BatchRequestInput) -> tuple[str, str] | None:
    """(message, param) for a line this runner does not send: a url it does not serve, or a
    body asking for an answer that is not one JSON body (a stream, a background response)."""
    if request.url not in SUPPORTED_URLS:
        supported = ", ".join(SUPPORTED_URLS)
        return f"URL {request.url} is not supported; supported: {supported}.", "url"
    for field in ("stream", "background"):
        if request.body.get(field):
            return (
                f"Request must not be sent with {field}: a batch line answers in one body.",
                field,
            )
    return None


async def run_batch(
    app: FastAPI, requests: list[BatchRequestInput], output_path: str, api_key: str | None
) -> int:
    """Answer every request through `app` and write the output file (or upload it, to a URL);
    returns the number of requests that did not get a 200."""
    if is_url(output_path):  # answered into a local file first, uploaded at the end
        written = Path(tempfile.mkdtemp(prefix="pagedserve-run-batch-")) / "output.jsonl"
        failed = await run_batch(app, requests, str(written), api_key)
        await upload(written, output_path)  # kept where it is if that fails (the error says)
        shutil.rmtree(written.parent)
        return failed
    target = Path(os.path.realpath(output_path))  # a symlink's target is what gets replaced
    mode = _output_mode(target)
    handle, temporary = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
    try:
        with os.fdopen(handle, "w", encoding="utf-8") as output:
            async with app.router.lifespan_context(app):
                # A route's own failure is that line's 500, as the server answers it.
                transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
                async with httpx.AsyncClient(
                    transport=transport, base_url="http://run-batch", timeout=None
                ) as client:
                    batch = _Batch(app, client, api_key, len(requests))
                    await _write_in_order([batch.line(r) for r in requests], output.write)
        os.chmod(temporary, mode)
        os.replace(temporary, target)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    return batch.progress.failed


def _output_mode(target: Path) -> int:
    """The replaced file's permissions, else what the umask leaves of rw-rw-rw-."""
    if target.is_file():
        return target.stat().st_mode & 0o777
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


async def _write_in_order(lines: list[Any], write: Callable[[str], Any]) -> None:
    """Run the line coroutines together (each waits for the server's admission); write each
    answer once those before it are written. On a failure the others are cancelled, and their
    end awaited, before the engine is shut down."""
    tasks = [asyncio.ensure_future(line) for line in lines]
    try:
        for task in tasks:
            write(await task + "\n")
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
