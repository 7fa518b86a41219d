"""MIG geometry against the profile tables: the layouts `pack` builds are ones NVIDIA would create, and the
rules agree with the facts of the MIG user guide ("Supported MIG Profiles" and its placement diagrams)."""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpufrac.mig.geometry import (
    MigLayoutError,
    Slice,
    check_layout,
    fill,
    fits,
    free_starts,
    occupied,
    pack,
    room,
    smallest_fitting,
)
from gpufrac.mig.profiles import MIG_MODELS, MigModel

MODELS = sorted(MIG_MODELS)
A100_40 = MIG_MODELS["A100-40GB"]


@st.composite
def _model_and_wanted(draw: st.DrawFn) -> tuple[MigModel, list[str]]:
    model = MIG_MODELS[draw(st.sampled_from(MODELS))]
    names = [p.name for p in model.profiles]
    return model, draw(st.lists(st.sampled_from(names), max_size=10))


@st.composite
def _layout(draw: st.DrawFn) -> tuple[MigModel, tuple[Slice, ...]]:
    """A valid layout, grown one placement at a time from the placements still free."""
    model = MIG_MODELS[draw(st.sampled_from(MODELS))]
    layout: list[Slice] = []
    for _ in range(draw(st.integers(0, 7))):
        free = [Slice(p.name, s) for p in model.profiles for s in free_starts(model, layout, p.name)]
        if not free:
            break
        layout.append(draw(st.sampled_from(free)))
    return model, tuple(layout)


def _overlap_free(model: MigModel, layout: tuple[Slice, ...]) -> bool:
    spans = [set(range(s.start, s.start + model.profile(s.profile).memory_slices)) for s in layout]
    return sum(map(len, spans)) == len(set().union(*spans))


@settings(max_examples=200, deadline=None)
@given(_model_and_wanted())
def test_every_layout_pack_builds_is_valid_and_leaves_out_only_what_cannot_fit(case) -> None:
    model, wanted = case
    layout, left = pack(model, wanted)
    check_layout(model, layout)
    assert _overlap_free(model, layout)
    assert sorted([s.profile for s in layout] + list(left)) == sorted(wanted)
    for name in left:
        assert free_starts(model, layout, name) == (), f"{name} was left out but fits beside {layout}"


@settings(max_examples=200, deadline=None)
@given(_layout(), st.data())
def test_pack_keeps_the_slices_it_is_given(case, data) -> None:
    model, keep = case
    wanted = data.draw(st.lists(st.sampled_from([p.name for p in model.profiles]), max_size=6))
    layout, left = pack(model, wanted, keep)
    assert set(keep) <= set(layout)
    check_layout(model, layout)
    for name in left:
        assert free_starts(model, layout, name) == ()


@settings(max_examples=300, deadline=None)
@given(_layout(), st.data())
def test_fits_agrees_with_check_layout(case, data) -> None:
    model, layout = case
    profile = data.draw(st.sampled_from([*(p.name for p in model.profiles), "9g.99gb"]))
    start = data.draw(st.integers(0, 7))
    try:
        check_layout(model, [*layout, Slice(profile, start)])
        valid = True
    except MigLayoutError:
        valid = False
    assert fits(model, layout, profile, start) == valid


@settings(max_examples=200, deadline=None)
@given(_layout())
def test_room_counts_the_placements_fits_allows(case) -> None:
    model, layout = case
    possible = [(p.name, s) for p in model.profiles for s in range(8)]
    assert room(model, layout) == sum(fits(model, layout, name, s) for name, s in possible)


@settings(max_examples=200, deadline=None)
@given(_layout(), st.data())
def test_fill_keeps_the_layout_stays_valid_and_leaves_no_placement(case, data) -> None:
    model, keep = case
    names = [p.name for p in model.profiles]
    asked = data.draw(st.dictionaries(st.sampled_from([*names, "9g.99gb"]), st.integers(-1, 9), max_size=4))
    wanted = data.draw(st.lists(st.sampled_from(names), max_size=3))
    layout = fill(model, keep, asked, wanted)
    check_layout(model, layout)
    assert set(keep) <= set(layout)
    assert room(model, layout) == 0, f"{layout} still has room"
    # Every wanted slice pack would place beside keep is there (the rest is free slices).
    placed = Counter(s.profile for s in pack(model, wanted, keep)[0] if s not in keep)
    assert not placed - Counter(s.profile for s in layout if s not in keep)
    assert fill(model, keep, asked, wanted) == layout  # deterministic


