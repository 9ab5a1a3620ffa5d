"""BlockManager prefix caching, with exact block ids: which full blocks a prompt hits (never the
partial last block nor the one holding the prompt's last token), extra keys, LRU eviction of freed
cached blocks, the query/hit counters, and a hash chain that Python's hash() collisions cannot fool."""

import pytest

from tests.cache.support import PROMPT, allocate_new, make_manager, run_prompt

# --- prefix caching ----------------------------------------------------------------------------


def test_requests_sharing_a_three_block_prefix_share_the_physical_blocks():
    manager = make_manager()
    assert run_prompt(manager, "a", PROMPT) == 0
    assert manager.block_ids("a") == [0, 1, 2, 3]
    assert run_prompt(manager, "b", PROMPT[:12] + [7, 7, 7, 7]) == 12
    assert manager.block_ids("b") == [0, 1, 2, 4]
    assert [manager.pool.blocks[i].ref_count for i in range(5)] == [2, 2, 2, 1, 1]
    manager.check_invariants()


def test_prefix_hit_survives_the_original_request_being_freed():
    manager = make_manager()
    run_prompt(manager, "a", PROMPT)
    manager.free("a")
    assert manager.allocate_cached_prefix("b", PROMPT) == 12
    assert manager.block_ids("b") == [0, 1, 2]
    assert manager.num_free_blocks == 5
    manager.check_invariants()


def test_partial_last_block_is_never_shared_by_hash():
    manager = make_manager()
    run_prompt(manager, "a", PROMPT[:6])  # block 1 holds only 2 tokens
    assert manager.pool.blocks[0].block_hash is not None
    assert manager.pool.blocks[1].block_hash is None
    assert manager.allocate_cached_prefix("b", PROMPT[:6] + [1, 2, 3]) == 4
    assert manager.block_ids("b") == [0]
    manager.check_invariants()


def test_block_holding_the_prompts_last_token_is_never_a_hit():
    manager = make_manager()
    run_prompt(manager, "a", PROMPT[:8])
    assert all(manager.pool.blocks[i].block_hash is not None for i in (0, 1))
    # Both blocks are cached, but block 1 holds the last token, whose logits must be computed.
    assert manager.allocate_cached_prefix("b", PROMPT[:8]) == 4
    assert manager.block_ids("b") == [0]
    assert manager.allocate_slots("b", 4, 4)
    assert manager.block_ids("b") == [0, 2]
    manager.check_invariants()


def test_max_cached_tokens_caps_the_hit_and_a_recomputed_prefix_is_not_cached_twice():
    manager = make_manager()
    run_prompt(manager, "a", PROMPT)  # blocks 0-3, the three full ones cached
    # A request that needs the logits from position 5 on may skip at most 5 tokens: one block.
    assert manager.allocate_cached_prefix("b", PROMPT, max_cached_tokens=5) == 4
    assert manager.block_ids("b") == [0]
    assert manager.allocate_cached_prefix("c", PROMPT, max_cached_tokens=0) == 0
    assert manager.allocate_slots("c", 13, 0)
    assert manager.block_ids("c") == [4, 5, 6, 7]  # computed again, in private blocks
    manager.cache_computed_blocks("c", PROMPT, 13)  # equal hashes: a's blocks stay the cached ones
    assert all(manager.pool.blocks[i].block_hash is None for i in (4, 5, 6, 7))
    assert manager.allocate_cached_prefix("d", PROMPT) == 12
    assert manager.block_ids("d") == [0, 1, 2]
    manager.check_invariants()


def test_one_token_prompt_is_never_a_hit():
    manager = make_manager()
    run_prompt(manager, "a", [5])
    assert manager.allocate_cached_prefix("b", [5]) == 0
    manager.check_invariants()


def test_prompt_one_token_past_a_cached_prefix_hits_every_full_block():
    manager = make_manager()
    run_prompt(manager, "a", PROMPT[:8])
    assert manager.allocate_cached_prefix("b", PROMPT[:9]) == 8
    assert manager.block_ids("b") == [0, 1]
    manager.check_invariants()


def test_prefix_hit_stops_at_the_first_differing_block():
    manager = make_manager()
    run_prompt(manager, "a", PROMPT)
    changed = PROMPT[:4] + [0] + PROMPT[5:]
    assert manager.allocate_cached_prefix("b", changed) == 4
    manager.check_invariants()


def test_same_block_after_a_different_prefix_is_not_a_hit():
    manager = make_manager()
    run_prompt(manager, "a", [1, 1, 1, 1, 2, 2, 2, 2, 9])
    assert manager.allocate_cached_prefix("b", [3, 3, 3, 3, 2, 2, 2, 2, 9]) == 0
    manager.check_invariants()


def test_different_extra_keys_do_not_share_blocks():
    manager = make_manager()
    run_prompt(manager, "a", PROMPT, extra_key="lora-1")
    assert manager.allocate_cached_prefix("b", PROMPT, extra_key="lora-2") == 0
    assert manager.allocate_cached_prefix("c", PROMPT, extra_key="lora-1") == 12
    manager.check_invariants()


