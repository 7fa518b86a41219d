"""The stranded-room estimate by hand, fgd-room closing rooms that fgd-plus cuts down to dead ends, and
its look-ahead giving the last free GPU of a batch to the share whose room later shares fill."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from placement_builders import fraction, node, pod, whole

from gpufrac.contract.request import ComputeMode, GpuMemory
from gpufrac.placement.decision import ContainerPlacement, DeviceAssignment, Placement
from gpufrac.placement.engine import Engine
from gpufrac.placement.policies import DEFAULT_POLICY, make_policy
from gpufrac.placement.room_waste import RoomWaste, one_gpu_shares, stranded_table
from gpufrac.placement.typical import PriorTypicalPods, TypicalPod, select_typical

MIB = 16384


def share(portion: float) -> TypicalPod:
    return TypicalPod(cpu_milli=0, memory=GpuMemory(portion=portion))


WHOLE = TypicalPod(cpu_milli=0, memory=None, exclusive=True)
CPU_ONLY = TypicalPod(cpu_milli=1000, memory=None)
# Whole GPUs 40 %, then 0.65, 0.47 and 0.32 shares at 20 % each.
PRIOR = Counter({WHOLE: 2, share(0.65): 1, share(0.47): 1, share(0.32): 1})


def test_without_shares_every_partial_room_is_stranded_and_a_whole_gpu_is_not():
    table = stranded_table([])
    assert table[1000] == 0
    assert table[:1000].tolist() == list(range(1000))


def test_a_room_the_common_share_fills_exactly_is_hardly_stranded_one_only_rare_pods_fit_mostly_is():
    table = stranded_table([(500, 0.99), (200, 0.01)])
    assert table[0] == 0
    # 499: only the 0.2 pods fit, twice at most: 499 -> 299 -> 99 (nothing fits 99).
    w299 = (0.01 * 99 + 0.005 * 299) / 0.015
    assert table[499] == pytest.approx((0.01 * w299 + 0.005 * 499) / 0.015)
    assert table[500] < 0.01 * 500  # the 0.5 pods close it
    assert table[400] == pytest.approx((0.01 * table[200] + 0.005 * 400) / 0.015)
    assert table[200] > 0.3 * 200  # only the 1 % pods fit: two thirds of it stays empty
    assert table[199] == 199  # nothing fits


def test_stop_weight_must_be_positive():
    with pytest.raises(ValueError, match="stop must be positive, got 0"):
        stranded_table([(500, 1.0)], stop=0)


def test_shares_are_weighted_among_the_gpu_pods_only():
    typical = select_typical(Counter({WHOLE: 2, share(0.5): 1, CPU_ONLY: 1}), coverage=1.0)
    assert one_gpu_shares(typical, MIB) == [(500, pytest.approx(1 / 3))]


def _book(e: Engine, portion: float, node_name: str) -> None:
    """A time-slicing pod of ``portion`` already bound on GPU 0 of ``node_name``."""
    p = pod(fraction(portion))
    mib = int(portion * MIB)
    device = DeviceAssignment(f"{node_name}-g0", 0, mib, mib, None)
    e.assume(
        p,
        Placement(
            p.uid, node_name, (ContainerPlacement("main", ComputeMode.TIME_SLICING, False, (device,)),)
        ),
    )


def _cluster(policy: str, seed: int) -> Engine:
    """x: one GPU holding a 0.47 (0.53 free); y: one GPU holding a 0.32 (0.68 free)."""
    e = Engine(policy=policy, seed=seed, typical=PRIOR)
    e.add_node(node("x", gpus=1, mib=MIB))
    e.add_node(node("y", gpus=1, mib=MIB))
    _book(e, 0.47, "x")
    _book(e, 0.32, "y")
    return e


@pytest.mark.parametrize("seed", range(4))
def test_fgd_room_leaves_rooms_later_shares_use_where_fgd_plus_leaves_dead_ends(seed):
    """A 0.32, a 0.47 and a 0.32 arrive. Next to the 0.47 on x the first 0.32 would leave 0.21, which no
    typical pod fits, yet FGD's measure falls there (the 0.53 room already counted as a fragment for
    whole GPUs and 0.65s), so fgd-plus takes it; the 0.47 then cuts y down to 0.21 too and the last
    0.32 finds no room. fgd-room puts the first 0.32 next to the other 0.32 on y (0.36 left, which a
    0.32 closes), the 0.47 next to the 0.47 on x (0.06 left), and the last 0.32 fits on y."""
    outcome = {}
    for policy in ("fgd-plus", "fgd-room"):
        e = _cluster(policy, seed)
        decisions = [e.place(pod(fraction(p))) for p in (0.32, 0.47, 0.32)]
        outcome[policy] = [d.node if isinstance(d, Placement) else None for d in decisions]
    assert outcome == {"fgd-plus": ["x", "y", None], "fgd-room": ["y", "x", "y"]}


def test_fgd_room_is_the_default_and_leaves_whole_gpu_pods_to_fgd():
    assert DEFAULT_POLICY == "fgd-room"
    policy = make_policy("fgd-room", PRIOR)
    room = policy.scorers[0][0]
    assert isinstance(room, RoomWaste)
    e = _cluster("fgd-room", 0)
    e.add_node(node("z", gpus=1, mib=MIB))
    placed = e.place(pod(whole(1)))
    assert isinstance(placed, Placement) and placed.node == "z"  # the only empty GPU


def test_fgd_room_learns_online_once_per_request():
    """No prior: the FGD key feeds the shared typical source, the room key reads it (one count each)."""
    e = Engine(policy="fgd-room", seed=0)
    e.add_node(node("a", gpus=2, mib=MIB))
    policy = e.policy("fgd-room")
    room = policy.scorers[0][0]
    assert isinstance(room, RoomWaste)
    assert len(policy.learning) == 1
    e.place(pod(fraction(0.5)))
    e.place(pod(fraction(0.25)))
    learned = room.source.current()
    assert sorted(p.memory.portion for p in learned.pods) == [0.25, 0.5]
    assert np.isclose(learned.weights.sum(), 1.0)


def test_room_scores_follow_the_gpu_size_of_each_node():
    """A MiB request is a different share of a 16 GiB and a 32 GiB GPU; each node's table is its own."""
    typical = PriorTypicalPods(Counter({share(0.5): 1}))
    scorer = RoomWaste(typical)
    small, large = scorer.table(16384), scorer.table(32768)
    assert small is not large and np.array_equal(small, large)  # portions: the same thousandths
    assert scorer.table(16384) is small  # memoised per snapshot


