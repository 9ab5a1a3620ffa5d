"""End to end: structured outputs on a real server with the default model, driven by the official
`openai` client. Every constrained output must validate (jsonschema), at temperature 0 and 1,
streamed or not; malformed constraints are 400s naming the parameter. One server, short outputs
(bounded schemas), so the module stays cheap on a small machine."""

from __future__ import annotations

import enum
import json
import re
from collections.abc import Iterator
from typing import Annotated

import jsonschema
import openai
import pytest
from openai.lib._parsing._completions import type_to_response_format_param
from pydantic import BaseModel, Field

from tests.server_process import ServerProcess

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

ENGINE_FLAGS = ("--max-model-len", "1024", "--num-kv-blocks", "256", "--block-size", "16")
MAX_TOKENS = 200  # above the longest output the bounded schemas below allow
SYSTEM = {"role": "system", "content": "You reply with JSON only."}


class Role(str, enum.Enum):
    admin = "admin"
    user = "user"
    guest = "guest"


class Address(BaseModel):
    city: str = Field(max_length=16)
    zip_code: str = Field(pattern=r"^[0-9]{5}$")


class Person(BaseModel):
    """Nested object, enum ($ref), bounded integer, pattern string, array with minItems, optional."""

    name: str = Field(max_length=16)
    age: int = Field(ge=18, le=99)
    role: Role
    skills: list[Annotated[str, Field(max_length=12)]] = Field(min_length=2, max_length=3)
    address: Address
    nickname: Annotated[str, Field(max_length=10)] | None = None


class Verdict(BaseModel):
    label: bool
    score: int = Field(ge=1, le=5)


# The schema exactly as the client sends it (strict: every property required, no extras).
PERSON_SCHEMA = type_to_response_format_param(Person)["json_schema"]["schema"]
VERDICT_SCHEMA = type_to_response_format_param(Verdict)["json_schema"]["schema"]


@pytest.fixture(scope="module")
def client() -> Iterator[openai.OpenAI]:
    process = ServerProcess(*ENGINE_FLAGS)
    try:
        yield openai.OpenAI(base_url=f"{process.url}/v1", api_key="unused", timeout=300)
    finally:
        process.stop()


@pytest.fixture(scope="module")
def model_name(client) -> str:
    return client.models.list().data[0].id


def _user(text: str) -> list[dict[str, str]]:
    return [SYSTEM, {"role": "user", "content": text}]


@pytest.mark.parametrize(
    ("model", "schema", "text"),
    [
        (Person, PERSON_SCHEMA, "Invent a person."),
        (Verdict, VERDICT_SCHEMA, "Is the sky blue? Rate your confidence."),
    ],
)
@pytest.mark.parametrize(("temperature", "seed"), [(0.0, None), (1.0, 7)])
def test_parse_returns_objects_that_validate(
    client, model_name, model, schema, text, temperature, seed
):
    completion = client.chat.completions.parse(
        model=model_name,
        messages=_user(text),
        response_format=model,
        temperature=temperature,
        seed=seed,
        max_tokens=MAX_TOKENS,
        n=3 if temperature else 1,
    )
    for choice in completion.choices:
        assert choice.finish_reason == "stop"
        assert isinstance(choice.message.parsed, model)
        jsonschema.validate(json.loads(choice.message.content), schema)


def test_streamed_json_schema_concatenates_to_a_valid_object(client, model_name):
    stream = client.chat.completions.create(
        model=model_name,
        messages=_user("Invent a person."),
        response_format=type_to_response_format_param(Person),
        temperature=1.0,
        seed=3,
        max_tokens=MAX_TOKENS,
        stream=True,
    )
    pieces, reasons = [], []
    for chunk in stream:
        for choice in chunk.choices:
            pieces.append(choice.delta.content or "")
            reasons.append(choice.finish_reason)
    assert reasons[-1] == "stop"
    jsonschema.validate(json.loads("".join(pieces)), PERSON_SCHEMA)


