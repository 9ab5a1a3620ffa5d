"""`CacheSpec`: what one KV block costs for a given model (layers, heads, head dim, dtype)."""

from __future__ import annotations

from dataclasses import dataclass

# fp8_e4m3: torch.float8_e4m3fn, one byte a value (a storage format: attention computes in float32).
DTYPE_SIZES = {"float32": 4, "bfloat16": 2, "float16": 2, "fp8_e4m3": 1}


@dataclass(frozen=True, slots=True)
class CacheSpec:
    """Full-attention KV layout: per layer, K and V of
    [num_blocks, block_size, num_kv_heads, head_dim]."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str  # storage dtype: "float32" | "bfloat16" | "float16" | "fp8_e4m3"
    block_size: int

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_SIZES:
            raise ValueError(f"unsupported KV cache dtype {self.dtype!r}")
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    @property
    def bytes_per_token(self) -> int:
        # 2: one K and one V vector per kv head per layer
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * DTYPE_SIZES[self.dtype]

    @property
    def bytes_per_block(self) -> int:
        return self.bytes_per_token * self.block_size

    def num_blocks_for_budget(self, num_bytes: int) -> int:
        return num_bytes // self.bytes_per_block
