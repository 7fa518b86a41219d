"""DRA claims for the kube-scheduler comparison (``kube_scheduler_e2e.py --scenarios claims``, issue #39).

The world both schedulers meet: every simulated node publishes gpufrac's ResourceSlice (the node agent's
own publisher, ``gpufrac.node.dra.slices``, from the node's inventory: one device per GPU with
``allowMultipleAllocations`` and consumable ``memory`` and ``compute`` capacity, docs/dra.md), and the
chart's DeviceClasses exist (rendered with testenv's Helm, ``gpufrac.local.dra``). Each pod of a burst
refers to its own ResourceClaim, created before the burst starts (untimed), asking one device of the
``time-slicing`` class with ``capacity.requests.memory`` from a fixed mix (``CLAIM_MEMORY``): the same
claims on both sides. SIMULATED: the GPUs (inventory of simulated nodes); the slices, classes, claims,
allocations and bindings are real API objects.

After a burst (its pods deleted) the claims are audited from their ``status.allocation`` (every claim
allocated, no device's consumed memory above its capacity, how many GPUs and nodes the allocations
use), then released and deleted as kube-controller-manager would once their pods are gone (no
controller runs here): their finalizer removed, deleted, so the next burst meets free GPUs.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from pathlib import Path
from typing import Any

from lightkube import AsyncClient
from lightkube.resources.core_v1 import Node, Pod
from lightkube.resources.resource_v1 import DeviceClass, ResourceClaim, ResourceSlice
from lightkube.types import PatchType

from gpufrac.contract import keys
from gpufrac.contract.quantities import parse_mib
from gpufrac.kube.errors import Conflict
from gpufrac.local.dra import device_classes
from gpufrac.node.dra.slices import ResourceSlicePublisher
from gpufrac.node.inventory.backend import GpuInfo, NodeInventory
from gpufrac.node.mps.mode import DriverVersion, capability_for
from gpufrac.scheduler.objects import node_inventory

CLASS = f"time-slicing.{keys.DRA_DRIVER_NAME}"
#: The claims' memory, in turn: shares of an 80Gi GPU that pack well (2 x 40, 4 x 20...) only when
#: the allocator fills a GPU before opening the next.
CLAIM_MEMORY = ("10Gi", "20Gi", "40Gi", "20Gi", "10Gi")
DRIVER = "615.20.01"


def claim_name(i: int) -> str:
    return f"c{i:05d}"


def claim_body(i: int, *, namespace: str) -> dict[str, Any]:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": claim_name(i), "namespace": namespace},
        "spec": {
            "devices": {
                "requests": [
                    {
                        "name": "gpu",
                        "exactly": {
                            "deviceClassName": CLASS,
                            "capacity": {
                                "requests": {keys.DRA_MEMORY_CAPACITY: CLAIM_MEMORY[i % len(CLAIM_MEMORY)]}
                            },
                        },
                    }
                ]
            }
        },
    }


def claim_pod(i: int, *, namespace: str, scheduler: str) -> Pod:
    """The i-th pod: its container uses the pod's claim ``gpu``, which is ResourceClaim ``c<i>``."""
    return Pod.from_dict(
        {
            "metadata": {"name": f"p{i:05d}", "namespace": namespace},
            "spec": {
                "schedulerName": scheduler,
                "tolerations": [keys.managed_toleration()],
                "resourceClaims": [{"name": "gpu", "resourceClaimName": claim_name(i)}],
                "containers": [
                    {
                        "name": "app",
                        "image": "busybox",
                        "resources": {
                            "requests": {"cpu": "100m", "memory": "256Mi"},
                            "claims": [{"name": "gpu"}],
                        },
                    }
                ],
            },
        }
    )


