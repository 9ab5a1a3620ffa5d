"""`Scheduler`: continuous batching over a paged KV cache.

Each step, in this order, and why:

1. Fork ready children (n > 1): a choice waiting on its parent's prompt takes a shared copy of
   the parent's block table once the prompt is computed; copy-on-write splits them on first write.
2. Running requests first, oldest (or most important) first: each gets its remaining tokens
   (1 for a decode, the next chunk for a prompt) within the step's token budget, and its block
   table grows by exactly the blocks those tokens need. Running work goes first so that decodes
   never stall behind a long prompt; a long prompt is split into chunks (chunked prefill, each at
   most `long_prefill_token_threshold` while others share the step), and a chunk leaves one token
   of the budget for every decode behind it in the running order.
3. When a table cannot grow (the pool is dry), the lowest-priority, latest-arrived running
   request not yet scheduled is preempted (recompute: blocks released, progress reset to 0,
   generated tokens kept) and the allocation retried; if that victim is the failing request, it
   waits. No length advances for a failed reservation. The oldest request can always take blocks
   from younger ones and every admitted request fits the pool alone, so nothing starves.
4. Waiting requests are admitted (FCFS, or by priority) while budget, `max_num_seqs` and blocks
   last (without chunked prefill: their whole prompt), reusing the longest cached prefix; none is
   admitted in a step that preempted, so a victim is not immediately replaced by a newcomer.

`update_from_output` then advances `num_computed_tokens` by what was computed (accepted drafts
included), appends sampled tokens, checks token-level stops and frees finished requests' blocks.
"""

from __future__ import annotations

import bisect
import time
from collections import deque

from pagedserve.cache.block_manager import BlockManager
from pagedserve.configs import SchedulerConfig
from pagedserve.scheduler.admission import check_admissible
from pagedserve.scheduler.output import (
    ModelRunnerOutput,
    RequestUpdate,
    ScheduledRequest,
    SchedulerOutput,
)
from pagedserve.scheduler.request import Request, RequestStatus
from pagedserve.scheduler.speculation import Speculator


