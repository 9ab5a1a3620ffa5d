"""Random allocate / grow / fork / write / free / prefix-hit sequences against a simple model.

The model keeps, per request, its token ids and `num_computed_tokens`, and per physical block a
shadow of what the K/V in each slot were computed from: the extra key and every token up to and
including that position. Reads must see exactly the request's own history, a prefix hit must
point at blocks computed from the same prefix, and copy-on-write must carry content over.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    rule,
)

from pagedserve.cache.block_manager import BlockManager
from pagedserve.cache.block_pool import DoubleFreeError, OutOfBlocksError
from pagedserve.cache.block_table import ceil_div

# A tiny alphabet and short prompts, so identical prefixes (and so hits) are common.
TOKENS = st.lists(st.integers(min_value=0, max_value=2), min_size=1, max_size=10)
EXTRA_KEYS = st.sampled_from([None, None, None, "lora-a"])

# What one slot's K/V were computed from: (extra key, token ids up to and including the slot).
SlotContent = tuple[object, tuple[int, ...]]


@dataclass
class ModelRequest:
    token_ids: list[int]
    num_computed_tokens: int
    extra_key: object


class BlockManagerMachine(RuleBasedStateMachine):
    requests = Bundle("requests")

    def __init__(self) -> None:
        super().__init__()
        self.manager: BlockManager | None = None
        self.model: dict[str, ModelRequest] = {}
        self.slot_content: dict[int, list[SlotContent | None]] = {}
        self.past_prompts: list[list[int]] = [[0, 1, 2, 0, 1, 2, 0, 1, 2]]
        self.num_created = 0

    @initialize(
        num_blocks=st.integers(min_value=1, max_value=16),
        block_size=st.sampled_from([1, 2, 4]),
        enable_prefix_caching=st.booleans(),
    )
    def make_manager(self, num_blocks: int, block_size: int, enable_prefix_caching: bool) -> None:
        self.manager = BlockManager(num_blocks, block_size, enable_prefix_caching)
        self.block_size = block_size
        self.slot_content = {block_id: [None] * block_size for block_id in range(num_blocks)}

    # --- helpers ---------------------------------------------------------------------------

    def snapshot(self) -> tuple:
        manager = self.manager
        return (
            {request_id: tuple(table.block_ids) for request_id, table in manager.tables.items()},
            tuple(b.ref_count for b in manager.pool.blocks),
            tuple(b.block_hash for b in manager.pool.blocks),
            manager.num_free_blocks,
        )

    def new_request_id(self) -> str:
        self.num_created += 1
        return f"r{self.num_created}"

    def expected_content(self, request: ModelRequest, pos: int) -> SlotContent:
        return (request.extra_key, tuple(request.token_ids[: pos + 1]))

    def read_history(self, request_id: str, num_tokens: int) -> None:
        """The K/V a request reads back for [0, num_tokens) are exactly its own history."""
        request, table = self.model[request_id], self.manager.get_table(request_id)
        for pos in range(num_tokens):
            block_id, offset = table.resolve(pos)
            assert self.slot_content[block_id][offset] == self.expected_content(request, pos), (
                f"{request_id} reads wrong K/V at position {pos} (block {block_id})"
            )

    # --- rules -----------------------------------------------------------------------------

    def admit(self, token_ids: list[int], extra_key: object) -> str:
        manager, request_id = self.manager, self.new_request_id()
        self.past_prompts.append(list(token_ids))
        num_cached_tokens = manager.allocate_cached_prefix(request_id, token_ids, extra_key)
        assert num_cached_tokens % self.block_size == 0
        assert num_cached_tokens < len(token_ids), "the last token must always be computed"
        assert len(manager.block_ids(request_id)) == num_cached_tokens // self.block_size
        if not manager.pool.enable_prefix_caching:
            assert num_cached_tokens == 0
        self.model[request_id] = ModelRequest(list(token_ids), num_cached_tokens, extra_key)
        # A hit (possibly a revived free block) must hold K/V of exactly this prefix.
        self.read_history(request_id, num_cached_tokens)
        return request_id

    @rule(target=requests, token_ids=TOKENS, extra_key=EXTRA_KEYS, prefill=st.booleans())
    def add_request(self, token_ids: list[int], extra_key: object, prefill: bool) -> str:
        request_id = self.admit(token_ids, extra_key)
        if prefill:
            self.step(request_id, max_num_tokens=len(token_ids), sampled_token=0)
        return request_id

    @rule(
        target=requests,
        data=st.data(),
        suffix=st.lists(st.integers(min_value=0, max_value=2), max_size=4),
        extra_key=EXTRA_KEYS,
        prefill=st.booleans(),
    )
    def add_request_reusing_past_tokens(
        self, data, suffix: list[int], extra_key: object, prefill: bool
    ) -> str:
        """A prompt spliced from seen token sequences (prompts and generated tokens alike), so
        that hits on shared, revived and forked blocks are common."""
        live_token_ids = [request.token_ids for request in self.model.values() if request.token_ids]
        sources = self.past_prompts + live_token_ids
        head = data.draw(st.sampled_from(sources), label="head")
        token_ids = head[: data.draw(st.integers(1, len(head)), label="head_len")]
        if data.draw(st.booleans(), label="splice"):
            tail = data.draw(st.sampled_from(sources), label="tail")
            token_ids = token_ids + tail[data.draw(st.integers(0, len(tail)), label="tail_start") :]
        token_ids = (token_ids + suffix)[:16]
        request_id = self.admit(token_ids, extra_key)
        if prefill:
            self.step(request_id, max_num_tokens=len(token_ids), sampled_token=0)
        return request_id

    @rule(
        request_id=requests,
        max_num_tokens=st.integers(min_value=1, max_value=6),
        sampled_token=st.integers(min_value=0, max_value=2),
    )
    def schedule(self, request_id: str, max_num_tokens: int, sampled_token: int) -> None:
        if request_id in self.model:
            self.step(request_id, max_num_tokens, sampled_token)

    def step(self, request_id: str, max_num_tokens: int, sampled_token: int) -> None:
        """One step for one request: a prefill chunk, or one decode token once prefilled."""
        manager, request = self.manager, self.model[request_id]
        if request.num_computed_tokens == len(request.token_ids):
            request.token_ids.append(sampled_token)
        start = request.num_computed_tokens
        num_new_tokens = min(max_num_tokens, len(request.token_ids) - start)
        num_blocks_before = len(manager.block_ids(request_id))
        # Blocks this step writes into that others share or the prefix cache promises: each
        # must be copied first, and nothing else.
        num_must_copy = len(
            {
                block_id
                for pos in range(
                    start, min(start + num_new_tokens, num_blocks_before * self.block_size)
                )
                for block_id in [manager.get_table(request_id).resolve(pos)[0]]
                if manager.pool.blocks[block_id].ref_count > 1
                or manager.pool.blocks[block_id].block_hash is not None
            }
        )
        before = self.snapshot()
        if not manager.allocate_slots(request_id, num_new_tokens, start):
            assert self.snapshot() == before, "a failed allocation changed state"
            assert manager.take_block_copies() == []
            return
        table = manager.get_table(request_id)
        end = start + num_new_tokens
        assert len(table) == max(num_blocks_before, ceil_div(end, self.block_size))
        copies = manager.take_block_copies()
        assert len(copies) == num_must_copy
        for src, dst in copies:
            assert dst in table.block_ids and src not in table.block_ids
            self.slot_content[dst] = list(self.slot_content[src])
        self.read_history(request_id, start)
        for pos in range(start, end):
            block_id, offset = table.resolve(pos)
            block = manager.pool.blocks[block_id]
            assert block.ref_count == 1, f"writing into shared block {block_id}"
            assert block.block_hash is None, f"writing into cached block {block_id}"
            self.slot_content[block_id][offset] = self.expected_content(request, pos)
        request.num_computed_tokens = end
        manager.cache_computed_blocks(
            request_id, request.token_ids, request.num_computed_tokens, request.extra_key
        )
        self.read_history(request_id, end)

    @rule(target=requests, parent_id=requests, data=st.data(), decode_both=st.booleans())
    def fork(self, parent_id: str, data, decode_both: bool) -> str:
        """Fork the first num_tokens of a request's computed history; optionally both then
        decode a different token (copy-on-write)."""
        if parent_id not in self.model:
            return parent_id
        manager, child_id, parent = self.manager, self.new_request_id(), self.model[parent_id]
        num_tokens = data.draw(st.integers(0, parent.num_computed_tokens), label="num_tokens")
        refs_before = [b.ref_count for b in manager.pool.blocks]
        manager.fork(parent_id, child_id, num_tokens)
        self.model[child_id] = ModelRequest(
            parent.token_ids[:num_tokens], num_tokens, parent.extra_key
        )
        num_shared_blocks = ceil_div(num_tokens, self.block_size)
        assert manager.block_ids(child_id) == manager.block_ids(parent_id)[:num_shared_blocks]
        for block_id in manager.block_ids(child_id):
            refs_before[block_id] += 1
        assert [b.ref_count for b in manager.pool.blocks] == refs_before
        self.read_history(child_id, num_tokens)
        if decode_both:
            self.step(parent_id, max_num_tokens=1, sampled_token=1)
            self.step(child_id, max_num_tokens=1, sampled_token=2)
        return child_id

    @rule(request_id=consumes(requests))
    def free(self, request_id: str) -> None:
        manager = self.manager
        refs_before = [b.ref_count for b in manager.pool.blocks]
        for block_id in manager.block_ids(request_id):
            refs_before[block_id] -= 1
        manager.free(request_id)
        self.model.pop(request_id, None)
        assert request_id not in manager.tables
        assert [b.ref_count for b in manager.pool.blocks] == refs_before

    @rule()
    def finish_oldest(self) -> None:
        """Keep the pool turning over: requests finish as well as arrive."""
        if self.model:
            self.free(next(iter(self.model)))

    # --- invariants, checked after every step ----------------------------------------------

    @invariant()
    def bookkeeping_is_consistent(self) -> None:
        manager = self.manager
        if manager is None:
            return
        manager.check_invariants()
        pool = manager.pool
        assert set(manager.tables) == set(self.model)
        holders = [0] * pool.num_blocks
        for request_id in self.model:
            for block_id in manager.block_ids(request_id):
                holders[block_id] += 1
        assert [b.ref_count for b in pool.blocks] == holders
        num_referenced = sum(1 for count in holders if count > 0)
        assert pool.num_free_blocks + num_referenced == pool.num_blocks
        assert pool.num_free_blocks == holders.count(0)

    @invariant()
    def releasing_a_free_block_raises_double_free_and_changes_nothing(self) -> None:
        if self.manager is None:
            return
        free_blocks = [b for b in self.manager.pool.blocks if b.ref_count == 0]
        if not free_blocks:
            return
        before = self.snapshot()
        with pytest.raises(DoubleFreeError):
            self.manager.pool.release(free_blocks[-1])
        assert self.snapshot() == before

    @invariant()
    def allocating_more_than_free_raises_and_changes_nothing(self) -> None:
        if self.manager is None:
            return
        before = self.snapshot()
        with pytest.raises(OutOfBlocksError):
            self.manager.pool.allocate(self.manager.num_free_blocks + 1)
        assert self.snapshot() == before

    @invariant()
    def can_ever_fit_matches_the_pool_capacity(self) -> None:
        if self.manager is None:
            return
        capacity = self.manager.pool.num_blocks * self.block_size
        assert self.manager.can_ever_fit(capacity)
        assert not self.manager.can_ever_fit(capacity + 1)

    @invariant()
    def tables_cover_the_computed_tokens(self) -> None:
        for request_id, request in self.model.items():
            table = self.manager.get_table(request_id)
            assert table.num_slots >= request.num_computed_tokens
            assert len(set(table.block_ids)) == len(table.block_ids)

    @invariant()
    def cached_blocks_hold_what_their_hash_claims(self) -> None:
        manager = self.manager
        if manager is None:
            return
        for block in manager.pool.blocks:
            if block.block_hash is None:
                continue
            assert manager.pool.enable_prefix_caching
            assert (
                manager.pool.lookup(block.block_hash, block.parent_hash, block.token_ids) is block
            )
            content = self.slot_content[block.block_id]
            assert all(slot is not None for slot in content), "a cached block is not full"
            assert tuple(slot[1][-1] for slot in content) == block.token_ids


BlockManagerMachine.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_block_manager_matches_the_model = BlockManagerMachine.TestCase
