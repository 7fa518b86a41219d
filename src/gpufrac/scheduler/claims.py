"""DRA claims of gpufrac's driver in gpufrac-scheduler: a claim's requests become the engine's request,
the engine's placement becomes the allocation kube-scheduler would write, and every allocation of our
driver, whoever wrote it, is booked in the engine once.

Why the scheduler allocates claims itself: the stock allocator picks the first device with room, blind
to fragmentation and to compute modes (it would put an sm-sharing claim on a GPU that holds time-slicing
shares; the node then refuses to prepare it). A claim request is the same thing as an annotation
request -- MiB of one GPU, a mode, a compute portion -- so it becomes the same ``ContainerGpuRequest``
and the placement engine places it with every rule it applies to annotation pods.

Reading a claim (resource.k8s.io/v1 ``ResourceClaimSpec``). Every request must be ``exactly`` one
class of our driver (a DeviceClass whose ``config`` hands our driver its opaque ``GpuShareConfig``:
the classes are read from the API, not named here); the rest is refused with the field that says why:
``firstAvailable``, ``allocationMode: All``, ``adminAccess``, CEL ``selectors`` on the claim and
``constraints`` (the scheduler does not evaluate CEL: the class's own selector is read as "GPUs of
our driver that can enforce the class's mode", which the engine's mode rules enforce). Per request:

- ``capacity.requests.memory`` rounded as the slice's ``requestPolicy`` says (``consumed``, the
  allocator's rule); no memory: the whole GPU (the policy's default is the GPU's value);
- the compute mode from our opaque config (the class's, then the claim's own, the later wins), as the
  node's prepare reads it; ``memoryLimit`` is the container's limit;
- ``capacity.requests.compute`` (percent) the sm-sharing portion; none: 0, the policy's default (no
  thread ceiling), so the engine reserves no compute either;
- ``count`` GPUs of one node, as an annotation container's ``device_count``.

Writing an allocation: ``allocation`` renders ``status.allocation`` as kube-scheduler's allocator does
(``devices.results[]`` with ``request``, ``driver``, ``pool``, ``device``, every capacity in
``consumedCapacity`` and a fresh ``shareID`` per share of a device that allows multiple allocations;
``devices.config[]`` with the class's config per request (``FromClass``) then the claim's
(``FromClaim``); a ``nodeSelector`` on the node's name). ``claim_front.ClaimWriter`` adds kube-scheduler's
finalizer, then writes the allocation with the pod in ``reservedFor``, each preconditioned on the
version read.

Booking: ``claim_placement`` reads an allocation back with the reader the node prepares it with
(``gpufrac.contract.dra.read_allocation``), so the books hold exactly what the node will enforce.
Device names are the ones the node's ResourceSlice publishes (``gpufrac.contract.dra.device_name``).
"""

from __future__ import annotations

import logging
import math
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

from lightkube.resources.core_v1 import Pod
from lightkube.resources.resource_v1 import DeviceClass, ResourceClaim, ResourceSlice
from lightkube.utils.quantity import parse_quantity

from gpufrac.contract import keys
from gpufrac.contract.dra import (
    AllocationError,
    device_name,
    mib_quantity,
    read_allocation,
    read_share_parameters,
)
from gpufrac.contract.request import ComputeMode, ContainerGpuRequest, GpuMemory
from gpufrac.placement.decision import ContainerPlacement, DeviceAssignment, Placement
from gpufrac.placement.model import GpuDevice, NodeSpec

log = logging.getLogger(__name__)

MIB = 1024 * 1024

#: The engine's key for a claim's hold (``Engine.hold``): never a pod UID.
HOLD_PREFIX = "resourceclaim/"


def hold_key(claim_uid: str) -> str:
    return f"{HOLD_PREFIX}{claim_uid}"


def share_container(claim: str, request: str) -> str:
    """The engine's container name for one request of a claim (unique within a pod: claim names are
    unique in its namespace)."""
    return f"{claim}/{request}"


