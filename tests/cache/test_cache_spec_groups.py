"""CacheSpec layer groups: grouping by window, shared layer tensors, bytes and blocks per request."""

from __future__ import annotations

import pytest

from pagedserve.cache.cache_engine import CacheEngine
from pagedserve.cache.cache_spec import CacheSpec, LayerGroup, group_layers


def test_alternating_layers_form_one_full_and_one_sliding_group():
    groups = group_layers([8, None, 8, None])
    assert groups == (LayerGroup((1, 3), None), LayerGroup((0, 2), 8))


def test_a_five_to_one_pattern_splits_the_sliding_kind_into_groups_of_the_smaller_size():
    groups = group_layers([8, 8, 8, 8, 8, None])
    assert [g.layer_ids for g in groups] == [(5,), (0,), (1,), (2,), (3,), (4,)]
    assert [g.sliding_window for g in groups] == [None, 8, 8, 8, 8, 8]


def test_a_block_costs_one_groups_layers_and_blocks_per_request_follow_the_windows():
    spec = CacheSpec(4, 2, 16, "float32", 4, groups=group_layers([8, None, 8, None]))
    assert spec.layers_per_block == 2
    assert spec.bytes_per_block == 2 * 2 * 2 * 16 * 4 * 4
    # Full group: 25 blocks for 100 tokens; sliding group: blocks overlapping 8 + 1 positions.
    assert spec.num_blocks_per_request(100) == 25 + 4
    plain = CacheSpec(4, 2, 16, "float32", 4)
    assert plain.bytes_per_block == 2 * spec.bytes_per_block
    assert plain.num_blocks_per_request(100) == 25


def test_layers_at_the_same_index_of_their_groups_share_a_tensor():
    spec = CacheSpec(4, 2, 16, "float32", 4, groups=group_layers([8, None, 8, None]))
    engine = CacheEngine(spec, num_blocks=3, device="cpu")
    assert engine.key_caches[1] is engine.key_caches[0]  # index 0 of the full and sliding group
    assert engine.key_caches[3] is engine.key_caches[2]
    assert engine.key_caches[0] is not engine.key_caches[2]
    assert engine.group_of_layer == [1, 0, 1, 0]
    assert "2 full + 2 sliding(8)" in engine.describe(100)


def test_groups_must_cover_every_layer_once():
    with pytest.raises(ValueError, match="cover"):
        CacheSpec(3, 2, 16, "float32", 4, groups=(LayerGroup((0, 1)),))
