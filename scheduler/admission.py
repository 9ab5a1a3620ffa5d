"""Admission: whether a request of a given size could ever be served by this model and pool.

Checked once, by the engine, before anything is queued; the scheduler then trusts it.
"""

from __future__ import annotations

from pagedserve.cache.block_manager import BlockManager


class AdmissionError(ValueError):
    """A request that can never be served (too long for the model or the pool)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def check_admissible(
    num_prompt_tokens: int, max_tokens: int, max_model_len: int, block_manager: BlockManager
) -> None:
    """Raise AdmissionError unless a request of this size could ever complete (a sliding-window
    group holds only its window's blocks plus one step's: see the BlockManager).

    Raises:
        AdmissionError: with `param` "prompt" (empty, or no room for one output token) or
            "max_tokens" (more KV slots than the whole pool holds).
    """
    if num_prompt_tokens < 1:
        raise AdmissionError("the prompt is empty", "prompt")
    if num_prompt_tokens >= max_model_len:
        raise AdmissionError(
            f"the prompt has {num_prompt_tokens} tokens, but this model's context is "
            f"{max_model_len} tokens (prompt + at least 1 output token must fit)",
            "prompt",
        )
    # The last sampled token is returned, never fed back: it needs no slot (max_tokens 0: none).
    total = min(num_prompt_tokens + max(max_tokens - 1, 0), max_model_len)
    num_blocks = block_manager.num_blocks_needed_at_most(total)
    if num_blocks > block_manager.pool.num_blocks:
        raise AdmissionError(
            f"the prompt ({num_prompt_tokens} tokens) plus max_tokens ({max_tokens}) needs "
            f"{num_blocks} KV blocks of {block_manager.block_size} slots over all layer groups, "
            f"but the whole cache holds {block_manager.pool.num_blocks}",
            "max_tokens",
        )