# -- device classes and slices ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class DriverClass:
    """A DeviceClass that hands our driver its configuration: the mode its claims get, and its config
    entries as an allocation copies them."""

    name: str
    mode: ComputeMode
    config: tuple[dict[str, Any], ...]
    problem: str | None = None


def driver_class(obj: DeviceClass) -> DriverClass | None:
    """The class as ours, or None when its config hands our driver nothing (another driver's class)."""
    name = obj.metadata.name if obj.metadata else ""
    spec = obj.to_dict().get("spec") or {}
    config = tuple(c for c in spec.get("config") or [] if c.get("opaque"))
    ours = [c["opaque"] for c in config if c["opaque"].get("driver") == keys.DRA_DRIVER_NAME]
    if not ours:
        return None
    mode = ComputeMode.TIME_SLICING
    for opaque in ours:
        value = (opaque.get("parameters") or {}).get(keys.DRA_CONFIG_COMPUTE_MODE)
        if value is None:
            continue
        try:
            mode = ComputeMode(value)
        except ValueError:
            known = " or ".join(m.value for m in ComputeMode)
            return DriverClass(
                name,
                mode,
                config,
                problem=f"DeviceClass {name}: config opaque parameters {keys.DRA_CONFIG_COMPUTE_MODE}="
                f"{value!r} is invalid: it must be {known}",
            )
    return DriverClass(name, mode, config)


@dataclass(frozen=True, slots=True)
class PublishedNode:
    """What a node's ResourceSlices of our driver publish: its pool, device names and capacities."""

    pool: str
    #: Device name -> its ``capacity`` entries (``value`` and ``requestPolicy`` per capacity).
    capacity: Mapping[str, Mapping[str, Mapping[str, Any]]] = field(default_factory=dict)


def published_nodes(slices: Iterable[ResourceSlice]) -> dict[str, PublishedNode]:
    """Node name -> what our driver's slices publish there (slices of other drivers are skipped)."""
    out: dict[str, PublishedNode] = {}
    for obj in slices:
        spec = obj.to_dict().get("spec") or {}
        node = spec.get("nodeName")
        if spec.get("driver") != keys.DRA_DRIVER_NAME or not node:
            continue
        capacity = dict(out[node].capacity) if node in out else {}
        for device in spec.get("devices") or []:
            capacity[str(device.get("name"))] = device.get("capacity") or {}
        out[node] = PublishedNode(pool=str((spec.get("pool") or {}).get("name") or node), capacity=capacity)
    return out


def consumed(requested: Decimal | None, capacity: Mapping[str, Any]) -> Decimal | None:
    """What a request consumes of a device capacity under its ``requestPolicy`` (kube-scheduler's
    rule, ``k8s.io/api/resource/v1`` ``CapacityRequestPolicy``): no request -> ``default`` (the whole
    value without a policy); ``validValues`` -> the smallest one not below the request; ``validRange``
    -> at least ``min``, rounded up to ``min + n*step``. None: the request violates the policy (above
    ``max``, above every valid value, or above the value itself)."""
    value = parse_quantity(capacity.get("value")) or Decimal(0)
    policy = capacity.get("requestPolicy") or {}
    if requested is None:
        default = policy.get("default")
        return value if default is None else parse_quantity(default)
    amount = requested
    valid_values = [parse_quantity(v) for v in policy.get("validValues") or []]
    valid_range = policy.get("validRange")
    if valid_values:
        fitting = [v for v in valid_values if v is not None and v >= amount]
        if not fitting:
            return None
        amount = min(fitting)
    elif valid_range:
        low = parse_quantity(valid_range.get("min")) or Decimal(0)
        step = parse_quantity(valid_range.get("step"))
        high = parse_quantity(valid_range.get("max"))
        amount = max(amount, low)
        if step:
            amount = low + math.ceil((amount - low) / step) * step
        if high is not None and amount > high:
            return None
    return amount if amount <= value else None


# -- a pod's claims -----------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Share:
    """One request of a claim to allocate, as the engine places it."""

    claim: str
    request: str
    device_class: DriverClass
    gpu: ContainerGpuRequest
    compute_percent: Decimal


