"""The node's GPUs as a DRA ResourceSlice (resource.k8s.io/v1), so that claims can ask for memory shares.

DRA is gpufrac's second front door (docs/dra.md): a pod asks for part of a GPU with a ResourceClaim
instead of annotations, and the default kube-scheduler allocates it. What makes that possible is
consumable capacity (KEP-5075): a device with ``allowMultipleAllocations`` may be allocated to many
claims, each consuming part of its ``capacity``, and the scheduler keeps the sum within the value.

One slice per node, one pool named after the node, one device per usable GPU:

- the device name is derived from the GPU's UUID, not its index: an allocation names a device, and an
  index can point at another GPU after a reboot (``gpufrac.contract.dra.device_name``, the wire format's
  rule, which gpufrac-scheduler names devices with too);
- capacity ``memory`` is the GPU's usable MiB as the inventory reports them (the same figure as the
  ``gpufrac.io/gpus`` annotation), with a request policy: a claim that names no amount consumes the
  whole GPU (what a request for "a GPU" means), and a claim's amount is rounded up to whole MiB, the
  rounding the annotation contract applies to quantities;
- capacity ``compute`` is 100 (percent of the SMs): an sm-sharing claim's portion, whole percent, whose
  sum the allocator keeps within 100; a claim that names none consumes 0 (time-slicing claims, and an
  sm-sharing claim without a thread ceiling);
- attributes for selectors: model, UUID, index, driver major, and one boolean per compute mode saying
  whether the node can enforce that mode's limits right now (the capability labels' truth).

A GPU the inventory withdraws (gone, compute prohibited) leaves the slice, and so does one that does not
serve fractions (mode ``mig`` or ``whole``, docs/mig.md: its MIG slices and whole-GPU pods go through the
annotation path only); a pool whose content changes gets the next ``generation``, so the scheduler drops
the older view. While the inventory
cannot be read at all, the slice keeps no devices: nothing may be allocated on GPUs nobody can see.

The slice is owned by the Node (an owner reference), so it goes when the Node is deleted, as the slices
of the kubelet's own DRA helper do.

Feature gate. On Kubernetes 1.34 and 1.35 ``allowMultipleAllocations`` and ``requestPolicy`` exist only
while ``DRAConsumableCapacity`` is enabled on the API server; without it the server silently drops them
and each GPU could go to a single claim. The publisher reads the stored slice back and says so
(``consumable_capacity`` False, a warning naming the gate) instead of pretending to share.
"""

from __future__ import annotations

import hashlib
import logging
from typing import Any

from lightkube import AsyncClient
from lightkube.resources.core_v1 import Node
from lightkube.resources.resource_v1 import ResourceSlice

from gpufrac.contract import dra, keys
from gpufrac.contract.dra import mib_quantity
from gpufrac.contract.request import ComputeMode
from gpufrac.kube.errors import NotFound, api_errors
from gpufrac.kube.patch import merge_patch
from gpufrac.node.inventory.backend import GpuInfo, NodeInventory
from gpufrac.node.mps.mode import DriverVersion, NodeMpsCapability

log = logging.getLogger(__name__)

#: The compute modes' attribute names (``contract.keys`` spells them, the chart's DeviceClasses use them).
MODE_ATTRIBUTES: dict[ComputeMode, str] = {
    ComputeMode.TIME_SLICING: keys.DRA_ATTRIBUTE_TIME_SLICING,
    ComputeMode.SM_SHARING: keys.DRA_ATTRIBUTE_SM_SHARING,
}

#: A GPU's compute capacity: percent of its SMs. The allocator keeps the sum of sm-sharing portions on a
#: GPU within it, the rule the annotation path's scheduler applies to compute portions.
COMPUTE_PERCENT = 100

#: The feature gate that keeps ``allowMultipleAllocations`` on Kubernetes 1.34/1.35 (beta, on, from 1.36).
CONSUMABLE_CAPACITY_GATE = "DRAConsumableCapacity"

_NAME_MAX = 253  # a ResourceSlice name is a DNS subdomain


def slice_name(node_name: str) -> str:
    """The node's ResourceSlice: ``<node>-<driver>``, hashed when that would exceed a DNS subdomain."""
    name = f"{node_name}-{keys.DRA_DRIVER_NAME}"
    if len(name) <= _NAME_MAX:
        return name
    digest = hashlib.sha256(node_name.encode()).hexdigest()[:10]
    return f"{node_name[: _NAME_MAX - len(keys.DRA_DRIVER_NAME) - 12]}-{digest}-{keys.DRA_DRIVER_NAME}"


def device_name(gpu: GpuInfo) -> str:
    """The GPU's device name in the slice (``contract.dra.device_name``: from its UUID, stable across index
    changes), the name allocations carry back to the node and to gpufrac-scheduler."""
    return dra.device_name(gpu.uuid, gpu.index)


def _device(
    gpu: GpuInfo, *, driver_major: int | None, capability: NodeMpsCapability | None
) -> dict[str, Any]:
    memory = mib_quantity(gpu.mib)
    attributes: dict[str, dict[str, Any]] = {
        keys.DRA_ATTRIBUTE_MODEL: {"string": gpu.model},
        keys.DRA_ATTRIBUTE_UUID: {"string": gpu.uuid},
        keys.DRA_ATTRIBUTE_INDEX: {"int": gpu.index},
    }
    if driver_major is not None:
        attributes[keys.DRA_ATTRIBUTE_DRIVER_MAJOR] = {"int": driver_major}
    if capability is not None:
        for mode, attribute in MODE_ATTRIBUTES.items():
            attributes[attribute] = {"bool": mode in capability.enforceable}
    return {
        "name": device_name(gpu),
        "allowMultipleAllocations": True,
        "attributes": attributes,
        "capacity": {
            keys.DRA_MEMORY_CAPACITY: {
                "value": memory,
                "requestPolicy": {
                    "default": memory,
                    "validRange": {"min": "1Mi", "step": "1Mi"},
                },
            },
            keys.DRA_COMPUTE_CAPACITY: {
                "value": str(COMPUTE_PERCENT),
                "requestPolicy": {
                    "default": "0",
                    "validRange": {"min": "0", "max": str(COMPUTE_PERCENT), "step": "1"},
                },
            },
        },
    }


