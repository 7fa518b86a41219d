"""Check the cluster's GPU bookings from the API objects alone, not from any scheduler's memory.

Given the managed Nodes and the Pods, this recomputes every GPU's ledger from the pods' annotations
(the contract's parse, the same as a restarted scheduler's) and reports each broken promise: a GPU
whose guaranteed memory exceeds its capacity, a GPU holding both compute modes or an exclusive pod next
to others, an sm-sharing GPU over 100% compute or shared by namespaces when tenancy is per namespace, a
device that is not on the pod's node, and a pod carrying devices without a node. ``books_disagree``
compares a scheduler's books (its engine's ledgers) with the same recomputation: after a bind, a resize
(``gpufrac.scheduler.resize``) or a restart, what the scheduler holds is what the pods say. Allocated
DRA claims of gpufrac's driver count on their GPUs too (once each, read as the node's prepare reads them),
so a GPU shared by claims and annotation pods is judged as one ledger. The tests and the benchmark use it
after bursts and crashes; an operator can too.

Containers of one pod may share a GPU: each is its own fraction with its own request and limit, as the
engine places them (a later container of a pod sees the memory the earlier ones took) and the node
agent enforces them (one cgroup and MPS namespace per container). So a GPU is judged by every fraction
on it, whichever pod each belongs to: the containers of one pod together over its capacity is an
over-committed GPU. One container that names a GPU twice never gets this far: the contract refuses a
device list with a repeat, and a bound pod with one is reported as an invalid request.

GPU modes (docs/mig.md): a MIG container's devices must be MIG slices its node publishes, each held by
one container at most; a fraction or whole-GPU device on a GPU in mode mig, or a fraction on one in mode
whole, is a broken promise. A slice's memory counts as booked on its GPU (``GpuBooking.slices``).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field

from lightkube.resources.core_v1 import Node, Pod
from lightkube.resources.resource_v1 import ResourceClaim

from gpufrac.contract.errors import InvalidPodRequest
from gpufrac.contract.request import ComputeMode
from gpufrac.placement.demand import PPM, portion_ppm
from gpufrac.placement.model import GpuMode, NodeSpec
from gpufrac.placement.state import GpuLedger
from gpufrac.scheduler.claims import allocated_node, claim_placement
from gpufrac.scheduler.objects import gpu_request, node_inventory

_EXCLUSIVE = "exclusive"


@dataclass(slots=True)
class GpuBooking:
    node: str
    capacity_mib: int
    request_mib: int = 0
    limit_mib: int = 0
    compute_ppm: int = 0
    modes: set[str] = field(default_factory=set)
    namespaces: set[str] = field(default_factory=set)
    pods: list[str] = field(default_factory=list)
    mode: GpuMode = GpuMode.FRACTIONS
    #: MIG slices held, by MIG UUID: the holders (pod keys; more than one is a problem) and the MiB.
    slices: dict[str, list[str]] = field(default_factory=dict)
    slice_mib: int = 0


@dataclass(slots=True)
class AuditReport:
    gpus: dict[str, GpuBooking]
    problems: list[str]
    placed_pods: int

    @property
    def ok(self) -> bool:
        return not self.problems


def audit(
    *,
    nodes: Iterable[Node],
    pods: Iterable[Pod],
    claims: Iterable[ResourceClaim] = (),
    sm_sharing_single_tenant: bool = True,
) -> AuditReport:
    gpus: dict[str, GpuBooking] = {}
    slices: dict[str, tuple[str, int, str]] = {}  # MIG UUID -> (GPU uuid, MiB, "<profile>@<start>")
    specs: dict[str, NodeSpec] = {}
    for node in nodes:
        inventory = node_inventory(node)
        specs[node.metadata.name] = NodeSpec(
            name=node.metadata.name, cpu_milli=0, memory_bytes=0, gpus=inventory
        )
        for gpu in inventory:
            gpus[gpu.uuid] = GpuBooking(node=node.metadata.name, capacity_mib=gpu.memory_mib, mode=gpu.mode)
            for s in gpu.mig:
                slices[s.uuid] = (gpu.uuid, s.mib, str(s))
    problems: list[str] = []
    placed = 0
    for claim in claims:
        node_name = allocated_node(claim)
        spec = specs.get(node_name or "")
        placement = claim_placement(claim.to_dict(), spec) if spec is not None else None
        if placement is None:
            continue  # not allocated, another driver's, or on a node not audited
        key = f"claim {claim.metadata.namespace}/{claim.metadata.name}"
        for held in placement.containers:
            for device in held.devices:
                booking = gpus[device.uuid]
                booking.request_mib += device.request_mib
                booking.limit_mib += device.limit_mib
                booking.modes.add(_EXCLUSIVE if held.exclusive else held.mode.value)
                if held.mode is ComputeMode.SM_SHARING and not held.exclusive:
                    booking.compute_ppm += portion_ppm(device.compute_portion or 0.0)
                    booking.namespaces.add(claim.metadata.namespace)
                booking.pods.append(key)
    for pod in pods:
        key = f"{pod.metadata.namespace}/{pod.metadata.name}"
        node = pod.spec.nodeName if pod.spec else None
        try:
            request = gpu_request(pod)
        except InvalidPodRequest as error:
            if node:
                problems.append(f"bound pod {key} has an invalid GPU request: {error}")
            continue
        devices = [d for c in request.containers for d in c.devices]
        if not devices:
            continue
        if not node:
            problems.append(f"pod {key} carries devices {devices} but is not bound to a node")
            continue
        placed += 1
        for container in request.containers:
            if container.mig is not None:
                _book_slices(key, node, container.devices, gpus, slices, problems)
                continue
            for name in container.devices:
                booking = gpus.get(name.removeprefix("nvidia.com/gpu="))
                wrong_mode = booking is not None and (
                    booking.mode is GpuMode.MIG or (booking.mode is GpuMode.WHOLE and not container.exclusive)
                )
                if booking is not None and booking.node == node and wrong_mode:
                    what = "whole GPU" if container.exclusive else "fraction"
                    problems.append(
                        f"pod {key} on {node} holds GPU {name} in mode {booking.mode.value} as a {what}"
                    )
                if booking is None or booking.node != node:
                    problems.append(f"pod {key} on {node} holds GPU {name}, which {node} does not have")
                    continue
                cap = booking.capacity_mib
                booking.request_mib += container.request_mib(cap)
                booking.limit_mib += container.limit_mib(cap)
                booking.modes.add(_EXCLUSIVE if container.exclusive else container.mode.value)
                if container.mode is ComputeMode.SM_SHARING and not container.exclusive:
                    portion = container.compute_portion
                    portion = container.compute_portion_on(cap) if portion is None else portion
                    booking.compute_ppm += portion_ppm(portion or 0.0)
                    booking.namespaces.add(pod.metadata.namespace)
                booking.pods.append(key)
    for uuid, b in gpus.items():
        where = f"GPU {uuid} on {b.node}"
        if b.request_mib > b.capacity_mib:
            problems.append(f"{where} is over-committed: {b.request_mib} MiB guaranteed of {b.capacity_mib}")
        if len(b.modes) > 1:
            problems.append(f"{where} mixes {sorted(b.modes)}: {b.pods}")
        if _EXCLUSIVE in b.modes and len(b.pods) > 1:
            problems.append(f"{where} is exclusive but shared by {b.pods}")
        if b.compute_ppm > PPM:
            problems.append(f"{where} has {b.compute_ppm / PPM:.3f} of its compute promised")
        if sm_sharing_single_tenant and len(b.namespaces) > 1:
            problems.append(f"{where} is sm-shared by namespaces {sorted(b.namespaces)}")
        for uuid_, holders in b.slices.items():
            if len(holders) > 1:
                problems.append(f"MIG slice {slices[uuid_][2]} ({uuid_}) of {where} is held by {holders}")
    return AuditReport(gpus=gpus, problems=problems, placed_pods=placed)


def _book_slices(
    key: str,
    node: str,
    names: Iterable[str],
    gpus: dict[str, GpuBooking],
    slices: dict[str, tuple[str, int, str]],
    problems: list[str],
) -> None:
    """A MIG container's devices: each a slice its node publishes, booked whole on its GPU."""
    for name in names:
        uuid = name.removeprefix("nvidia.com/gpu=")
        found = slices.get(uuid)
        booking = gpus[found[0]] if found is not None else None
        if found is None or booking is None or booking.node != node:
            problems.append(f"pod {key} on {node} holds MIG device {name}, which {node} does not publish")
            continue
        holders = booking.slices.setdefault(uuid, [])
        if not holders:
            booking.slice_mib += found[1]
        holders.append(key)
        booking.pods.append(key)