@dataclass(frozen=True, slots=True)
class ClaimToAllocate:
    claim: ResourceClaim
    shares: tuple[Share, ...]


@dataclass(frozen=True, slots=True)
class ClaimPlan:
    """What placing a claim pod takes: the claims to allocate (their shares placed with the pod), every
    claim of the pod (each gets the pod in ``reservedFor``), the node the already allocated ones tie it
    to, and the nodes that publish our driver's devices (where new shares can go)."""

    to_allocate: tuple[ClaimToAllocate, ...]
    claims: tuple[ResourceClaim, ...]
    node: str | None
    nodes: frozenset[str]

    @property
    def shares(self) -> tuple[Share, ...]:
        return tuple(s for c in self.to_allocate for s in c.shares)


def allocated_node(claim: ResourceClaim) -> str | None:
    """The node an allocation's ``nodeSelector`` names (``matchFields`` on ``metadata.name``, as both
    schedulers write it for node-local devices); None when it names none."""
    allocation = (claim.to_dict().get("status") or {}).get("allocation") or {}
    for term in (allocation.get("nodeSelector") or {}).get("nodeSelectorTerms") or []:
        for field_ in term.get("matchFields") or []:
            if (
                field_.get("key") == "metadata.name"
                and field_.get("operator") == "In"
                and field_.get("values")
            ):
                return str(field_["values"][0])
    return None


def ours_allocated(claim: ResourceClaim) -> bool:
    """Whether the claim is allocated with at least one device of our driver."""
    return bool(_our_results(claim)[0])


def _our_results(claim: ResourceClaim) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    allocation = (claim.to_dict().get("status") or {}).get("allocation") or {}
    results = (allocation.get("devices") or {}).get("results") or []
    ours = [r for r in results if r.get("driver") == keys.DRA_DRIVER_NAME]
    return ours, [r for r in results if r.get("driver") != keys.DRA_DRIVER_NAME]


def _claim_config(
    claim: Mapping[str, Any], request: str, where: str
) -> tuple[ComputeMode | None, str | None]:
    """(mode, memoryLimit) the claim's own config for our driver sets on ``request`` (None: unset)."""
    mode: ComputeMode | None = None
    limit: str | None = None
    for i, entry in enumerate(((claim.get("spec") or {}).get("devices") or {}).get("config") or []):
        opaque = entry.get("opaque") or {}
        if opaque.get("driver") != keys.DRA_DRIVER_NAME:
            continue
        requests = entry.get("requests") or []
        if requests and request not in requests:
            continue
        parameters = opaque.get("parameters") or {}
        at = f"{where}.spec.devices.config[{i}].opaque.parameters"
        try:
            found_mode, found_limit = read_share_parameters(parameters, where=at)
        except AllocationError as error:
            raise _Refused(str(error)) from None
        mode = found_mode or mode
        limit = found_limit if found_limit is not None else limit
    return mode, limit


class _Refused(Exception):
    """A sentence saying why the pod's claims cannot be placed (now)."""


