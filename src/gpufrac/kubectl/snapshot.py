"""The cluster as a trace: its GPU nodes and GPU pods in the openb shape, for ``kubectl gpufrac whatif``.

The simulator replays traces; a snapshot turns the live cluster into one, so "how much more would fit
under another policy" is asked of the pods this cluster really runs, not of Alibaba's. Nodes come from
the inventory the node agents publish and the kubelet's allocatable; pods from their contract
annotations, read by the scheduler's own code. Every GPU request becomes a share of ONE GPU in
thousandths (``gpu_milli``), the trace's unit: a portion as written, a MiB amount against the GPU it runs
on (the largest GPU of the cluster for a pod still waiting), an exclusive request as 1000.

What the openb shape cannot say is left out and listed: a request larger than a whole GPU, a pod with
more than one GPU container (the trace has one request per pod; the first container is kept), the
compute mode (the trace's pods are time-slicing; ``--scenario`` varies it) and node affinity.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from lightkube.resources.core_v1 import Node, Pod

from gpufrac.contract.errors import ContractError
from gpufrac.contract.request import ComputeMode, ContainerGpuRequest
from gpufrac.kubectl.view import TERMINAL_PHASES
from gpufrac.scheduler.objects import InvalidInventory, gpu_request, host_request, node_inventory, node_spec
from gpufrac.sim.trace import TraceNode, TracePod

MILLI = 1000


@dataclass(slots=True)
class ClusterTrace:
    nodes: list[TraceNode] = field(default_factory=list)
    pods: list[TracePod] = field(default_factory=list)
    #: GPU thousandths the bound pods of ``pods`` hold today (the current placement's allocation).
    allocated_milli: int = 0
    #: What could not be expressed in the openb shape, one sentence each.
    left_out: list[str] = field(default_factory=list)

    @property
    def capacity_milli(self) -> int:
        return sum(n.gpus for n in self.nodes) * MILLI


def _milli(container: ContainerGpuRequest, gpu_mib: int) -> int | None:
    """The request as thousandths of one GPU of ``gpu_mib``; None when it is more than a whole GPU."""
    if container.exclusive or container.request is None:
        return MILLI
    if container.request.portion is not None:
        return max(1, round(container.request.portion * MILLI))
    share = container.request_mib(gpu_mib) / gpu_mib
    return None if share > 1 else max(1, round(share * MILLI))


def cluster_trace(nodes: Iterable[Node], pods: Iterable[Pod]) -> ClusterTrace:
    trace = ClusterTrace()
    gpu_mib: dict[str, int] = {}
    for node in nodes:
        try:
            inventory = node_inventory(node)
        except InvalidInventory as error:
            trace.left_out.append(str(error))
            continue
        if not inventory:
            continue
        spec = node_spec(node)
        name = node.metadata.name
        gpu_mib[name] = inventory[0].memory_mib
        trace.nodes.append(
            TraceNode(name, spec.cpu_milli, spec.memory_bytes >> 20, len(inventory), inventory[0].model)
        )
    largest = max(gpu_mib.values(), default=0)
    for pod in pods:
        meta = pod.metadata
        if pod.status and pod.status.phase in TERMINAL_PHASES:
            continue
        try:
            request = gpu_request(pod)
        except ContractError as error:
            trace.left_out.append(f"pod {meta.namespace}/{meta.name}: {error}")
            continue
        if not request.wants_gpu or not largest:
            continue
        first, *others = request.containers
        if first.mig is not None:  # hardware slices: the openb shape has no MIG (docs/mig.md)
            trace.left_out.append(
                f"pod {meta.namespace}/{meta.name}: asks for MIG slices, which the replay leaves out"
            )
            continue
        if others:
            names = ", ".join(c.container for c in others)
            trace.left_out.append(
                f"pod {meta.namespace}/{meta.name}: only container {first.container} kept ({names} left out)"
            )
        trace.left_out.extend(f"pod {meta.namespace}/{meta.name}: {note}" for note in _unsaid(pod, first))
        node = pod.spec.nodeName if pod.spec else None
        bound = bool(node) and node in gpu_mib
        milli = _milli(first, gpu_mib[node] if bound else largest)
        if milli is None:
            trace.left_out.append(
                f"pod {meta.namespace}/{meta.name}: asks for more than a whole GPU ({largest} MiB) per device"
            )
            continue
        cpu_milli, memory_bytes = host_request(pod)
        trace.pods.append(
            TracePod(
                name=f"{meta.namespace}/{meta.name}",
                cpu_milli=cpu_milli,
                memory_mib=memory_bytes >> 20,
                num_gpu=first.device_count,
                gpu_milli=milli,
                namespace=meta.namespace,
            )
        )
        if bound:
            trace.allocated_milli += milli * first.device_count
    return trace


def _unsaid(pod: Pod, kept: ContainerGpuRequest) -> list[str]:
    """What the replay ignores of a pod it keeps: its compute mode and where it may run."""
    notes = []
    if kept.mode is ComputeMode.SM_SHARING and not kept.exclusive:
        notes.append(
            "compute mode sm-sharing left out (replayed as time-slicing; "
            "gpufrac simulate --scenario varies the mode)"
        )
    spec = pod.spec
    if spec is not None and (spec.nodeSelector or (spec.affinity and spec.affinity.nodeAffinity)):
        notes.append("node selector and node affinity left out (replayed on any GPU node)")
    return notes