def test_fill_follows_the_mix_of_the_asks() -> None:
    h100 = MIG_MODELS["H100-80GB"]
    keep = [Slice("3g.40gb", 0)]
    assert [str(s) for s in fill(h100, keep, {"3g.40gb": 1})] == ["3g.40gb@0", "3g.40gb@4"]
    # Twice as many 1g.10gb asks as 1g.20gb: the four memory slices left get two of one and one of the other.
    added = [s.profile for s in fill(h100, keep, {"1g.10gb": 2, "1g.20gb": 1}) if s not in keep]
    assert sorted(added) == ["1g.10gb", "1g.10gb", "1g.20gb"]
    # A profile that cannot fit any more (7g) is passed over; nothing asked: the smallest slices.
    assert fill(h100, keep, {"7g.80gb": 5}) == fill(h100, keep) == pack(h100, ["1g.10gb"] * 4, keep)[0]


def test_a_wanted_slice_is_re_packed_with_the_fill_where_it_wastes_nothing() -> None:
    h100 = MIG_MODELS["H100-80GB"]
    # Laid out alone a 1g.10gb goes to 6 (the most room), which leaves memory slice 7 to no profile;
    # re-packed with the 3g.40gb asked lately, the 3g.40gb takes 4-7 and four 1g.10gb fit beside it.
    assert pack(h100, ["1g.10gb"])[0] == (Slice("1g.10gb", 6),)
    layout = fill(h100, (), {"3g.40gb": 2, "1g.10gb": 1}, ["1g.10gb"])
    assert [str(s) for s in layout] == ["1g.10gb@0", "1g.10gb@1", "1g.10gb@2", "1g.10gb@3", "3g.40gb@4"]


@settings(max_examples=200, deadline=None)
@given(_layout())
def test_room_never_grows_when_a_slice_is_added(case) -> None:
    model, layout = case
    for cut in range(len(layout)):
        assert room(model, layout[: cut + 1]) <= room(model, layout[:cut])


@pytest.mark.parametrize("model", MODELS)
def test_seven_small_slices_fill_a_gpu_and_an_eighth_does_not_fit(model: str) -> None:
    mig = MIG_MODELS[model]
    small = mig.profiles[0].name
    layout, left = pack(mig, [small] * 8)
    assert [s.start for s in layout] == [0, 1, 2, 3, 4, 5, 6]
    assert left == (small,)


def test_a_3g_slice_at_4_blocks_the_1g_placements_4_5_and_6() -> None:
    layout = [Slice("3g.20gb", 4)]
    assert occupied(A100_40, layout) == frozenset({4, 5, 6, 7})
    assert free_starts(A100_40, layout, "1g.5gb") == (0, 1, 2, 3)
    assert free_starts(A100_40, layout, "3g.20gb") == (0,)


@pytest.mark.parametrize("model", MODELS)
def test_a_4g_and_a_3g_fill_the_gpu(model: str) -> None:
    mig = MIG_MODELS[model]
    four, three = (next(p.name for p in mig.profiles if p.compute_slices == g) for g in (4, 3))
    layout, left = pack(mig, [three, four])
    assert left == ()
    assert layout == (Slice(four, 0), Slice(three, 4))
    assert room(mig, layout) == 0


@pytest.mark.parametrize("model", MODELS)
def test_a_7g_slice_stands_alone(model: str) -> None:
    mig = MIG_MODELS[model]
    whole = next(p.name for p in mig.profiles if p.compute_slices == 7)
    assert pack(mig, [whole]) == ((Slice(whole, 0),), ())
    assert room(mig, [Slice(whole, 0)]) == 0
    others = [p.name for p in mig.profiles if p.name != whole]
    assert pack(mig, [whole, *others])[1] == tuple(others)


def test_two_3g_slices_use_all_memory_though_one_compute_slice_is_left() -> None:
    layout, left = pack(A100_40, ["3g.20gb", "3g.20gb", "1g.5gb"])
    assert layout == (Slice("3g.20gb", 0), Slice("3g.20gb", 4))
    assert left == ("1g.5gb",)


def test_the_first_3g_goes_where_it_leaves_the_most_room() -> None:
    """At 4 it leaves the 4g placement at 0 open; at 0 it would leave only the second 3g's."""
    layout, _ = pack(A100_40, ["3g.20gb"])
    assert layout == (Slice("3g.20gb", 4),)
    assert room(A100_40, [Slice("3g.20gb", 4)]) > room(A100_40, [Slice("3g.20gb", 0)])