def _share(
    claim: Mapping[str, Any],
    request: Mapping[str, Any],
    *,
    where: str,
    classes: Mapping[str, DriverClass | None],
    capacity: Mapping[str, Mapping[str, Any]],
) -> Share:
    name = str(request.get("name"))
    at = f"{where}.spec.devices.requests[{name}]"
    exactly = request.get("exactly")
    if exactly is None:
        raise _Refused(
            f"{at}.firstAvailable: gpufrac-scheduler does not allocate prioritized lists; name one "
            "DeviceClass with exactly, or use kube-scheduler for this pod"
        )
    class_name = str(exactly.get("deviceClassName"))
    if class_name not in classes:
        raise _Refused(f"{at}.exactly.deviceClassName={class_name!r}: the DeviceClass does not exist")
    found = classes[class_name]
    if found is None:
        raise _Refused(
            f"{at}.exactly.deviceClassName={class_name!r} is not a class of driver {keys.DRA_DRIVER_NAME}: "
            "gpufrac-scheduler allocates only gpufrac's claims; use kube-scheduler for this pod"
        )
    if found.problem is not None:
        raise _Refused(f"{at}: {found.problem}")
    if (exactly.get("allocationMode") or "ExactCount") != "ExactCount":
        raise _Refused(
            f"{at}.exactly.allocationMode={exactly.get('allocationMode')!r}: gpufrac-scheduler allocates "
            "ExactCount requests only (a share of a GPU, or count whole GPUs)"
        )
    if exactly.get("adminAccess"):
        raise _Refused(f"{at}.exactly.adminAccess=true: admin access is not a GPU share")
    if exactly.get("selectors"):
        raise _Refused(
            f"{at}.exactly.selectors: gpufrac-scheduler does not evaluate CEL selectors; choose GPUs with "
            f"the pod's node selector or affinity (label {keys.GPU_MODEL_LABEL}), or use kube-scheduler"
        )
    count = int(exactly.get("count") or 1)
    requested = ((exactly.get("capacity") or {}).get("requests")) or {}
    unknown = sorted(set(requested) - {keys.DRA_MEMORY_CAPACITY, keys.DRA_COMPUTE_CAPACITY})
    if unknown:
        raise _Refused(
            f"{at}.exactly.capacity.requests: {', '.join(unknown)} is not a capacity of driver "
            f"{keys.DRA_DRIVER_NAME} (it has {keys.DRA_MEMORY_CAPACITY} and {keys.DRA_COMPUTE_CAPACITY})"
        )
    mode, limit_text = _claim_config(claim, name, where)
    mode = mode or found.mode
    memory_capacity = capacity.get(keys.DRA_MEMORY_CAPACITY) or {}
    compute_capacity = capacity.get(keys.DRA_COMPUTE_CAPACITY) or {}
    raw_memory = requested.get(keys.DRA_MEMORY_CAPACITY)
    request_mem: GpuMemory | None = None
    if raw_memory is not None:
        amount = parse_quantity(str(raw_memory))
        rounded = consumed(amount, memory_capacity) if amount is not None and amount > 0 else None
        if rounded is None:
            raise _Refused(
                f"{at}.exactly.capacity.requests.{keys.DRA_MEMORY_CAPACITY}={raw_memory!r} is invalid: it "
                "must be a positive quantity within the request policy of the published GPUs"
            )
        request_mem = GpuMemory(mib=math.ceil(rounded / MIB))
    raw_compute = requested.get(keys.DRA_COMPUTE_CAPACITY)
    percent = (
        consumed(None if raw_compute is None else parse_quantity(str(raw_compute)), compute_capacity)
        if compute_capacity
        else Decimal(0)
    )
    if percent is None:
        raise _Refused(
            f"{at}.exactly.capacity.requests.{keys.DRA_COMPUTE_CAPACITY}={raw_compute!r} is invalid: it "
            "must be a percent from 0 to 100"
        )
    if raw_compute is not None and percent > 0 and mode is not ComputeMode.SM_SHARING:
        raise _Refused(
            f"{at}.exactly.capacity.requests.{keys.DRA_COMPUTE_CAPACITY}={raw_compute!r}: a compute "
            f"portion applies to {ComputeMode.SM_SHARING.value} only, and this request is {mode.value}"
        )
    limit_mem: GpuMemory | None = None
    if limit_text is not None:
        limit_key = f"{where}.spec.devices.config {keys.DRA_CONFIG_MEMORY_LIMIT}"
        amount = parse_quantity(limit_text)
        if request_mem is None or amount is None or request_mem.mib is None:
            raise _Refused(
                f"{limit_key}={limit_text!r} is invalid: a limit applies to a share of a GPU, and request "
                f"{name} asks for the whole GPU"
            )
        limit_mib = math.ceil(amount / MIB)
        if limit_mib < request_mem.mib:
            raise _Refused(
                f"{limit_key}={limit_text!r} is invalid: the limit must not be below the request "
                f"({request_mem.mib} MiB)"
            )
        limit_mem = GpuMemory(mib=limit_mib)
    claim_name = str((claim.get("metadata") or {}).get("name"))
    gpu = ContainerGpuRequest(
        container=share_container(claim_name, name),
        request=request_mem,
        limit=limit_mem,
        mode=mode,
        device_count=count,
        exclusive=request_mem is None,
        compute_request=float(percent) / 100 if mode is ComputeMode.SM_SHARING else None,
    )
    return Share(claim_name, name, found, gpu, percent)


