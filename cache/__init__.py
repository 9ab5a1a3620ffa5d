"""The paged KV cache: block bookkeeping (pure Python) and the device tensors + attention kernels.

`block_pool`, `block_table`, `block_manager` never import torch; `cache_engine`, `cache_spec`
and `attention/` are the only tensor code here.
"""

from pagedserve.cache.block_manager import BlockManager, BlockManagerSnapshot
from pagedserve.cache.block_pool import Block, BlockPool, DoubleFreeError, OutOfBlocksError
from pagedserve.cache.block_table import BlockTable

__all__ = [
    "Block",
    "BlockManager",
    "BlockManagerSnapshot",
    "BlockPool",
    "BlockTable",
    "DoubleFreeError",
    "OutOfBlocksError",
]