def test_eviction_is_least_recently_used():
    manager = make_manager(num_blocks=6)
    prompt_a, prompt_b = [1] * 8, [2] * 8
    run_prompt(manager, "a", prompt_a)
    run_prompt(manager, "b", prompt_b)
    assert manager.block_ids("a") == [0, 1]
    assert manager.block_ids("b") == [2, 3]
    manager.free("a")
    manager.free("b")
    # Four blocks: the two never used, then A's (freed first), not B's.
    assert allocate_new(manager, "c", 16)
    assert sorted(manager.block_ids("c")) == [0, 1, 4, 5]
    assert manager.allocate_cached_prefix("a2", prompt_a + [0]) == 0
    assert manager.allocate_cached_prefix("b2", prompt_b + [0]) == 8
    assert manager.block_ids("b2") == [2, 3]
    manager.check_invariants()


def test_freed_table_tail_is_evicted_before_its_head():
    manager = make_manager(num_blocks=3)
    run_prompt(manager, "a", [1] * 12)
    manager.free("a")
    assert allocate_new(manager, "c", 4)
    assert manager.block_ids("c") == [2]
    # The head of the chain survives: a shorter prefix still hits.
    assert manager.allocate_cached_prefix("b", [1] * 9) == 8
    manager.check_invariants()


def test_recently_hit_prefix_is_kept_over_an_older_one():
    manager = make_manager(num_blocks=4)
    prompt_a, prompt_b = [1] * 8, [2] * 8
    run_prompt(manager, "a", prompt_a)
    run_prompt(manager, "b", prompt_b)
    manager.free("a")
    manager.free("b")
    run_prompt(manager, "a2", prompt_a + [5])  # revives A's blocks, then frees them after B's
    manager.free("a2")
    assert allocate_new(manager, "c", 4)
    assert manager.allocate_cached_prefix("a3", prompt_a + [5]) == 8
    assert manager.allocate_cached_prefix("b3", prompt_b + [5]) == 4
    manager.check_invariants()


def test_prefix_caching_off_gives_no_hits_and_no_hashes():
    manager = make_manager(enable_prefix_caching=False)
    run_prompt(manager, "a", PROMPT)
    assert manager.block_ids("a") == [0, 1, 2, 3]
    assert run_prompt(manager, "b", PROMPT) == 0
    assert manager.block_ids("b") == [4, 5, 6, 7]
    assert all(b.block_hash is None for b in manager.pool.blocks)
    manager.check_invariants()


def test_cache_computed_blocks_registers_only_computed_full_blocks():
    manager = make_manager()
    assert manager.allocate_cached_prefix("a", PROMPT) == 0
    assert manager.allocate_slots("a", 13, 0)
    manager.cache_computed_blocks("a", PROMPT, 5)  # a chunked prefill: only 5 tokens computed
    hashed = [manager.pool.blocks[i].block_hash is not None for i in manager.block_ids("a")]
    assert hashed == [True, False, False, False]
    manager.cache_computed_blocks("a", PROMPT, 13)
    hashed = [manager.pool.blocks[i].block_hash is not None for i in manager.block_ids("a")]
    assert hashed == [True, True, True, False]
    manager.check_invariants()


def test_identical_prompts_computed_concurrently_keep_one_cached_copy():
    manager = make_manager()
    for request_id in ("a", "b"):
        assert manager.allocate_cached_prefix(request_id, PROMPT[:9]) == 0
        assert manager.allocate_slots(request_id, 9, 0)
    for request_id in ("a", "b"):
        manager.cache_computed_blocks(request_id, PROMPT[:9], 9)
    assert manager.block_ids("a") == [0, 1, 2]
    assert manager.block_ids("b") == [3, 4, 5]
    assert manager.allocate_cached_prefix("c", PROMPT[:9]) == 8
    assert manager.block_ids("c") == [0, 1]
    manager.check_invariants()


def test_second_table_for_the_same_request_is_refused():
    manager = make_manager()
    manager.allocate_cached_prefix("a", PROMPT)
    with pytest.raises(RuntimeError):
        manager.allocate_cached_prefix("a", PROMPT)
    manager.check_invariants()


# --- regression: Python's hash() collides (hash(-1) == hash(-2)); the chain must not --------


def test_prefix_hit_never_serves_a_block_computed_after_a_colliding_parent():
    assert hash(-1) == hash(-2)  # the collision a hash()-based chain would fall for
    manager = make_manager()
    run_prompt(manager, "b", [-2, 0, 0, 0, 1])  # block 0 is cached under h0
    # "a" misses block 0 (other tokens) and caches block 3 with parent hash h0.
    run_prompt(manager, "a", [-1, 0, 0, 0, 5, 5, 5, 5, 9])
    assert manager.block_ids("a") == [2, 3, 4]
    # Block 3's K/V were computed after [-1, 0, 0, 0]; "c" must not reuse it after [-2, 0, 0, 0].
    num_cached_tokens = manager.allocate_cached_prefix("c", [-2, 0, 0, 0, 5, 5, 5, 5, 9])
    assert 3 not in manager.block_ids("c")[:2], f"hit {num_cached_tokens} tokens on block 3"
    manager.check_invariants()