def plan_claims(
    pod: Pod,
    *,
    claim: Callable[[str, str], ResourceClaim | None],
    classes: Mapping[str, DriverClass | None],
    published: Mapping[str, PublishedNode],
) -> ClaimPlan | str:
    """What placing ``pod`` takes for its ``spec.resourceClaims``, or the sentence saying why it
    cannot be placed (now). ``claim(namespace, name)`` looks a claim up; ``classes`` are the cluster's
    DeviceClasses by name (None: another driver's)."""
    ns = pod.metadata.namespace
    statuses = {s.name: s for s in (pod.status.resourceClaimStatuses if pod.status else None) or []}
    to_allocate: list[ClaimToAllocate] = []
    claims: list[ResourceClaim] = []
    nodes: set[str] = set()
    try:
        for i, entry in enumerate(pod.spec.resourceClaims or []):
            where = f"spec.resourceClaims[{i}] ({entry.name})"
            name = entry.resourceClaimName
            if name is None and entry.resourceClaimTemplateName:
                status = statuses.get(entry.name)
                if status is None:
                    template = entry.resourceClaimTemplateName
                    raise _Refused(
                        f"{where}: waiting for the ResourceClaim of template {template} "
                        "(kube-controller-manager creates it and names it in status.resourceClaimStatuses)"
                    )
                if status.resourceClaimName is None:
                    continue  # the controller decided no claim is needed
                name = status.resourceClaimName
            if name is None:
                raise _Refused(f"{where}: names neither resourceClaimName nor resourceClaimTemplateName")
            found = claim(ns, name)
            where = f"{where}, ResourceClaim {ns}/{name}"
            if found is None:
                raise _Refused(f"{where}: the claim does not exist (yet)")
            if found.metadata.deletionTimestamp is not None:
                raise _Refused(f"{where}: the claim is being deleted")
            if entry.resourceClaimTemplateName and not any(
                r.controller and r.uid == pod.metadata.uid for r in found.metadata.ownerReferences or ()
            ):
                raise _Refused(f"{where}: the claim was not generated for this pod (another pod owns it)")
            claims.append(found)
            body = found.to_dict()
            if (body.get("status") or {}).get("allocation"):
                ours, others = _our_results(found)
                if others or not ours:
                    drivers = sorted({str(r.get("driver")) for r in others}) or ["none"]
                    raise _Refused(
                        f"{where}: it is allocated to driver(s) {', '.join(drivers)}: gpufrac-scheduler "
                        f"places only pods whose claims are all for {keys.DRA_DRIVER_NAME}"
                    )
                node = allocated_node(found)
                if node is None:
                    raise _Refused(f"{where}: its allocation names no node (status.allocation.nodeSelector)")
                nodes.add(node)
                continue
            if ((body.get("spec") or {}).get("devices") or {}).get("constraints"):
                raise _Refused(
                    f"{where}.spec.devices.constraints: gpufrac-scheduler does not evaluate device "
                    "constraints; use kube-scheduler for this pod"
                )
            requests = ((body.get("spec") or {}).get("devices") or {}).get("requests") or []
            if not requests:
                continue
            if not published:
                raise _Refused(
                    f"{where}: no node publishes a ResourceSlice of driver {keys.DRA_DRIVER_NAME} (run the "
                    "node agents with --dra)"
                )
            capacity = next(iter(next(iter(published.values())).capacity.values()), {})
            shares = tuple(
                _share(body, r, where=f"ResourceClaim {ns}/{name}", classes=classes, capacity=capacity)
                for r in requests
            )
            to_allocate.append(ClaimToAllocate(found, shares))
        if len(nodes) > 1:
            raise _Refused(
                f"the pod's claims are allocated on different nodes ({', '.join(sorted(nodes))}): no node "
                "has them all"
            )
    except _Refused as refused:
        return str(refused)
    return ClaimPlan(
        to_allocate=tuple(to_allocate),
        claims=tuple(claims),
        node=next(iter(nodes), None),
        nodes=frozenset(published),
    )


