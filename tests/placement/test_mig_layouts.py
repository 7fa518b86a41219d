"""The layout planner (docs/mig.md, "Dynamic layouts"): which idle GPUs to re-partition for waiting MIG
pods, and which to give back to fractions, packed by gpufrac.mig.geometry and deterministic."""

from __future__ import annotations

import random
import re
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpufrac.mig.geometry import Slice, check_layout, room
from gpufrac.mig.profiles import MIG_MODELS, mig_model
from gpufrac.placement.mig_layouts import FractionWait, IdleGpu, MigWait, RecentMigAsks, plan_layouts
from gpufrac.placement.model import GpuMode

H100 = "H100-80GB"


def idle(node: str, index: int, mode: GpuMode = GpuMode.FRACTIONS, slices: str = "", model: str = H100):
    layout = tuple(Slice.parse(s) for s in slices.split()) if slices else ()
    return IdleGpu(node, f"{node}-g{index}", index, model, 81559, mode, layout)


def wait(key: str, *profiles: str, nodes: set[str] | None = None) -> MigWait:
    return MigWait(key, {H100: profiles}, None if nodes is None else frozenset(nodes))


def test_a_waiting_3g_pod_gets_an_idle_gpu_laid_out_for_it_and_the_rest_filled_alike():
    (change,) = plan_layouts([wait("ns/a", "3g.40gb")], [], [idle("n1", 0)])
    assert change.node == "n1" and change.uuid == "n1-g0" and change.mode is GpuMode.MIG
    # Its slice, and the rest of the GPU in the profile asked: the next 3g pod needs no change.
    assert [str(s) for s in change.slices] == ["3g.40gb@0", "3g.40gb@4"]
    assert change.serves == ("ns/a",)
    (bare,) = plan_layouts([wait("ns/a", "3g.40gb")], [], [idle("n1", 0)], fill_rest=False)
    assert [s.profile for s in bare.slices] == ["3g.40gb"] and bare.serves == ("ns/a",)


def test_the_rest_of_the_gpu_follows_the_pods_seen_lately_then_the_smallest_slices():
    recent = RecentMigAsks()
    recent.add([wait("ns/r1", "3g.40gb"), wait("ns/r2", "3g.40gb")])
    (change,) = plan_layouts([wait("ns/a", "1g.10gb")], [], [idle("n1", 0)], recent=recent.waits())
    # A 3g.40gb for the pods seen lately, the rest in 1g.10gb like the pod waiting now.
    assert Counter(s.profile for s in change.slices) == {"1g.10gb": 4, "3g.40gb": 1}
    assert change.serves == ("ns/a",)
    (alone,) = plan_layouts([wait("ns/a", "1g.10gb")], [], [idle("n1", 0)])
    assert Counter(s.profile for s in alone.slices) == {"1g.10gb": 7}
    # Asked lately: nothing that still fits beside a 4g.40gb; the rest goes to the smallest slices.
    (big,) = plan_layouts([wait("ns/b", "4g.40gb")], [], [idle("n1", 0)], recent=[wait("ns/r", "7g.80gb")])
    assert sorted(str(s) for s in big.slices) == ["1g.10gb@4", "1g.10gb@5", "1g.10gb@6", "4g.40gb@0"]


def test_recent_asks_keep_the_last_pods_once_each():
    recent = RecentMigAsks(size=2)
    recent.add([wait("ns/a", "1g.10gb"), wait("ns/b", "3g.40gb")])
    recent.add([wait("ns/a", "1g.20gb"), wait("ns/c", "2g.20gb")])
    assert [(w.key, w.profiles[H100]) for w in recent.waits()] == [
        ("ns/a", ("1g.20gb",)),
        ("ns/c", ("2g.20gb",)),
    ]
    with pytest.raises(ValueError, match=re.escape("size 0: the number of recent MIG asks kept must be")):
        RecentMigAsks(size=0)


_PROFILES = [p.name for p in MIG_MODELS[H100].profiles]


@settings(max_examples=100, deadline=None)
@given(
    st.lists(st.lists(st.sampled_from(_PROFILES), min_size=1, max_size=3), min_size=1, max_size=6),
    st.lists(st.sampled_from(_PROFILES), max_size=5),
    st.lists(st.sampled_from(["", "3g.40gb@0", "1g.10gb@6 2g.20gb@0", "7g.80gb@0"]), min_size=1, max_size=3),
)
def test_every_filled_layout_is_valid_holds_the_pods_it_serves_and_leaves_no_room(asks, seen, gpus):
    pods = [wait(f"ns/p{i}", *profiles) for i, profiles in enumerate(asks)]
    recent = [wait(f"ns/r{i}", p) for i, p in enumerate(seen)]
    idle_gpus = [
        idle("n", i, GpuMode.MIG if text else GpuMode.FRACTIONS, text) for i, text in enumerate(gpus)
    ]
    model = mig_model(H100)
    assert model is not None
    changes = plan_layouts(pods, [], idle_gpus, recent=recent)
    bare = plan_layouts(pods, [], idle_gpus, fill_rest=False)
    assert [(c.uuid, c.serves) for c in changes] == [(c.uuid, c.serves) for c in bare]
    by_key = {w.key: w for w in pods}
    for change in changes:
        check_layout(model, change.slices)
        assert room(model, change.slices) == 0, f"{change.describe()} leaves room"
        held = Counter(s.profile for s in change.slices)
        needed = Counter(p for key in change.serves for p in by_key[key].profiles[H100])
        assert not needed - held, f"{change.describe()} lacks slices for {change.serves}"