def test_a_mib_request_is_scored_against_each_gpu_size():
    """8 GiB is half of a 16 GiB GPU (an exact fit for the typical 0.5 pods that follow) but a quarter
    of a 32 GiB one (0.75 left, of which a 0.5 pod closes only two thirds)."""
    from placement_builders import mib

    from gpufrac.placement.demand import demand_of
    from gpufrac.placement.filters import GpuRules, resource_fit

    e = Engine(policy="fgd-room", seed=0, typical=Counter({share(0.5): 1}))
    e.add_node(node("small", gpus=1, mib=16384))
    e.add_node(node("large", gpus=1, mib=32768))
    demand = demand_of(pod(mib(8192)), policy="fgd-room")
    fit = resource_fit(e.state, demand, e.state.live(), GpuRules()).feasible()
    scorer = RoomWaste(PriorTypicalPods(Counter({share(0.5): 1})))
    assert scorer.one_size(e.state) == 0
    values = scorer.per_gpu(e.state, demand, fit)[:, 0]
    table = scorer.table(16384)
    by_node = dict(zip((e.state.nodes[i].name for i in fit.nodes.tolist()), values.tolist(), strict=True))
    assert by_node == {"small": RoomWaste.CLIP - table[500], "large": RoomWaste.CLIP - table[750]}
    assert table[500] < 5 and table[750] > 240
    assert e.place(pod(mib(8192))).node == "small"


