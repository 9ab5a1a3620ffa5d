"""POST /score and /rerank with the fake engine, which embeds a text of n bytes as (n, 3, 4): each
pair's score is the cosine of the two embeddings, one text against a list or two lists element
by element, and rerank returns the documents best first."""

from __future__ import annotations

import math

import pytest

from tests.server.conftest import FakeEngine


def _cosine(a: int, b: int) -> float:
    return (a * b + 25) / math.sqrt((a * a + 25) * (b * b + 25))


@pytest.mark.parametrize("path", ["/score", "/v1/score"])
def test_one_text_against_a_list_and_two_lists_pairwise(client, engine: FakeEngine, path):
    one = client.post(path, json={"text_1": "ab", "text_2": ["ab", "abcdefghij"]})
    assert one.status_code == 200, one.text
    body = one.json()
    assert body["object"] == "list" and body["model"] == engine.model_name
    assert [item["score"] for item in body["data"]] == pytest.approx([1.0, _cosine(2, 10)])
    assert body["usage"]["prompt_tokens"] == 2 + 2 + 10  # every input position, as vLLM
    pairwise = client.post(path, json={"queries": ["a", "abc"], "documents": ["abc", "abc"]})
    assert [item["score"] for item in pairwise.json()["data"]] == pytest.approx(
        [_cosine(1, 3), 1.0]
    )


def test_rerank_orders_the_documents_best_first(client):
    documents = ["a" * 30, "abcd", "abcde"]
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        response = client.post(path, json={"query": "abcd", "documents": documents, "top_n": 2})
        assert response.status_code == 200, response.text
        results = response.json()["results"]
        assert [result["index"] for result in results] == [1, 2]
        assert results[0]["relevance_score"] == pytest.approx(1.0)
        assert results[1]["document"] == {"text": "abcde"}
    bare = client.post(
        "/rerank", json={"query": "a", "documents": ["b"], "return_documents": False}
    )
    assert "document" not in bare.json()["results"][0]
    objects = {"query": {"text": "abcd"}, "documents": [{"text": "x"}, {"text": "abcd"}]}
    ranked = client.post("/v2/rerank", json=objects).json()["results"]  # Jina's, Cohere's shape
    assert [result["index"] for result in ranked] == [1, 0]
    assert ranked[0]["document"] == {"text": "abcd"}


def test_the_cache_salt_and_the_truncation_side_reach_the_engine(client, engine: FakeEngine):
    body = {"query": "abcdef", "documents": ["xyz"], "truncate_prompt_tokens": 2}
    for side, kept in ((None, b"ab"), ("left", b"ef")):
        extra = {"cache_salt": "tenant"} | ({"truncation_side": side} if side else {})
        assert client.post("/rerank", json=body | extra).status_code == 200
        query = next(ids for _, ids, _ in engine.requests[-2:] if bytes(ids) in (b"ab", b"ef"))
        assert bytes(query) == kept
        assert {params.cache_salt for _, _, params in engine.requests[-2:]} == {"tenant"}


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/score", {"text_1": ["a", "b"], "text_2": ["a", "b", "c"]}, "text_1"),
        ("/score", {"text_1": "a", "queries": "a", "text_2": "b"}, "text_1"),
        ("/score", {"text_1": "a"}, "text_2"),
        ("/score", {"text_1": [], "text_2": "b"}, "text_1"),
        ("/score", {"text_1": "a", "text_2": [""]}, "text_2"),
        ("/rerank", {"query": "a", "documents": ["b"] * 9}, "documents"),  # over 8 in flight
        ("/rerank", {"query": "a", "documents": ["b"], "max_tokens_per_doc": 5}, "max_tokens"),
        ("/rerank", {"query": "a", "documents": ["b"], "padding": "max_length"}, "padding"),
        ("/score", {"text_1": "a", "text_2": ["b" * 70]}, "text_2"),
        ("/rerank", {"query": "a", "documents": []}, "documents"),
        ("/rerank", {"query": "a", "documents": ["b"], "top_n": -1}, "top_n"),
    ],
)
def test_what_cannot_be_scored_is_a_400_naming_the_field(client, path, body, param):
    response = client.post(path, json=body)
    assert response.status_code == 400, response.text
    assert (response.json()["error"]["param"] or "").startswith(param)


def test_an_unknown_model_is_a_404(client):
    assert (
        client.post("/score", json={"model": "x", "text_1": "a", "text_2": "b"}).status_code == 404
    )
