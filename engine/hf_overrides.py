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


def apply_overrides(
    hf_config: PretrainedConfig, overrides: dict[str, Any], prefix: str = ""
) -> None:
    """Set each override on `hf_config`; an object over a sub-config sets that sub-config's fields.
    A name the config does not have is set too (a model's code may read it), with a warning, since
    it is as likely a typo."""
    for name, value in overrides.items():
        current = getattr(hf_config, name, None)
        if isinstance(current, PretrainedConfig) and isinstance(value, dict):
            apply_overrides(current, value, f"{prefix}{name}.")
            continue
        if not hasattr(hf_config, name):
            logger.warning("hf_overrides: the model's config has no %s%s; set anyway", prefix, name)
        setattr(hf_config, name, value)
        logger.info("hf_overrides: %s%s = %r", prefix, name, value)
