"""A deterministic fake `EngineClient` with a byte-level tokenizer, and app/client fixtures."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from pagedserve.configs import EngineConfig, SamplingParams, load_engine_config
from pagedserve.engine.errors import EngineOverloadedError, InvalidRequestError
from pagedserve.engine.outputs import EngineStats, RequestDelta, RequestTimings, TokenLogprob
from pagedserve.engine.profiling import ProfilingError
from pagedserve.server.app import create_app

EOS_TOKEN_ID = 257


def sse_json(text: str) -> list[dict[str, Any]]:
    """The JSON events of a streamed response's body, which must end with `data: [DONE]`."""
    lines = [line for line in text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]


class ByteTokenizer:
    """Token id = UTF-8 byte; 256 is BOS and 257 EOS (decoded as nothing)."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode())

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return bytes(token_id for token_id in token_ids if token_id < 256).decode(errors="replace")

    def convert_ids_to_tokens(self, token_ids: list[int]) -> list[str]:
        return [chr(t) if t < 256 else ("<s>" if t == 256 else "</s>") for t in token_ids]

    def apply_chat_template(
        self,
        conversation: list[dict[str, str]],
        add_generation_prompt: bool,
        tokenize: bool,
        tools: object = None,  # ignored, as many real templates do
        continue_final_message: bool = False,
        **variables: object,  # written first, as `[name=value]`
    ) -> str:
        text = "".join(f"[{name}={value}]" for name, value in sorted(variables.items()))
        text += "".join(
            f"<{message['role']}{':' + message['name'] if 'name' in message else ''}>"
            f"{message['content']}\n"
            for message in conversation
        )
        if continue_final_message:
            text = text.removesuffix("\n")
        return text + ("<assistant>" if add_generation_prompt else "")


def fake_prompt_logprobs(
    prompt_token_ids: list[int], num_top: int
) -> tuple[TokenLogprob | None, ...]:
    """Prompt token i scores -i/10 (rank i), with "z" as its alternative."""
    return (None,) + tuple(
        TokenLogprob(token_id, -i / 10, ((ord("z"), -0.05),)[:num_top], rank=i)
        for i, token_id in enumerate(prompt_token_ids[1:], start=1)
    )


class FakeEngine:
    """Choice i of a request writes "abcdefgh"[i:] one letter per step, then EOS ("stop");
    `max_tokens` cuts it short ("length"), max_tokens 0 ends after the prompt. Prompt logprobs
    come on each choice's first delta. Records requests, aborts and early-closed streams."""

    model_name = "fake-model"
    served_model_names = ("fake-model",)
    max_model_len = 64
    vocab_size = 258
    eos_token_ids = (EOS_TOKEN_ID,)
    max_waiting_requests = 8
    classifier = None  # a generative model (tests/server/test_classify.py sets a head)

    def __init__(self) -> None:
        self.tokenizer = ByteTokenizer()
        self.is_alive = True
        self.requests: list[tuple[str, list[int], SamplingParams]] = []
        self.aborted: list[str] = []
        self.closed_early: list[str] = []
        self.raise_on_generate: Exception | None = None
        self.hang_after_first_delta = False  # simulates a long decode
        self.first_delta_delay_s = 0.0  # simulates a queue and a prefill before the first token
        self.fail_after_first_delta: Exception | None = None
        self.started = self.shut_down = False
        # As AsyncEngine: a priority needs the priority policy; in-flight requests are capped.
        self.scheduling_policy = "fcfs"
        self.priorities: dict[str, int] = {}
        self.in_flight = 0
        self.script = ""  # when set, every choice writes this text (ASCII) instead of letters
        self.num_cached_prompt_tokens = 0  # what each prompt's final deltas report
        self.sampling_defaults: dict[str, float | int] = {}  # the model's generation config's
        self.lora_adapters: dict[str, str] = {}  # name -> folder, as AsyncEngine's
        self.lora_failure: Exception | None = None  # what the next load raises
        self.prefix_cache_resets = 0
        self.profiling: Path | None = None  # the running profile's trace
        # An aborted request's hanging stream ends with an "abort" delta, as the engine's does.
        self._abort_events: dict[str, asyncio.Event] = {}

    async def start(self) -> None:
        self.started = True

    async def shutdown(self) -> None:
        self.shut_down = True

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)
        self._abort_events.setdefault(request_id, asyncio.Event()).set()

    async def start_profile(self, folder: Path) -> None:  # as AsyncEngine's
        if self.profiling is not None:
            raise ProfilingError("a profile is already running; stop it first")
        self.profiling = folder / "trace.json"

    async def stop_profile(self) -> Path:
        if self.profiling is None:
            raise ProfilingError("no profile is running; start one first")
        trace, self.profiling = self.profiling, None
        trace.parent.mkdir(parents=True, exist_ok=True)
        trace.write_text('{"traceEvents": []}')
        return trace

    async def reset_prefix_cache(self) -> bool:
        """As AsyncEngine: only while nothing is in flight."""
        self.prefix_cache_resets += self.in_flight == 0
        return self.in_flight == 0

    def stats(self) -> EngineStats:
        return EngineStats(
            num_requests_running=1,
            num_requests_waiting=2,
            num_free_blocks=7,
            num_total_blocks=8,
            block_size=4,
            cache_dtype="fp8_e4m3",
            kv_cache_usage=0.125,
            num_prompt_tokens=11,
            num_generation_tokens=5,
            num_structured_requests=2,
        )

    async def load_lora_adapter(self, name: str, path: str, replace: bool = False) -> None:
        if self.lora_failure is not None:
            raise self.lora_failure
        self.lora_adapters = {**self.lora_adapters, name: path}

    async def unload_lora_adapter(self, name: str) -> None:
        if name not in self.lora_adapters:
            raise KeyError(name)
        self.lora_adapters = {key: path for key, path in self.lora_adapters.items() if key != name}

    def drain_step_token_counts(self) -> list[int]:
        return [3, 1]

    def drain_grammar_mask_times(self) -> list[float]:
        return [0.002]

    def _token(self, choice: int, step: int, params: SamplingParams) -> int:
        letters = self.script.encode() if self.script else "abcdefgh"[choice:].encode()
        return letters[step] if step < len(letters) and not params.ignore_eos else EOS_TOKEN_ID

    async def generate(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str,
        priority: int = 0,
    ) -> AsyncIterator[RequestDelta]:
        if self.raise_on_generate is not None:
            raise self.raise_on_generate
        if len(prompt_token_ids) + params.max_tokens > self.max_model_len:
            raise InvalidRequestError("too long", "max_tokens")  # the server checks first
        if priority != 0 and self.scheduling_policy != "priority":
            raise InvalidRequestError("priority needs --scheduling-policy priority", "priority")
        if self.in_flight >= self.max_waiting_requests:
            raise EngineOverloadedError(f"{self.in_flight} requests are in flight")
        self.requests.append((request_id, prompt_token_ids, params))
        self.priorities[request_id] = priority
        self.in_flight += 1
        arrival, finished = time.monotonic(), set()
        prompt_logprobs = (
            None
            if params.prompt_logprobs is None
            else fake_prompt_logprobs(prompt_token_ids, params.prompt_logprobs)
        )
        try:
            await asyncio.sleep(self.first_delta_delay_s)
            if params.embed:  # one final delta, with (prompt length, 3, 4) as the embedding
                finished.add(0)
                yield RequestDelta(
                    request_id, 0, (EOS_TOKEN_ID,), "", None, len(prompt_token_ids), 1, True,
                    "stop", embedding=(float(len(prompt_token_ids)), 3.0, 4.0),
                )  # fmt: skip
                return
            if params.max_tokens == 0:
                for choice in range(params.n):
                    finished.add(choice)
                    yield RequestDelta(
                        request_id,
                        choice,
                        (),
                        "",
                        None,
                        len(prompt_token_ids),
                        0,
                        True,
                        "length",
                        prompt_logprobs=prompt_logprobs,
                    )
            for step in range(params.max_tokens):
                for choice in range(params.n):
                    if choice in finished:
                        continue
                    token_id = self._token(choice, step, params)
                    is_last_step = step + 1 == params.max_tokens
                    reason = (
                        "stop" if token_id == EOS_TOKEN_ID else "length" if is_last_step else None
                    )
                    if reason:
                        finished.add(choice)
                    all_done = len(finished) == params.n
                    timings = (
                        RequestTimings(arrival, arrival, arrival, time.monotonic())
                        if all_done
                        else None
                    )
                    logprobs = (
                        None
                        if params.logprobs is None
                        else (
                            TokenLogprob(
                                token_id,
                                -0.5,
                                ((token_id, -0.5), (ord("z"), -1.5))[: params.logprobs],
                            ),
                        )
                    )
                    yield RequestDelta(
                        request_id,
                        choice,
                        (token_id,),
                        self.tokenizer.decode([token_id]),
                        logprobs,
                        len(prompt_token_ids),
                        step + 1,
                        reason is not None,
                        reason,
                        # A forked choice (index > 0) reports its parent's shared blocks.
                        num_cached_prompt_tokens=(
                            self.num_cached_prompt_tokens + 100 * choice if reason else 0
                        ),
                        timings=timings,
                        prompt_logprobs=prompt_logprobs if step == 0 else None,
                    )
                    if self.fail_after_first_delta is not None:
                        raise self.fail_after_first_delta
                    if self.hang_after_first_delta:
                        aborted = self._abort_events.setdefault(request_id, asyncio.Event())
                        await aborted.wait()
                        for index in set(range(params.n)) - finished:
                            finished.add(index)
                            yield RequestDelta(
                                request_id, index, (), "", None, len(prompt_token_ids), step + 1,
                                True, "abort",
                            )  # fmt: skip
                        return
                await asyncio.sleep(0)
        finally:
            self.in_flight -= 1
            if len(finished) < params.n:
                self.closed_early.append(request_id)


def make_config(**settings: Any) -> EngineConfig:
    return load_engine_config(cli=settings, environ={})


@pytest.fixture
def engine() -> FakeEngine:
    return FakeEngine()


@pytest.fixture
def app(engine: FakeEngine) -> FastAPI:
    return create_app(make_config(), engine)


@pytest.fixture
def client(app: FastAPI) -> Iterator[TestClient]:
    with TestClient(app, raise_server_exceptions=False) as test_client:
        yield test_client


@pytest.fixture
def client_with(engine: FakeEngine) -> Iterator[Callable[..., TestClient]]:
    """`client_with(api_key="k")`: a started client for an app with these settings."""
    with ExitStack() as stack:

        def make(**settings: Any) -> TestClient:
            app = create_app(make_config(**settings), engine)
            return stack.enter_context(TestClient(app, raise_server_exceptions=False))

        yield make


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"
