"""The step contract between scheduler and engine: what runs this step, and what came back."""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedserve.cache.block_table import BlockTable
from pagedserve.scheduler.request import Request, RequestStatus


@dataclass(frozen=True, slots=True)
class ScheduledRequest:
    """One request's share of a step: run `token_ids` at positions start_position + 0.."""

    sequence_id: str
    token_ids: list[int]  # prefill chunk, or the last sampled token for a decode
    start_position: int  # == num_computed_tokens before this step
    # Per layer group (one for most models): KV slot of each new token, and the full block table
    # after this step's allocation (a sliding group's released entries are NULL_BLOCK, -1).
    slot_mappings: tuple[list[int], ...]
    block_tables: tuple[list[int], ...]
    needs_sample: bool  # False for a non-final prefill chunk (or when max_tokens is 0)
    # Speculative drafts: the tail of `token_ids` (after the last real token), to be verified
    draft_token_ids: tuple[int, ...] = ()
    # Offsets into token_ids whose logits score the next prompt token (prompt logprobs): row i
    # yields the logprob of prompt token start_position + i + 1.
    prompt_logprob_rows: range = range(0)
    lora: int = 0  # the LoRA adapter load its tokens run (engine/lora.py); 0: the base model

    @property
    def slot_mapping(self) -> list[int]:
        """Group 0's slot mapping: the only group of a model without sliding-window layers."""
        return self.slot_mappings[0]

    @property
    def block_ids(self) -> list[int]:
        """Group 0's block table (see `slot_mapping`)."""
        return self.block_tables[0]

    @property
    def num_new_tokens(self) -> int:
        return len(self.token_ids)

    @classmethod
    def plan(
        cls, request: Request, tables: list[BlockTable], num_new_tokens: int, drafts: tuple = ()
    ) -> ScheduledRequest:
        """`request`'s next `num_new_tokens` (and `drafts`) over its tables, one per layer group,
        grown for them already."""
        start, end = request.num_computed_tokens, request.num_computed_tokens + num_new_tokens
        return cls(
            sequence_id=request.sequence_id,
            token_ids=request.all_token_ids[start:end] + list(drafts),
            start_position=start,
            slot_mappings=tuple(table.slot_mapping(start, end + len(drafts)) for table in tables),
            block_tables=tuple(table.block_ids for table in tables),
            needs_sample=end == request.num_tokens and request.sampling_params.max_tokens > 0,
            draft_token_ids=drafts,
            prompt_logprob_rows=request.prompt_logprob_rows(start, end),
            lora=request.lora,
        )

    @property
    def seq_len(self) -> int:
        """Context length once this step's tokens are in the cache."""
        return self.start_position + len(self.token_ids)


@dataclass(frozen=True, slots=True)
class SchedulerOutput:
    requests: list[ScheduledRequest]
    num_batched_tokens: int
    block_copies: list[tuple[int, int]]  # copy-on-write (src, dst), run before the forward pass

    @property
    def is_empty(self) -> bool:
        return not self.requests


@dataclass(frozen=True, slots=True)
class ModelRunnerOutput:
    sampled_token_ids: dict[str, int]  # only for requests with needs_sample
    # Speculation: the drafts each request accepted (a prefix of its draft_token_ids), which
    # precede its sampled token (the bonus, or the resample at the first rejection)
    accepted_draft_ids: dict[str, list[int]] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class RequestUpdate:
    """What one step did to one request: the token it gained and whether it finished."""

    sequence_id: str
    new_token_ids: list[int]
    status: RequestStatus
