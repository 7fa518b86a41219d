"""Where MIG slices may sit on one GPU, beside the slices already there.

A GPU has 8 memory slices and 7 compute slices. A GPU instance of a profile occupies ``memory_slices``
consecutive memory slices from one of its valid starts, and ``compute_slices`` of the compute slices.
A layout is valid when every slice has a known profile and a valid start, no two slices share a memory
slice, the compute slices add up to at most 7, and no profile has more instances than it allows (NVIDIA
MIG User Guide, "Supported MIG Profiles" and its placement diagrams). So a 3g slice at 4 takes memory
slices 4-7 and with them the 1g placements 4, 5 and 6: where a slice goes decides what still fits.

``room`` scores a layout by the placements still possible beside it, and ``pack`` builds a layout from a
list of wanted profiles, largest first, each at the start that leaves the most room.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from gpufrac.mig.profiles import MigModel, MigProfile

_SLICE = re.compile(r"^(?P<profile>[1-9][0-9]*g\.[0-9]+gb)@(?P<start>[0-9]+)$")


class MigLayoutError(ValueError):
    """A slice text or a layout that breaks a MIG rule; the message is one sentence naming both."""


@dataclass(frozen=True, slots=True, order=True)
class Slice:
    """One GPU instance of a layout: its profile and its placement start (a memory-slice offset)."""

    profile: str
    start: int

    def __str__(self) -> str:
        return f"{self.profile}@{self.start}"

    @classmethod
    def parse(cls, text: str) -> Slice:
        """``3g.40gb@4`` -> ``Slice("3g.40gb", 4)``; the profile is not checked against a model here."""
        match = _SLICE.match(text.strip()) if isinstance(text, str) else None
        if match is None:
            raise MigLayoutError(f"MIG slice {text!r} is not written <profile>@<start>, e.g. 3g.40gb@4")
        return cls(match["profile"], int(match["start"]))


def _profile(model: MigModel, slice_: Slice) -> MigProfile:
    profile = model.profile(slice_.profile)
    if profile is None:
        known = ", ".join(p.name for p in model.profiles)
        raise MigLayoutError(
            f"slice {slice_}: {model.model} has no MIG profile {slice_.profile!r} (it has {known})"
        )
    return profile


def _span(profile: MigProfile, start: int) -> range:
    return range(start, start + profile.memory_slices)


def occupied(model: MigModel, slices: Iterable[Slice]) -> frozenset[int]:
    """The memory slices the layout's slices take."""
    return frozenset(i for s in slices for i in _span(_profile(model, s), s.start))


def check_layout(model: MigModel, slices: Iterable[Slice]) -> None:
    """Raise :class:`MigLayoutError` naming the first slice that breaks a rule of ``model``."""
    taken: dict[int, Slice] = {}
    compute = 0
    count: dict[str, int] = {}
    for slice_ in slices:
        profile = _profile(model, slice_)
        if slice_.start not in profile.starts:
            valid = ", ".join(map(str, profile.starts))
            raise MigLayoutError(
                f"slice {slice_}: {slice_.start} is not a valid start for {profile.name} on {model.model}"
                f" (valid starts: {valid})"
            )
        for i in _span(profile, slice_.start):
            if i in taken:
                raise MigLayoutError(f"slice {slice_}: it overlaps {taken[i]} at memory slice {i}")
            taken[i] = slice_
        compute += profile.compute_slices
        if compute > model.compute_slices:
            raise MigLayoutError(
                f"slice {slice_}: the layout would use {compute} compute slices and {model.model} has"
                f" {model.compute_slices}"
            )
        count[profile.name] = count.get(profile.name, 0) + 1
        if count[profile.name] > profile.max_instances:
            raise MigLayoutError(
                f"slice {slice_}: {model.model} allows at most {profile.max_instances} instance(s) of"
                f" {profile.name}"
            )


def fits(model: MigModel, slices: Sequence[Slice], profile: str, start: int) -> bool:
    """Whether a ``profile`` slice at ``start`` can join the (valid) layout ``slices``."""
    wanted = model.profile(profile)
    if wanted is None or start not in wanted.starts:
        return False
    profiles = [_profile(model, s) for s in slices]
    if sum(p.compute_slices for p in profiles) + wanted.compute_slices > model.compute_slices:
        return False
    if sum(p.name == profile for p in profiles) >= wanted.max_instances:
        return False
    return occupied(model, slices).isdisjoint(_span(wanted, start))


def free_starts(model: MigModel, slices: Sequence[Slice], profile: str) -> tuple[int, ...]:
    """The starts at which a ``profile`` slice can join the layout, in order; empty for an unknown profile."""
    wanted = model.profile(profile)
    if wanted is None:
        return ()
    return tuple(start for start in wanted.starts if fits(model, slices, profile, start))


def smallest_fitting(model: MigModel, min_mib: int) -> MigProfile | None:
    """The profile with the least memory that still has ``min_mib``; ties go to fewer compute slices."""
    fitting = [p for p in model.profiles if p.memory_mib >= min_mib]
    return min(fitting, key=lambda p: (p.memory_mib, p.compute_slices), default=None)


def room(model: MigModel, slices: Sequence[Slice]) -> int:
    """How many (profile, start) placements are still possible beside the layout (higher: less fragmented)."""
    return _Taken.of(model, slices).room()


@dataclass(frozen=True, slots=True)
class _Placement:
    name: str
    start: int
    mask: int
    compute: int
    max_instances: int


