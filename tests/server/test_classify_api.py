"""/classify, and /score and /rerank with a cross-encoder, served by the real engine (in process)
from tiny random `*ForSequenceClassification` checkpoints: the probabilities and scores equal
Hugging Face's forward over the same tokens; generation routes refuse a classifier with a 400;
/health_generate still probes it. A model that is not a classifier answers /classify with a 400."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from fastapi.testclient import TestClient
from transformers import AutoTokenizer

from pagedserve.configs import load_engine_config
from pagedserve.engine.model_loader import DEFAULT_MODEL, resolve_model_path
from pagedserve.server.app import create_app
from tests.engine.test_classifier import TEXTS, hf_probabilities, save_classifier


def _served(folder) -> TestClient:
    config = load_engine_config(
        cli={"model": str(folder), "dtype": "float32", "num_kv_blocks": 64}, environ={}
    )
    return TestClient(create_app(config), raise_server_exceptions=False)


@pytest.fixture(scope="module")
def default_tokenizer():
    return AutoTokenizer.from_pretrained(resolve_model_path(DEFAULT_MODEL)[0])


def _classifier_served(tmp_path_factory, tokenizer, family: str, num_labels: int) -> Iterator:
    folder = tmp_path_factory.mktemp(f"{family}-{num_labels}-labels")
    model = save_classifier(folder, tokenizer, family, num_labels)
    with _served(folder) as client:
        yield model, client


@pytest.fixture(scope="module")
def sentiment(tmp_path_factory, default_tokenizer) -> Iterator[tuple]:
    yield from _classifier_served(tmp_path_factory, default_tokenizer, "qwen2", 3)


@pytest.fixture(scope="module")
def reranker(tmp_path_factory, default_tokenizer) -> Iterator[tuple]:
    yield from _classifier_served(tmp_path_factory, default_tokenizer, "llama", 1)


def test_classify_takes_vllm_s_chat_style_messages(sentiment, default_tokenizer):
    # vLLM's ClassificationChatRequest: the conversation as the chat template renders it (no
    # generation prompt, the template's own special tokens), classified as that text would be.
    model, client = sentiment
    messages = [{"role": "user", "content": "What a lovely day"}]
    body = client.post("/classify", json={"messages": messages}).json()
    rendered = default_tokenizer.apply_chat_template(
        messages, add_generation_prompt=False, tokenize=False
    )
    token_ids = default_tokenizer.encode(rendered, add_special_tokens=False)
    (item,) = body["data"]
    assert item["probs"] == pytest.approx(hf_probabilities(model, token_ids), abs=1e-5)
    assert body["usage"]["prompt_tokens"] == len(token_ids)
    both = client.post("/classify", json={"messages": messages, "input": "x"})
    assert both.status_code == 400 and both.json()["error"]["param"] == "input"


def test_classify_gives_hugging_face_s_probabilities(sentiment, default_tokenizer):
    model, client = sentiment
    body = client.post("/classify", json={"input": TEXTS}).json()
    assert body["object"] == "list" and body["id"].startswith("classify-")
    for text, item in zip(TEXTS, body["data"], strict=True):
        want = hf_probabilities(model, default_tokenizer.encode(text))
        assert item["probs"] == pytest.approx(want, abs=1e-5) and item["num_classes"] == 3
        assert (
            item["label"]
            == ["negative", "neutral", "positive"][max(range(3), key=want.__getitem__)]
        )
    num_tokens = sum(len(default_tokenizer.encode(text)) for text in TEXTS)
    assert body["usage"] == {
        "prompt_tokens": num_tokens,
        "total_tokens": num_tokens,
        "completion_tokens": 0,
    }
    raw = client.post("/classify", json={"input": TEXTS[0], "use_activation": False}).json()
    logits = torch.tensor(raw["data"][0]["probs"])
    assert torch.softmax(logits, dim=0).tolist() == pytest.approx(
        body["data"][0]["probs"], abs=1e-6
    )


def test_a_classifier_refuses_generation_but_passes_its_health_probe(sentiment):
    _, client = sentiment
    for path, request in (
        ("/v1/completions", {"prompt": "Hi", "max_tokens": 2}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}),
        ("/generate", {"text": "Hi"}),
    ):
        response = client.post(path, json=request)
        assert response.status_code == 400, (path, response.text)
        assert "sequence classifier" in response.json()["error"]["message"]
    assert client.get("/health_generate").status_code == 200
    response = client.post("/v1/score", json={"text_1": "a", "text_2": "b"})
    assert response.status_code == 400 and "3 labels" in response.json()["error"]["message"]


def test_a_cross_encoder_scores_and_reranks_each_pair(reranker, default_tokenizer):
    model, client = reranker
    query, documents = "Where is Paris?", ["Paris is in France.", "Bananas are yellow.", "Hi"]
    want = [
        hf_probabilities(model, default_tokenizer(query, document)["input_ids"])[0]
        for document in documents
    ]
    scores = client.post("/v1/score", json={"text_1": query, "text_2": documents}).json()
    assert [item["score"] for item in scores["data"]] == pytest.approx(want, abs=1e-5)
    ranked = client.post("/rerank", json={"query": query, "documents": documents}).json()
    assert [result["index"] for result in ranked["results"]] == sorted(
        range(3), key=lambda index: -want[index]
    )
    (item,) = client.post("/classify", json={"input": [query]}).json()["data"]
    assert item["num_classes"] == 1 and 0.0 < item["probs"][0] < 1.0  # a sigmoid
    raw = client.post(
        "/score", json={"text_1": query, "text_2": documents, "use_activation": False}
    )
    logits = torch.tensor([item["score"] for item in raw.json()["data"]])
    assert torch.sigmoid(logits).tolist() == pytest.approx(want, abs=1e-5)
    assert client.get("/model_info").json()["is_generation"] is False


def test_a_cross_encoder_cuts_a_long_pair_as_the_tokenizer_cuts_a_pair(reranker, default_tokenizer):
    model, client = reranker
    query = "Where is the city that is the capital of France, on which river, and how big?"
    documents = ["Paris is in France.", "Bananas are yellow."]
    body = {"query": query, "documents": documents, "truncate_prompt_tokens": 12}
    ranked = client.post("/rerank", json=body).json()["results"]
    want = {
        index: hf_probabilities(
            model, default_tokenizer(query, document, truncation=True, max_length=12)["input_ids"]
        )[0]
        for index, document in enumerate(documents)
    }
    assert {r["index"]: r["relevance_score"] for r in ranked} == pytest.approx(want, abs=1e-5)
    assert want[0] != pytest.approx(want[1])  # each document kept a part of itself


def test_classify_needs_a_classifier(client):
    response = client.post("/classify", json={"input": "hi"})
    assert response.status_code == 400
    assert "needs a sequence classifier" in response.json()["error"]["message"]
