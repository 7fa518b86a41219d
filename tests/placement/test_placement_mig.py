"""MIG slices and GPU modes in the engine (docs/mig.md, "Placement"): a MIG request takes a free slice of
its profile (a size request the smallest free slice that fits) on a GPU in mode mig, whole; a fraction
never lands on a MIG or whole-mode GPU; a whole-GPU pod takes an empty fractions GPU or a whole-mode one;
slices count their MiB against the queue; nothing is booked on a fenced GPU; and random mixes keep every
book exact (no slice double-booked, no mode mixed, release the inverse of apply)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_placement_engine import same, snapshot

from gpufrac.contract.request import ContainerGpuRequest, GpuMemory, MigRequest, PodGpuRequest
from gpufrac.mig.geometry import pack
from gpufrac.mig.profiles import mig_model
from gpufrac.placement.decision import ContainerPlacement, DeviceAssignment, Placement, Unschedulable
from gpufrac.placement.engine import Engine
from gpufrac.placement.model import GpuDevice, GpuMode, MigSlice, NodeSpec, PendingPod, Queue, Quota

H100 = "H100-80GB"
H100_MIB = 81559


def mig_gpu(uuid: str, index: int, layout: list[str], model: str = H100) -> GpuDevice:
    """A GPU in mode mig with the slices ``layout`` names (``3g.40gb@0``), sized from the profile table."""
    table = mig_model(model)
    assert table is not None
    slices = []
    for text in layout:
        profile, start = text.split("@")
        found = table.profile(profile)
        assert found is not None
        slices.append(MigSlice(profile, int(start), f"MIG-{uuid}-{start}", found.memory_mib))
    return GpuDevice(uuid, index, H100_MIB, model, GpuMode.MIG, tuple(slices))


def gpu(uuid: str, index: int, mode: GpuMode = GpuMode.FRACTIONS) -> GpuDevice:
    return GpuDevice(uuid, index, H100_MIB, H100, mode)


def node(name: str, *gpus: GpuDevice, **kw) -> NodeSpec:
    return NodeSpec(name, 64000, 256 << 30, gpus=gpus, gpu_model=H100, **kw)


def mig(profile: str | None = None, min_mib: int | None = None, count: int = 1, name: str = "c"):
    return ContainerGpuRequest(name, None, None, device_count=count, mig=MigRequest(profile, min_mib, count))


def fraction(mib: int, name: str = "c") -> ContainerGpuRequest:
    return ContainerGpuRequest(name, GpuMemory(mib=mib), None)


def whole(count: int = 1, name: str = "c") -> ContainerGpuRequest:
    return ContainerGpuRequest(name, None, None, device_count=count, exclusive=True)


def pod(name: str, *containers: ContainerGpuRequest, queue: str = "default", **kw) -> PendingPod:
    return PendingPod("ns", name, f"uid-{name}", gpu=PodGpuRequest(containers), queue=queue, **kw)


def devices(d) -> list[str]:
    assert isinstance(d, Placement), d
    return [u for c in d.containers for u in c.uuids]


def test_a_mig_request_takes_a_free_slice_of_its_profile_whole():
    e = Engine()
    e.add_node(node("n", mig_gpu("g0", 0, ["3g.40gb@0", "2g.20gb@4", "1g.10gb@6"]), gpu("g1", 1)))
    first = e.place(pod("a", mig("2g.20gb")))
    assert devices(first) == ["MIG-g0-4"]
    (c,) = first.containers
    assert c.mig and c.devices[0].request_mib == 20096 and c.devices[0].index == 0
    second = e.place(pod("b", mig("2g.20gb")))
    assert isinstance(second, Unschedulable)
    assert "1 node(s) had no free MIG slice of 2g.20gb" in second.message
    e.forget("uid-a")  # the slice is free again
    assert devices(e.place(pod("b", mig("2g.20gb")))) == ["MIG-g0-4"]


def test_a_size_request_takes_the_smallest_free_slice_that_fits():
    e = Engine()
    e.add_node(node("n", mig_gpu("g0", 0, ["3g.40gb@0", "2g.20gb@4", "1g.10gb@6"])))
    assert devices(e.place(pod("a", mig(min_mib=9000)))) == ["MIG-g0-6"]
    assert devices(e.place(pod("b", mig(min_mib=9000)))) == ["MIG-g0-4"]  # the 1g is taken: 2g next
    assert devices(e.place(pod("c", mig(min_mib=9000)))) == ["MIG-g0-0"]
    assert isinstance(e.place(pod("d", mig(min_mib=9000))), Unschedulable)


def test_several_slices_and_containers_of_one_pod_never_share_a_slice():
    e = Engine()
    e.add_node(node("n", mig_gpu("g0", 0, [f"1g.10gb@{i}" for i in range(7)])))
    placed = e.place(pod("a", mig("1g.10gb", count=3, name="x"), mig(min_mib=5000, name="y")))
    got = devices(placed)
    assert len(got) == 4 and len(set(got)) == 4
    assert isinstance(e.place(pod("b", mig("1g.10gb", count=4))), Unschedulable)
    assert len(devices(e.place(pod("c", mig("1g.10gb", count=3))))) == 3


def test_fractions_and_whole_gpus_never_land_on_a_mig_gpu():
    e = Engine()
    e.add_node(node("n", mig_gpu("g0", 0, ["7g.80gb@0"])))
    for p in (pod("f", fraction(1000)), pod("w", whole())):
        d = e.place(p)
        assert isinstance(d, Unschedulable)
    assert "had no GPU in fractions mode" in e.place(pod("f2", fraction(1000))).message  # type: ignore[union-attr]
    assert "had only MIG or re-partitioning GPUs" in e.place(pod("w2", whole())).message  # type: ignore[union-attr]


def test_a_whole_mode_gpu_takes_whole_gpu_pods_only_and_a_mig_pod_needs_a_mig_gpu():
    e = Engine()
    e.add_node(node("n", gpu("w0", 0, GpuMode.WHOLE), gpu("f0", 1)))
    assert devices(e.place(pod("f", fraction(1000)))) == ["f0"]
    assert devices(e.place(pod("w", whole()))) == ["w0"]
    e.forget("uid-w")
    e.forget("uid-f")
    both = e.place(pod("w2", whole(2)))
    assert sorted(devices(both)) == ["f0", "w0"]  # an empty fractions GPU serves a whole-GPU pod too
    e.forget("uid-w2")
    e.place(pod("w3", whole()))
    assert e.ledger("n")[0].pods == 1
    m = e.place(pod("m", mig("1g.10gb")))
    assert isinstance(m, Unschedulable) and "1 node(s) had no GPU in MIG mode" in m.message


def test_slices_count_their_memory_against_the_queue_and_its_limit():
    e = Engine(queues=[Queue("q", gpu_memory=Quota(limit=51000))])
    e.add_node(node("n", mig_gpu("g0", 0, ["3g.40gb@0", "2g.20gb@4", "1g.10gb@6"])))
    e.place(pod("a", mig("3g.40gb"), queue="q"))
    booked = e.booked_amount("uid-a")
    assert booked is not None and booked.amount.mib == 40448
    over = e.place(pod("b", mig("2g.20gb"), queue="q"))
    assert isinstance(over, Unschedulable) and "GPU-memory limit of 51000 MiB" in over.message
    assert devices(e.place(pod("c", mig("1g.10gb"), queue="q"))) == ["MIG-g0-6"]


def test_assume_books_a_bound_slice_and_refuses_a_second_holder():
    e = Engine()
    e.add_node(node("n", mig_gpu("g0", 0, ["3g.40gb@0", "3g.40gb@4"])))
    held = Placement(
        "uid-a",
        "n",
        (
            ContainerPlacement(
                "c",
                mig("3g.40gb").mode,
                False,
                (DeviceAssignment("MIG-g0-4", 0, 40448, 40448, None),),
                mig=True,
            ),
        ),
    )
    before = snapshot(e)
    e.assume(pod("a", mig("3g.40gb")), held)
    assert devices(e.place(pod("b", mig("3g.40gb")))) == ["MIG-g0-0"]
    with pytest.raises(ValueError, match="booked already"):
        e.assume(pod("x", mig("3g.40gb")), Placement("uid-x", "n", held.containers))
    e.forget("uid-a")
    e.forget("uid-b")
    assert same(before, snapshot(e))
    assert not any(s.taken for s in e.state.mig.slots.values())


def test_a_new_inventory_keeps_a_slice_holder_whose_slice_is_still_published():
    e = Engine()
    e.add_node(node("n", mig_gpu("g0", 0, ["3g.40gb@0", "3g.40gb@4"]), gpu("g1", 1)))
    e.place(pod("a", mig("3g.40gb")))
    dropped = e.update_node(
        node("n", mig_gpu("g0", 0, ["3g.40gb@0", "3g.40gb@4"]), mig_gpu("g1", 1, ["7g.80gb@0"]))
    )
    assert dropped == []
    assert devices(e.place(pod("b", mig("3g.40gb")))) == ["MIG-g0-4"]
    assert devices(e.place(pod("c", mig("7g.80gb")))) == ["MIG-g1-0"]


def test_nothing_is_booked_on_a_fenced_gpu_until_it_is_unfenced():
    e = Engine()
    e.add_node(node("n", mig_gpu("g0", 0, ["7g.80gb@0"]), gpu("g1", 1)))
    assert [u for u, _, _ in e.idle_gpus("n")] == ["g0", "g1"]
    e.fence("g1")
    e.fence("g0")
    assert e.idle_gpus("n") == []
    assert isinstance(e.place(pod("f", fraction(1000))), Unschedulable)
    assert isinstance(e.place(pod("m", mig("7g.80gb"))), Unschedulable)
    # A new inventory (the agent's answer) keeps the fence until the scheduler lifts it.
    e.update_node(node("n", mig_gpu("g0", 0, ["7g.80gb@0"]), mig_gpu("g1", 1, ["3g.40gb@0"])))
    assert isinstance(e.place(pod("m2", mig("3g.40gb"))), Unschedulable)
    e.unfence("g1")
    assert devices(e.place(pod("m3", mig("3g.40gb")))) == ["MIG-g1-0"]
    with pytest.raises(ValueError, match="holds bookings"):
        e.fence("g1")
    e.unfence("g0")
    assert devices(e.place(pod("m4", mig("7g.80gb")))) == ["MIG-g0-0"]


# -- property: random mixes on random layouts ---------------------------------------------------------

PROFILES = ["1g.10gb", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb"]


@st.composite
def clusters(draw):
    table = mig_model(H100)
    assert table is not None
    specs = []
    for n in range(draw(st.integers(1, 3))):
        gpus = []
        for g in range(draw(st.integers(0, 3))):
            uuid = f"n{n}g{g}"
            mode = draw(st.sampled_from(list(GpuMode)))
            if mode is GpuMode.MIG:
                layout, _ = pack(table, draw(st.lists(st.sampled_from(PROFILES), max_size=7)))
                gpus.append(mig_gpu(uuid, g, [str(s) for s in layout]))
            else:
                gpus.append(gpu(uuid, g, mode))
        specs.append(node(f"n{n}", *gpus))
    return specs


@st.composite
def asks(draw, i: int):
    kind = draw(st.sampled_from(["profile", "size", "fraction", "whole", "mixed"]))
    if kind == "profile":
        cs = (mig(draw(st.sampled_from(PROFILES)), count=draw(st.integers(1, 2))),)
    elif kind == "size":
        cs = (mig(min_mib=draw(st.integers(1000, 70000))),)
    elif kind == "fraction":
        cs = (fraction(draw(st.integers(1000, 60000))),)
    elif kind == "whole":
        cs = (whole(draw(st.integers(1, 2))),)
    else:
        cs = (mig(draw(st.sampled_from(PROFILES)), name="m"), fraction(5000, name="f"))
    return pod(f"p{i}", *cs)


@st.composite
def scenarios(draw):
    specs = draw(clusters())
    pods = [draw(asks(i)) for i in range(draw(st.integers(1, 14)))]
    leave = draw(st.lists(st.integers(0, 13), max_size=6))
    return specs, pods, leave


def check(e: Engine, specs: list[NodeSpec]) -> None:
    modes = {g.uuid: g.mode for s in specs for g in s.gpus}
    slices = {sl.uuid: (g.uuid, sl) for s in specs for g in s.gpus for sl in g.mig}
    holders: dict[str, str] = {}
    for uid in e.bound_uids:
        placement = e.placement_of(uid)
        assert placement is not None
        for c in placement.containers:
            for d in c.devices:
                if c.mig:
                    assert d.uuid in slices, "a MIG container holds something that is not a slice"
                    assert slices[d.uuid][1].mib == d.request_mib
                    assert d.uuid not in holders, f"slice {d.uuid} booked by {holders.get(d.uuid)} and {uid}"
                    holders[d.uuid] = uid
                elif c.exclusive:
                    assert modes[d.uuid] in (GpuMode.FRACTIONS, GpuMode.WHOLE)
                else:
                    assert modes[d.uuid] is GpuMode.FRACTIONS, "a fraction on a MIG or whole-mode GPU"
    taken = {u for u, s in e.state.mig.slots.items() if s.taken}
    assert taken == set(holders)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_random_mixes_keep_slices_single_modes_apart_and_books_exact(scenario):
    specs, pods, leave = scenario
    e = Engine()
    for s in specs:
        e.add_node(s)
    before = snapshot(e)
    for p in pods:
        e.place(p)
        check(e, specs)
    for i in leave:
        if i < len(pods):
            e.forget(pods[i].uid)
            check(e, specs)
    for p in pods[:3]:
        if e.placement_of(p.uid) is None:
            e.place(p)
            check(e, specs)
    for uid in list(e.bound_uids):
        e.forget(uid)
    assert same(before, snapshot(e))
    assert not any(s.taken for s in e.state.mig.slots.values())
    assert np.array_equal(e.state.mode, before["mode"])


def test_preemption_frees_a_slice_the_pod_can_take_by_evicting_its_holder_only():
    from gpufrac.placement.preemption import Kind, find_victims

    e = Engine()
    e.add_node(node("n", mig_gpu("g0", 0, ["3g.40gb@0", "1g.10gb@4", "1g.10gb@5"])))
    e.place(pod("small", mig("1g.10gb"), priority=1))
    e.place(pod("big", mig("3g.40gb"), priority=2))
    e.place(pod("other", mig("1g.10gb"), priority=0))
    wanted = pod("urgent", mig("3g.40gb"), priority=10)
    assert isinstance(e.place(wanted), Unschedulable)
    before = snapshot(e)
    found = find_victims(e, wanted, kind=Kind.PREEMPT)
    assert found is not None
    assert found.victims == ("uid-big",)  # the 1g holders free nothing a 3g pod can use
    assert devices(found.placement) == ["MIG-g0-0"]
    assert same(before, snapshot(e)) and e.placement_of("uid-big") is not None  # only a plan
    assert find_victims(e, pod("meek", mig("3g.40gb"), priority=2), kind=Kind.PREEMPT) is None
