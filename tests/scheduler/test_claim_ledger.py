"""The booking cache's DRA claim holds, in memory with the real engine: a claim is booked once from its
allocation as the node reads it, follows the informer's view, and comes back with its node."""

from __future__ import annotations

import json
from typing import Any

from lightkube.resources.core_v1 import Node, Pod
from lightkube.resources.resource_v1 import ResourceClaim

from gpufrac.contract import keys
from gpufrac.placement.model import GpuDevice, NodeSpec
from gpufrac.placement.state import EMPTY, SM_SHARING
from gpufrac.scheduler.booking_audit import audit
from gpufrac.scheduler.booking_cache import BookingCache
from gpufrac.scheduler.claims import claim_placement, gpu_device_name, hold_key
from gpufrac.scheduler.config import SchedulerConfig
from gpufrac.scheduler.placement_engine import build_engine

GPUS = (
    GpuDevice(uuid="GPU-0f0e0d0c-0000-4000-8000-000000000001", index=0, memory_mib=81920, model="H100"),
    GpuDevice(uuid="GPU-0f0e0d0c-0000-4000-8000-000000000002", index=1, memory_mib=81920, model="H100"),
)
NODE = NodeSpec(name="n1", cpu_milli=8000, memory_bytes=64 << 30, gpus=GPUS)


def claim(
    uid: str, *, gpu: GpuDevice = GPUS[0], memory: str | None = "30Gi", mode: str = "time-slicing"
) -> dict[str, Any]:
    result: dict[str, Any] = {
        "request": "gpu",
        "driver": keys.DRA_DRIVER_NAME,
        "pool": "n1",
        "device": gpu_device_name(gpu),
    }
    if memory is not None:
        result["consumedCapacity"] = {keys.DRA_MEMORY_CAPACITY: memory, keys.DRA_COMPUTE_CAPACITY: "0"}
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": f"c-{uid}", "namespace": "team", "uid": uid},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "x"}}]}},
        "status": {
            "allocation": {
                "devices": {
                    "results": [result],
                    "config": [
                        {
                            "source": "FromClass",
                            "requests": ["gpu"],
                            "opaque": {
                                "driver": keys.DRA_DRIVER_NAME,
                                "parameters": {
                                    "apiVersion": keys.DRA_CONFIG_API_VERSION,
                                    "kind": keys.DRA_CONFIG_KIND,
                                    keys.DRA_CONFIG_COMPUTE_MODE: mode,
                                },
                            },
                        }
                    ],
                },
                "nodeSelector": {
                    "nodeSelectorTerms": [
                        {"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["n1"]}]}
                    ]
                },
            }
        },
    }


def unallocated(body: dict[str, Any]) -> ResourceClaim:
    return ResourceClaim.from_dict({k: v for k, v in body.items() if k != "status"})


def cache() -> BookingCache:
    return BookingCache(engine=build_engine(SchedulerConfig()), default_queue="default")


def free(books: BookingCache, gpu: int = 0) -> int:
    return books.engine.ledger("n1")[gpu].free_mib


def test_an_allocated_claim_is_booked_once_and_released_when_deallocated_or_deleted() -> None:
    books = cache()
    books.set_node(NODE)
    slots = int(books.engine.state.pods_free[books.engine.state.index["n1"]])
    body = claim("u1")
    assert books.claim_changed(ResourceClaim.from_dict(body))
    assert free(books) == 81920 - 30720
    # A claim is no pod: it takes no pod slot (its pods take theirs).
    assert books.engine.state.pods_free[books.engine.state.index["n1"]] == slots
    assert not books.claim_changed(ResourceClaim.from_dict(body))  # the same view again: nothing new
    assert free(books) == 81920 - 30720
    assert books.engine.ledger("n1")[0].pods == 1  # the GPU's holders: one, however many pods use it
    assert books.claim_changed(unallocated(body))  # deallocated
    assert free(books) == 81920 and books.engine.ledger("n1")[0].mode == EMPTY
    books.claim_changed(ResourceClaim.from_dict(body))
    assert books.release_claim("u1") and free(books) == 81920  # deleted


def test_a_claim_this_scheduler_is_writing_survives_older_views_until_it_is_seen_or_fails() -> None:
    books = cache()
    books.set_node(NODE)
    body = claim("u2", mode="sm-sharing")
    books.hold_claim(body, node="n1", assumed=True)
    assert books.engine.ledger("n1")[0].mode == SM_SHARING
    # The finalizer's write comes back first, without the allocation: the hold stays.
    assert not books.claim_changed(unallocated(body))
    assert not books.claim_written("u2", landed=True)
    assert not books.claim_changed(unallocated(body))
    assert free(books) == 81920 - 30720
    # Seen allocated: an ordinary hold from now on, released by a view without allocation.
    books.claim_changed(ResourceClaim.from_dict(body))
    assert books.claim_changed(unallocated(body)) and free(books) == 81920
    # A write that failed releases at once.
    books.hold_claim(body, node="n1", assumed=True)
    assert books.claim_written("u2", landed=False) and free(books) == 81920


