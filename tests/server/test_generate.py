"""SGLang's POST /generate against the fake engine: the answer's shape (single, batch, n),
finish reasons, how sampling parameters reach the engine, logprob triples, cumulative streaming,
and a 400 naming the field for every input it cannot take. The real model answers it in
tests/server/test_e2e_generate.py."""

from __future__ import annotations

import json

import pytest

from pagedserve.engine.outputs import TokenLogprob
from pagedserve.server.protocol import MIN_LOGPROB
from pagedserve.server.routes.generate import _Logprobs
from tests.server.conftest import EOS_TOKEN_ID

META_KEYS = {
    "id",
    "finish_reason",
    "prompt_tokens",
    "completion_tokens",
    "cached_tokens",
    "weight_version",
    "e2e_latency",
}


def _generate(client, **body):
    response = client.post("/generate", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def _error(client, body: dict, param: str) -> str:
    response = client.post("/generate", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    return error["message"]


def test_one_prompt_is_one_object_with_sglang_s_meta_info(client):
    body = _generate(client, text="hi", rid="r1")
    assert body["text"] == "abcdefgh"
    assert body["output_ids"] == [*b"abcdefgh", EOS_TOKEN_ID]  # the stop token included
    meta = body["meta_info"]
    assert set(meta) == META_KEYS
    assert meta["id"] == "r1" and meta["weight_version"] == "default"
    assert meta["finish_reason"] == {"type": "stop", "matched": EOS_TOKEN_ID}
    assert (meta["prompt_tokens"], meta["completion_tokens"]) == (2, 9)
    assert meta["e2e_latency"] >= 0


def test_max_new_tokens_ends_by_length_and_defaults_to_128_within_the_context(client, engine):
    body = _generate(client, text="hi", sampling_params={"max_new_tokens": 3})
    assert body["text"] == "abc"
    assert body["meta_info"]["finish_reason"] == {"type": "length", "length": 3}
    _generate(client, text="hi")  # 128 tokens do not fit the fake's 64: the rest of it
    _generate(client, text="hi", sampling_params={"max_new_tokens": None})  # null: the rest
    assert [params.max_tokens for _, _, params in engine.requests] == [3, 62, 62]


def test_a_batch_with_n_is_a_prompt_major_list_named_by_the_rid(client, engine):
    body = _generate(
        client, text=["hi", "yo!"], rid="job", sampling_params={"max_new_tokens": 2, "n": 2}
    )
    assert [item["meta_info"]["id"] for item in body] == [
        "job_0_0",
        "job_0_1",
        "job_1_0",
        "job_1_1",
    ]
    assert [item["text"] for item in body] == ["ab", "bc", "ab", "bc"]
    assert [item["meta_info"]["prompt_tokens"] for item in body] == [2, 2, 3, 3]
    assert [request_id for request_id, _, _ in engine.requests] == ["job_0", "job_1"]
    assert [params.n for _, _, params in engine.requests] == [2, 2]  # n choices share a prompt


def test_input_ids_single_and_batched_with_a_rid_per_prompt(client, engine):
    single = _generate(client, input_ids=[104, 105], sampling_params={"max_new_tokens": 1})
    assert single["text"] == "a" and single["meta_info"]["prompt_tokens"] == 2
    batch = _generate(
        client,
        input_ids=[[104], [105, 106]],
        rid=["x", "y"],
        sampling_params=[{"max_new_tokens": 1}, {"max_new_tokens": 2}],
    )
    assert [(item["meta_info"]["id"], item["text"]) for item in batch] == [("x", "a"), ("y", "ab")]
    assert [tokens for _, tokens, _ in engine.requests[1:]] == [[104], [105, 106]]


def test_sampling_parameters_reach_the_engine_in_its_terms(client, engine):
    sampling = {
        "max_new_tokens": 5,
        "min_new_tokens": 2,
        "temperature": 0.5,
        "top_p": 0.9,
        "top_k": 7,
        "min_p": 0.1,
        "frequency_penalty": 0.2,
        "presence_penalty": -0.3,
        "repetition_penalty": 1.1,
        "stop": "x",
        "stop_token_ids": [7],
        "ignore_eos": True,
        "skip_special_tokens": False,
        "no_stop_trim": True,
        "logit_bias": {"5": 1.5},
        "sampling_seed": 11,
        "json_schema": '{"type": "object"}',
    }
    _generate(client, text="hi", sampling_params=sampling, cache_salt="tenant")
    params = engine.requests[0][2]
    assert (params.max_tokens, params.min_tokens, params.temperature) == (5, 2, 0.5)
    assert (params.top_p, params.top_k, params.min_p) == (0.9, 7, 0.1)
    assert (params.frequency_penalty, params.presence_penalty) == (0.2, -0.3)
    assert params.repetition_penalty == 1.1
    assert (params.stop, params.stop_token_ids, params.ignore_eos) == (("x",), (7,), True)
    assert params.include_stop_str_in_output and not params.skip_special_tokens
    assert (params.logit_bias, params.seed, params.cache_salt) == ({5: 1.5}, 11, "tenant")
    constraint = params.structured_outputs
    assert (constraint.kind, constraint.spec) == ("json", '{"type": "object"}')
    _generate(client, text="hi", sampling_params={"regex": "a+", "json_schema": ""})
    _generate(client, text="hi", sampling_params={"ebnf": 'root ::= "a"'})
    tag = {"structures": [{"begin": "<f>", "schema": {}, "end": "</f>"}], "triggers": ["<f"]}
    _generate(client, text="hi", sampling_params={"structural_tag": json.dumps(tag)})
    kinds = [params.structured_outputs.kind for _, _, params in engine.requests[1:]]
    assert kinds == ["regex", "grammar", "structural_tag"]  # SGLang: "" is no constraint
    assert engine.requests[-1][2].structured_outputs.spec == json.dumps(tag)
    both = {"regex": "a", "structural_tag": json.dumps(tag)}
    refused = client.post("/generate", json={"text": "hi", "sampling_params": both})
    assert refused.status_code == 400
    assert refused.json()["error"]["param"] == "sampling_params.structural_tag"


def test_sglang_s_priority_is_higher_first_the_engine_s_lower_first(client_with, engine):
    client = client_with(scheduling_policy="priority")
    engine.scheduling_policy = "priority"
    _generate(client, text="hi", priority=5)
    assert engine.priorities[engine.requests[0][0]] == -5


def test_logprobs_are_triples_from_logprob_start_len(client, engine):
    body = _generate(
        client,
        input_ids=[104, 105, 106],
        return_logprob=True,
        logprob_start_len=1,
        top_logprobs_num=1,
        return_text_in_logprobs=True,
        sampling_params={"max_new_tokens": 2},
    )
    meta = body["meta_info"]
    # The fake scores prompt token i at -i/10 with "z" as its alternative; as SGLang, the first
    # position returned has no logprob wherever the list starts.
    assert meta["input_token_logprobs"] == [[None, 105, "i"], [-0.2, 106, "j"]]
    assert meta["input_top_logprobs"] == [None, [[-0.05, ord("z"), "z"]]]
    assert meta["output_token_logprobs"] == [[-0.5, 97, "a"], [-0.5, 98, "b"]]
    assert meta["output_top_logprobs"] == [[[-0.5, 97, "a"]], [[-0.5, 98, "b"]]]
    assert engine.requests[0][2].prompt_logprobs == 1


def test_logprobs_without_prompt_positions_or_text(client, engine):
    meta = _generate(client, text="hi", return_logprob=True, sampling_params={"max_new_tokens": 1})[
        "meta_info"
    ]
    assert meta["input_token_logprobs"] == [] and meta["output_token_logprobs"] == [
        [-0.5, 97, None]
    ]
    assert "output_top_logprobs" not in meta  # top_logprobs_num 0
    assert engine.requests[0][2].prompt_logprobs is None  # -1: nothing of the prompt is scored
    assert engine.requests[0][2].logprobs == 0


def test_max_new_tokens_zero_only_prefills_or_scores_the_prompt(client, engine):
    warm = _generate(client, text="hi", sampling_params={"max_new_tokens": 0})
    assert (warm["text"], warm["output_ids"]) == ("", [])
    assert warm["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
    scored = _generate(
        client,
        input_ids=[104, 105],
        return_logprob=True,
        logprob_start_len=0,
        sampling_params={"max_new_tokens": 0},
    )
    assert scored["meta_info"]["input_token_logprobs"] == [[None, 104, None], [-0.1, 105, None]]


def _events(response) -> list:
    lines = [line for line in response.text.split("\n") if line]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]


def test_streaming_is_cumulative_and_batches_say_which_item(client):
    response = client.post(
        "/generate", json={"text": "hi", "stream": True, "sampling_params": {"max_new_tokens": 3}}
    )
    chunks = _events(response)
    assert [chunk["text"] for chunk in chunks] == ["a", "ab", "abc"]
    assert [chunk["output_ids"] for chunk in chunks][-1] == [*b"abc"]
    assert [chunk["meta_info"]["finish_reason"] for chunk in chunks[:-1]] == [None, None]
    assert "e2e_latency" in chunks[-1]["meta_info"] and "index" not in chunks[-1]
    response = client.post(
        "/generate",
        json={"text": ["hi", "yo"], "stream": True, "sampling_params": {"max_new_tokens": 2}},
    )
    chunks = _events(response)
    assert sorted((chunk["index"], chunk["text"]) for chunk in chunks) == [
        (0, "a"), (0, "ab"), (1, "a"), (1, "ab"),
    ]  # fmt: skip


def test_stream_interval_sends_the_first_tokens_then_every_interval(client):
    body = {"text": "hi", "stream": True, "sampling_params": {"max_new_tokens": 7}}
    body["sampling_params"]["stream_interval"] = 3
    chunks = _events(client.post("/generate", json=body))
    assert [chunk["text"] for chunk in chunks] == ["a", "abcd", "abcdefg"]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"text": "hi", "sampling_params": {"max_new_token": 3}}, "sampling_params.max_new_token"),
        (
            {"text": "hi", "sampling_params": {"max_new_tokens": "3"}},
            "sampling_params.max_new_tokens",
        ),
        (
            {"text": "hi", "sampling_params": {"max_new_tokens": -1}},
            "sampling_params.max_new_tokens",
        ),
        (
            {"text": "hi", "sampling_params": {"max_new_tokens": 63}},
            "sampling_params.max_new_tokens",
        ),
        ({"text": "hi", "sampling_params": {"temperature": -1.0}}, "sampling_params.temperature"),
        (
            {"text": "hi", "sampling_params": {"sampling_seed": 2**63}},
            "sampling_params.sampling_seed",
        ),
        ({"text": "hi", "sampling_params": {"stop_regex": "(a)\\1"}}, "sampling_params.stop_regex"),
        (
            {"text": "hi", "sampling_params": {"stop_regex": ["x", "a*"]}},
            "sampling_params.stop_regex",
        ),
        ({"text": "hi", "sampling_params": {"beam_width": 2}}, "sampling_params.beam_width"),
        ({"text": "hi", "sampling_params": {"regex": "a", "ebnf": "b"}}, "sampling_params.ebnf"),
        ({"text": ["a", "b"], "sampling_params": [{}, {"top_p": 0}]}, "sampling_params[1].top_p"),
        ({"text": ["a", "b"], "sampling_params": [{}]}, "sampling_params"),
        ({"text": ["a", "b"], "sampling_params": [{"n": 1}, {"n": 2}]}, "sampling_params"),
        ({"text": "hi", "input_ids": [1]}, "text"),
        ({}, "text"),
        ({"text": ""}, "text"),
        ({"input_ids": [999]}, "input_ids"),
        ({"text": "hi", "image_data": "x.png"}, "image_data"),
        ({"text": "hi", "return_hidden_states": True}, "return_hidden_states"),
        ({"text": ["a", "b"], "rid": ["x", "x"]}, "rid"),
        ({"text": "hi", "return_logprob": True, "logprob_start_len": 3}, "logprob_start_len"),
        ({"text": "hi", "return_logprob": True, "top_logprobs_num": 21}, "top_logprobs_num"),
        ({"text": "hi", "lora_path": "no-such-adapter"}, None),
    ],
)
def test_each_bad_input_is_a_400_naming_its_field(client, body, param):
    if param is None:  # an adapter that is not served: the OpenAI routes' 404
        assert client.post("/generate", json=body).status_code == 404
        return
    assert _error(client, body, param)