def desired_devices(
    *, inventory: NodeInventory | None, capability: NodeMpsCapability | None
) -> list[dict[str, Any]]:
    """Pure: the slice's devices for what the backend reports (none while it cannot be read)."""
    if inventory is None:
        return []
    try:
        driver_major: int | None = DriverVersion.parse(inventory.driver_version).major
    except ValueError:
        driver_major = None
    return [_device(g, driver_major=driver_major, capability=capability) for g in inventory.fractionable]


def _without_gated(devices: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``devices`` as an API server without ``DRAConsumableCapacity`` stores them (the gated fields
    dropped), so that a re-sync there does not rewrite the same slice with a new generation."""
    out = []
    for device in devices:
        kept = {k: v for k, v in device.items() if k != "allowMultipleAllocations"}
        kept["capacity"] = {
            name: {k: v for k, v in capacity.items() if k != "requestPolicy"}
            for name, capacity in (device.get("capacity") or {}).items()
        }
        out.append(kept)
    return out


def _shares(devices: list[dict[str, Any]]) -> bool:
    """Whether the stored devices kept ``allowMultipleAllocations`` (the gate was on at the server)."""
    return all(d.get("allowMultipleAllocations") is True for d in devices)


class ResourceSlicePublisher:
    """Keeps the node's ResourceSlice equal to its inventory; ``sync`` writes only what changed."""

    def __init__(self, *, client: AsyncClient, node_name: str) -> None:
        self._client = client
        self._node = node_name
        self.name = slice_name(node_name)
        self._written: list[dict[str, Any]] | None = None
        #: False once the API server was seen dropping ``allowMultipleAllocations`` (the gate is off).
        self.consumable_capacity: bool | None = None
        self.writes = 0

    async def sync(
        self,
        *,
        inventory: NodeInventory | None,
        capability: NodeMpsCapability | None,
        force: bool = False,
    ) -> bool:
        """Create or update the slice when its devices differ (``force``: compare with the stored one).

        Returns whether it wrote. Raises ``KubeError``; the caller retries at its next interval.
        """
        devices = desired_devices(inventory=inventory, capability=capability)
        if not force and devices == self._written:
            return False
        try:
            with api_errors():
                current: ResourceSlice | None = await self._client.get(ResourceSlice, self.name)
        except NotFound:
            current = None
        if current is None:
            stored = await self._create(devices)
        else:
            spec = current.to_dict().get("spec") or {}
            stored_devices = spec.get("devices", [])
            if stored_devices == devices or (  # an earlier write already says it
                self.consumable_capacity is False and stored_devices == _without_gated(devices)
            ):
                self._written = devices
                self._check_gate(current)
                return False
            stored = await self._update(
                devices,
                generation=int((spec.get("pool") or {}).get("generation", 0)) + 1,
                resource_version=current.metadata.resourceVersion if current.metadata else None,
            )
        self._written = devices
        self.writes += 1
        self._check_gate(stored)
        log.info("dra: published %d GPU device(s) in ResourceSlice %s", len(devices), self.name)
        return True

    async def _create(self, devices: list[dict[str, Any]]) -> ResourceSlice:
        with api_errors():
            node = await self._client.get(Node, self._node)
        owner = node.metadata
        body = {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceSlice",
            "metadata": {
                "name": self.name,
                "ownerReferences": [
                    {
                        "apiVersion": "v1",
                        "kind": "Node",
                        "name": self._node,
                        "uid": owner.uid if owner else None,
                        "controller": True,
                    }
                ],
            },
            "spec": {
                "driver": keys.DRA_DRIVER_NAME,
                "nodeName": self._node,
                "pool": {"name": self._node, "generation": 1, "resourceSliceCount": 1},
                "devices": devices,
            },
        }
        with api_errors():
            return await self._client.create(ResourceSlice.from_dict(body))  # type: ignore[no-any-return]

    async def _update(
        self, devices: list[dict[str, Any]], *, generation: int, resource_version: str | None
    ) -> ResourceSlice:
        # The devices list is replaced as a whole (merge patch), preconditioned on the version read, so
        # a concurrent writer makes this a Conflict for the next sync instead of a lost generation.
        return await merge_patch(
            self._client,
            ResourceSlice,
            name=self.name,
            patch={
                "spec": {
                    "pool": {"name": self._node, "generation": generation, "resourceSliceCount": 1},
                    "devices": devices,
                }
            },
            resource_version=resource_version,
        )

    def _check_gate(self, stored: ResourceSlice) -> None:
        devices = (stored.to_dict().get("spec") or {}).get("devices", [])
        if not devices:
            return
        shares = _shares(devices)
        if not shares and self.consumable_capacity is not False:
            log.warning(
                "dra: the API server dropped allowMultipleAllocations from ResourceSlice %s: the feature "
                "gate %s is off (Kubernetes 1.34/1.35 need --feature-gates=%s=true on kube-apiserver, "
                "kube-scheduler, kube-controller-manager and kubelet), so each GPU can go to one claim only",
                self.name,
                CONSUMABLE_CAPACITY_GATE,
                CONSUMABLE_CAPACITY_GATE,
            )
        self.consumable_capacity = shares
