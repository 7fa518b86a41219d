"""GPU faults told to the people they hit: Events on the Node and on every pod with a container on the GPU.

The inventory publisher withdraws a faulted GPU from scheduling (``GpuInfo.fault``: fell off the bus, or a
fatal XID since its last reset; the condition's message says which and why), so no new fraction lands on
it. That says nothing to the pods already there, whose CUDA calls now fail: each gets a Warning Event
``GpuFault`` naming the GPU and the fault (``kubectl describe pod`` shows it next to the container's own
errors), and the Node gets one too. When the GPU is healthy again (reset, back on the bus) the publisher
offers it again and the Node gets a Normal ``GpuRecovered``.

Which pods are on a GPU comes from the node agent's mapping store (what was injected at
CreateContainer), matched by UUID — devices given as CDI names (``nvidia.com/gpu=<uuid>``) or as indices
count too, and so do the MIG devices of a GPU's slices (a MIG GPU's fault is its slices' fault). Each
fault is told once per GPU until it recovers, not at every poll.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Protocol

from gpufrac.kube.events import NORMAL, WARNING, ObjectRef
from gpufrac.node.enforcement_audit import EventSink
from gpufrac.node.inventory.backend import GpuInfo, NodeInventory
from gpufrac.node.mapping import AllocationRecord

log = logging.getLogger(__name__)

REASON_FAULT = "GpuFault"
REASON_RECOVERED = "GpuRecovered"


class Allocations(Protocol):
    def allocations(self) -> list[AllocationRecord]: ...


def _names(gpu: GpuInfo) -> set[str]:
    """What a container's devices may call the GPU: its UUID, its index, or one of its MIG slices."""
    return {gpu.uuid, str(gpu.index), *(s.uuid for s in gpu.mig_slices)}


def _device_id(device: str) -> str:
    """``nvidia.com/gpu=GPU-…`` → ``GPU-…``; a UUID or an index as it is."""
    return device.rpartition("=")[2]


class GpuFaultNotifier:
    def __init__(self, *, node_name: str, store: Allocations, recorder: EventSink) -> None:
        self._node = node_name
        self._store = store
        self._recorder = recorder
        self._faulted: dict[str, str] = {}  # uuid -> the fault told

    def observe(self, inventory: NodeInventory) -> None:
        """Compare with the last inventory: tell new faults and recoveries (cheap; call at every read)."""
        node = ObjectRef(kind="Node", namespace="default", name=self._node)
        present = {g.uuid: g for g in inventory.gpus}
        for gpu in inventory.gpus:
            fault = gpu.fault
            if fault is None or self._faulted.get(gpu.uuid) == fault:
                continue
            self._faulted[gpu.uuid] = fault
            text = f"GPU {gpu.index} ({gpu.uuid}) withdrawn from scheduling: {fault}"
            log.warning("%s", text)
            self._recorder.emit(regarding=node, type=WARNING, reason=REASON_FAULT, message=text)
            for record in self._on(gpu, self._store.allocations()):
                self._recorder.emit(
                    regarding=ObjectRef(
                        kind="Pod", namespace=record.pod_namespace, name=record.pod_name, uid=record.pod_uid
                    ),
                    type=WARNING,
                    reason=REASON_FAULT,
                    message=f"container {record.container_name}: {text}; its GPU work fails until the "
                    "pod is recreated on a healthy GPU",
                )
        for uuid in list(self._faulted):
            gpu = present.get(uuid)
            if gpu is not None and gpu.fault is None:
                del self._faulted[uuid]
                self._recorder.emit(
                    regarding=node,
                    type=NORMAL,
                    reason=REASON_RECOVERED,
                    message=f"GPU {gpu.index} ({uuid}) is healthy again and offered for scheduling",
                )

    @staticmethod
    def _on(gpu: GpuInfo, records: Iterable[AllocationRecord]) -> list[AllocationRecord]:
        names = _names(gpu)
        seen: set[tuple[str, str]] = set()
        hit = []
        for record in records:
            key = (record.pod_uid, record.container_name)
            if key not in seen and any(_device_id(d) in names for d in record.devices):
                seen.add(key)
                hit.append(record)
        return hit