@functools.cache
def _placements(model: MigModel) -> tuple[_Placement, ...]:
    return tuple(
        _Placement(p.name, s, ((1 << p.memory_slices) - 1) << s, p.compute_slices, p.max_instances)
        for p in model.profiles
        for s in p.starts
    )


@dataclass(frozen=True, slots=True)
class _Taken:
    """What a valid layout takes, as :func:`fits` reads it: memory slices (a bit mask), compute slices and
    instances per profile. :func:`room` and :func:`pack` ask it thousands of times per layout planned."""

    model: MigModel
    mask: int
    compute: int
    count: Mapping[str, int]

    @classmethod
    def of(cls, model: MigModel, slices: Iterable[Slice]) -> _Taken:
        taken = cls(model, 0, 0, {})
        for s in slices:
            taken = taken.plus(_profile(model, s), s.start)
        return taken

    def plus(self, profile: MigProfile, start: int) -> _Taken:
        count = dict(self.count)
        count[profile.name] = count.get(profile.name, 0) + 1
        mask = self.mask | (((1 << profile.memory_slices) - 1) << start)
        return _Taken(self.model, mask, self.compute + profile.compute_slices, count)

    def fits(self, p: _Placement) -> bool:
        return (
            not self.mask & p.mask
            and self.compute + p.compute <= self.model.compute_slices
            and self.count.get(p.name, 0) < p.max_instances
        )

    def room(self) -> int:
        return sum(self.fits(p) for p in _placements(self.model))


def _largest_first(model: MigModel, name: str) -> tuple[int, int, int]:
    profile = model.profile(name)
    assert profile is not None
    return (-profile.memory_slices, -profile.compute_slices, -profile.memory_mib)


def pack(
    model: MigModel, wanted: Sequence[str], keep: Sequence[Slice] = ()
) -> tuple[tuple[Slice, ...], tuple[str, ...]]:
    """A layout with ``keep`` and as many of ``wanted`` as fit, and the wanted names that did not fit.

    Largest profiles go first, each at the start that leaves the highest :func:`room` (the lowest start
    on a tie). ``keep`` must be a valid layout (:class:`MigLayoutError` otherwise); a name ``model`` has no
    profile for never fits. The layout is ordered by start; the names left out keep ``wanted``'s order.
    Since adding a slice never makes room for another, no name left out fits anywhere in the result.
    """
    check_layout(model, keep)
    layout = list(keep)
    taken = _Taken.of(model, keep)
    known = [(i, n) for i, n in enumerate(wanted) if model.profile(n) is not None]
    left = {i for i, n in enumerate(wanted) if model.profile(n) is None}
    for index, name in sorted(known, key=lambda item: (_largest_first(model, item[1]), item[0])):
        profile = _profile(model, Slice(name, 0))
        options = [p for p in _placements(model) if p.name == name and taken.fits(p)]
        if not options:
            left.add(index)
            continue
        best = max(options, key=lambda p: (taken.plus(profile, p.start).room(), -p.start))
        layout.append(Slice(name, best.start))
        taken = taken.plus(profile, best.start)
    return tuple(sorted(layout, key=lambda s: (s.start, s.profile))), tuple(wanted[i] for i in sorted(left))


def _smallest_first(model: MigModel, name: str) -> tuple[int, int, int, str]:
    profile = model.profile(name)
    assert profile is not None
    return (profile.memory_mib, profile.compute_slices, profile.memory_slices, name)


def fill(
    model: MigModel,
    keep: Sequence[Slice],
    asked: Mapping[str, int] | None = None,
    wanted: Sequence[str] = (),
) -> tuple[Slice, ...]:
    """``keep`` and ``wanted`` (as :func:`pack` lays them out) with free slices added until no profile of
    ``model`` fits (:func:`room` 0).

    The free slices follow ``asked`` (profile name -> how often it was asked lately): each next one is the
    profile that still fits with the highest ``asked / (slices of it added + 1)`` (the D'Hondt rule, so the
    added slices follow the mix of the asks; ties: the more asked, then the smaller). Every added slice is
    re-packed with ``wanted`` beside ``keep`` (:func:`pack`, largest first), so the wanted slices and the
    larger asked ones get the starts that suit them whatever order they were chosen in (a 1g.10gb laid
    out alone goes to start 6, where it leaves memory slice 7 to no one; beside a 3g.40gb it does not).
    Once no asked profile fits, the smallest profile that fits (memory, then compute slices, as
    :func:`smallest_fitting` prefers) is added until none does. ``keep`` stays where it is and must be
    valid (:class:`MigLayoutError` otherwise); a wanted name that does not fit is left out as by
    :func:`pack`; names ``model`` lacks are ignored. Ordered by start, as :func:`pack`'s.
    """
    layout, left = pack(model, wanted, keep)
    wanted = [n for n in wanted if model.profile(n) is not None]
    for name in left:
        if name in wanted:
            wanted.remove(name)
    weights = {n: w for n, w in (asked or {}).items() if w > 0 and model.profile(n) is not None}
    added: list[str] = []
    dead: set[str] = set()
    while True:
        live = [n for n in weights if n not in dead]
        if not live:
            break
        name = max(
            live,
            key=lambda n: (weights[n] / (added.count(n) + 1), weights[n], _largest_first(model, n), n),
        )
        trial, lost = pack(model, [*wanted, *added, name], keep)
        if lost:
            dead.add(name)
            continue
        added.append(name)
        layout = trial
    by_size = sorted((p.name for p in model.profiles), key=lambda n: _smallest_first(model, n))
    while True:
        name = next((n for n in by_size if free_starts(model, layout, n)), None)
        if name is None:
            return layout
        layout = pack(model, [name], layout)[0]
