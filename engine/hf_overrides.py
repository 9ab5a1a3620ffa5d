"""vLLM's `--hf-overrides`: values set on the model's Hugging Face config before it loads, e.g. a
longer `max_position_embeddings` with a `rope_scaling` to match, or a sub-config's field (nested
objects merge into sub-configs, as vLLM's). The model classes then build from that config, and
the engine (context length, KV layout) reads the same config from the loaded model."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from transformers import AutoConfig, PretrainedConfig

from pagedserve.configs.engine import ModelConfig

logger = logging.getLogger(__name__)


def from_pretrained_kwargs(model_path: Path, config: ModelConfig) -> dict[str, Any]:
    """How `from_pretrained` reads the model: offline, remote code only if allowed, and with
    `config.hf_overrides` applied to its config (read here first) when there are any."""
    kwargs: dict[str, Any] = {
        "trust_remote_code": config.trust_remote_code,
        "local_files_only": True,
    }
    if config.hf_overrides:
        hf_config = AutoConfig.from_pretrained(model_path, **kwargs)
        apply_overrides(hf_config, config.hf_overrides)
        kwargs["config"] = hf_config
    return kwargs


# Names that would make the checkpoint another kind of model than its weights are, which vLLM's
# conversions (e.g. a causal LM served as a reranker) rely on and pagedserve does not do.
REFUSED = ("architectures", "classifier_from_token", "is_original_qwen3_reranker")
# transformers 5 keeps RoPE settings in `rope_parameters`; `rope_scaling` (vLLM's examples) names
# the same dict.
ALIASES = {"rope_scaling": "rope_parameters"}


def apply_overrides(
    hf_config: PretrainedConfig, overrides: dict[str, Any], prefix: str = ""
) -> None:
    """Set each override on `hf_config`. An object over a sub-config sets that sub-config's fields,
    and over a dict (RoPE's parameters) merges into it, so `{"rope_scaling": {"rope_type":
    "linear", "factor": 4.0}}` keeps the checkpoint's rope_theta. A name the config does not have
    is set too (a model's code may read it), with a warning, since it is as likely a typo."""
    for name, value in overrides.items():
        if name in REFUSED:
            raise ValueError(
                f"hf_overrides: {name} is not overridden here: pagedserve serves a checkpoint as "
                "the model its weights are"
            )
        name = ALIASES.get(name, name) if hasattr(hf_config, ALIASES.get(name, name)) else name
        current = getattr(hf_config, name, None)
        if isinstance(current, PretrainedConfig) and isinstance(value, dict):
            apply_overrides(current, value, f"{prefix}{name}.")
            continue
        if isinstance(current, dict) and isinstance(value, dict):
            value = _merged(current, value)
        elif not hasattr(hf_config, name):
            logger.warning("hf_overrides: the model's config has no %s%s; set anyway", prefix, name)
        setattr(hf_config, name, value)
        logger.info("hf_overrides: %s%s = %r", prefix, name, value)


def _merged(current: dict[str, Any], value: dict[str, Any]) -> dict[str, Any]:
    merged = dict(current)
    for key, item in value.items():
        old = merged.get(key)
        merged[key] = (
            _merged(old, item) if isinstance(old, dict) and isinstance(item, dict) else item
        )
    return merged
