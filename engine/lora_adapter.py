"""Reading a PEFT LoRA folder (`adapter_config.json` + `adapter_model.safetensors`) into the
terms engine/lora.py adds: per targeted layer, A [r, in] and B [out, r] scaled by the adapter's
s = alpha / r (alpha / sqrt(r) with rsLoRA). What the terms would not compute as PEFT does is
refused here, at start, rather than served as another model: DoRA, trained biases, extra
modules, per-module ranks, weights the terms do not use, and layers that do not run each
request's own token rows.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch import Tensor

ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."
# The layers an adapter may target: a decoder layer's per-token projections (Phi-3's own fused
# ones included). Anything else sees other rows than the step's tokens (lm_head the logits rows,
# latent attention's kv_b_proj the whole history, MoE experts their routed tokens) or is no
# linear layer (embeddings): refused at load rather than given another request's rows.
TARGETS = frozenset(
    ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    + ("qkv_proj", "gate_up_proj")
)
DECODER_LAYER = re.compile(r"(^|\.)layers\.\d+\.(self_attn|mlp)\.[a-z_]+$")


class LoRAError(ValueError):
    """An adapter that cannot be served on this model (the message says why)."""


@dataclass(frozen=True)
class LoRADelta:
    a: Tensor  # [rank, in]
    b: Tensor  # [out, rank], scaled by the adapter's s


@dataclass(frozen=True)
class LoRAAdapter:
    name: str
    path: Path
    rank: int
    deltas: dict[str, LoRADelta]  # HF module path (model.layers.0.self_attn.q_proj) -> term


def load_adapter(name: str, path: Path, max_rank: int, dtype: torch.dtype) -> LoRAAdapter:
    """Read a PEFT LoRA folder; raises LoRAError for anything its terms would not compute."""
    try:
        config = json.loads((path / ADAPTER_CONFIG).read_text())
        tensors = load_file(path / ADAPTER_WEIGHTS)
    except (OSError, ValueError, SafetensorError) as error:  # also a git-LFS pointer
        raise LoRAError(f"LoRA adapter {name!r} at {path}: {error}") from None
    if not isinstance(config, dict):
        raise LoRAError(f"LoRA adapter {name!r}: {ADAPTER_CONFIG} is not a JSON object")
    rank, scale = _rank_and_scale(name, config, max_rank)
    deltas = _terms(name, tensors, rank, scale, dtype)
    if not deltas:
        raise LoRAError(f"LoRA adapter {name!r} at {path} holds no lora_A/lora_B weights")
    return LoRAAdapter(name, path, rank, deltas)


def _terms(
    name: str, tensors: dict[str, Tensor], rank: int, scale: float, dtype: torch.dtype
) -> dict[str, LoRADelta]:
    """Module path -> its term, from every lora_A/lora_B pair (and nothing else) of `tensors`."""
    b_keys = [key for key in tensors if key.endswith(".lora_B.weight")]
    unread = [key for key in tensors if not key.endswith((".lora_A.weight", ".lora_B.weight"))]
    unread += [key for key in b_keys if key.replace(".lora_B.", ".lora_A.") not in tensors]
    if unread:  # e.g. lora_embedding_A/B, DoRA magnitudes, a lora_B without its lora_A
        raise LoRAError(f"LoRA adapter {name!r}: weights not supported: {', '.join(unread[:3])}")
    deltas = {}
    for key, a in tensors.items():
        if not key.endswith(".lora_A.weight"):
            continue
        module = key.removeprefix(PEFT_PREFIX).removesuffix(".lora_A.weight")
        if module.rpartition(".")[2] not in TARGETS or not DECODER_LAYER.search(module):
            raise LoRAError(
                f"LoRA adapter {name!r} targets {module}: only a decoder layer's projections "
                f"({', '.join(sorted(TARGETS))}) are supported"
            )
        b = tensors.get(key.replace(".lora_A.", ".lora_B."))
        if b is None or a.ndim != 2 or b.ndim != 2 or a.shape[0] != rank or b.shape[1] != rank:
            raise LoRAError(f"LoRA adapter {name!r}: {module} has no rank-{rank} lora_B")
        deltas[module] = LoRADelta(a.to(dtype), (b * scale).to(dtype))
    return deltas


def _rank_and_scale(name: str, config: dict, max_rank: int) -> tuple[int, float]:
    """The adapter's rank and the factor s of its terms; raises LoRAError for a configuration
    whose terms would not be s (x A^T) B^T."""
    refused = {
        "use_dora": config.get("use_dora"),
        "bias": config.get("bias", "none") != "none",
        "modules_to_save": config.get("modules_to_save"),
        "rank_pattern": config.get("rank_pattern"),
        "alpha_pattern": config.get("alpha_pattern"),
        "fan_in_fan_out": config.get("fan_in_fan_out"),
    }
    if any(refused.values()) or config.get("peft_type", "LORA") != "LORA":
        unsupported = [key for key, value in refused.items() if value] or ["peft_type"]
        raise LoRAError(f"LoRA adapter {name!r}: not supported: {', '.join(unsupported)}")
    try:
        rank = int(config.get("r", 0))
        alpha = float(config.get("lora_alpha", rank))
    except (TypeError, ValueError, OverflowError):
        raise LoRAError(f"LoRA adapter {name!r}: r and lora_alpha must be numbers") from None
    if not 0 < rank <= max_rank:
        raise LoRAError(f"LoRA adapter {name!r} has rank {rank}; --max-lora-rank is {max_rank}")
    return rank, alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)