def books_disagree(report: AuditReport, ledgers: Iterable[GpuLedger]) -> list[str]:
    """Each audited GPU whose guaranteed or limit MiB in a scheduler's ``ledgers`` differ from what the
    pods' annotations book there, or, for a MIG GPU, whose taken slices differ (a GPU the ledgers do not
    show is not compared)."""
    out = []
    for ledger in ledgers:
        booked = report.gpus.get(ledger.uuid)
        if booked is None:
            continue
        if booked.mode is GpuMode.MIG or ledger.slices:
            held = sorted(booked.slices)
            if sorted(ledger.slices) != held:
                out.append(
                    f"GPU {ledger.uuid} on {booked.node}: the books hold MIG slices {sorted(ledger.slices)},"
                    f" the pods' annotations {held}: {booked.pods}"
                )
            continue
        books = (ledger.capacity_mib - ledger.free_mib, ledger.limit_sum_mib)
        if books != (booked.request_mib, booked.limit_mib):
            out.append(
                f"GPU {ledger.uuid} on {booked.node}: the books hold {books[0]} MiB guaranteed"
                f" ({books[1]} limit), the pods' annotations {booked.request_mib} MiB"
                f" ({booked.limit_mib} limit): {booked.pods}"
            )
    return out


def by_node(report: AuditReport) -> dict[str, list[GpuBooking]]:
    out: dict[str, list[GpuBooking]] = defaultdict(list)
    for booking in report.gpus.values():
        out[booking.node].append(booking)
    return dict(out)
