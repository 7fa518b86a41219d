"""The pairing bound: never above the true fewest GPUs, and first fit decreasing is a real packing."""

from __future__ import annotations

import math
from collections import Counter
from functools import cache

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpufrac.sim.pairing import fewest_bins_bound, first_fit_decreasing


def fewest_bins(sizes: list[int], capacity: int) -> int:
    """The true optimum by search over subsets (small inputs only)."""
    n = len(sizes)
    fits = [sum(sizes[i] for i in range(n) if mask >> i & 1) <= capacity for mask in range(1 << n)]

    @cache
    def bins(left: int) -> int:
        if not left:
            return 0
        low = left & -left  # the lowest share left goes into some bin: try every bin holding it
        best = n
        sub = left
        while sub:
            if sub & low and fits[sub]:
                best = min(best, 1 + bins(left & ~sub))
            sub = (sub - 1) & left
        return best

    return bins((1 << n) - 1)


shares = st.lists(st.sampled_from([50, 110, 160, 230, 320, 340, 470, 510, 550, 650, 810, 1000]), max_size=9)


@settings(max_examples=150, deadline=None)
@given(shares)
def test_bound_never_exceeds_the_optimum_and_ffd_never_beats_it(sizes: list[int]) -> None:
    packing = first_fit_decreasing(sizes, 1000)
    assert Counter(s for b in packing for s in b) == Counter(sizes)  # every share placed, once
    assert all(sum(b) <= 1000 for b in packing)
    optimum = fewest_bins(sizes, 1000)
    assert math.ceil(sum(sizes) / 1000) <= fewest_bins_bound(sizes, 1000) <= optimum <= len(packing)


def test_bound_sees_what_volume_does_not() -> None:
    # Nine shares of 0.34: 3.06 GPUs of volume, but two a GPU at most, so five GPUs.
    assert fewest_bins_bound([340] * 9, 1000) == 5
    # Lone 0.81 shares and the rare small ones: each 0.81 needs a GPU of its own.
    assert fewest_bins_bound([810] * 100 + [160] * 10 + [110] * 5, 1000) == 100
    assert fewest_bins_bound([600] * 5 + [400] * 5, 1000) == 5


def test_ffd_fills_the_first_gpu_with_room() -> None:
    assert first_fit_decreasing([470, 810, 160, 470, 50], 1000) == [[810, 160], [470, 470, 50]]
    assert first_fit_decreasing([], 1000) == []
    assert fewest_bins_bound([], 1000) == 0


@pytest.mark.parametrize("bad", [0, -5, 1001])
def test_a_share_no_gpu_can_hold_is_named(bad: int) -> None:
    with pytest.raises(ValueError, match=f"share size {bad} is outside"):
        fewest_bins_bound([500, bad], 1000)
    with pytest.raises(ValueError, match=f"share size {bad} is outside"):
        first_fit_decreasing([bad], 1000)
