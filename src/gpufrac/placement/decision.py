"""What the engine answers for each pod: a Placement to bind, or Unschedulable with the reasons.

A Placement is what the engine booked: per container the GPU UUIDs and, per device, the request and
limit resolved to whole MiB on that GPU (a portion becomes ``floor(portion x GPU MiB)``) and the
sm-sharing compute portion. The binder does not copy those MiB: it renders the contract's keys with
``gpufrac.contract.render.render_binding`` from the pod's request, the Placement's devices and compute
portion, and the smallest chosen GPU's size (the same MiB when the chosen GPUs are of one size). A
Placement is also what ``assume`` takes back when the service rebuilds its ledgers from bound pods.

Unschedulable counts, per reason, how many nodes failed for that reason (the first failing filter of
each node), and renders the kube-scheduler style sentence users already know:
``0/12 nodes are available: 8 insufficient GPU memory, 4 compute-mode conflict.``
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

from gpufrac.contract.request import ComputeMode


class Reason(IntEnum):
    """Why a node cannot take a pod (0: it can). The order is the order filters run in."""

    FITS = 0
    NODE_STACK_CONFLICT = 1
    NOT_READY = 2
    AGENT_HEARTBEAT_EXPIRED = 3
    UNSCHEDULABLE = 4
    UNTOLERATED_TAINT = 5
    NODE_SELECTOR = 6
    NODE_AFFINITY = 7
    MODE_UNSUPPORTED = 8
    TOO_MANY_PODS = 9
    INSUFFICIENT_CPU = 10
    INSUFFICIENT_MEMORY = 11
    NO_GPUS = 12
    TOO_FEW_GPUS = 13
    NO_WHOLE_GPU = 14
    MODE_CONFLICT = 15
    TENANT_CONFLICT = 16
    INSUFFICIENT_GPU_MEMORY = 17
    INSUFFICIENT_COMPUTE = 18
    LIMIT_OVERCOMMIT = 19
    DEVICE_ASSIGNMENT = 20
    # Rules about other pods and node-local resources besides CPU, memory and GPUs, evaluated per pod
    # on the nodes that pass the filters above (gpufrac.placement.topology).
    HOST_PORTS = 21
    INSUFFICIENT_EXTENDED = 22
    INSUFFICIENT_EPHEMERAL = 23
    POD_AFFINITY = 24
    POD_ANTI_AFFINITY = 25
    EXISTING_ANTI_AFFINITY = 26
    SPREAD_LABEL_MISSING = 27
    SPREAD = 28
    # GPU modes (docs/mig.md): checked with the GPU fit above, numbered here to keep the codes stable.
    NO_FRACTIONS_GPU = 29
    NO_WHOLE_OR_FRACTIONS_GPU = 30
    NO_MIG_GPU = 31
    NO_FREE_MIG_SLICE = 32

    @property
    def message(self) -> str:
        return _MESSAGES[self]


_MESSAGES = {
    Reason.FITS: "fits",
    Reason.NODE_STACK_CONFLICT: "node(s) run another GPU-fractioning node stack",
    Reason.NOT_READY: "node(s) were not ready",
    Reason.AGENT_HEARTBEAT_EXPIRED: "node agent heartbeat(s) expired",
    Reason.UNSCHEDULABLE: "node(s) were unschedulable",
    Reason.UNTOLERATED_TAINT: "node(s) had untolerated taint",
    Reason.NODE_SELECTOR: "node(s) didn't match Pod's node selector",
    Reason.NODE_AFFINITY: "node(s) didn't match Pod's node affinity",
    Reason.MODE_UNSUPPORTED: "node(s) cannot enforce the compute mode",
    Reason.TOO_MANY_PODS: "too many pods",
    Reason.INSUFFICIENT_CPU: "insufficient cpu",
    Reason.INSUFFICIENT_MEMORY: "insufficient memory",
    Reason.NO_GPUS: "node(s) had no GPUs",
    Reason.TOO_FEW_GPUS: "node(s) had fewer GPUs than requested devices",
    Reason.NO_WHOLE_GPU: "not enough whole free GPUs",
    Reason.MODE_CONFLICT: "compute-mode conflict",
    Reason.TENANT_CONFLICT: "sm-sharing tenant conflict",
    Reason.INSUFFICIENT_GPU_MEMORY: "insufficient GPU memory",
    Reason.INSUFFICIENT_COMPUTE: "insufficient GPU compute portion",
    Reason.LIMIT_OVERCOMMIT: "GPU memory limit overcommit cap",
    Reason.DEVICE_ASSIGNMENT: "GPUs could not be assigned to all containers together",
    # kube-scheduler's own sentences for these (nodeports, noderesources, interpodaffinity,
    # podtopologyspread), so users read what they already know.
    Reason.HOST_PORTS: "node(s) didn't have free ports for the requested pod ports",
    Reason.INSUFFICIENT_EXTENDED: "insufficient extended resource",
    Reason.INSUFFICIENT_EPHEMERAL: "insufficient ephemeral-storage",
    Reason.POD_AFFINITY: "node(s) didn't match pod affinity rules",
    Reason.POD_ANTI_AFFINITY: "node(s) didn't match pod anti-affinity rules",
    Reason.EXISTING_ANTI_AFFINITY: "node(s) didn't satisfy existing pods anti-affinity rules",
    Reason.SPREAD_LABEL_MISSING: (
        "node(s) didn't match pod topology spread constraints (missing required label)"
    ),
    Reason.SPREAD: "node(s) didn't match pod topology spread constraints",
    Reason.NO_FRACTIONS_GPU: "node(s) had no GPU in fractions mode (only MIG, whole or re-partitioning)",
    Reason.NO_WHOLE_OR_FRACTIONS_GPU: "node(s) had only MIG or re-partitioning GPUs",
    Reason.NO_MIG_GPU: "node(s) had no GPU in MIG mode",
    Reason.NO_FREE_MIG_SLICE: "node(s) had no free MIG slice that fits",
}


def mig_slice_message(wanted: str) -> str:
    """``NO_FREE_MIG_SLICE``'s sentence naming what the pod asks for (``2g.20gb``, ``at least N MiB``)."""
    return f"node(s) had no free MIG slice of {wanted}"


