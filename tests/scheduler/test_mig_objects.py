"""MIG on the scheduler's side of the API objects (docs/mig.md, "Inventory"): a node's ``gpufrac.io/gpus``
read with each GPU's mode and slices (a missing mode is fractions; bad entries are refused in a sentence
naming the GPU, the value and the rule), bound MIG pods booked on their slices, and the booking audit's
MIG promises (one holder per slice, no fraction on a MIG GPU)."""

from __future__ import annotations

import json

import pytest
from lightkube.resources.core_v1 import Node, Pod

from gpufrac.contract import keys
from gpufrac.local.simnodes import NodeShape, sim_node
from gpufrac.placement.model import GpuMode, PendingPod
from gpufrac.scheduler.booking_audit import audit, books_disagree
from gpufrac.scheduler.config import SchedulerConfig
from gpufrac.scheduler.objects import (
    InvalidInventory,
    bound_placement,
    gpu_request,
    node_inventory,
    node_spec,
)
from gpufrac.scheduler.placement_engine import build_engine

SHAPE = NodeShape(gpus=2, mig=((0, ("3g.40gb@0", "2g.20gb@4", "1g.10gb@6")),))


def node_with(entries: list[dict]) -> Node:
    node = sim_node(name="n1", shape=NodeShape(gpus=1))
    node.metadata.annotations[keys.NODE_GPUS_ANNOTATION] = json.dumps(entries)
    return node


def entry(**extra) -> dict:
    return {"uuid": "GPU-1", "index": 0, "model": "H100-80GB", "mib": 81559, **extra}


def test_the_inventory_reads_modes_and_slices_and_an_older_agents_entry_as_fractions() -> None:
    (older,) = node_inventory(node_with([entry()]))
    assert older.mode is GpuMode.FRACTIONS and older.mig == ()
    mig_gpu, plain = node_inventory(sim_node(name="n1", shape=SHAPE))
    assert mig_gpu.mode is GpuMode.MIG and plain.mode is GpuMode.FRACTIONS
    assert [str(s) for s in mig_gpu.mig] == ["3g.40gb@0", "2g.20gb@4", "1g.10gb@6"]
    assert all(s.uuid.startswith("MIG-") and s.mib > 0 for s in mig_gpu.mig)
    (whole,) = node_inventory(node_with([entry(mode="whole")]))
    assert whole.mode is GpuMode.WHOLE


@pytest.mark.parametrize(
    ("bad", "says"),
    [
        (entry(mode="shared"), "GPU GPU-1 has mode 'shared'; a mode is one of fractions, mig, whole"),
        (
            entry(mig=[{"profile": "1g.10gb", "start": 0, "uuid": "MIG-1", "mib": 9984}]),
            "GPU GPU-1 in mode fractions lists MIG slices; only mode mig has them",
        ),
        (entry(mode="mig", mig=[{"profile": "1g.10gb", "start": 0}]), "a slice needs profile, start, uuid"),
        (
            entry(mode="mig", mig=[{"profile": "3g.40gb", "start": 2, "uuid": "MIG-1", "mib": 40448}]),
            "2 is not a valid start for 3g.40gb",
        ),
        (
            entry(
                mode="mig",
                mig=[
                    {"profile": "1g.10gb", "start": 0, "uuid": "MIG-1", "mib": 9984},
                    {"profile": "1g.10gb", "start": 1, "uuid": "MIG-1", "mib": 9984},
                ],
            ),
            "MIG devices need UUIDs of their own",
        ),
    ],
)
def test_bad_entries_are_refused_naming_the_gpu_and_the_rule(bad: dict, says: str) -> None:
    with pytest.raises(InvalidInventory) as refused:
        node_inventory(node_with([bad]))
    assert str(refused.value).startswith("gpufrac.io/gpus of node n1: ")
    assert says in str(refused.value)
    assert node_spec(node_with([bad])).gpus == ()  # such a node takes no GPU pod until it is fixed


def mig_pod(name: str, device: str, node: str | None = "n1") -> Pod:
    annotations = {keys.mig_key("app", keys.MIG_PROFILE): "1g.10gb", keys.devices_key("app"): device}
    spec: dict = {"containers": [{"name": "app", "image": "x"}]}
    if node:
        spec["nodeName"] = node
    return Pod.from_dict(
        {"metadata": {"name": name, "namespace": "ns", "uid": name, "annotations": annotations}, "spec": spec}
    )


def test_a_bound_mig_pod_is_booked_on_its_slice_and_the_audit_agrees() -> None:
    node = sim_node(name="n1", shape=SHAPE)
    mig_gpu, _ = node_inventory(node)
    one_g = mig_gpu.mig[2]
    placement = bound_placement(
        mig_pod("a", one_g.uuid), gpus_by_uuid={g.uuid: g for g in node_inventory(node)}
    )
    ((device,),) = [c.devices for c in placement.containers]
    assert (device.uuid, device.request_mib, placement.containers[0].mig) == (one_g.uuid, one_g.mib, True)

    engine = build_engine(SchedulerConfig())
    engine.add_node(node_spec(node))
    pod = mig_pod("a", one_g.uuid)
    engine.assume(PendingPod("ns", "a", "a", gpu=gpu_request(pod)), placement)
    report = audit(nodes=[node], pods=[pod])
    assert report.ok, report.problems
    assert report.gpus[mig_gpu.uuid].slice_mib == one_g.mib
    assert books_disagree(report, engine.ledger("n1")) == []
    engine.forget("a")
    assert books_disagree(report, engine.ledger("n1"))  # the books no longer hold the pod's slice


def test_the_audit_reports_a_slice_held_twice_and_a_fraction_on_a_mig_gpu() -> None:
    node = sim_node(name="n1", shape=SHAPE)
    mig_gpu, _ = node_inventory(node)
    first = mig_gpu.mig[0].uuid
    fraction = Pod.from_dict(
        {
            "metadata": {
                "name": "f",
                "namespace": "ns",
                "annotations": {keys.memory_request_key("app"): "1Gi", keys.devices_key("app"): mig_gpu.uuid},
            },
            "spec": {"nodeName": "n1", "containers": [{"name": "app", "image": "x"}]},
        }
    )
    report = audit(nodes=[node], pods=[mig_pod("a", first), mig_pod("b", first), fraction])
    assert any(
        f"({first}) of GPU {mig_gpu.uuid} on n1 is held by ['ns/a', 'ns/b']" in p for p in report.problems
    )
    assert any(f"holds GPU {mig_gpu.uuid} in mode mig as a fraction" in p for p in report.problems)
    elsewhere = audit(nodes=[node], pods=[mig_pod("c", "MIG-unknown")])
    assert elsewhere.problems == ["pod ns/c on n1 holds MIG device MIG-unknown, which n1 does not publish"]
