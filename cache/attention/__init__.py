"""Paged attention backends: write new K/V into the paged cache and attend through block tables.

Backends: ``cpu`` (C++/OpenMP kernel), ``triton`` (CUDA, or CPU under ``TRITON_INTERPRET=1``) and
``torch`` (the readable reference that defines correct). Heavy imports (the kernel build, triton)
happen only when a backend is constructed.
"""

from __future__ import annotations

import logging
import os
from typing import Protocol

import torch
from torch import Tensor

from pagedserve.cache.attention.metadata import AttentionMetadata
from pagedserve.cache.attention.torch_ref import TorchPagedAttention

logger = logging.getLogger(__name__)

BACKEND_NAMES = ("auto", "cpu", "triton", "torch")

__all__ = [
    "BACKEND_NAMES",
    "AttentionBackend",
    "AttentionMetadata",
    "TorchPagedAttention",
    "get_attention_backend",
]


class AttentionBackend(Protocol):
    """Reads and writes one layer's paged KV cache.

    Each cache is ``[num_blocks, block_size, num_kv_heads, head_dim]``.

    The cache's dtype may differ from the model's (``--kv-cache-dtype``): ``store_kv`` converts
    new K/V to it (fp8 saturating) and ``forward`` returns the query's dtype.
    """

    name: str

    def store_kv(
        self,
        key: Tensor,
        value: Tensor,
        key_cache: Tensor,
        value_cache: Tensor,
        slot_mapping: Tensor,
    ) -> None:
        """Write key/value ``[num_tokens, num_kv_heads, head_dim]`` into their slots, in place."""
        ...

    def forward(
        self,
        query: Tensor,
        key_cache: Tensor,
        value_cache: Tensor,
        meta: AttentionMetadata,
        scale: float,
        *,
        sliding_window: int | None = None,
        softcap: float | None = None,
        sinks: Tensor | None = None,
    ) -> Tensor:
        """Causal attention of query ``[num_tokens, num_heads, head_dim]``; returns the same shape.

        The keyword options are the layer's own (a sliding window, logit soft-capping, one sink
        logit per head); `TorchPagedAttention.forward` defines them.
        """
        ...


def _make_backend(name: str, device: torch.device) -> AttentionBackend:
    if name == "torch":
        return TorchPagedAttention()
    if name == "cpu":
        if device.type != "cpu":
            raise ValueError(f"the cpu attention backend cannot serve device {device}")
        from pagedserve.cache.attention.cpu import CpuPagedAttention

        return CpuPagedAttention()
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("the triton attention backend needs CUDA, or TRITON_INTERPRET=1 on CPU")
    from pagedserve.cache.attention.triton_backend import TritonPagedAttention

    return TritonPagedAttention()


def get_attention_backend(name: str, device: torch.device) -> AttentionBackend:
    """Pick the attention backend for ``device``.

    Args:
        name: one of ``auto`` (cpu on CPU, triton on CUDA), ``cpu``, ``triton``, ``torch``.
        device: where the KV cache lives.

    Raises:
        ValueError: unknown name, or a backend that cannot serve this device type.
        RuntimeError: the requested backend is unavailable (no triton, kernel build failed).
            Only ``auto`` falls back to the torch reference instead, with a warning.
    """
    if name not in BACKEND_NAMES:
        raise ValueError(f"unknown attention backend {name!r}; expected one of {BACKEND_NAMES}")
    device = torch.device(device)
    if name != "auto":
        return _make_backend(name, device)
    preferred = "triton" if device.type == "cuda" else "cpu"
    try:
        return _make_backend(preferred, device)
    except (ImportError, RuntimeError, ValueError) as error:
        logger.warning(
            "attention backend %r unavailable on %s (%s); falling back to the slow torch reference",
            preferred,
            device,
            error,
        )
        return TorchPagedAttention()
