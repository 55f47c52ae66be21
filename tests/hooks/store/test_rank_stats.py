"""Cross-rank statistics below the UI (issue 21): the numbers the ranks line and the ranks
screen show, against values worked out by hand."""

from __future__ import annotations

import math

import pytest

from hooks.store.rank_stats import furthest, spread, stragglers, tied_with


def test_spread_leaves_out_what_is_not_finite():
    assert spread([3.0, None, 1.0, math.nan, 2.0, math.inf]) == (1.0, 2.0, 3.0)
    assert spread([2.0, 4.0]) == (2.0, 3.0, 4.0)  # the median of two is their mean
    assert spread([None, math.nan]) is None


def test_furthest_names_the_rank_and_its_relative_distance():
    # median of 1.0, 1.1, 2.0 is 1.1; rank 2 is 0.9 away: (2.0 - 1.1) / 1.1
    rank, value, median, rel = furthest({0: 1.0, 1: 1.1, 2: 2.0, 3: None})
    assert (rank, value, median) == (2, 2.0, 1.1)
    assert rel == pytest.approx(0.9 / 1.1)
    assert furthest({0: 1.0, 1: 3.0})[0] == 0  # a tie: the lower rank
    assert furthest({0: -1.0, 1: 1.0})[3] is None  # zero median: no relative distance
    assert furthest({0: 1.0, 1: math.nan}) is None


def test_tied_with_lists_the_ranks_as_far_from_the_median():
    assert tied_with({0: 1.0, 1: 3.0}, 0) == [1]
    assert tied_with({0: 1.0, 1: 2.0, 2: 3.0}, 0) == [2]
    assert tied_with({0: 1.0, 1: 2.0, 2: 2.5}, 0) == []


def test_stragglers_are_slower_than_the_median_by_more_than_the_ratio():
    # median of 0.10, 0.105, 0.12, 0.20 is 0.1125; 1.1 × that is 0.12375
    times = {0: 0.10, 1: 0.105, 2: 0.12, 3: 0.20}
    assert stragglers(times) == [(3, 0.20, pytest.approx(0.1125))]
    assert stragglers(times, ratio=1.05) == [(3, 0.20, pytest.approx(0.1125)),
                                              (2, 0.12, pytest.approx(0.1125))]
    assert stragglers({0: 1.0}) == []