def test_a_batch_gives_the_last_free_gpu_to_the_share_whose_room_the_common_shares_fill():
    """One empty GPU, a batch of a 0.55 and a 0.47 (they do not fit together). Largest first (fgd-plus)
    gives the GPU to the 0.55, whose 0.45 room no typical share fits; fgd-room gives it to the 0.47,
    whose 0.53 room the common 0.47s close, and the 0.55 waits."""
    prior = Counter({WHOLE: 2, share(0.47): 2, share(0.55): 1})
    placed = {}
    for policy in ("fgd-plus", "fgd-room"):
        e = Engine(policy=policy, seed=0, typical=prior)
        e.add_node(node("x", gpus=1, mib=MIB))
        batch = [pod(fraction(0.55), name="big"), pod(fraction(0.47), name="small")]
        decisions = e.schedule(batch)
        placed[policy] = [p.name for p, d in zip(batch, decisions, strict=True) if isinstance(d, Placement)]
    assert placed == {"fgd-plus": ["big"], "fgd-room": ["small"]}


def test_batch_order_whole_gpus_first_then_shares_by_stranded_room_then_cpu_only_and_it_follows_learning():
    """Before any share is learned every room is stranded, so shares go largest first; once the 0.47s
    are known, a 0.47 (0.53 left, which a 0.47 closes) goes before a 0.55 (0.45 left, nothing fits)."""
    e = Engine(policy="fgd-room", seed=0)
    e.add_node(node("a", gpus=4, mib=MIB))
    pods = {
        "two whole": pod(whole(2)),
        "whole": pod(whole(1)),
        "0.55": pod(fraction(0.55)),
        "0.47": pod(fraction(0.47)),
        "cpu only": pod(cpu_milli=500),
    }

    def order() -> list[str]:
        return sorted(pods, key=lambda name: e.batch_key(pods[name]), reverse=True)

    assert order() == ["two whole", "whole", "0.55", "0.47", "cpu only"]
    for _ in range(3):
        e.place(pod(fraction(0.47)))  # learned online: the typical shares are now 0.47s
    assert order() == ["two whole", "whole", "0.47", "0.55", "cpu only"]
    assert Engine(policy="fgd-plus", seed=0).batch_key(pods["0.55"]) == (550, 0, 0)  # largest first
    # Equal shares keep their arrival order whatever CPU they ask for (CPU-heavy ones in a row would use
    # up the CPU of the nodes they land on).
    assert e.batch_key(pod(fraction(0.47), cpu_milli=8000)) == e.batch_key(pod(fraction(0.47), cpu_milli=100))


def _cpu_tight_cluster(host: bool, *, light: TypicalPod | None = None) -> Engine:
    """tight: two GPUs, a 0.47 (8 cores) on GPU 0, 20 cores in all (12 free); roomy: one empty GPU,
    32 cores. The typical pods ask for 8 cores each (and ``light``, if given, is typical too)."""
    prior = Counter(
        {
            TypicalPod(cpu_milli=8000, memory=None, exclusive=True): 2,
            TypicalPod(cpu_milli=8000, memory=GpuMemory(portion=0.47)): 1,
        }
    )
    if light is not None:
        prior[light] = 1
    e = Engine(policy="fgd-room", seed=0, typical=prior)
    e.add_node(node("tight", gpus=2, mib=MIB, cpu=20_000))
    e.add_node(node("roomy", gpus=1, mib=MIB, cpu=32_000))
    p = pod(fraction(0.47), cpu_milli=8000)
    mib = int(0.47 * MIB)
    device = DeviceAssignment("tight-g0", 0, mib, mib, None)
    e.assume(
        p,
        Placement(p.uid, "tight", (ContainerPlacement("main", ComputeMode.TIME_SLICING, False, (device,)),)),
    )
    room = e.policy("fgd-room").scorers[0][0]
    assert isinstance(room, RoomWaste)
    room.host = host
    return e


@pytest.mark.parametrize("host", [True, False])
def test_a_share_does_not_close_a_room_with_cpu_the_node_needs_for_its_other_gpu(host):
    """A 0.47, a whole GPU and a 0.47 arrive, 8 cores each. The stranded room alone puts the first 0.47
    next to the other on tight (0.06 left) and leaves tight 4 cores, too few for anything on its empty
    GPU: the whole GPU goes to roomy and the last 0.47 fits nowhere. Charged for the GPU its CPU
    strands, the first 0.47 opens roomy's GPU, the whole GPU takes tight's, and the last 0.47 joins the
    first on roomy."""
    e = _cpu_tight_cluster(host)
    decisions = [
        e.place(pod(fraction(0.47), cpu_milli=8000)),
        e.place(pod(whole(1), cpu_milli=8000)),
        e.place(pod(fraction(0.47), cpu_milli=8000)),
    ]
    nodes = [d.node if isinstance(d, Placement) else None for d in decisions]
    assert nodes == (["roomy", "tight", "roomy"] if host else ["tight", "roomy", None])


