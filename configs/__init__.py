"""Typed, validated configuration: engine settings, presets and per-request sampling parameters.

Leaf package: imports nothing else of the project, no torch, no transformers.
"""

from pagedserve.configs.engine import (
    CacheConfig,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
    ServerConfig,
    parse_bytes,
)
from pagedserve.configs.loader import load_engine_config
from pagedserve.configs.sampling import (
    SamplingParams,
    SamplingParamsError,
    StructuredOutputs,
    ThinkBlock,
)
from pagedserve.configs.speculative import SpeculativeConfig

__all__ = [
    "CacheConfig",
    "EngineConfig",
    "ModelConfig",
    "SamplingParams",
    "SamplingParamsError",
    "SchedulerConfig",
    "ServerConfig",
    "StructuredOutputs",
    "SpeculativeConfig",
    "ThinkBlock",
    "load_engine_config",
    "parse_bytes",
]
