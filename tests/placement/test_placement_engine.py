"""The engine as the scheduler service drives it: nodes coming and going, bound pods, batches, queues."""

from __future__ import annotations

import numpy as np
import pytest
from placement_builders import fraction, mib, node, pod, whole

from gpufrac.placement.decision import Placement, Unschedulable
from gpufrac.placement.engine import Engine
from gpufrac.placement.model import GpuDevice, Queue, Quota


def build(*nodes, **kw) -> Engine:
    e = Engine(policy=kw.pop("policy", "binpack"), **kw)
    for n in nodes:
        e.add_node(n)
    return e


def snapshot(e: Engine) -> dict[str, np.ndarray]:
    st = e.state
    return {
        name: getattr(st, name).copy()
        for name in (
            "cpu_free",
            "mem_free",
            "pods_free",
            "free",
            "limit_sum",
            "ppm",
            "mode",
            "npods",
            "tenant",
        )
    } | {"tenants": dict(st.tenants)}


def same(a: dict, b: dict) -> bool:
    return all(np.array_equal(a[k], b[k]) if isinstance(a[k], np.ndarray) else a[k] == b[k] for k in a)


def test_forget_restores_every_ledger():
    e = build(node("a"), node("b"))
    before = snapshot(e)
    placed = [e.place(pod(fraction(0.3), cpu_milli=500, memory_bytes=1 << 30)) for _ in range(5)]
    placed.append(e.place(pod(whole(2))))
    assert all(isinstance(p, Placement) for p in placed)
    assert not same(before, snapshot(e))
    for p in placed:
        assert e.forget(p.pod_uid)
    assert same(before, snapshot(e))
    assert not e.forget("unknown")


def test_assume_replaces_what_a_pod_held():
    e = build(node("a", gpus=2))
    p = pod(fraction(0.5))
    first = e.place(p)
    moved = Placement(
        p.uid,
        "a",
        tuple(
            type(c)(c.container, c.mode, c.exclusive, (type(c.devices[0])("a-g1", 1, 8192, 8192, None),))
            for c in first.containers
        ),
    )
    e.assume(p, moved)
    ledgers = e.ledger("a")
    assert [g.free_mib for g in ledgers] == [16384, 8192]
    assert e.placement_of(p.uid) == moved


def test_remove_node_releases_its_pods():
    e = build(node("a", gpus=1), node("b", gpus=1))
    on_a = e.place(pod(fraction(0.5), node_selector={}))
    other = e.place(pod(fraction(0.5)))
    gone = e.remove_node(on_a.node)
    assert on_a.pod_uid in gone
    assert e.placement_of(on_a.pod_uid) is None
    assert e.node_names == sorted({"a", "b"} - {on_a.node})
    if other.node != on_a.node:
        assert e.placement_of(other.pod_uid) == other
    # The slot is reused by the next node and starts empty.
    e.add_node(node("c", gpus=1))
    assert e.ledger("c")[0].free_mib == 16384


def test_gpu_capacity_is_what_the_ledgers_add_up_to_as_nodes_come_and_go():
    def from_ledgers(e: Engine) -> tuple[int, int, int]:
        sizes = [g.capacity_mib for n in e.node_names for g in e.ledger(n)]
        return sum(sizes), len(sizes), max(sizes, default=0)

    e = build()
    assert e.gpu_capacity() == (0, 0, 0)
    e.add_node(node("a", gpus=2, mib=16384))
    e.add_node(node("b", gpus=4, mib=81920, model="H100"))
    e.place(pod(fraction(0.5)))  # what is booked does not change what there is
    assert e.gpu_capacity() == from_ledgers(e) == (2 * 16384 + 4 * 81920, 6, 81920)
    e.remove_node("b")
    assert e.gpu_capacity() == from_ledgers(e) == (2 * 16384, 2, 16384)
    e.update_node(_with_gpus(node("a", gpus=2), node("a", gpus=2).gpus[:1]))
    e.add_node(node("c", gpus=1, mib=40960))  # reuses b's slot
    assert e.gpu_capacity() == from_ledgers(e) == (16384 + 40960, 2, 40960)


def test_update_node_keeps_pods_whose_gpus_remain():
    e = build(node("a", gpus=2))
    first = e.place(pod(mib(10000)))
    second = e.place(pod(mib(10000)))
    assert {first.containers[0].uuids, second.containers[0].uuids} == {("a-g0",), ("a-g1",)}
    keep_uuid = first.containers[0].uuids[0]
    spec = _with_gpus(node("a", gpus=2), [g for g in node("a", gpus=2).gpus if g.uuid == keep_uuid])
    dropped = e.update_node(spec)
    assert dropped == [second.pod_uid]
    assert e.placement_of(first.pod_uid) is not None
    assert [g.uuid for g in e.ledger("a")] == [keep_uuid]
    assert e.ledger("a")[0].free_mib == 16384 - 10000


def test_update_node_spec_only_changes_filters_not_ledgers():
    e = build(node("a", gpus=1))
    e.place(pod(fraction(0.5)))
    e.update_node(node("a", gpus=1, ready=False))
    assert e.ledger("a")[0].free_mib == 8192
    got = e.place(pod(fraction(0.25)))
    assert isinstance(got, Unschedulable) and got.counts == (("node(s) were not ready", 1),)
    e.update_node(node("a", gpus=1))
    assert isinstance(e.place(pod(fraction(0.25))), Placement)