@dataclass(frozen=True, slots=True)
class Status:
    """One filter's answer for one node, as kube-scheduler's framework.Status."""

    code: Reason
    reason: str = ""

    @property
    def ok(self) -> bool:
        return self.code is Reason.FITS


@dataclass(frozen=True, slots=True)
class DeviceAssignment:
    """One GPU given to a container, with the amounts resolved on that GPU."""

    uuid: str
    index: int
    request_mib: int
    limit_mib: int
    compute_portion: float | None


@dataclass(frozen=True, slots=True)
class ContainerPlacement:
    """One container's devices. ``mig``: they are MIG slices (each device's UUID is the slice's MIG
    UUID, its ``index`` the GPU's, its MiB the slice's); no fraction, limit or compute mode applies."""

    container: str
    mode: ComputeMode
    exclusive: bool
    devices: tuple[DeviceAssignment, ...]
    mig: bool = False

    @property
    def uuids(self) -> tuple[str, ...]:
        return tuple(d.uuid for d in self.devices)


@dataclass(frozen=True, slots=True)
class Placement:
    """Where a pod goes. ``containers`` is empty for a pod that asks for no GPU."""

    pod_uid: str
    node: str
    containers: tuple[ContainerPlacement, ...] = ()


@dataclass(frozen=True, slots=True)
class Unschedulable:
    """No node can take the pod now: ``counts`` is (reason message, number of nodes), most first."""

    pod_uid: str
    total_nodes: int
    counts: tuple[tuple[str, int], ...] = ()
    detail: str = ""

    @property
    def message(self) -> str:
        head = f"0/{self.total_nodes} nodes are available"
        parts = [f"{n} {msg}" for msg, n in self.counts]
        if self.detail:
            parts.insert(0, self.detail)
        return f"{head}: {', '.join(parts)}." if parts else f"{head}."


Decision = Placement | Unschedulable