def test_claims_wait_for_their_node_and_follow_it_through_changes() -> None:
    books = cache()
    books.claim_changed(ResourceClaim.from_dict(claim("u3", gpu=GPUS[1])))
    books.set_node(NODE)
    assert free(books, 1) == 81920 - 30720  # booked when the node came
    books.remove_node("n1")
    books.set_node(NODE)
    assert free(books, 1) == 81920 - 30720  # and again when it came back
    books.set_node(NodeSpec(name="n1", cpu_milli=8000, memory_bytes=64 << 30, gpus=GPUS[:1]))
    assert books.engine.ledger("n1")[0].free_mib == 81920  # its GPU went: nothing held
    books.set_node(NODE)
    assert free(books, 1) == 81920 - 30720  # its GPU came back


def test_the_ledger_reads_an_allocation_as_the_node_does() -> None:
    """No consumed capacity (the DRAConsumableCapacity gate off) is the whole GPU, exclusive; a device the
    node does not publish holds nothing there."""
    body = claim("u4", memory=None)
    placement = claim_placement(body, NODE)
    assert placement is not None and placement.pod_uid == hold_key("u4")
    (container,) = placement.containers
    assert container.exclusive and container.devices[0].request_mib == 81920
    body["status"]["allocation"]["devices"]["results"][0]["device"] = "gpu-elsewhere"
    assert claim_placement(body, NODE) is None


def test_the_audit_judges_claims_and_annotation_pods_as_one_ledger() -> None:
    node = Node.from_dict(
        {
            "metadata": {
                "name": "n1",
                "annotations": {
                    keys.NODE_GPUS_ANNOTATION: json.dumps(
                        [
                            {"uuid": g.uuid, "index": g.index, "model": g.model, "mib": g.memory_mib}
                            for g in GPUS
                        ]
                    )
                },
            }
        }
    )

    def pod(name: str, gpu: GpuDevice, *, memory: str, mode: str = "time-slicing") -> Pod:
        return Pod.from_dict(
            {
                "metadata": {
                    "name": name,
                    "namespace": "team",
                    "annotations": {
                        keys.devices_key("app"): gpu.uuid,
                        keys.memory_request_key("app"): memory,
                        keys.compute_mode_key("app"): mode,
                    },
                },
                "spec": {"nodeName": "n1", "containers": [{"name": "app", "image": "x"}]},
            }
        )

    claims = [ResourceClaim.from_dict(claim("u5", memory="60Gi"))]
    fine = audit(nodes=[node], pods=[pod("p", GPUS[0], memory="20Gi")], claims=claims)
    assert fine.ok and fine.gpus[GPUS[0].uuid].request_mib == 81920
    assert fine.gpus[GPUS[0].uuid].pods == ["claim team/c-u5", "team/p"]
    over = audit(nodes=[node], pods=[pod("p", GPUS[0], memory="21Gi")], claims=claims)
    assert any("over-committed" in p for p in over.problems)
    mixed = audit(nodes=[node], pods=[pod("p", GPUS[0], memory="1Gi", mode="sm-sharing")], claims=claims)
    assert any("mixes" in p for p in mixed.problems)


def test_a_request_consumes_what_the_slice_request_policy_says() -> None:
    """kube-scheduler's rounding (CapacityRequestPolicy), as the node agent's slices state it and as
    other drivers may: default, validRange (min, step, max) and validValues."""
    from decimal import Decimal

    from lightkube.utils.quantity import parse_quantity

    from gpufrac.node.dra.slices import desired_devices
    from gpufrac.node.inventory.backend import GpuInfo, NodeInventory
    from gpufrac.scheduler.claims import consumed

    inventory = NodeInventory("615.20.01", "13.0", (GpuInfo("GPU-1", 0, 0, "H100", 81920),))
    (device,) = desired_devices(inventory=inventory, capability=None)
    memory, compute = (
        device["capacity"][keys.DRA_MEMORY_CAPACITY],
        device["capacity"][keys.DRA_COMPUTE_CAPACITY],
    )
    q = parse_quantity
    assert consumed(None, memory) == q("80Gi")  # no amount: the whole GPU
    assert consumed(q("20Gi"), memory) == q("20Gi")
    assert consumed(q("1500Ki"), memory) == q("2Mi")  # whole MiB, rounded up
    assert consumed(q("81Gi"), memory) is None  # more than the GPU
    assert consumed(None, compute) == 0 and consumed(Decimal("25"), compute) == 25
    assert consumed(Decimal("101"), compute) is None
    values = {"value": "100", "requestPolicy": {"default": "10", "validValues": ["10", "50", "100"]}}
    assert consumed(Decimal("11"), values) == 50 and consumed(Decimal("150"), values) is None
    ranged = {"value": "100", "requestPolicy": {"default": "10", "validRange": {"min": "10", "step": "20"}}}
    assert consumed(Decimal("1"), ranged) == 10 and consumed(Decimal("31"), ranged) == 50
