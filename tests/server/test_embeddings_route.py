"""POST /v1/embeddings with the fake engine (which embeds a prompt of n tokens as (n, 3, 4)):
each input becomes an engine request of one token asking for its embedding; the answer is
OpenAI's list, normalised unless `normalize` is false, cut to `dimensions`, as floats or as
base64 float32; what cannot be served is a 400 naming the field."""

from __future__ import annotations

import base64
import math
import struct

import pytest

from pagedserve.engine.outputs import RequestDelta
from tests.server.conftest import FakeEngine


def _embed(client, **body):
    return client.post("/v1/embeddings", json={"input": "hi"} | body)


def _unit(*values: float) -> list[float]:
    norm = math.sqrt(sum(value * value for value in values))
    return [value / norm for value in values]


def test_each_input_gets_its_normalised_embedding_in_order(client, engine: FakeEngine):
    response = _embed(client, input=["hi", "hello", "abcd"])
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["object"] == "list" and body["model"] == engine.model_name
    assert [item["index"] for item in body["data"]] == [0, 1, 2]
    for item, length in zip(body["data"], (2, 5, 4), strict=True):
        assert item["object"] == "embedding"
        assert item["embedding"] == pytest.approx(_unit(length, 3, 4))
    assert body["usage"] == {"prompt_tokens": 11, "total_tokens": 11}
    for _, _, params in engine.requests:  # one token, greedy, asking for the embedding
        assert params.embed and params.max_tokens == 1 and params.n == 1
    ids = _embed(client, input=[[1, 2, 3], [4, 5]]).json()["data"]
    assert ids[1]["embedding"] == pytest.approx(_unit(2, 3, 4))
    assert engine.requests[-1][1] == [4, 5]


def test_normalize_false_dimensions_and_base64(client):
    raw = _embed(client, normalize=False).json()["data"][0]["embedding"]
    assert raw == [2.0, 3.0, 4.0]
    cut = _embed(client, dimensions=2).json()["data"][0]["embedding"]
    assert cut == pytest.approx(_unit(2, 3))
    encoded = _embed(client, encoding_format="base64").json()["data"][0]["embedding"]
    decoded = struct.unpack("<3f", base64.b64decode(encoded))
    assert decoded == pytest.approx(_unit(2, 3, 4))


def test_vllm_encoding_options(client):
    for field in ("use_activation", "normalize"):  # vLLM 0.32's, and its older name
        assert _embed(client, **{field: False}).json()["data"][0]["embedding"] == [2.0, 3.0, 4.0]
    for dtype, endianness, code in [
        ("float16", "little", "<3e"),
        ("float32", "big", ">3f"),
        ("bfloat16", "native", None),
    ]:
        body = {"encoding_format": "base64", "embed_dtype": dtype, "endianness": endianness}
        raw = base64.b64decode(
            _embed(client, normalize=False, **body).json()["data"][0]["embedding"]
        )
        if code is None:  # bfloat16: the top half of each float32
            raw = b"".join(b"\0\0" + raw[i : i + 2] for i in range(0, len(raw), 2))
            code = "<3f"
        assert struct.unpack(code, raw) == (2.0, 3.0, 4.0)


@pytest.mark.parametrize(("side", "kept"), [(None, b"abcd"), ("right", b"abcd"), ("left", b"wxyz")])
def test_truncation_cuts_from_the_side_asked_for(client, engine: FakeEngine, side, kept):
    body = {"input": "abcd" + "-" * 100 + "wxyz", "truncate_prompt_tokens": 4}
    assert _embed(client, **body, **({"truncation_side": side} if side else {})).status_code == 200
    assert bytes(engine.requests[-1][1]) == kept  # the tokenizer's side (right) by default
    longest = _embed(client, input="x" * 100, truncate_prompt_tokens=-1)
    assert longest.status_code == 200 and len(engine.requests[-1][1]) == 63  # context less one


def test_conversations_are_rendered_by_the_chat_template(client, engine: FakeEngine):
    hello = [{"role": "user", "content": "hello"}]
    one = _embed(client, input=None, messages=hello)
    assert one.status_code == 200, one.text
    assert bytes(engine.requests[-1][1]).decode() == "<user>hello\n"  # no generation prompt
    two = _embed(
        client, input=None, messages=[hello, hello], add_generation_prompt=True,
        chat_template_kwargs={"x": 1},
    ).json()  # fmt: skip
    assert len(two["data"]) == 2
    assert bytes(engine.requests[-1][1]).decode() == "[x=1]<user>hello\n<assistant>"


def test_an_adapter_named_as_the_model_runs_it(client_with, engine: FakeEngine):
    engine.lora_adapters = {"sql": "/adapters/sql"}
    client = client_with(enable_lora=True, lora_modules=["sql=/adapters/sql"])
    body = _embed(client, model="sql").json()
    assert body["model"] == "sql" and engine.requests[-1][2].lora == "sql"


@pytest.mark.parametrize(
    ("body", "param", "says"),
    [
        ({"input": []}, "input", "must not be empty"),
        ({"input": [""]}, "input", "must not be empty"),
        ({"input": [[1, 999]]}, "input", "out of vocabulary"),
        ({"input": "x" * 64}, "input", "embeds at most 63"),
        ({"dimensions": 4}, "dimensions", "have 3"),
        ({"dimensions": 0}, "dimensions", "greater than or equal to 1"),
        ({"encoding_format": "int8"}, "encoding_format", "encoding_format"),
        ({"input": 5}, "input", "input"),
        ({"messages": [{"role": "user", "content": "hi"}]}, "input", "exactly one"),
        ({"input": None, "messages": []}, "messages", "at least one message"),
        ({"input": None, "messages": [[]]}, "messages", "at least one message"),
        (
            {
                "input": None,
                "messages": [{"role": "user", "content": "hi"}],
                "continue_final_message": True,
                "add_generation_prompt": True,
            },
            "continue_final_message",
            "cannot both",
        ),
        ({"padding": "max_length"}, "padding", "padding"),
        ({"embed_dtype": "int8"}, "embed_dtype", "embed_dtype"),
        # the template's controls with `input`: nothing would render it
        ({"add_generation_prompt": True}, "add_generation_prompt", "applies to messages"),
        ({"chat_template_kwargs": {"x": 1}}, "chat_template_kwargs", "applies to messages"),
    ],
)
def test_what_cannot_be_served_is_a_400_naming_the_field(client, body, param, says):
    response = _embed(client, **body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert says in str(error) and (error["param"] or "").startswith(param), error


def test_an_unknown_model_is_a_404(client):
    assert _embed(client, model="nope").status_code == 404


def test_an_embedding_aborted_before_it_ends_is_a_503_naming_the_abort(client, engine, monkeypatch):
    async def aborted(prompt_token_ids, params, request_id, priority=0):
        yield RequestDelta(request_id, 0, (), "", None, len(prompt_token_ids), 0, True, "abort")

    monkeypatch.setattr(engine, "generate", aborted)  # as /abort_request or shutdown ends it
    response = client.post("/v1/embeddings", json={"input": "hi"})
    assert response.status_code == 503 and response.json()["error"]["code"] == "aborted"
