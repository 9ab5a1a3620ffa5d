"""Sequence classifiers: checkpoints of a decoder `*ForSequenceClassification` class (reward
models, cross-encoder rerankers, sentiment or safety heads on Llama, Qwen2, Qwen3...).

Such a model is the decoder plus one linear head (`score`) over the final hidden state of the
last token that is not padding. The engine serves its decoder as it serves any causal model (the
checkpoint's `model.*` weights load into the family's `*ForCausalLM`, whose LM head stays unused
and refuses generation), takes the last token's final hidden state the way it takes an embedding
(engine/embeddings.py), and `ClassifierHead` applies the head, one matrix product for a request's
inputs where the answer is built, with no second forward path.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)
HEAD_WEIGHT = "score.weight"  # the head's name in transformers' decoder classifiers


def is_sequence_classifier(hf_config: Any) -> bool:
    architectures = getattr(hf_config, "architectures", None) or []
    return any(name.endswith("ForSequenceClassification") for name in architectures)


@dataclass(frozen=True, slots=True, eq=False)
class ClassifierHead:
    """The head's weight ([labels, hidden], float32, on the CPU) and the label names."""

    weight: torch.Tensor
    labels: tuple[str, ...]
    pad_token_id: int | None  # inputs are pooled at their last token that is not this one

    @property
    def num_labels(self) -> int:
        return self.weight.shape[0]

    def logits(self, states: Sequence[Sequence[float]]) -> list[list[float]]:
        """Each final hidden state's logits: one product for all of them (a request's inputs
        together: microseconds, where a Python loop over a 4,096-wide head took 1.5 ms each)."""
        hidden = torch.tensor(states, dtype=torch.float32).reshape(len(states), -1)
        if hidden.shape[1] != self.weight.shape[1]:
            raise ValueError(
                f"{hidden.shape[1]} hidden values for a head of {self.weight.shape[1]}"
            )
        return (hidden @ self.weight.T).tolist()

    def best_label(self, logits: Sequence[float]) -> str:
        """The label of the largest logit (the first of equal ones)."""
        return self.labels[max(range(len(logits)), key=logits.__getitem__)]

    def pooled(self, token_ids: list[int]) -> list[int]:
        """The tokens up to the last one that is not padding (transformers pools there; the
        state at a position does not depend on the tokens after it, so dropping the trailing
        padding gives the same state)."""
        end = len(token_ids)
        while end > 1 and token_ids[end - 1] == self.pad_token_id:
            end -= 1
        return token_ids[:end]


def probabilities(logits: Sequence[float]) -> list[float]:
    """vLLM's activation for a classifier: softmax over the labels, a sigmoid for one label."""
    if len(logits) == 1:
        return [_sigmoid(logits[0])]
    top = max(logits)
    exps = [math.exp(value - top) for value in logits]
    total = math.fsum(exps)
    return [value / total for value in exps]


def _sigmoid(value: float) -> float:
    if value >= 0:
        return 1.0 / (1.0 + math.exp(-value))
    exp = math.exp(value)
    return exp / (1.0 + exp)


def load_classifier(model_path: Path, hf_config: Any, name: str) -> ClassifierHead | None:
    """The head of the sequence classifier checkpoint in `model_path`; None for other models."""
    if not is_sequence_classifier(hf_config):
        return None
    head = load_classifier_head(model_path, hf_config)
    logger.info(
        "%s is a sequence classifier (%d labels): it serves /classify, /score, /rerank and "
        "/v1/embeddings; its LM head is not in the checkpoint, so it does not generate",
        name,
        head.num_labels,
    )
    return head


def load_classifier_head(model_path: Path, hf_config: Any) -> ClassifierHead:
    """The `score` head of the checkpoint in `model_path` (safetensors: `model.safetensors`, or
    the shards its index names). transformers builds the head without a bias, so a `score.bias`
    in a checkpoint is ignored, as transformers ignores it.

    Raises:
        ValueError: no `score.weight` (say, an encoder classifier, whose head is named otherwise,
            or a checkpoint without safetensors), or one whose shape is not [num_labels, hidden].
    """
    from safetensors import safe_open  # a transformers dependency

    weight = None
    for file in _weight_files(model_path):
        with safe_open(str(file), framework="pt") as handle:
            if HEAD_WEIGHT in set(handle.keys()):
                weight = handle.get_tensor(HEAD_WEIGHT).float().contiguous()
    if weight is None:
        raise ValueError(
            f"{model_path} is a sequence classifier without a {HEAD_WEIGHT} head in its "
            "safetensors files (model.safetensors, or the shards of its index)"
        )
    expected = (getattr(hf_config, "num_labels", None), getattr(hf_config, "hidden_size", None))
    if tuple(weight.shape) != expected:
        raise ValueError(
            f"{model_path}: {HEAD_WEIGHT} is {tuple(weight.shape)}, not (num_labels, hidden_size) "
            f"= {expected}"
        )
    id2label = getattr(hf_config, "id2label", None) or {}
    labels = tuple(str(id2label.get(index, f"LABEL_{index}")) for index in range(weight.shape[0]))
    return ClassifierHead(weight, labels, getattr(hf_config, "pad_token_id", None))


def _weight_files(model_path: Path) -> list[Path]:
    index = model_path / "model.safetensors.index.json"
    if index.is_file():
        shard = json.loads(index.read_text())["weight_map"].get(HEAD_WEIGHT)
        return [model_path / shard] if shard else []
    single = model_path / "model.safetensors"
    return [single] if single.is_file() else []