def test_cpu_stranded_is_the_room_typical_pods_lose_when_the_share_leaves_too_little_cpu_for_any():
    from gpufrac.placement.demand import demand_of
    from gpufrac.placement.filters import GpuRules, resource_fit
    from gpufrac.placement.fragmentation import cpu_stranded

    def stranded(e: Engine, cpu_milli: int) -> dict[str, list[float]]:
        """cpu_stranded of a 0.47 asking for ``cpu_milli`` on GPUs 0 and 1 of each node."""
        demand = demand_of(pod(fraction(0.47), cpu_milli=cpu_milli), policy="fgd-room")
        fit = resource_fit(e.state, demand, e.state.live(), GpuRules()).feasible()
        typical = e.policy("fgd-room").scorers[0][0].source.current()
        values = cpu_stranded(e.state, typical, demand, fit)
        return {e.state.nodes[i].name: values[row, :2].tolist() for row, i in enumerate(fit.nodes.tolist())}

    heavy = stranded(_cpu_tight_cluster(True), 8000)
    # On tight, 12 cores fall to 4. On GPU 0 (0.06 left) both typical pods lose the empty GPU 1; on
    # GPU 1 no GPU is left whole, so only the 0.47s lose something: the two 0.53 rooms.
    whole_weight, share_weight = 2 / 3, 1 / 3
    assert heavy["tight"] == pytest.approx(
        [1000 * whole_weight + 1000 * share_weight, 2 * 530 * share_weight]
    )
    assert heavy["roomy"] == [0.0, 0.0]  # 32 cores: 24 left
    assert stranded(_cpu_tight_cluster(True), 4000)["tight"] == [0.0, 0.0]  # 12 cores fall to 8: enough

    # With a typical 0.81 that asks for 2 cores, the 4 cores left still host one: nothing is charged,
    # although the 8-core pods can no longer come (charging that kept shares off small nodes).
    e = _cpu_tight_cluster(True, light=TypicalPod(cpu_milli=2000, memory=GpuMemory(portion=0.81)))
    assert stranded(e, 8000)["tight"] == [0.0, 0.0]


def test_a_batch_keeps_arrival_order_among_shares_whose_stranded_rooms_fall_in_one_tier():
    """A 0.47 and a 0.46 strand almost the same room (one tier), so the one that came first gets the last
    room of a batch whichever it is; a 0.55, whose room nothing fills, waits for a later tier. Ranked by
    the exact stranded room, one size would win every time and pods of one shape would line up."""
    prior = Counter({WHOLE: 2, share(0.47): 1, share(0.46): 1})
    e = Engine(policy="fgd-room", seed=0, typical=prior)
    room = e.policy("fgd-room").scorers[0][0]
    assert isinstance(room, RoomWaste)
    table = stranded_table(one_gpu_shares(room.source.current(), MIB), room.order_stop)
    assert table[530] != table[540]  # the exact measure tells them apart
    assert e.batch_key(pod(fraction(0.47))) == e.batch_key(pod(fraction(0.46)))
    assert e.batch_key(pod(fraction(0.47))) > e.batch_key(pod(fraction(0.55)))

    for first, second in ((0.47, 0.46), (0.46, 0.47)):
        e = Engine(policy="fgd-room", seed=0, typical=prior)
        e.add_node(node("x", gpus=1, mib=MIB))
        _book(e, 0.4, "x")  # 0.6 left: room for one of the two
        batch = [
            pod(fraction(0.55), name="late"),
            pod(fraction(first), name="a"),
            pod(fraction(second), name="b"),
        ]
        decisions = e.schedule(batch)
        placed = [p.name for p, d in zip(batch, decisions, strict=True) if isinstance(d, Placement)]
        assert placed == ["a"]