def test_pods_share_one_gpu_and_the_layout_is_valid():
    pods = [
        wait("ns/a", "1g.10gb"),
        wait("ns/b", "3g.40gb"),
        wait("ns/c", "2g.20gb"),
        wait("ns/d", "1g.10gb"),
    ]
    (change,) = plan_layouts(pods, [], [idle("n1", 0), idle("n1", 1)])
    model = mig_model(H100)
    assert model is not None
    check_layout(model, change.slices)
    assert sorted(change.serves) == ["ns/a", "ns/b", "ns/c", "ns/d"]


def test_gpus_in_mode_mig_come_first_and_keep_their_slices_when_the_wanted_fit_beside():
    gpus = [idle("a", 0), idle("b", 0, GpuMode.MIG, "3g.40gb@0")]
    (change,) = plan_layouts([wait("ns/p", "2g.20gb")], [], gpus)
    assert change.uuid == "b-g0"
    assert Slice("3g.40gb", 0) in change.slices and any(s.profile == "2g.20gb" for s in change.slices)


def test_a_mig_gpu_is_laid_out_anew_when_its_slices_leave_no_room():
    gpus = [idle("b", 0, GpuMode.MIG, "4g.40gb@0")]
    (change,) = plan_layouts([wait("ns/p", "3g.40gb"), wait("ns/q", "3g.40gb")], [], gpus)
    assert sorted(str(s) for s in change.slices) == ["3g.40gb@0", "3g.40gb@4"]
    assert change.serves == ("ns/p", "ns/q")


def test_only_nodes_the_pod_may_use_and_only_mig_capable_models():
    gpus = [idle("a", 0), idle("b", 0, model="NVIDIA L4"), idle("c", 0, model="NVIDIA L4")]
    changes = plan_layouts([wait("ns/p", "1g.10gb", nodes={"b", "c"})], [], gpus)
    assert changes == []
    (change,) = plan_layouts([wait("ns/p", "1g.10gb", nodes={"a"})], [], gpus)
    assert change.node == "a"


def test_a_pod_whose_slices_fit_on_no_one_gpu_gets_nothing():
    assert plan_layouts([wait("ns/p", "7g.80gb", "1g.10gb")], [], [idle("a", 0)]) == []


def test_fractions_that_no_pool_holds_take_idle_mig_and_whole_gpus_back():
    gpus = [
        idle("a", 0, GpuMode.MIG, "7g.80gb@0"),
        idle("a", 1, GpuMode.WHOLE),
        idle("b", 0, GpuMode.MIG, "1g.10gb@0"),
    ]
    half = FractionWait("ns/f", lambda mib: mib // 2)
    third = FractionWait("ns/g", lambda mib: mib // 3)
    big = FractionWait("ns/h", lambda mib: mib, nodes=frozenset({"b"}))
    changes = plan_layouts([], [half, third, big], gpus)
    assert [(c.uuid, c.mode, c.serves) for c in changes] == [
        ("a-g0", GpuMode.FRACTIONS, ("ns/f", "ns/g")),
        ("b-g0", GpuMode.FRACTIONS, ("ns/h",)),
    ]


def test_mig_demand_goes_first_and_a_gpu_is_changed_once():
    gpus = [idle("a", 0, GpuMode.MIG, "7g.80gb@0")]
    changes = plan_layouts([wait("ns/m", "3g.40gb")], [FractionWait("ns/f", lambda mib: 1000)], gpus)
    assert [(c.uuid, c.mode) for c in changes] == [("a-g0", GpuMode.MIG)]


def test_the_plan_is_the_same_whatever_order_the_gpus_come_in():
    gpus = [idle(n, i, mode) for n in "abc" for i in range(2) for mode in (GpuMode.FRACTIONS, GpuMode.WHOLE)][
        :6
    ]
    pods = [
        wait(f"ns/p{i}", p) for i, p in enumerate(["3g.40gb", "4g.40gb", "1g.10gb", "7g.80gb", "2g.20gb"])
    ]
    want = plan_layouts(pods, [], gpus)
    for seed in range(5):
        shuffled = list(gpus)
        random.Random(seed).shuffle(shuffled)
        assert plan_layouts(pods, [], shuffled) == want
    served = [k for c in want for k in c.serves]
    assert sorted(served) == sorted(p.key for p in pods)