# -- allocations --------------------------------------------------------------------------------------------


def _plain(amount: Decimal) -> str:
    """A quantity without exponent (``Decimal("1E+2")`` is ``100``)."""
    return str(int(amount)) if amount == amount.to_integral_value() else format(amount, "f")


def gpu_device_name(gpu: GpuDevice) -> str:
    """The device name the node's ResourceSlice gives ``gpu`` (the wire format's rule)."""
    return device_name(gpu.uuid, gpu.index)


def allocation(
    claim: ClaimToAllocate, *, placement: Placement, node: NodeSpec, published: PublishedNode
) -> dict[str, Any]:
    """``status.allocation`` for ``claim``'s shares as the engine placed them (``placement``: the pod's),
    in the shape kube-scheduler's allocator writes."""
    placed = {c.container: c for c in placement.containers}
    results: list[dict[str, Any]] = []
    config: list[dict[str, Any]] = []
    for share in claim.shares:
        container = placed[share.gpu.container]
        for device in container.devices:
            name = gpu_device_name(next(g for g in node.gpus if g.uuid == device.uuid))
            if name not in published.capacity:
                raise ValueError(f"node {node.name} does not publish GPU {device.uuid} as a device")
            # Every capacity of the device, as the allocator records them (zero ones too).
            capacity = {keys.DRA_MEMORY_CAPACITY: mib_quantity(device.request_mib)}
            if keys.DRA_COMPUTE_CAPACITY in published.capacity[name]:
                capacity[keys.DRA_COMPUTE_CAPACITY] = _plain(share.compute_percent)
            results.append(
                {
                    "request": share.request,
                    "driver": keys.DRA_DRIVER_NAME,
                    "pool": published.pool,
                    "device": name,
                    "consumedCapacity": capacity,
                    "shareID": str(uuid.uuid4()),
                }
            )
        for entry in share.device_class.config:
            config.append({"source": "FromClass", "requests": [share.request], "opaque": entry["opaque"]})
    spec = claim.claim.to_dict().get("spec") or {}
    for entry in (spec.get("devices") or {}).get("config") or []:
        written = {"source": "FromClaim", "requests": list(entry.get("requests") or [])}
        if entry.get("opaque"):
            written["opaque"] = entry["opaque"]
        config.append(written)
    return {
        "devices": {"results": results, "config": config},
        "nodeSelector": {
            "nodeSelectorTerms": [
                {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [node.name]}]}
            ]
        },
    }


def claim_placement(claim: Mapping[str, Any], node: NodeSpec) -> Placement | None:
    """What an allocated claim holds on ``node``, read by the reader the node prepares it with; None when
    it holds nothing of our driver there (or the node cannot read it: logged)."""
    meta = claim.get("metadata") or {}
    by_device = {gpu_device_name(g): g for g in node.gpus}
    try:
        shares = read_allocation(claim, uuids={name: g.uuid for name, g in by_device.items()})
    except AllocationError as error:
        log.warning(
            "ResourceClaim %s/%s: its allocation on node %s is not booked: %s",
            meta.get("namespace"),
            meta.get("name"),
            node.name,
            error,
        )
        return None
    containers = []
    for i, share in enumerate(shares):
        bound = share.bound
        gpu = by_device[share.device]
        request = gpu.memory_mib if bound.request_mib is None else bound.request_mib
        limit = gpu.memory_mib if bound.limit_mib is None else bound.limit_mib
        portion = bound.compute_portion if bound.mode is ComputeMode.SM_SHARING else None
        containers.append(
            ContainerPlacement(
                container=f"{share.request}#{i}",
                mode=bound.mode,
                exclusive=bound.exclusive,
                devices=(DeviceAssignment(gpu.uuid, gpu.index, request, limit, portion),),
            )
        )
    if not containers:
        return None
    return Placement(pod_uid=hold_key(str(meta.get("uid"))), node=node.name, containers=tuple(containers))
