"""End to end on one real server with the default model, through the official `openai` client and
the OpenAI Agents SDK: tool calling ("required" and named tool_choice always return calls whose
arguments validate against the tool's schema; streamed deltas concatenate to the same calls), the
Responses API (the answer chat gives, streamed, stored and continued; the Agents SDK's default
model calling a tool through it), embeddings (Hugging Face's final hidden states) with the
scores and rerankings their cosines give; and over raw HTTP, SGLang's /generate (the answers and
logprobs /v1/completions gives, streamed, stopped, prompt-scored), /flush_cache and
/abort_request."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import httpx
import jsonschema
import openai
import pytest
import torch
from transformers import AutoModelForCausalLM

from pagedserve.engine.model_loader import DEFAULT_MODEL, resolve_model_path
from tests.server_process import ServerProcess

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

ENGINE_FLAGS = ("--max-model-len", "2048", "--num-kv-blocks", "384", "--block-size", "16")
TOOL_FLAGS = ("--enable-auto-tool-choice", "--tool-call-parser", "hermes")
MAX_TOKENS = 120
USER = [{"role": "user", "content": "What is the weather in Paris, and book me a table for two."}]


def _tool(name: str, description: str, parameters: dict) -> dict:
    return {
        "type": "function",
        "function": {"name": name, "description": description, "parameters": parameters},
    }


TOOLS = [
    _tool(
        "get_weather",
        "Current weather for a city",
        {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 24},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
        },
    ),
    _tool(
        "book_table",
        "Book a restaurant table",
        {
            "type": "object",
            "properties": {
                "party": {"type": "integer", "minimum": 1, "maximum": 12},
                "when": {
                    "type": "object",
                    "properties": {
                        "day": {"enum": ["today", "tomorrow"]},
                        "hour": {"type": "integer", "minimum": 11, "maximum": 23},
                    },
                    "required": ["day", "hour"],
                },
            },
            "required": ["party", "when"],
        },
    ),
]
SCHEMAS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    process = ServerProcess(*ENGINE_FLAGS, *TOOL_FLAGS)
    yield process
    process.stop()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", timeout=300)


@pytest.fixture(scope="module")
def model_name(client) -> str:
    return client.models.list().data[0].id


def _check_calls(message, allowed: set[str]) -> None:
    assert message.tool_calls, message
    for call in message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in allowed
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


@pytest.mark.parametrize(
    "tool_choice",
    ["required", {"type": "function", "function": {"name": "book_table"}}],
    ids=["required", "named"],
)
@pytest.mark.parametrize(("temperature", "seed"), [(0.0, None), (1.0, 5)])
def test_forced_tool_choice_always_returns_valid_calls(
    client, model_name, tool_choice, temperature, seed
):
    completion = client.chat.completions.create(
        model=model_name,
        messages=USER,
        tools=TOOLS,
        tool_choice=tool_choice,
        temperature=temperature,
        seed=seed,
        max_tokens=MAX_TOKENS,
        n=2 if temperature else 1,
        # Sampled freely, a small model keeps appending parallel calls until max_tokens.
        parallel_tool_calls=not temperature,
    )
    allowed = set(SCHEMAS) if tool_choice == "required" else {"book_table"}
    for choice in completion.choices:
        assert choice.finish_reason == "tool_calls"
        assert choice.message.content is None
        _check_calls(choice.message, allowed)


def test_streamed_tool_call_deltas_concatenate_to_the_same_calls(client, model_name):
    request = dict(
        model=model_name, messages=USER, tools=TOOLS, tool_choice="required", temperature=0
    )
    whole = client.chat.completions.create(**request, max_tokens=MAX_TOKENS).choices[0]
    calls: dict[int, dict[str, str]] = {}
    reasons = []
    for chunk in client.chat.completions.create(**request, max_tokens=MAX_TOKENS, stream=True):
        for choice in chunk.choices:
            reasons.append(choice.finish_reason)
            for piece in choice.delta.tool_calls or []:
                call = calls.setdefault(piece.index, {"name": "", "arguments": ""})
                call["name"] += piece.function.name or ""
                call["arguments"] += piece.function.arguments or ""
    assert reasons[-1] == "tool_calls"
    expected = [
        {"name": call.function.name, "arguments": call.function.arguments}
        for call in whole.message.tool_calls
    ]
    assert [calls[index] for index in sorted(calls)] == expected


def test_a_tool_result_follow_up_is_accepted_and_answered(client, model_name):
    first = (
        client.chat.completions.create(
            model=model_name,
            messages=USER,
            tools=TOOLS,
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
            temperature=0,
            max_tokens=MAX_TOKENS,
        )
        .choices[0]
        .message
    )
    call = first.tool_calls[0]
    follow_up = client.chat.completions.create(
        model=model_name,
        messages=[
            *USER,
            first.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 22 degrees."},
        ],
        tools=TOOLS,
        tool_choice="none",
        temperature=0,
        max_tokens=24,
    ).choices[0]
    assert follow_up.finish_reason in ("stop", "length")
    assert follow_up.message.content


def test_the_responses_api_answers_as_chat_does(client, model_name):
    messages = [{"role": "user", "content": "Name three colours."}]
    chat = client.chat.completions.create(
        model=model_name, messages=messages, max_tokens=12, temperature=0
    )
    response = client.responses.create(
        model=model_name, input=messages, max_output_tokens=12, temperature=0
    )
    assert response.output_text == chat.choices[0].message.content
    assert response.status == (
        "incomplete" if chat.choices[0].finish_reason == "length" else "completed"
    )
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.usage.output_tokens == chat.usage.completion_tokens
    events = list(
        client.responses.create(
            model=model_name, input=messages, max_output_tokens=12, temperature=0, stream=True
        )
    )
    deltas = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    assert deltas == response.output_text
    assert events[-1].response.output_text == response.output_text
    # Stored (OpenAI's default): retrieved as answered, and continued as the chat it was
    assert client.responses.retrieve(response.id).output_text == response.output_text
    [item] = client.responses.input_items.list(response.id).data  # its input, as OpenAI's items
    colours = [{"role": "user", "content": c} for c in ("Red.", "Green.", "Blue.")]
    several = client.responses.create(model=model_name, input=colours, max_output_tokens=1)
    pages = client.responses.input_items.list(several.id, order="asc", limit=2)  # 2 pages
    assert [listed.content[0].text for listed in pages] == ["Red.", "Green.", "Blue."]
    assert (item.type, item.role, item.content[0].text) == (
        "message",
        "user",
        messages[0]["content"],
    )
    follow_up = [{"role": "user", "content": "And one more."}]
    continued = client.responses.create(
        model=model_name, input=follow_up, previous_response_id=response.id,
        max_output_tokens=12, temperature=0,
    )  # fmt: skip
    history = [*messages, {"role": "assistant", "content": response.output_text}, *follow_up]
    chat = client.chat.completions.create(
        model=model_name, messages=history, max_tokens=12, temperature=0
    )
    assert continued.output_text == chat.choices[0].message.content
    assert client.responses.delete(response.id) is None
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(response.id)
    # In the background: answered at once, polled to the same answer; a long one cancelled
    queued = client.responses.create(
        model=model_name, input=messages, max_output_tokens=12, temperature=0, background=True
    )
    assert queued.status in ("queued", "in_progress")
    while (polled := client.responses.retrieve(queued.id)).status in ("queued", "in_progress"):
        time.sleep(0.05)
    assert polled.output_text == response.output_text
    long = client.responses.create(model=model_name, input=messages, background=True)
    assert client.responses.cancel(long.id).status == "cancelled"
    assert client.responses.retrieve(long.id).status == "cancelled"


@pytest.mark.parametrize("api", ["chat", "responses"])
def test_agents_sdk_runs_a_turn_with_a_function_tool(server, model_name, api):
    agents = pytest.importorskip("agents")  # the test extra installs it
    agents.set_tracing_disabled(True)
    cities: list[str] = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """Current weather for a city."""
        cities.append(city)
        return f"The weather in {city} is sunny and 22 degrees."

    # The SDK's default model speaks the Responses API (/v1/responses); the other, chat.
    model_class = {
        "chat": agents.OpenAIChatCompletionsModel,
        "responses": agents.OpenAIResponsesModel,
    }[api]
    model = model_class(
        model=model_name,
        openai_client=openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused"),
    )
    agent = agents.Agent(
        name="weather",
        instructions="Answer weather questions with the get_weather tool.",
        tools=[get_weather],
        model=model,
        model_settings=agents.ModelSettings(tool_choice="required", temperature=0, max_tokens=60),
        tool_use_behavior="stop_on_first_tool",  # the tool's result is the turn's final answer
    )
    result = agents.Runner.run_sync(agent, "What is the weather in Paris?")
    assert len(cities) == 1 and cities[0]
    assert result.final_output == f"The weather in {cities[0]} is sunny and 22 degrees."


def test_embeddings_are_the_models_normalised_final_hidden_states(server, client, model_name):
    texts = ["The capital of France is", "Embeddings compare by angle."]
    path = resolve_model_path(DEFAULT_MODEL)[0]
    hf_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    as_base64 = client.embeddings.create(model=model_name, input=texts)  # the SDK's default
    as_floats = client.embeddings.create(model=model_name, input=texts, encoding_format="float")
    assert as_base64.usage.prompt_tokens == as_floats.usage.prompt_tokens > 0
    for text, packed, plain in zip(texts, as_base64.data, as_floats.data, strict=True):
        ids = httpx.post(f"{server.url}/tokenize", json={"prompt": text}).json()["tokens"]
        with torch.no_grad():
            state = hf_model.model(torch.tensor([ids])).last_hidden_state[0, -1]
        want = torch.nn.functional.normalize(state, dim=0)
        for got in (packed.embedding, plain.embedding):
            assert (torch.tensor(got) - want).abs().max().item() < 1e-4
    # /v1/score and /rerank: the cosine of the same embeddings
    wanted = torch.stack([torch.tensor(item.embedding) for item in as_floats.data])
    cosine = float(wanted[0] @ wanted[1])
    score = httpx.post(f"{server.url}/v1/score", json={"text_1": texts[0], "text_2": texts})
    assert [item["score"] for item in score.json()["data"]] == pytest.approx(
        [1.0, cosine], abs=1e-4
    )
    rerank = httpx.post(f"{server.url}/rerank", json={"query": texts[1], "documents": texts})
    assert [result["index"] for result in rerank.json()["results"]] == [1, 0]


def _generate(server, **body) -> dict:
    response = httpx.post(f"{server.url}/generate", json=body, timeout=300)
    assert response.status_code == 200, response.text
    return response.json()


def test_sglang_s_generate_answers_as_completions_do(server, client, model_name):
    prompts = ["The capital of France is", "def fibonacci(n):"]
    completion = client.completions.create(
        model=model_name,
        prompt=prompts,
        max_tokens=12,
        temperature=0,
        logprobs=2,
        extra_body={"return_token_ids": True},
    )
    batch = _generate(
        server,
        text=prompts,
        return_logprob=True,
        top_logprobs_num=2,
        sampling_params={"max_new_tokens": 12, "temperature": 0},
    )
    by_ids = _generate(
        server,
        input_ids=completion.choices[0].prompt_token_ids,
        sampling_params={"max_new_tokens": 12, "temperature": 0},
    )
    for choice, item in zip(completion.choices, batch, strict=True):
        assert item["text"] == choice.text and item["output_ids"] == choice.token_ids
        meta = item["meta_info"]
        assert meta["prompt_tokens"] == len(choice.prompt_token_ids)
        assert meta["finish_reason"] == {"type": "length", "length": 12}
        assert meta["input_token_logprobs"] == []  # logprob_start_len -1: none of the prompt
        got = [logprob for logprob, _, _ in meta["output_token_logprobs"]]
        assert got == pytest.approx(choice.logprobs.token_logprobs, abs=1e-3)
        assert [len(top) for top in meta["output_top_logprobs"]] == [2] * 12
    assert by_ids["text"] == completion.choices[0].text


def test_generate_streams_stops_scores_the_prompt_and_flush_cache_empties_the_cache(server):
    prompt = "One, two, three, four, five, six, seven, eight, nine, ten, eleven, twelve"
    greedy = {"max_new_tokens": 8, "temperature": 0}
    whole = _generate(server, text=prompt, sampling_params=greedy)
    with httpx.stream(
        "POST",
        f"{server.url}/generate",
        json={"text": prompt, "stream": True, "sampling_params": greedy},
        timeout=300,
    ) as response:
        events = [line.removeprefix("data: ") for line in response.iter_lines() if line]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(event) for event in events[:-1]]
    assert chunks[-1]["text"] == whole["text"]  # cumulative: the last chunk is the answer
    assert [len(chunk["output_ids"]) for chunk in chunks] == list(range(1, 9))
    assert chunks[-1]["meta_info"]["cached_tokens"] > 0  # the same prompt, just computed
    stop = whole["text"].split(",")[1] + ","
    stopped = _generate(server, text=prompt, sampling_params={**greedy, "stop": [stop]})
    assert stopped["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert stopped["text"] == whole["text"][: whole["text"].index(stop)]
    scored = _generate(
        server,
        text=prompt,
        return_logprob=True,
        logprob_start_len=0,
        sampling_params={"max_new_tokens": 0},
    )["meta_info"]
    assert scored["input_token_logprobs"][0][0] is None
    assert len(scored["input_token_logprobs"]) == scored["prompt_tokens"]
    assert all(entry[0] < 0 for entry in scored["input_token_logprobs"][1:])
    assert httpx.post(f"{server.url}/flush_cache").status_code == 200
    after = _generate(server, text=prompt, sampling_params=greedy)
    assert after["meta_info"]["cached_tokens"] == 0 and after["text"] == whole["text"]


def test_generate_refuses_a_rid_in_flight_and_abort_request_ends_it(server):
    body = {"text": "Count:", "rid": "long-job", "stream": True}
    body["sampling_params"] = {"max_new_tokens": 400, "ignore_eos": True}
    with httpx.stream("POST", f"{server.url}/generate", json=body, timeout=300) as response:
        lines = (line for line in response.iter_lines() if line)
        next(lines)
        again = httpx.post(f"{server.url}/generate", json={"text": "x", "rid": "long-job"})
        assert again.status_code == 400 and "in flight" in again.json()["error"]["message"]
        assert (
            httpx.post(f"{server.url}/abort_request", json={"rid": "long-job"}).status_code == 200
        )
        rest = list(lines)
    last = json.loads(rest[-2].removeprefix("data: "))
    assert last["meta_info"]["finish_reason"]["type"] == "abort"
    assert 0 < last["meta_info"]["completion_tokens"] < 400