def test_a_mixed_layout_of_the_guide() -> None:
    """The guide's example: 4g.20gb at 0, 2g.10gb at 4, 1g.5gb at 6 (`nvidia-smi mig -cgi 19,14,5`)."""
    check_layout(A100_40, [Slice("1g.5gb", 6), Slice("2g.10gb", 4), Slice("4g.20gb", 0)])
    layout, left = pack(A100_40, ["1g.5gb", "2g.10gb", "4g.20gb"])
    assert left == ()
    assert layout == (Slice("4g.20gb", 0), Slice("2g.10gb", 4), Slice("1g.5gb", 6))


@pytest.mark.parametrize(
    ("layout", "rule"),
    [
        ([Slice("5g.30gb", 0)], "has no MIG profile '5g.30gb'"),
        ([Slice("3g.20gb", 2)], "2 is not a valid start for 3g.20gb"),
        ([Slice("1g.5gb", 7)], "7 is not a valid start for 1g.5gb"),
        ([Slice("4g.20gb", 0), Slice("1g.5gb", 3)], "overlaps 4g.20gb@0 at memory slice 3"),
        ([Slice("1g.10gb", s) for s in (0, 2, 4, 6)] + [Slice("3g.20gb", 0)], "overlaps"),
        ([Slice("2g.10gb", 0), Slice("2g.10gb", 2), Slice("2g.10gb", 4), Slice("1g.10gb", 6)], None),
    ],
)
def test_check_layout_names_the_slice_and_the_rule(layout: list[Slice], rule: str | None) -> None:
    if rule is None:
        check_layout(A100_40, layout)
        return
    with pytest.raises(MigLayoutError, match=re.escape(rule)):
        check_layout(A100_40, layout)


def test_a_full_gpu_has_no_room_left() -> None:
    full = [Slice("2g.10gb", 0), Slice("2g.10gb", 2), Slice("2g.10gb", 4), Slice("1g.5gb", 6)]
    check_layout(A100_40, full)
    assert room(A100_40, full) == 0


def test_more_compute_slices_than_the_gpu_has_are_refused() -> None:
    """The tables' starts keep real layouts within 7 compute slices; the rule still holds for a model with
    fewer (a 6-slice part)."""
    six = MigModel(model="six-slice", profiles=A100_40.profiles, compute_slices=6)
    with pytest.raises(
        MigLayoutError,
        match=re.escape("slice 3g.20gb@4: the layout would use 7 compute slices and six-slice has 6"),
    ):
        check_layout(six, [Slice("4g.20gb", 0), Slice("3g.20gb", 4)])
    assert not fits(six, [Slice("4g.20gb", 0)], "3g.20gb", 4)


def test_more_instances_than_a_profile_allows_are_refused() -> None:
    two = tuple(replace(p, max_instances=2) if p.name == "1g.5gb" else p for p in A100_40.profiles)
    model = MigModel(model="two-small", profiles=two)
    with pytest.raises(
        MigLayoutError, match=re.escape("slice 1g.5gb@2: two-small allows at most 2 instance")
    ):
        check_layout(model, [Slice("1g.5gb", 0), Slice("1g.5gb", 1), Slice("1g.5gb", 2)])
    assert free_starts(model, [Slice("1g.5gb", 0), Slice("1g.5gb", 1)], "1g.5gb") == ()


@pytest.mark.parametrize(
    ("model", "mib", "profile"),
    [
        ("A100-40GB", 1, "1g.5gb"),
        ("A100-40GB", 4864, "1g.5gb"),
        ("A100-40GB", 4865, "1g.10gb"),  # ties with 2g.10gb on memory: fewer compute slices win
        ("A100-40GB", 10_000, "3g.20gb"),
        ("A100-40GB", 20_000, "7g.40gb"),
        ("A100-40GB", 40_193, None),
        ("H100-80GB", 20 * 1024, "3g.40gb"),
        ("H200-141GB", 20 * 1024, "1g.35gb"),
    ],
)
def test_smallest_fitting_profile(model: str, mib: int, profile: str | None) -> None:
    found = smallest_fitting(MIG_MODELS[model], mib)
    assert (found.name if found else None) == profile


def test_a_slice_is_written_profile_at_start() -> None:
    assert str(Slice("3g.40gb", 4)) == "3g.40gb@4"
    assert Slice.parse("3g.40gb@4") == Slice("3g.40gb", 4)
    assert Slice.parse(str(Slice("7g.141gb", 0))) == Slice("7g.141gb", 0)
    for bad in ("3g.40gb", "3g.40gb@", "@4", "3g.40gb@-1", "3g@4", "3g.40gb@4x"):
        with pytest.raises(MigLayoutError, match=r"is not written <profile>@<start>"):
            Slice.parse(bad)
