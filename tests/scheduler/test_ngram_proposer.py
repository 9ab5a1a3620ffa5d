"""The n-gram proposer: latest earlier occurrence of the longest suffix, from an index that grows."""

from __future__ import annotations

import random

import pytest

from pagedserve.scheduler.ngram import NgramProposer


def brute_force(token_ids: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """The definition: for n from max_n down, the latest i < len - n with tokens[i:i+n] == suffix."""
    num_tokens = len(token_ids)
    for n in range(min(max_n, num_tokens - 1), min_n - 1, -1):
        suffix = token_ids[num_tokens - n :]
        for start in range(num_tokens - n - 1, -1, -1):
            if token_ids[start : start + n] == suffix:
                return token_ids[start + n : start + n + k]
    return []


def test_proposes_what_followed_the_latest_earlier_occurrence_of_the_suffix():
    proposer = NgramProposer(3, 1, 4)
    tokens = [1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 5, 1, 2, 3]
    assert proposer.propose("r", tokens, 8) == [7, 8, 5]  # the later "1 2 3" wins


def test_longer_ngrams_win_over_later_shorter_matches():
    proposer = NgramProposer(2, 1, 3)
    tokens = [4, 5, 6, 10, 11, 7, 6, 12, 13, 4, 5, 6]
    # "6" alone last occurred before 12; "4 5 6" (longest) occurred before 10
    assert proposer.propose("r", tokens, 8) == [10, 11]


def test_no_match_and_no_self_match_propose_nothing():
    proposer = NgramProposer(4, 2, 4)
    assert proposer.propose("r", [1, 2, 3, 4], 8) == []
    assert proposer.propose("s", [7], 8) == []


def test_drafts_are_capped_by_max_drafts_and_by_the_tokens_that_exist():
    proposer = NgramProposer(5, 1, 2)
    assert proposer.propose("r", [1, 2, 3, 1, 2, 3, 1], 2) == [2, 3]
    assert proposer.propose("s", [8, 9, 8], 8) == [9, 8]  # only two tokens follow the match
    assert proposer.propose("t", [8, 9, 8], 0) == []


@pytest.mark.parametrize("seed", range(20))
def test_incremental_index_agrees_with_a_full_scan_as_the_request_grows(seed):
    rng = random.Random(seed)
    min_n, max_n = rng.randint(1, 2), rng.randint(2, 5)
    proposer = NgramProposer(4, min_n, max_n)
    tokens = [rng.randint(0, 5) for _ in range(rng.randint(1, 6))]
    for _ in range(120):
        assert proposer.propose("r", tokens, 4) == brute_force(tokens, 4, min_n, max_n), tokens
        tokens.extend(rng.randint(0, 5) for _ in range(rng.randint(1, 3)))


def test_a_request_with_low_acceptance_pauses_drafting_then_tries_again():
    proposer = NgramProposer(4, 1, 2, min_acceptance_rate=0.5)
    tokens = [1, 2, 1, 2, 1]
    assert proposer.propose("r", tokens, 4)
    proposer.record("r", 16, 1)  # a window of mostly rejected drafts
    paused = [proposer.propose("r", tokens, 4) for _ in range(NgramProposer._PAUSE_STEPS)]
    assert paused == [[]] * NgramProposer._PAUSE_STEPS
    assert proposer.propose("r", tokens, 4)
    proposer.record("r", 16, 12)  # a good window keeps it drafting
    assert proposer.propose("r", tokens, 4)


def test_dropping_a_request_forgets_its_index():
    proposer = NgramProposer(2, 1, 2)
    proposer.propose("r", [1, 2, 1], 2)
    proposer.drop("r")
    proposer.drop("r")  # idempotent
    assert proposer.propose("r", [5, 6, 5], 2) == [6, 5]