def test_gang_all_or_nothing():
    e = build(node("a", gpus=2))
    before = snapshot(e)
    decisions = e.schedule([pod(fraction(0.75)) for _ in range(3)], gang=True)
    assert all(isinstance(d, Unschedulable) for d in decisions)
    assert "gang of 3" in decisions[0].message or "gang of 3" in decisions[1].message
    assert same(before, snapshot(e))
    ok = e.schedule([pod(fraction(0.75)) for _ in range(2)], gang=True)
    assert all(isinstance(d, Placement) for d in ok)


def test_statement_discards_on_exit_and_keeps_on_commit():
    e = build(node("a", gpus=1))
    before = snapshot(e)
    with e.statement() as st:
        assert isinstance(st.place(pod(fraction(0.5))), Placement)
    assert same(before, snapshot(e))
    with pytest.raises(RuntimeError), e.statement() as st:
        st.place(pod(fraction(0.5)))
        raise RuntimeError("boom")
    assert same(before, snapshot(e))
    with e.statement() as st:
        st.place(pod(fraction(0.5)))
        st.commit()
    assert e.ledger("a")[0].free_mib == 8192


def test_multi_container_pod_is_all_or_nothing():
    from gpufrac.contract.request import ContainerGpuRequest, GpuMemory, PodGpuRequest

    two = PodGpuRequest(
        (
            ContainerGpuRequest("a", GpuMemory(portion=0.6), None),
            ContainerGpuRequest("b", GpuMemory(portion=0.6), None),
        )
    )
    e = build(node("one", gpus=1), node("two", gpus=2))
    got = e.place(pod(two))
    assert isinstance(got, Placement) and got.node == "two"
    assert {c.uuids[0] for c in got.containers} == {"two-g0", "two-g1"}
    # Each container alone fits "one"'s GPU, together they do not: the node is skipped, nothing held.
    e2 = build(node("one", gpus=1))
    before = snapshot(e2)
    got2 = e2.place(pod(two))
    assert isinstance(got2, Unschedulable)
    assert "could not be assigned" in got2.message
    assert same(before, snapshot(e2))


def test_queue_order_priority_then_share_then_arrival():
    e = build(
        node("a", gpus=1), queues=[Queue("rich", deserved_share=0.5), Queue("poor", deserved_share=0.5)]
    )
    assert isinstance(e.place(pod(mib(4096), queue="rich")), Placement)
    pods = [
        pod(fraction(0.25), name="rich-early", queue="rich", arrival=1),
        pod(fraction(0.25), name="poor-late", queue="poor", arrival=2),
        pod(fraction(0.25), name="urgent", queue="rich", arrival=3, priority=10),
    ]
    order: list[str] = []
    original = e.place

    def spy(p):
        order.append(p.name)
        return original(p)

    e.place = spy  # type: ignore[method-assign]
    e.schedule(pods)
    # Priority first; then "poor" (0 of its share used) before "rich"; arrival last.
    assert order == ["urgent", "poor-late", "rich-early"]


def test_look_ahead_places_the_largest_pod_of_a_batch_first_within_its_queue_and_priority():
    def run(largest_first: bool, **urgent: object) -> list[bool]:
        e = build(node("a", gpus=1))
        pods = [
            pod(fraction(0.5), name="half", arrival=1, **urgent),  # type: ignore[arg-type]
            pod(whole(), name="whole", arrival=2),
            pod(fraction(0.25), name="quarter", arrival=3),
        ]
        return [isinstance(d, Placement) for d in e.schedule(pods, largest_first=largest_first)]

    # Arrival order: the half and the quarter share the GPU and the whole-GPU pod waits.
    assert run(False) == [True, False, True]
    # Look-ahead over the batch already received: the whole-GPU pod first; the others wait.
    assert run(True) == [False, True, False]
    # Size orders pods of one priority only: an urgent half still goes first.
    assert run(True, priority=10) == [True, False, True]


def test_queue_gpu_memory_limit():
    e = build(node("a", gpus=2), queues=[Queue("small", gpu_memory=Quota(limit=10_000))])
    assert isinstance(e.place(pod(mib(8000), queue="small")), Placement)
    over = e.place(pod(mib(4000), queue="small"))
    assert isinstance(over, Unschedulable) and "GPU-memory limit of 10000 MiB" in over.message
    assert isinstance(e.place(pod(mib(2000), queue="small")), Placement)
    assert isinstance(e.place(pod(mib(8000), queue="other")), Placement)


def test_duplicate_node_and_gpu_are_rejected():
    e = build(node("a"))
    with pytest.raises(ValueError):
        e.add_node(node("a"))
    with pytest.raises(ValueError):
        e.add_node(_with_gpus(node("b"), [GpuDevice("a-g0", 0, 16384)]))


def test_placing_a_held_pod_twice_is_an_error():
    e = build(node("a"))
    p = pod(fraction(0.5))
    e.place(p)
    with pytest.raises(ValueError):
        e.place(p)


def _with_gpus(spec, gpus):
    from dataclasses import replace

    return replace(spec, gpus=tuple(gpus))