async def publish_world(client: AsyncClient, names: list[str], *, workdir: Path) -> None:
    """The chart's DeviceClasses and every node's ResourceSlice (the node agent's publisher)."""
    for body in device_classes(work_dir=workdir):
        with contextlib.suppress(Conflict):
            await client.create(DeviceClass.from_dict(body))
    capability = capability_for(driver=DriverVersion.parse(DRIVER), mps_running=True)
    gate = asyncio.Semaphore(32)

    async def one(name: str) -> None:
        async with gate:
            node = await client.get(Node, name)
            gpus = tuple(
                GpuInfo(uuid=g.uuid, index=g.index, minor=g.index, model=g.model, mib=g.memory_mib)
                for g in node_inventory(node)
            )
            publisher = ResourceSlicePublisher(client=client, node_name=name)
            await publisher.sync(
                inventory=NodeInventory(driver_version=DRIVER, cuda_driver_version="13.0", gpus=gpus),
                capability=capability,
            )
            if publisher.consumable_capacity is False:
                raise RuntimeError(
                    "the API server dropped allowMultipleAllocations: DRAConsumableCapacity off"
                )

    await asyncio.gather(*(one(n) for n in names))


async def create_claims(client: AsyncClient, *, namespace: str, count: int) -> None:
    gate = asyncio.Semaphore(32)

    async def one(i: int) -> None:
        async with gate:
            await client.create(ResourceClaim.from_dict(claim_body(i, namespace=namespace)))

    await asyncio.gather(*(one(i) for i in range(count)))


async def device_memory(client: AsyncClient) -> dict[tuple[str, str], int]:
    """(pool, device) -> the device's memory capacity in MiB, from every slice of our driver."""
    have: dict[tuple[str, str], int] = {}
    async for listed in client.list(ResourceSlice):
        spec = listed.to_dict()["spec"]
        if spec["driver"] != keys.DRA_DRIVER_NAME:
            continue
        for d in spec.get("devices") or []:
            memory = (d.get("capacity") or {}).get(keys.DRA_MEMORY_CAPACITY)
            if memory is not None:
                have[(spec["pool"]["name"], d["name"])] = parse_mib(
                    str(memory["value"]), key="capacity.memory"
                )
    return have


def audit_claims(claims: list[dict[str, Any]], capacity: dict[tuple[str, str], int]) -> dict[str, Any]:
    """Every claim allocated, no device's consumed memory above its capacity; the GPUs and nodes used,
    and the memory allocated as a share of the used GPUs' memory (allocation quality: fewer GPUs for
    the same claims leaves more whole GPUs for whole-GPU work)."""
    consumed: Counter[tuple[str, str]] = Counter()
    unallocated = []
    for claim in claims:
        results = ((claim.get("status") or {}).get("allocation") or {}).get("devices", {}).get(
            "results"
        ) or []
        if not results:
            unallocated.append(claim["metadata"]["name"])
        for r in results:
            memory = (r.get("consumedCapacity") or {}).get(keys.DRA_MEMORY_CAPACITY)
            consumed[(r["pool"], r["device"])] += parse_mib(memory, key="consumedCapacity") if memory else 0
    over = [
        f"{p}/{d}: {mib} MiB of {capacity.get((p, d))}"
        for (p, d), mib in consumed.items()
        if mib > capacity.get((p, d), 0)
    ]
    used_mib = sum(capacity.get(k, 0) for k in consumed)
    return {
        "claims_allocated": len(claims) - len(unallocated),
        "audit_ok": not unallocated and not over,
        "audit_problems": ([f"{len(unallocated)} claims not allocated"] if unallocated else []) + over[:5],
        "gpus_used": len(consumed),
        "nodes_used": len({p for p, _ in consumed}),
        "gpu_memory_allocated_pct": round(100 * sum(consumed.values()) / max(1, used_mib), 1),
    }


async def audit_and_release(client: AsyncClient, *, namespace: str) -> dict[str, Any]:
    """``audit_claims`` of the namespace's claims, then each released (finalizer off) and deleted."""
    claims = [c.to_dict() async for c in client.list(ResourceClaim, namespace=namespace)]
    report = audit_claims(claims, await device_memory(client))
    report["claims_per_gpu"] = round(report["claims_allocated"] / max(1, report["gpus_used"]), 2)
    gate = asyncio.Semaphore(32)

    async def release(name: str) -> None:
        async with gate:
            await client.patch(
                ResourceClaim,
                name,
                {"metadata": {"finalizers": None}},
                namespace=namespace,
                patch_type=PatchType.MERGE,
            )

    await asyncio.gather(*(release(c["metadata"]["name"]) for c in claims))
    await client.deletecollection(ResourceClaim, namespace=namespace)
    return report