def test_sglang_router_s_extra_fields_are_accepted(client):
    body = _generate(
        client,
        text="hi",
        model=None,
        log_metrics=True,
        no_logs=False,
        background=False,
        return_hidden_states=False,
        return_text_in_logprobs=False,
        sampling_params={"max_new_tokens": 1},
    )
    assert body["text"] == "a"


def test_a_masked_top_logprob_is_sent_as_the_floor_not_minus_infinity():
    # A grammar's masked tokens have -inf, which JSON cannot carry: the OpenAI routes' floor.
    logprobs = _Logprobs(start=0, num_top=2, tokenizer=None)
    entry = TokenLogprob(97, -0.5, ((97, -0.5), (98, float("-inf"))))
    logprobs.add_output((entry,))
    body = logprobs.body()
    assert body["output_top_logprobs"] == [[[-0.5, 97, None], [MIN_LOGPROB, 98, None]]]
    assert body["output_token_logprobs_length"] == 1
    json.dumps(body, allow_nan=False)


def test_put_is_generate_too_and_negative_seeds_are_taken(client, engine):
    response = client.put(
        "/generate",
        json={"text": "hi", "sampling_params": {"max_new_tokens": 1, "sampling_seed": -1}},
    )
    assert response.status_code == 200 and response.json()["text"] == "a"
    assert engine.requests[0][2].seed == 2**63 - 1  # SGLang's signed seeds wrap into the engine's
    body = {"text": "hi", "sampling_params": {"sampling_seed": -(2**63) - 1}}
    assert _error(client, body, "sampling_params.sampling_seed")