def test_json_object_choice_and_regex_hold(client, model_name):
    as_object = client.chat.completions.create(
        model=model_name,
        messages=_user("Give a JSON object with one key, name."),
        response_format={"type": "json_object"},
        temperature=0,
        max_tokens=MAX_TOKENS,
    )
    assert as_object.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(as_object.choices[0].message.content), dict)
    choice = client.chat.completions.create(
        model=model_name,
        messages=_user("Is water wet?"),
        temperature=1.0,
        seed=1,
        max_tokens=8,
        extra_body={"guided_choice": ["yes", "no", "it depends"]},
    )
    assert choice.choices[0].message.content in ("yes", "no", "it depends")
    pattern = r"[A-Z]{2}-[0-9]{3}"
    completion = client.completions.create(
        model=model_name,
        prompt="A licence plate:",
        max_tokens=16,
        extra_body={"structured_outputs": {"regex": pattern}},
    )
    assert re.fullmatch(pattern, completion.choices[0].text)


@pytest.mark.parametrize("stream", [False, True])
def test_a_structural_tag_s_content_validates(client, model_name, stream):
    # vLLM's response_format of type structural_tag: here one forced tag around a JSON object.
    tag = {"type": "tag", "begin": "<tool>", "end": "</tool>"}
    tag["content"] = {"type": "json_schema", "json_schema": VERDICT_SCHEMA}
    reply = client.chat.completions.create(
        model=model_name,
        messages=_user("Is water wet? Give a verdict."),
        temperature=0,
        max_tokens=MAX_TOKENS,
        stream=stream,
        extra_body={"response_format": {"type": "structural_tag", "format": tag}},
    )
    if stream:
        text = "".join(chunk.choices[0].delta.content or "" for chunk in reply if chunk.choices)
    else:
        assert reply.choices[0].finish_reason == "stop"
        text = reply.choices[0].message.content
    match = re.fullmatch(r"<tool>(.*)</tool>", text, re.S)
    assert match is not None, text
    jsonschema.validate(json.loads(match.group(1)), VERDICT_SCHEMA)


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "foo"}},
                }
            },
            "response_format",
        ),
        ({"guided_regex": "[a-"}, "guided_regex"),
        ({"response_format": {"type": "yaml"}}, "response_format"),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
        (
            {"response_format": {"type": "structural_tag", "format": {"type": "bogus"}}},
            "response_format",
        ),
    ],
)
def test_bad_constraints_are_400s_naming_the_parameter(client, model_name, extra, param):
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(
            model=model_name, messages=_user("hi"), max_tokens=4, extra_body=extra
        )
    assert raised.value.status_code == 400
    assert raised.value.body["param"] == param


@pytest.mark.parametrize("stream", [False, True])
def test_logprobs_of_tokens_the_constraint_rules_out_come_back_as_minus_9999(
    client, model_name, stream
):
    """Where the grammar allows fewer tokens than the top list asks for, the rest have logprob
    -inf, which JSON cannot carry: the response writes -9999.0 (as vLLM's server does)."""
    regex = "[01]{3}"  # a digit of two at each step: three of the five alternatives are ruled out
    completion = client.completions.create(
        model=model_name,
        prompt="Three bits:",
        max_tokens=3,
        logprobs=5,
        stream=stream,
        extra_body={"structured_outputs": {"regex": regex}},
    )
    chunks = list(completion) if stream else [completion]
    text = "".join(chunk.choices[0].text for chunk in chunks)
    top = [step for chunk in chunks for step in chunk.choices[0].logprobs.top_logprobs]
    assert re.fullmatch(regex, text)
    assert len(top) == 3 and all(len(step) == 5 for step in top)
    assert all(-9999.0 in step.values() for step in top), top
    chosen = [v for chunk in chunks for v in chunk.choices[0].logprobs.token_logprobs]
    assert all(-9999.0 < value <= 0 for value in chosen)
