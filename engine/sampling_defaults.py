"""The sampling defaults a model ships (its generation_config.json), for the fields a request
leaves out: what vLLM applies under its default `--generation-config auto`. Qwen3, for one, ships
temperature 0.6, top_p 0.95 and top_k 20; without these, the same request would sample at 1.0
here and at 0.6 on vLLM."""

from __future__ import annotations

import logging
from typing import Any

from pagedserve.configs import SamplingParams, SamplingParamsError
from pagedserve.configs.engine import (
    GENERATION_CONFIG_FIELDS,
    ModelConfig,
    as_sampling_value,
    sampling_name,
)

logger = logging.getLogger(__name__)


def model_sampling_defaults(model: Any, config: ModelConfig) -> dict[str, float | int]:
    """The model's sampling defaults (only those its generation config sets, as transformers'
    `to_diff_dict` tells them from its own defaults; none under `--generation-config vllm`), with
    `--override-generation-config` over them (checked with the config); SamplingParams' names
    (a generation config's max_new_tokens is the default max_tokens, as in vLLM)."""
    overrides = config.override_generation_config or {}
    merged = {**_from_the_model(model, config), **overrides}
    return {sampling_name(name): value for name, value in merged.items()}


def _from_the_model(model: Any, config: ModelConfig) -> dict[str, float | int]:
    generation_config = getattr(model, "generation_config", None)
    if config.generation_config == "vllm" or generation_config is None:
        return {}
    written = generation_config.to_diff_dict()
    defaults = {}
    for name in GENERATION_CONFIG_FIELDS:
        value = written.get(name)
        if value is None:
            continue
        value = as_sampling_value(name, value)
        try:  # one out of our range would fail every request that leaves the field out
            SamplingParams(**{sampling_name(name): value})
        except SamplingParamsError as error:
            logger.warning("ignoring the model's generation_config %s=%r: %s", name, value, error)
            continue
        defaults[name] = value
    return defaults
