"""`CacheSpec`: what one KV block costs for a given model, per group of layers with equal layout.

Layers are grouped by attention kind (full attention, or a sliding window of a given size). Every
group has its own block table per request, and all groups draw blocks from one pool: a block of
group g holds K/V of g's layers only. To make a block cost the same whatever group owns it, every
group has at most `layers_per_block` layers (vLLM's hybrid allocator does the same): a kind with
more layers is split into several groups, and the `layers_per_block` layer tensors are shared,
layer i of each group living in tensor i. A model with one kind is one group, exactly as before.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

# fp8_e4m3: torch.float8_e4m3fn, one byte a value (a storage format: attention computes in float32).
DTYPE_SIZES = {"float32": 4, "bfloat16": 2, "float16": 2, "fp8_e4m3": 1}


@dataclass(frozen=True, slots=True)
class LayerGroup:
    """Layers that share one block table: all full attention, or all one sliding window."""

    layer_ids: tuple[int, ...]
    sliding_window: int | None = None  # keys in (p - window, p] for a query at position p


def group_layers(windows: Sequence[int | None]) -> tuple[LayerGroup, ...]:
    """Groups for layers whose sliding windows (None: full attention) are `windows[layer]`.

    Full-attention groups come first; each kind is cut into groups of the smallest kind's size.
    """
    kinds: dict[int | None, list[int]] = {}
    for layer, window in enumerate(windows):
        kinds.setdefault(window, []).append(layer)
    size = min(len(layers) for layers in kinds.values())
    order = sorted(kinds, key=lambda window: (window is not None, window or 0))
    return tuple(
        LayerGroup(tuple(kinds[window][start : start + size]), window)
        for window in order
        for start in range(0, len(kinds[window]), size)
    )


@dataclass(frozen=True, slots=True)
class CacheSpec:
    """Per layer tensor, K and V of [num_blocks, block_size, num_kv_heads, head_dim] (see the
    module docstring).

    `groups` defaults to one full-attention group of all `num_layers` layers.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str  # storage dtype: "float32" | "bfloat16" | "float16" | "fp8_e4m3"
    block_size: int
    groups: tuple[LayerGroup, ...] = field(default=())
    # Multi-head latent attention (DeepSeek-V2/V3): one vector per token per layer, the latent
    # kv_lora_rank + qk_rope_head_dim wide (num_kv_heads 1, head_dim that sum), and no V.
    latent: bool = False

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_SIZES:
            raise ValueError(f"unsupported KV cache dtype {self.dtype!r}")
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.groups:
            object.__setattr__(self, "groups", (LayerGroup(tuple(range(self.num_layers))),))
        if self.latent and self.num_kv_heads != 1:
            raise ValueError("a latent cache stores one vector per token: num_kv_heads must be 1")
        layers = sorted(layer for group in self.groups for layer in group.layer_ids)
        if layers != list(range(self.num_layers)):
            raise ValueError(f"layer groups must cover layers 0..{self.num_layers - 1} once each")

    @property
    def layers_per_block(self) -> int:
        """Layer tensors: the largest group's size (a block holds one group's layers)."""
        return max(len(group.layer_ids) for group in self.groups)

    @property
    def sliding_windows(self) -> tuple[int | None, ...]:
        """Each group's window, in group order (what the BlockManager needs to know)."""
        return tuple(group.sliding_window for group in self.groups)

    def tensor_of_layer(self) -> list[tuple[int, int]]:
        """Per layer: (its group, the index of the shared layer tensor that holds it)."""
        placement = [(0, 0)] * self.num_layers
        for group_idx, group in enumerate(self.groups):
            for tensor_idx, layer in enumerate(group.layer_ids):
                placement[layer] = (group_idx, tensor_idx)
        return placement

    @property
    def bytes_per_token(self) -> int:
        """Of one group's block, per token slot: K and V (or the latent) for its layers."""
        vectors = 1 if self.latent else 2
        per_layer = vectors * self.num_kv_heads * self.head_dim * DTYPE_SIZES[self.dtype]
        return self.layers_per_block * per_layer

    @property
    def bytes_per_block(self) -> int:
        return self.bytes_per_token * self.block_size

    def num_blocks_for_budget(self, num_bytes: int) -> int:
        return num_bytes // self.bytes_per_block

    def num_blocks_per_request(self, num_tokens: int, max_step_tokens: int = 1) -> int:
        """Blocks one request of `num_tokens` holds at most, over all groups, when each step
        adds at most `max_step_tokens` (a sliding group keeps only its window's blocks)."""
        full = -(-num_tokens // self.block_size)
        total = 0
        for window in self.sliding_windows:
            if window is None:
                total += full
            else:  # see BlockManager: blocks overlapping [computed - window, computed + step)
                total += min(full, -(-(window + max_step_tokens) // self.block_size) + 1)
        return total

    def describe_groups(self) -> str:
        """One phrase per group for the start-up log, e.g. '2 full + 2 sliding(512) layers'."""
        kinds = [
            "full" if group.sliding_window is None else f"sliding({group.sliding_window})"
            for group in self.groups
        ]
        return " + ".join(
            f"{len(group.layer_ids)} {kind}" for group, kind in zip(self.groups, kinds, strict=True)
        )
