"""`CacheEngine`: owns the device KV tensors and executes block copies (copy-on-write).

The only tensor code in `cache/` besides the attention backends. Block ids come from the
BlockManager; this class never decides which block holds what.
"""

from __future__ import annotations

import logging
import math

import torch

from pagedserve.cache import huge_pages
from pagedserve.cache.cache_spec import CacheSpec

logger = logging.getLogger(__name__)

# The one name <-> torch dtype table (configs and CacheSpec speak names; tensors need dtypes).
TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# A KV cache may also be stored in fp8 (e4m3, values saturated to +-448) whatever the model's dtype.
KV_CACHE_DTYPES = {**TORCH_DTYPES, "fp8_e4m3": torch.float8_e4m3fn}


class CacheEngine:
    """`key_caches[l]` and `value_caches[l]` for layer l, each of shape
    [num_blocks, block_size, num_kv_heads, head_dim].

    The spec's `layers_per_block` tensors are allocated once; layers of different groups that sit
    at the same index in their group share a tensor (a block belongs to one group at a time).
    """

    def __init__(self, spec: CacheSpec, num_blocks: int, device: torch.device | str) -> None:
        if num_blocks < 1:
            raise ValueError(
                f"the KV cache budget holds no block (one block needs {spec.bytes_per_block} bytes)"
            )
        self.spec = spec
        self.num_blocks = num_blocks
        self.device = torch.device(device)
        shape = (num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim)
        dtype = KV_CACHE_DTYPES[spec.dtype]
        tensor_bytes = math.prod(shape) * dtype.itemsize
        self.on_huge_pages = self.device.type == "cpu" and huge_pages.uses_huge_pages(tensor_bytes)
        self._key_tensors = [self._zeros(shape, dtype) for _ in range(spec.layers_per_block)]
        # A latent cache has no V: the value views alias the latent, and are never written.
        self._value_tensors = (
            [] if spec.latent else [self._zeros(shape, dtype) for _ in range(spec.layers_per_block)]
        )
        placement = spec.tensor_of_layer()
        self.key_caches = [self._key_tensors[index] for _, index in placement]
        self.value_caches = [
            (self._key_tensors if spec.latent else self._value_tensors)[index]
            for _, index in placement
        ]
        self.group_of_layer = [group for group, _ in placement]

    def _zeros(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """zeros, not empty: padding slots a kernel may touch must never hold NaNs. On the CPU on
        huge pages (cache/huge_pages.py): a step's reads through the block tables then stay
        within a few TLB entries."""
        if self.on_huge_pages:
            return huge_pages.zeros(shape, dtype)
        return torch.zeros(shape, dtype=dtype, device=self.device)

    @property
    def num_bytes(self) -> int:
        return self.num_blocks * self.spec.bytes_per_block

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy block `src` to block `dst` in every layer tensor (copy-on-write before a shared
        block is written)."""
        if not copies:
            return
        src = torch.tensor([s for s, _ in copies], dtype=torch.long, device=self.device)
        dst = torch.tensor([d for _, d in copies], dtype=torch.long, device=self.device)
        for cache in (*self._key_tensors, *self._value_tensors):
            # As bytes: a block copy is dtype-blind, and CPU index_copy_ has no fp8 kernel.
            as_bytes = cache.view(torch.uint8)
            as_bytes.index_copy_(0, dst, as_bytes.index_select(0, src))

    def describe(self, max_model_len: int) -> str:
        num_tokens = self.num_blocks * self.spec.block_size
        blocks_per_request = self.spec.num_blocks_per_request(max_model_len)
        return (
            f"KV cache: {self.num_blocks} blocks x {self.spec.block_size} tokens = "
            f"{num_tokens} tokens, {self.num_bytes / 2**20:.1f} MiB ({self.spec.dtype}, "
            f"{self.spec.bytes_per_block} B/block) on {self.device}"
            f"{' (2 MiB pages)' if self.on_huge_pages else ''}; layer groups: "
            f"{self.spec.describe_groups()}; max concurrency at max_model_len "
            f"{max_model_len}: {self.num_blocks / blocks_per_request:.1f} requests"
        )
