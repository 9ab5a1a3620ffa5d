"""Device choice and KV cache sizing: how many blocks the memory budget buys for this model."""

from __future__ import annotations

import logging

import torch
from transformers import PretrainedConfig

from pagedserve.cache.cache_engine import TORCH_DTYPES
from pagedserve.cache.cache_spec import CacheSpec, group_layers
from pagedserve.configs import EngineConfig, parse_bytes

logger = logging.getLogger(__name__)

# Activations of one forward pass per batched token, as a multiple of the hidden size, reserved on
# CUDA before the KV cache takes the rest (a conservative stand-in for profiling a peak pass).
_ACTIVATION_BYTES_PER_TOKEN_PER_HIDDEN = 64


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was asked for, but torch sees no CUDA device")
    return torch.device(device)


def _dtype_name(dtype: torch.dtype) -> str:
    for name, torch_dtype in TORCH_DTYPES.items():
        if torch_dtype == dtype:
            return name
    raise ValueError(
        f"the model's weights are {dtype}; pass --kv-cache-dtype (one of "
        f"{', '.join(TORCH_DTYPES)}, fp8) for the KV cache"
    )


def make_cache_spec(
    hf_config: PretrainedConfig,
    model: torch.nn.Module,
    block_size: int,
    kv_cache_dtype: str = "auto",
) -> CacheSpec:
    """KV layout from the model's config, layers grouped by attention kind (full or sliding).

    `kv_cache_dtype` "auto" stores K/V in the weights' dtype; "fp8" is short for "fp8_e4m3"."""
    if kv_cache_dtype == "auto":
        kv_cache_dtype = _dtype_name(next(model.parameters()).dtype)
    elif kv_cache_dtype == "fp8":
        kv_cache_dtype = "fp8_e4m3"
    num_heads = hf_config.num_attention_heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads
    kv_lora_rank = getattr(hf_config, "kv_lora_rank", None)
    if kv_lora_rank is not None:  # MLA (DeepSeek-V2/V3): the latent plus the shared rotary key
        return CacheSpec(
            num_layers=hf_config.num_hidden_layers,
            num_kv_heads=1,
            head_dim=kv_lora_rank + hf_config.qk_rope_head_dim,
            dtype=kv_cache_dtype,
            block_size=block_size,
            latent=True,
        )
    return CacheSpec(
        num_layers=hf_config.num_hidden_layers,
        num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or num_heads,
        head_dim=head_dim,
        dtype=kv_cache_dtype,
        block_size=block_size,
        groups=group_layers(layer_sliding_windows(hf_config, model)),
    )


def layer_sliding_windows(hf_config: PretrainedConfig, model: torch.nn.Module) -> list[int | None]:
    """Each layer's sliding window (None: full attention), as its attention module passes it.

    Families with per-layer types (Gemma 2/3, Qwen2, GPT-OSS) keep it on the module as
    `sliding_window`; Mistral passes its config's `sliding_window` for every layer. The paged
    attention adapter checks at every call that the layer passes this very window.
    """
    windows: list[int | None] = [getattr(hf_config, "sliding_window", None)] * (
        hf_config.num_hidden_layers
    )
    for name, module in model.named_modules():
        layer_idx = getattr(module, "layer_idx", None)
        if (
            name.endswith("self_attn")
            and layer_idx is not None
            and hasattr(module, "sliding_window")
        ):
            windows[layer_idx] = module.sliding_window
    return [int(window) if window else None for window in windows]


def kv_cache_num_blocks(
    config: EngineConfig, spec: CacheSpec, device: torch.device, model: torch.nn.Module
) -> int:
    """`num_kv_blocks` if given; on CPU the `kv_cache_memory` budget; on CUDA what
    `gpu_memory_utilization` leaves after the weights and a forward pass's activations."""
    cache = config.cache
    if cache.num_kv_blocks is not None:
        return cache.num_kv_blocks
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        _, total = torch.cuda.mem_get_info(device)
        hidden_size = getattr(model.config, "hidden_size", 4096)
        activations = (
            config.scheduler.max_num_batched_tokens
            * hidden_size
            * _ACTIVATION_BYTES_PER_TOKEN_PER_HIDDEN
        )
        budget = (
            int(total * cache.gpu_memory_utilization)
            - torch.cuda.memory_allocated(device)
            - activations
        )
    else:
        budget = parse_bytes(cache.kv_cache_memory)
    num_blocks = spec.num_blocks_for_budget(max(budget, 0))
    if num_blocks < 1:
        raise ValueError(
            f"the KV cache budget ({budget} bytes) holds no block of {spec.bytes_per_block} bytes; "
            "raise --kv-cache-memory / --gpu-memory-utilization or set --num-kv-blocks"
        )
    return num_blocks
