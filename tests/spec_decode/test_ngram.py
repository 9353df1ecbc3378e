"""The n-gram proposer: exact drafts for hand-made sequences."""

from __future__ import annotations

import pytest

from paged_backend.spec_decode.ngram import NgramProposer


def test_longest_suffix_match_proposes_what_followed():
    p = NgramProposer(3, 2, 4)
    #          0  1  2  3  4  5  6  7  8
    tokens = [9, 1, 2, 3, 4, 5, 7, 2, 3]  # suffix [2, 3] occurred at 2: then 4, 5, 7
    assert p.propose(tokens) == [4, 5, 7]


def test_longer_ngram_wins_over_earlier_shorter_one():
    p = NgramProposer(2, 1, 3)
    # [3] alone first occurs at 0 (then 8); [2, 3] occurs at 4 (then 6, 1)
    tokens = [3, 8, 5, 5, 2, 3, 6, 1, 2, 3]
    assert p.propose(tokens) == [6, 1]


def test_earliest_occurrence_of_the_longest_ngram():
    p = NgramProposer(1, 2, 2)
    tokens = [1, 2, 5, 1, 2, 6, 1, 2]
    assert p.propose(tokens) == [5]


def test_continuation_may_run_into_the_suffix_and_stops_at_the_end():
    p = NgramProposer(5, 2, 2)
    assert p.propose([4, 4, 4]) == [4]  # [4, 4] at 0, followed by the last 4 only
    assert p.propose([1, 2, 3, 1, 2]) == [3, 1, 2]


def test_no_match_and_too_short():
    p = NgramProposer(4, 2, 5)
    assert p.propose([1, 2, 3, 4, 5]) == []
    assert p.propose([1, 1]) == []  # [1] is below prompt_lookup_min
    assert p.propose([]) == []


def test_max_drafts_caps_the_proposal():
    p = NgramProposer(4, 1, 1)
    assert p.propose([7, 1, 2, 3, 4, 7], max_drafts=2) == [1, 2]
    assert p.propose([7, 1, 2, 3, 4, 7], max_drafts=0) == []


def test_bad_bounds():
    with pytest.raises(ValueError):
        NgramProposer(2, 3, 2)
