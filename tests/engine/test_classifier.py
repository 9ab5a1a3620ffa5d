"""Sequence classifiers (engine/classifier.py) on tiny random checkpoints saved as transformers
saves them: the engine's class probabilities equal Hugging Face's `*ForSequenceClassification`
forward (float32), pooled at the last token that is not padding, from one file or shards; the
model refuses generation; a checkpoint without the head is refused at load."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import (
    LlamaConfig,
    LlamaForSequenceClassification,
    Qwen2Config,
    Qwen2ForSequenceClassification,
)

from pagedserve.configs import SamplingParams
from pagedserve.engine.classifier import load_classifier_head, probabilities
from pagedserve.engine.errors import InvalidRequestError
from pagedserve.engine.llm import LLM

TEXTS = ["I loved this movie", "The plot made no sense at all, and the acting was worse."]
SMALL = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2}
SMALL |= {"num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256}


def save_classifier(folder, tokenizer, family: str, num_labels: int, **saving) -> torch.nn.Module:
    """A seeded random classifier of `family` saved to `folder` with `tokenizer`."""
    common = {**SMALL, "vocab_size": len(tokenizer), "num_labels": num_labels}
    common["pad_token_id"] = tokenizer.pad_token_id
    if family == "qwen2":
        labels = {index: name for index, name in enumerate(["negative", "neutral", "positive"])}
        config = Qwen2Config(**common, use_sliding_window=False, id2label=labels)
        model_class = Qwen2ForSequenceClassification
    else:
        config = LlamaConfig(**common, head_dim=16)
        model_class = LlamaForSequenceClassification
    torch.manual_seed(3)
    model = model_class(config).float().eval()
    model.save_pretrained(folder, **saving)
    tokenizer.save_pretrained(folder)
    return model


def hf_probabilities(model: torch.nn.Module, token_ids: list[int]) -> list[float]:
    with torch.no_grad():
        logits = model(torch.tensor([token_ids])).logits[0]
    activation = torch.sigmoid if logits.numel() == 1 else lambda x: torch.softmax(x, dim=-1)
    return activation(logits).tolist()


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory, default_tokenizer):
    folder = tmp_path_factory.mktemp("qwen2-classifier")
    model = save_classifier(folder, default_tokenizer, "qwen2", 3)
    return model, LLM(model=str(folder), dtype="float32", num_kv_blocks=64)


def test_class_probabilities_equal_hugging_face_s(qwen2, default_tokenizer):
    model, llm = qwen2
    outputs = llm.classify(TEXTS)
    for text, output in zip(TEXTS, outputs, strict=True):
        want = hf_probabilities(model, default_tokenizer.encode(text))
        assert output.probs == pytest.approx(want, abs=1e-5)
        assert (
            output.label == ["negative", "neutral", "positive"][max(range(3), key=want.__getitem__)]
        )
        assert math.fsum(output.probs) == pytest.approx(1.0)
    assert llm.engine.classifier.labels == ("negative", "neutral", "positive")


def test_an_input_ending_in_padding_is_read_at_its_last_real_token(qwen2, default_tokenizer):
    model, llm = qwen2
    pad = default_tokenizer.pad_token_id
    token_ids = [*default_tokenizer.encode(TEXTS[0]), pad, pad]
    (output,) = llm.classify([token_ids])
    assert output.probs == pytest.approx(hf_probabilities(model, token_ids), abs=1e-5)


def test_a_classifier_does_not_generate(qwen2):
    _, llm = qwen2
    with pytest.raises(InvalidRequestError, match="sequence classifier"):
        llm.generate(["Hello"], SamplingParams(max_tokens=2))
    assert not llm.engine.has_unfinished_requests()


def test_a_sharded_one_label_cross_encoder(tmp_path, default_tokenizer):
    model = save_classifier(tmp_path, default_tokenizer, "llama", 1, max_shard_size="1MB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    llm = LLM(model=str(tmp_path), dtype="float32", num_kv_blocks=64)
    pair = default_tokenizer(TEXTS[0], TEXTS[1])["input_ids"]
    (output,) = llm.classify([pair])
    assert output.probs == pytest.approx(hf_probabilities(model, pair), abs=1e-5)
    assert len(output.probs) == 1 and output.label == "LABEL_0"


def test_a_classifier_checkpoint_without_its_head_is_refused(tmp_path, default_tokenizer):
    model = save_classifier(tmp_path, default_tokenizer, "llama", 2)
    state = {k: v for k, v in model.state_dict().items() if not k.startswith("score.")}
    model.save_pretrained(tmp_path, state_dict=state)
    with pytest.raises(ValueError, match="without a score.weight head"):
        load_classifier_head(tmp_path, model.config)


def test_probabilities_are_softmax_or_a_sigmoid_for_one_label():
    assert probabilities([0.0]) == [0.5]
    assert probabilities([-1000.0]) == [0.0] and probabilities([1000.0]) == [1.0]
    assert probabilities([1.0, 1.0]) == [0.5, 0.5]
    assert probabilities([1000.0, 0.0]) == pytest.approx([1.0, 0.0])


def test_a_head_of_the_wrong_shape_or_outside_the_checkpoint_is_refused(
    tmp_path, default_tokenizer
):
    from safetensors.torch import save_file

    model = save_classifier(tmp_path, default_tokenizer, "llama", 2)
    save_file({"score.weight": torch.zeros(2, 64)}, tmp_path / "z_stray.safetensors")
    head = load_classifier_head(tmp_path, model.config)  # only model.safetensors is read
    assert torch.equal(head.weight, model.score.weight.float())
    model.config.num_labels = 3
    with pytest.raises(ValueError, match=r"is \(2, 64\), not \(num_labels, hidden_size\)"):
        load_classifier_head(tmp_path, model.config)


def test_a_score_bias_is_ignored_as_transformers_ignores_it(tmp_path, default_tokenizer):
    from safetensors.torch import load_file, save_file

    model = save_classifier(tmp_path, default_tokenizer, "qwen2", 3)
    weights = load_file(tmp_path / "model.safetensors")
    save_file({**weights, "score.bias": torch.ones(3)}, tmp_path / "model.safetensors")
    llm = LLM(model=str(tmp_path), dtype="float32", num_kv_blocks=64)
    (output,) = llm.classify([TEXTS[0]])
    want = hf_probabilities(model, default_tokenizer.encode(TEXTS[0]))
    assert output.probs == pytest.approx(want, abs=1e-5)


def test_llm_score_is_a_cross_encoder_s_sigmoid_or_the_embeddings_cosine(
    tmp_path, default_tokenizer
):
    model = save_classifier(tmp_path / "reranker", default_tokenizer, "llama", 1)
    reranker = LLM(model=str(tmp_path / "reranker"), dtype="float32", num_kv_blocks=64)
    outputs = reranker.score(TEXTS[0], TEXTS)
    for document, output in zip(TEXTS, outputs, strict=True):
        pair = default_tokenizer(TEXTS[0], document)["input_ids"]
        assert output.outputs.score == pytest.approx(hf_probabilities(model, pair)[0], abs=1e-5)
        assert output.prompt_token_ids == pair
    with pytest.raises(ValueError, match="2 first texts for 3"):
        reranker.score(TEXTS, [*TEXTS, "x"])
    with pytest.raises(ValueError, match="one-label"):
        LLM(model=str(_saved(tmp_path / "three", default_tokenizer)), dtype="float32").score(
            "a", "b"
        )


def _saved(folder, tokenizer):
    save_classifier(folder, tokenizer, "qwen2", 3)
    return folder
