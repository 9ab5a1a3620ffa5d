"""`PromptLogprobs`: each sequence's prompt logprobs, gathered chunk by chunk as its prompt runs.

Keeps only what is sent (the prompt token's logprob, rank and top alternatives per position),
never a logits row across steps. The scheduler decides which rows a step scores and counts them
(`Request.num_prompt_logprob_tokens`), so a recompute after preemption adds no row twice.
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import Tensor

from pagedserve.engine.outputs import TokenLogprob
from pagedserve.engine.sampler import score_prompt_rows
from pagedserve.scheduler import Request, SchedulerOutput

PromptEntries = tuple[TokenLogprob | None, ...]


class PromptLogprobs:
    """sequence id -> its prompt's entries so far (the first token's None included)."""

    def __init__(self) -> None:
        self._entries: dict[str, list[TokenLogprob | None]] = {}

    def add_step(
        self, plan: SchedulerOutput, logits: Tensor, requests: Mapping[str, Request]
    ) -> None:
        """Score this step's prompt rows. Call before the scheduler's update advances the counts.

        Args:
            logits: [num_prompt_logprob_rows, vocab_size], the plan's `prompt_logprob_rows` in
                plan order (as the model runner returns them after the sampled rows).
        Raises:
            RuntimeError: a row would be lost or sent twice (the counts disagree).
        """
        targets: list[int] = []
        num_top: list[int] = []
        owners: list[str] = []
        for scheduled in plan.requests:
            request = requests[scheduled.sequence_id]
            if not request.has_prompt_logprobs_left:
                continue
            entries = self._entries.setdefault(request.sequence_id, [])
            if len(entries) != request.num_prompt_logprob_tokens:
                raise RuntimeError(
                    f"sequence {request.sequence_id}: {len(entries)} prompt logprobs kept, "
                    f"{request.num_prompt_logprob_tokens} counted"
                )
            if not entries:
                entries.append(None)  # the first prompt token has no context to be scored in
            for row in scheduled.prompt_logprob_rows:
                targets.append(request.prompt_token_ids[scheduled.start_position + row + 1])
                num_top.append(request.sampling_params.prompt_logprobs or 0)
                owners.append(request.sequence_id)
        if len(targets) != logits.shape[0]:
            raise RuntimeError(f"{logits.shape[0]} prompt logits rows for {len(targets)} targets")
        for owner, entry in zip(owners, score_prompt_rows(logits, targets, num_top), strict=True):
            self._entries[owner].append(entry)

    def get(self, sequence_id: str, num_prompt_tokens: int) -> PromptEntries | None:
        """The sequence's entries once its whole prompt is scored, else None."""
        entries = self._entries.get(sequence_id)
        if entries is None or len(entries) != num_prompt_tokens:
            return None
        return tuple(entries)

    def discard(self, sequence_id: str) -> None:
        self._entries.pop(sequence_id, None)
