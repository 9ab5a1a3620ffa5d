"""Sequence classifiers: checkpoints of a decoder `*ForSequenceClassification` class (reward
models, cross-encoder rerankers, sentiment or safety heads on Llama, Qwen2, Qwen3...).

Such a model is the decoder plus one linear head (`score`) over the final hidden state of the
last token that is not padding. The engine serves its decoder as it serves any causal model (the
checkpoint's `model.*` weights load into the family's `*ForCausalLM`, whose LM head stays unused
and refuses generation), takes the last token's final hidden state the way it takes an embedding
(engine/embeddings.py), and `ClassifierHead` applies the head: a few thousand products per input,
done where the answer is built, with no second forward path.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)
HEAD_WEIGHT = "score.weight"  # the head's name in transformers' decoder classifiers
HEAD_BIAS = "score.bias"


def is_sequence_classifier(hf_config: Any) -> bool:
    architectures = getattr(hf_config, "architectures", None) or []
    return any(name.endswith("ForSequenceClassification") for name in architectures)


@dataclass(frozen=True, slots=True)
class ClassifierHead:
    """The head's weights as plain floats ([label][hidden]), its bias, and the label names."""

    weight: tuple[tuple[float, ...], ...]
    bias: tuple[float, ...] | None
    labels: tuple[str, ...]
    pad_token_id: int | None  # inputs are pooled at their last token that is not this one

    @property
    def num_labels(self) -> int:
        return len(self.weight)

    def logits(self, hidden: Sequence[float]) -> list[float]:
        if len(hidden) != len(self.weight[0]):
            raise ValueError(f"{len(hidden)} hidden values for a head of {len(self.weight[0])}")
        bias = self.bias or (0.0,) * self.num_labels
        rows = zip(self.weight, bias, strict=True)
        return [math.fsum(map(float.__mul__, row, hidden)) + b for row, b in rows]

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
    """The `score` head of the checkpoint in `model_path` (safetensors, one file or sharded).

    Raises:
        ValueError: the checkpoint has no `score.weight` (say, an encoder classifier, whose head
            is named otherwise: not a decoder model this engine serves).
    """
    from safetensors import safe_open  # a transformers dependency

    tensors = {}
    for file in _weight_files(model_path):
        with safe_open(str(file), framework="pt") as handle:
            names = set(handle.keys())
            for name in (HEAD_WEIGHT, HEAD_BIAS):
                if name in names:
                    tensors[name] = handle.get_tensor(name).float()
    if HEAD_WEIGHT not in tensors:
        raise ValueError(f"{model_path} is a sequence classifier without a {HEAD_WEIGHT} head")
    weight = tensors[HEAD_WEIGHT]
    id2label = getattr(hf_config, "id2label", None) or {}
    labels = tuple(str(id2label.get(index, f"LABEL_{index}")) for index in range(weight.shape[0]))
    bias = tensors.get(HEAD_BIAS)
    return ClassifierHead(
        tuple(tuple(row) for row in weight.tolist()),
        tuple(bias.tolist()) if bias is not None else None,
        labels,
        getattr(hf_config, "pad_token_id", None),
    )


def _weight_files(model_path: Path) -> list[Path]:
    index = model_path / "model.safetensors.index.json"
    if index.is_file():
        shards = json.loads(index.read_text())["weight_map"]
        return sorted(
            {model_path / shards[name] for name in (HEAD_WEIGHT, HEAD_BIAS) if name in shards}
        )
    return sorted(model_path.glob("*.safetensors"))
