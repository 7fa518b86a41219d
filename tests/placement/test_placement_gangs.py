"""Gangs in the engine: one statement places at least ``min_member`` pods of a batch or none of them."""

from __future__ import annotations

import pytest
from placement_builders import fraction, node, pod
from test_placement_engine import build, same, snapshot

from gpufrac.placement.decision import Placement, Unschedulable


def test_a_gang_below_its_min_member_places_nothing_and_says_how_many_fit():
    e = build(node("a", gpus=2))
    before = snapshot(e)
    decisions = e.schedule([pod(fraction(0.75)) for _ in range(4)], gang=True, min_member=3)
    assert all(isinstance(d, Unschedulable) for d in decisions)
    assert all("gang of 4 needs 3 placed together, 2 fit" in d.message for d in decisions)
    assert same(before, snapshot(e))


def test_a_gang_at_its_min_member_keeps_what_fits_and_reports_the_rest():
    e = build(node("a", gpus=2))
    decisions = e.schedule([pod(fraction(0.75)) for _ in range(3)], gang=True, min_member=2)
    assert [isinstance(d, Placement) for d in decisions].count(True) == 2
    left = [d for d in decisions if isinstance(d, Unschedulable)]
    assert len(left) == 1 and "insufficient GPU memory" in left[0].message


def test_a_gang_of_fractions_spreads_over_nodes_when_no_node_holds_it():
    e = build(node("a", gpus=1), node("b", gpus=1), node("c", gpus=1))
    decisions = e.schedule([pod(fraction(0.6)) for _ in range(3)], gang=True)
    assert all(isinstance(d, Placement) for d in decisions)
    assert sorted(d.node for d in decisions) == ["a", "b", "c"]  # type: ignore[union-attr]
    # One more fraction of 0.6 fits nowhere: a gang of two with it places neither.
    before = snapshot(e)
    two = e.schedule([pod(fraction(0.3)), pod(fraction(0.6))], gang=True)
    assert all(isinstance(d, Unschedulable) for d in two)
    assert same(before, snapshot(e))


def test_a_min_member_larger_than_the_gang_is_refused_with_the_numbers():
    e = build(node("a"))
    with pytest.raises(ValueError, match="min_member=5 must be between 0 and the gang's 2 pods"):
        e.schedule([pod(fraction(0.1)), pod(fraction(0.1))], gang=True, min_member=5)