class Scheduler:
    """Decides, every step, which requests run and how many tokens each gets."""

    def __init__(
        self, config: SchedulerConfig, block_manager: BlockManager, max_model_len: int
    ) -> None:
        self.config = config
        self.block_manager = block_manager
        self.max_model_len = max_model_len
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # kept sorted by _order_key: most important first
        self.fork_waiting: list[Request] = []  # n > 1 children waiting for their parent's prompt
        self.num_preemptions = 0
        # Prompt tokens sought / hit in the prefix cache (once a request), and computed (each time)
        self.prefix_cache_queries = self.prefix_cache_hits = self.num_prefilled_tokens = 0
        self.speculator = Speculator(config.speculative_config, block_manager, max_model_len)

    # ---- admission and removal -------------------------------------------------------------

    def check_admissible(self, num_prompt_tokens: int, max_tokens: int) -> None:
        """Raise AdmissionError unless a request of this size could ever complete."""
        check_admissible(num_prompt_tokens, max_tokens, self.max_model_len, self.block_manager)

    def add_request(self, request: Request) -> None:
        """Queue a sequence. The caller has checked it (`check_admissible`, a fresh id): the
        scheduler does not check again."""
        self.requests[request.sequence_id] = request
        if request.parent_sequence_id is not None:
            self.fork_waiting.append(request)
        elif self.config.scheduling_policy == "priority":
            keys = [self._order_key(r) for r in self.waiting]
            self.waiting.insert(bisect.bisect_right(keys, self._order_key(request)), request)
        else:
            self.waiting.append(request)

    def _order_key(self, request: Request) -> tuple[int, float]:
        """Serve order (smaller first); the largest running key is preempted first. FCFS ignores
        `priority`: the oldest request always goes first, which is what makes the no-starvation
        argument hold. The priority policy serves lower values first, then FCFS."""
        if self.config.scheduling_policy == "priority":
            return (request.priority, request.arrival_time)
        return (0, request.arrival_time)

    def finish_request(self, sequence_id: str, status: RequestStatus) -> Request | None:
        """End a request from any state (abort, stop string, error); frees its blocks at once."""
        request = self.requests.pop(sequence_id, None)
        if request is None:
            return None
        for queue in (self.running, self.fork_waiting, self.waiting):
            if request in queue:
                queue.remove(request)
        request.status = status
        self.block_manager.free(sequence_id)
        self.speculator.drop(sequence_id)
        return request

    def stop_on_string(self, request: Request, num_dropped: int = 0) -> None:
        """The engine found a stop string in `request`'s text: it finishes as stopped (blocks
        freed at once), even where this step's token already finished it by length."""
        request.drop_last_output_tokens(num_dropped)  # a speculative run's, after the stop
        if not request.is_finished:
            self.finish_request(request.sequence_id, RequestStatus.FINISHED_STOPPED)
        elif request.status == RequestStatus.FINISHED_LENGTH or num_dropped:
            request.status = RequestStatus.FINISHED_STOPPED

    def abort_request(self, sequence_id: str) -> Request | None:
        return self.finish_request(sequence_id, RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:  # queued, preempted, or an n > 1 choice waiting for its parent
        return len(self.waiting) + len(self.fork_waiting)

    # ---- one step --------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        scheduled: list[ScheduledRequest] = []
        num_preemptions_before = self.num_preemptions
        self._fork_ready_children()
        token_budget = self._schedule_running(self.config.max_num_batched_tokens, scheduled)
        if self.num_preemptions == num_preemptions_before:  # no admission in a step that preempted
            token_budget = self._schedule_waiting(token_budget, scheduled)
        return SchedulerOutput(
            requests=scheduled,
            num_batched_tokens=self.config.max_num_batched_tokens - token_budget,
            block_copies=self.block_manager.take_block_copies(),
        )

    def _schedule_running(self, token_budget: int, scheduled: list[ScheduledRequest]) -> int:
        """Plan the running requests in order (appended to `scheduled`); returns the budget left."""
        # Decodes not yet scheduled in this pass: a prompt chunk leaves one token for each. (A
        # decode preempted from the tail stays counted: the chunk is then one token smaller.)
        decodes_left = sum(r.num_tokens - r.num_computed_tokens == 1 for r in self.running)
        index = 0
        while index < len(self.running) and token_budget > 0:
            request = self.running[index]
            num_remaining = request.num_tokens - request.num_computed_tokens
            num_new_tokens = self._chunk(num_remaining, token_budget)
            if num_remaining == 1:
                decodes_left -= 1
            elif num_new_tokens > 1:
                num_new_tokens = max(1, min(num_new_tokens, token_budget - decodes_left))
            # Drafts come with their slots reserved, or not at all: they never preempt anyone.
            drafts = self.speculator.reserve_drafts(
                request, num_remaining, token_budget, decodes_left
            )
            if drafts or self._reserve_or_preempt(request, num_new_tokens):
                scheduled.append(self._plan(request, num_new_tokens, drafts))
                token_budget -= num_new_tokens + len(drafts)
                index += 1
            # else: `request` itself was preempted and left `running`; the same index is next.
        return token_budget

    def _schedule_waiting(self, token_budget: int, scheduled: list[ScheduledRequest]) -> int:
        """Admit waiting requests in order while budget, seats and blocks last."""
        while self.waiting and token_budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            num_new_tokens = self._admit(request, token_budget)
            if not num_new_tokens:
                break
            scheduled.append(self._plan(request, num_new_tokens))
            token_budget -= num_new_tokens
        return token_budget

    def _reserve_or_preempt(self, request: Request, num_new_tokens: int) -> bool:
        """Grow `request`'s table for this step, preempting others until it fits (or itself)."""
        while not self.block_manager.allocate_slots(
            request.sequence_id, num_new_tokens, request.num_computed_tokens
        ):
            # Victims come from the not-yet-scheduled tail of `running` (most important first).
            victim = self.running[-1]
            self._preempt(victim)
            if victim is request:
                return False
        return True

    def _preempt(self, request: Request) -> None:
        """Recompute-mode preemption: drop the K/V, keep the tokens, wait at the queue's front."""
        self.running.remove(request)
        self.block_manager.free(request.sequence_id)
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        request.status = RequestStatus.PREEMPTED
        # Ahead of every waiting request it precedes in serve order (under FCFS: all of them).
        self._insert_waiting_ahead(request)
        self.num_preemptions += 1

    def _admit(self, request: Request, token_budget: int) -> int:
        """Move the head of `waiting` to `running` if its first chunk gets blocks: its size or 0."""
        block_manager = self.block_manager
        salt, max_cached_tokens = request.cache_salt, request.max_cached_tokens
        num_cached = block_manager.allocate_cached_prefix(
            request.sequence_id, request.all_token_ids, salt, max_cached_tokens
        )
        num_new_tokens = self._chunk(request.num_tokens - num_cached, token_budget, admit=True)
        if not num_new_tokens or not block_manager.allocate_slots(
            request.sequence_id, num_new_tokens, num_cached
        ):
            block_manager.free(request.sequence_id)  # give back the prefix hits: nothing changed
            return 0
        self.waiting.popleft()
        request.num_computed_tokens = num_cached
        if request.first_scheduled_time is None:  # its first admission (not a readmission)
            request.num_cached_tokens = num_cached
            if block_manager.pool.enable_prefix_caching:
                self.prefix_cache_queries += request.num_tokens
                self.prefix_cache_hits += num_cached
            request.first_scheduled_time = time.monotonic()
        request.status = RequestStatus.RUNNING
        self._insert_running(request)
        return num_new_tokens

    def _insert_waiting_ahead(self, request: Request) -> None:
        """Into `waiting` in serve order, ahead of requests with an equal key."""
        keys = [self._order_key(r) for r in self.waiting]
        self.waiting.insert(bisect.bisect_left(keys, self._order_key(request)), request)

    def _insert_running(self, request: Request) -> None:
        keys = [self._order_key(r) for r in self.running]  # behind equal keys: FCFS among equals
        self.running.insert(bisect.bisect_right(keys, self._order_key(request)), request)

    def _fork_ready_children(self) -> None:
        """Children whose parent has computed its prompt share its blocks; orphans wait normally."""
        for child in list(self.fork_waiting):
            parent = self.requests.get(child.parent_sequence_id or "")
            if parent is not None and parent.status == RequestStatus.WAITING:
                continue  # the parent has not started its prompt yet
            running = parent is not None and parent.status == RequestStatus.RUNNING
            if running and self.block_manager.can_fork(parent.sequence_id, child.num_prompt_tokens):
                if parent.num_computed_tokens < parent.num_prompt_tokens:
                    continue  # prompt still being prefilled
                if len(self.running) >= self.config.max_num_seqs:
                    continue
                self.block_manager.fork(
                    parent.sequence_id, child.sequence_id, child.num_prompt_tokens
                )
                # Recompute the last prompt token: its logits are this choice's own, and its write
                # into the shared block is what copy-on-write splits.
                child.num_computed_tokens = child.num_cached_tokens = child.num_prompt_tokens - 1
                child.needs_prompt_logprobs = False  # the parent has computed them
                child.first_scheduled_time = time.monotonic()
                child.status = RequestStatus.RUNNING
                self.fork_waiting.remove(child)
                self._insert_running(child)
            else:  # parent preempted, gone or past the child's window: serve this choice on its own
                self.fork_waiting.remove(child)
                child.parent_sequence_id = None
                # In serve order like any request (it keeps its parent's arrival and priority).
                self._insert_waiting_ahead(child)

    def _plan(self, request: Request, num_new_tokens: int, drafts: tuple = ()) -> ScheduledRequest:
        tables = [group[request.sequence_id] for group in self.block_manager.group_tables]
        self.num_prefilled_tokens += request.num_prompt_positions(num_new_tokens)
        return ScheduledRequest.plan(request, tables, num_new_tokens, drafts)

    def _chunk(self, num_remaining: int, token_budget: int, admit: bool = False) -> int:
        """A request's tokens this step: what it has left, within the budget and, while others
        share the step, --long-prefill-token-threshold (vLLM's; n > 1 children waiting on their
        parent's prompt do not count, and a step moves requests between these two queues only)."""
        shared = len(self.running) + len(self.waiting) > 1
        cap = self.config.long_prefill_token_threshold if shared else 0  # 0: none
        wanted = min(num_remaining, cap or num_remaining)
        whole_only = admit and not self.config.enable_chunked_prefill  # admitted whole, or not (0)
        return 0 if whole_only and wanted > token_budget else min(wanted, token_budget)

    # ---- after the forward pass ------------------------------------------------------------

    def update_from_output(
        self, plan: SchedulerOutput, result: ModelRunnerOutput
    ) -> list[RequestUpdate]:
        """Advance progress by what was computed, append sampled tokens, stop and free finished."""
        updates = []
        now = time.monotonic()
        for scheduled in plan.requests:
            request = self.requests.get(scheduled.sequence_id)
            if request is None:  # finished (aborted) since it was scheduled
                continue
            new_token_ids, status = self.speculator.apply(request, scheduled, result)
            if not scheduled.needs_sample:
                if request.num_computed_tokens < request.num_tokens:
                    continue  # a prompt chunk with more to come
                status = RequestStatus.FINISHED_LENGTH  # max_tokens 0: the prompt is done
            elif request.first_token_time is None:
                request.first_token_time = now
            if status is not None:
                self.finish_request(request.sequence_id, status)
            updates.append(RequestUpdate(request.sequence_id, new_token_ids, request.status))
        return updates
