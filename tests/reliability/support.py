"""Helpers for the reliability suite: a real `pagedserve serve` process on 127.0.0.1, metric
readers, and the checks every response must pass (OpenAI error bodies, no stack traces)."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any

import httpx

from tests.server_process import REPO_ROOT, STARTUP_TIMEOUT_S, free_port  # noqa: F401 - re-exported
from tests.server_process import ServerProcess as SharedServerProcess

API_KEY = "reliability-test-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
# The shared server's pool: 64 blocks x 16 tokens = 1024 slots = one request at max_model_len.
SHARED_SERVER_ARGS = (
    "--num-kv-blocks",
    "64",
    "--block-size",
    "16",
    "--max-model-len",
    "1024",
    "--api-key",
    API_KEY,
    "--timeout-graceful-shutdown",
    "3",
)
ERROR_FIELDS = {"message", "type", "param", "code"}
# Knobs of this suite. The server rejects unknown PAGEDSERVE_* variables, so they stay out of its
# environment.
TEST_KNOBS = ("PAGEDSERVE_FUZZ_SECONDS", "PAGEDSERVE_SOAK_SECONDS")


class ServerProcess(SharedServerProcess):
    """The shared test server process, without this suite's knobs in its environment."""

    def __init__(self, *args: str) -> None:
        super().__init__(*args, drop_env=TEST_KNOBS)


class SharedServer:
    """Starts the shared server on first use, and again if a test took the previous one."""

    def __init__(self) -> None:
        self._server: ServerProcess | None = None
        self.idle_free_blocks = 0

    def get(self) -> ServerProcess:
        if self._server is None or self._server.process.poll() is not None:
            self._server = ServerProcess(*SHARED_SERVER_ARGS)
            self.idle_free_blocks = total_blocks(self._server.url)
        return self._server

    def take(self) -> ServerProcess:
        """Hand the server to a test that will end it; the next `get()` starts a new one."""
        server, self._server = self.get(), None
        return server

    def close(self) -> None:
        if self._server is not None:
            self._server.stop()


# ---- metrics ------------------------------------------------------------------------------------


def read_metrics(url: str) -> dict[str, float]:
    """`name{labels}` -> value for every `pagedserve:` sample, plus `name` alone when unlabelled
    by anything but `model_name`."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    samples: dict[str, float] = {}
    for line in text.splitlines():
        match = re.match(r"^(pagedserve:[\w:]+)(\{[^}]*\})? (\S+)$", line)
        if match is None:
            continue
        name, labels, value = match.groups()
        samples[name + (labels or "")] = float(value)
        if not labels or re.fullmatch(r'\{model_name="[^"]*"\}', labels):
            samples[name] = float(value)
    return samples


def free_blocks(url: str) -> int:
    return int(read_metrics(url)["pagedserve:num_free_blocks"])


def total_blocks(url: str) -> int:
    samples = read_metrics(url)
    (info,) = [key for key in samples if key.startswith("pagedserve:cache_config_info{")]
    return int(re.search(r'num_blocks="(\d+)"', info).group(1))  # type: ignore[union-attr]


def wait_for_idle_pool(
    url: str, idle_free_blocks: int, timeout_s: float = 30.0
) -> dict[str, float]:
    """Poll /metrics until nothing runs or waits and every block is free; return the last sample."""
    deadline = time.monotonic() + timeout_s
    while True:
        samples = read_metrics(url)
        idle = (
            samples["pagedserve:num_free_blocks"] == idle_free_blocks
            and samples["pagedserve:num_requests_running"] == 0
            and samples["pagedserve:num_requests_waiting"] == 0
        )
        if idle or time.monotonic() > deadline:
            return samples
        time.sleep(0.2)


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for pid {pid}")


# ---- response checks ----------------------------------------------------------------------------


def assert_no_stack_trace(text: str) -> None:
    assert "Traceback" not in text and 'File "' not in text, f"stack trace leaked: {text[:500]}"


def assert_openai_error(
    status_code: int, text: str, statuses: range | set[int] = range(400, 500)
) -> dict[str, Any]:
    """The body is exactly OpenAI's `{"error": {message, type, param, code}}` with a 4xx (or one
    of `statuses`); returns the inner error object."""
    assert status_code in statuses, f"status {status_code}: {text[:500]}"
    assert_no_stack_trace(text)
    body = json.loads(text)
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == ERROR_FIELDS, error
    assert isinstance(error["message"], str) and error["message"], error
    assert isinstance(error["type"], str) and error["type"], error
    assert error["param"] is None or isinstance(error["param"], str), error
    assert error["code"] is None or isinstance(error["code"], str), error
    return dict(error)


def assert_completion(body: dict[str, Any], num_choices: int = 1) -> None:
    """A well-formed (chat) completion with `num_choices` finished choices."""
    assert body["object"] in ("text_completion", "chat.completion"), body
    assert len(body["choices"]) == num_choices, body
    for choice in body["choices"]:
        assert choice["finish_reason"] in ("stop", "length"), body
        text = choice["text"] if "text" in choice else choice["message"]["content"]
        assert isinstance(text, str)
    usage = body["usage"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"], usage
    assert usage["completion_tokens"] >= 1, usage


def parse_sse(lines: list[str]) -> tuple[list[dict[str, Any]], bool]:
    """The JSON events of an SSE body and whether it ended with `data: [DONE]`."""
    events, done = [], False
    for line in lines:
        if not line:
            continue
        assert line.startswith("data: "), line
        payload = line[len("data: ") :]
        assert not done, f"event after [DONE]: {line}"
        if payload == "[DONE]":
            done = True
        else:
            events.append(json.loads(payload))
    return events, done
