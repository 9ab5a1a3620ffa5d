"""`Speculator`: which running decodes get n-gram drafts this step, and the draft counters.

Drafts are an optimisation and must never cost anyone else their place: a request drafts only
when speculation is on, the batch is small enough (`disable_by_batch_size`), the token budget
leaves one token for every decode not yet scheduled, and the blocks its drafts need leave one
free block for each of them too (so drafts never trigger a preemption). A draft never runs past
`max_tokens` or the model's context: every accepted draft plus the bonus token must be allowed.
"""

from __future__ import annotations

from pagedserve.cache.block_manager import BlockManager
from pagedserve.configs import SpeculativeConfig
from pagedserve.scheduler.ngram import NgramProposer
from pagedserve.scheduler.output import ModelRunnerOutput, ScheduledRequest
from pagedserve.scheduler.request import Request, RequestStatus


class Speculator:
    def __init__(
        self, config: SpeculativeConfig | None, block_manager: BlockManager, max_model_len: int
    ) -> None:
        """`config` None: speculation is off; this speculator never drafts (nor costs a thing)."""
        self.config = config
        self.block_manager = block_manager
        self.max_model_len = max_model_len
        self.proposer = (
            NgramProposer(
                config.num_speculative_tokens,
                config.prompt_lookup_min,
                config.prompt_lookup_max,
                config.min_acceptance_rate,
            )
            if config is not None
            else None
        )
        # vLLM's spec_decode counters: verified steps with drafts, drafted and accepted tokens,
        # and acceptances by draft position (position i accepted => positions < i were too)
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.num_accepted_per_position = [0] * (config.num_speculative_tokens if config else 0)

    @property
    def enabled(self) -> bool:
        return self.proposer is not None

    def reserve_drafts(
        self, request: Request, num_remaining: int, token_budget: int, num_unscheduled: int
    ) -> tuple[int, ...]:
        """`drafts_for` a decode (`num_remaining` 1), with slots for the decode and its drafts
        reserved; else no drafts (and nothing reserved)."""
        if self.proposer is None or num_remaining != 1:
            return ()
        # Every running sequence, and only those, holds a block table.
        num_running = len(self.block_manager.tables)
        drafts = self.drafts_for(request, num_running, token_budget, num_unscheduled)
        if drafts and self.block_manager.allocate_slots(
            request.sequence_id, 1 + len(drafts), request.num_computed_tokens
        ):
            return tuple(drafts)
        return ()

    def apply(
        self, request: Request, scheduled: ScheduledRequest, result: ModelRunnerOutput
    ) -> tuple[list[int], RequestStatus | None]:
        """One step's result for `request` (speculative or not): the tokens it appended (the
        accepted drafts, then the sampled token, up to the first stop) and its new status.

        Computed: the real tokens run, plus each draft that became a token (each appended token
        but the last sat at a draft position). Rejected positions hold dead K/V: not computed,
        never cached, and the blocks only they needed go back to the pool at once.
        """
        new_token_ids: list[int] = []
        status = None
        if scheduled.needs_sample:
            run = self.accepted_drafts(scheduled, result)
            run.append(result.sampled_token_ids[request.sequence_id])
            new_token_ids, status = request.append_run(run, self.max_model_len)
        num_real = scheduled.num_new_tokens - len(scheduled.draft_token_ids)
        request.advance(num_real + max(len(new_token_ids) - 1, 0))
        self.block_manager.cache_computed_blocks(
            request.sequence_id,
            request.all_token_ids,
            request.num_computed_tokens,
            request.cache_salt,
        )
        if scheduled.needs_sample:
            self.block_manager.trim(request.sequence_id, request.num_tokens)
        return new_token_ids, status

    def accepted_drafts(self, scheduled: ScheduledRequest, result: ModelRunnerOutput) -> list[int]:
        """The drafts the sampler accepted for `scheduled` (checked to be a prefix), recorded."""
        sequence_id, drafts = scheduled.sequence_id, scheduled.draft_token_ids
        accepted = result.accepted_draft_ids.get(sequence_id, [])
        if not drafts and not accepted:
            return []
        if list(drafts[: len(accepted)]) != accepted:
            raise RuntimeError(f"{sequence_id}: accepted drafts {accepted} are not in {drafts}")
        self.record(sequence_id, len(drafts), len(accepted))
        return list(accepted)

    def drafts_for(
        self, request: Request, num_running: int, token_budget: int, num_unscheduled: int
    ) -> list[int]:
        """Drafts for a decode of `request` (none when any rule above says no).

        token_budget: what this step has left, this request's own token included;
        num_unscheduled: running requests after this one that still need a token and a block.
        """
        if self.proposer is None or num_running > self.config.disable_by_batch_size:
            return []
        params = request.sampling_params
        if params.structured_outputs is not None:  # its grammar masks only its first row
            return []
        max_drafts = min(
            token_budget - 1 - num_unscheduled,
            params.max_tokens - request.num_output_tokens - 1,
            self.max_model_len - request.num_tokens - 1,
        )
        if max_drafts <= 0:
            return []
        drafts = self.proposer.propose(request.sequence_id, request.all_token_ids, max_drafts)
        while drafts and not self._blocks_spare(request, len(drafts), num_unscheduled):
            drafts.pop()
        return drafts

    def _blocks_spare(self, request: Request, num_drafts: int, num_unscheduled: int) -> bool:
        table = self.block_manager.tables.get(request.sequence_id)
        num_held = len(table) if table is not None else 0
        size = self.block_manager.block_size
        needed = -(-(request.num_tokens + num_drafts) // size) - max(num_held, 0)
        return needed <= 0 or needed + num_unscheduled <= self.block_manager.num_free_blocks

    def record(self, sequence_id: str, num_drafted: int, num_accepted: int) -> None:
        if num_drafted == 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_drafted
        self.num_accepted_tokens += num_accepted
        for position in range(num_accepted):
            self.num_accepted_per_position[position] += 1
        self.proposer.record(sequence_id, num_drafted, num_accepted)

    def drop(self, sequence_id: str) -> None:
        if self.proposer is not None:
            self.proposer.drop(sequence_id)
