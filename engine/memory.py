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
# The CPU's "auto" budget: a quarter of the memory available once the weights are loaded (less the
# activations), so other processes and the allocator's slack keep the rest; at most 4 GiB (what
# vLLM-CPU takes by default) and never more than max_num_seqs requests at max_model_len can use.
CPU_AUTO_FRACTION = 0.25
CPU_AUTO_CAP_BYTES = 4 << 30
# Where /proc/meminfo cannot be read (not Linux): the old fixed default.
CPU_FALLBACK_BYTES = 512 << 20


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


def mem_available_bytes(meminfo: str = "/proc/meminfo") -> int | None:
    """The kernel's estimate of memory available to a new allocation (None if unknown)."""
    try:
        with open(meminfo) as lines:
            for line in lines:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # reported in kB
    except (OSError, ValueError, IndexError):
        pass
    return None


def auto_cpu_kv_budget(
    mem_available: int | None, activations: int, max_useful: int
) -> tuple[int, str]:
    """The default CPU budget and how it was chosen (for the start-up log).

    Args:
        mem_available: MemAvailable with the weights already loaded (None: unknown).
        activations: bytes a peak forward pass needs on top.
        max_useful: bytes of max_num_seqs requests at max_model_len (more is never used).
    """
    if mem_available is None:
        budget = min(CPU_FALLBACK_BYTES, max_useful)
        return budget, f"{_gib(budget)} (MemAvailable unknown: the fixed fallback)"
    share = int(max(mem_available - activations, 0) * CPU_AUTO_FRACTION)
    budget = min(share, CPU_AUTO_CAP_BYTES, max_useful)
    return budget, (
        f"{_gib(budget)} = min({CPU_AUTO_FRACTION:.0%} of {_gib(mem_available)} available less "
        f"{_gib(activations)} for activations, cap {_gib(CPU_AUTO_CAP_BYTES)}, "
        f"{_gib(max_useful)} that max_num_seqs requests at max_model_len can use)"
    )


def _gib(num_bytes: int) -> str:
    return f"{num_bytes / 2**30:.2f} GiB"


def _activation_bytes(config: EngineConfig, model: torch.nn.Module) -> int:
    hidden_size = getattr(model.config, "hidden_size", 4096)
    tokens = config.scheduler.max_num_batched_tokens
    return tokens * hidden_size * _ACTIVATION_BYTES_PER_TOKEN_PER_HIDDEN


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
    config: EngineConfig,
    spec: CacheSpec,
    device: torch.device,
    model: torch.nn.Module,
    max_model_len: int | None = None,
) -> int:
    """`num_kv_blocks` if given; on CPU the `kv_cache_memory` budget ("auto": sized from
    MemAvailable); on CUDA what `gpu_memory_utilization` leaves after the weights and a forward
    pass's activations."""
    cache = config.cache
    if cache.num_kv_blocks is not None:
        return cache.num_kv_blocks
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        _, total = torch.cuda.mem_get_info(device)
        budget = (
            int(total * cache.gpu_memory_utilization)
            - torch.cuda.memory_allocated(device)
            - _activation_bytes(config, model)
        )
    elif cache.kv_cache_memory.strip().lower() == "auto":
        max_len = max_model_len or config.model.max_model_len or 4096
        blocks_per_request = -(-max_len // spec.block_size)
        max_useful = config.scheduler.max_num_seqs * blocks_per_request * spec.bytes_per_block
        budget, reason = auto_cpu_kv_budget(
            mem_available_bytes(), _activation_bytes(config, model), max_useful
        )
        logger.info("KV cache budget (kv_cache_memory=auto): %s", reason)
    else:
        budget = parse_bytes(cache.kv_cache_memory)
    num_blocks = spec.num_blocks_for_budget(max(budget, 0))
    if num_blocks < 1:
        raise ValueError(
            f"the KV cache budget ({budget} bytes) holds no block of {spec.bytes_per_block} bytes; "
            "raise --kv-cache-memory / --gpu-memory-utilization or set --num-kv-blocks"
        )
    return num_blocks
