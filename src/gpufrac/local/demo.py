"""What ``gpufrac demo`` shows: the two reference pods and three that show the scheduler's rules.

Pods are submitted one at a time, each waited for until it settles (running, refused by the node, or
reported unschedulable), so the story reads in order: the sm-sharing inference server takes four GPUs
of one node; the time-slicing notebook cannot share those GPUs (modes never mix) and lands on the other
node; a small pod is packed next to the notebook; a four-GPU request fails on a compute-mode conflict
and too little memory; a request larger than any GPU fails on memory.

Everything printed is read back from the API objects (the binder's annotations, PodScheduled, and what
the simulated kubelet recorded that the node agent injected), not from any component's memory. On the
real node (``gpufrac demo --runtime containerd``: one node with eight GPUs, so the same story fits) the
pods really run, in busybox (``realnode.runnable_here``), and what each container got is read from
inside its running process: ``/proc/<pid>/environ`` and its mountinfo.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from pathlib import Path

from lightkube import AsyncClient
from lightkube.codecs import load_all_yaml
from lightkube.resources.core_v1 import Node, Pod
from rich.console import Console
from rich.table import Table

from gpufrac.contract import keys
from gpufrac.contract.errors import InvalidPodRequest
from gpufrac.contract.render import read_binding
from gpufrac.kube.errors import api_errors
from gpufrac.local.kubelet import CONTAINERS_ANNOTATION, injected_view
from gpufrac.local.realnode import RealNode, process_environ, process_mounts, runnable_here

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
DEMO_PODS = (
    EXAMPLES / "inference-sm-sharing.yaml",
    EXAMPLES / "notebook-time-slicing.yaml",
    EXAMPLES / "demo" / "packed.yaml",
    EXAMPLES / "demo" / "mode-conflict.yaml",
    EXAMPLES / "demo" / "too-big.yaml",
)


@dataclass(slots=True)
class PodOutcome:
    """How one demo pod settled, as the API objects say."""

    name: str
    node: str = ""
    state: str = "Pending"
    reason: str = ""
    devices: list[str] = field(default_factory=list)
    request_mib: int | None = None
    limit_mib: int | None = None
    mode: str = ""
    portion: float | None = None
    injected: dict[str, dict[str, object]] = field(default_factory=dict)
    #: The pod's GpuMemoryEnforced condition as "status (reason): message"; empty when it has none.
    enforced: str = ""


def settled(pod: Pod) -> bool:
    """Running, refused at container create, or reported unschedulable: nothing more will happen."""
    annotations = (pod.metadata.annotations or {}) if pod.metadata else {}
    if annotations.get(CONTAINERS_ANNOTATION):
        return True
    conditions = (pod.status.conditions or []) if pod.status else []
    return any(c.type == "PodScheduled" and c.status == "False" for c in conditions)


def outcome(pod: Pod, gpu_index: dict[str, str]) -> PodOutcome:
    meta, spec = pod.metadata, pod.spec
    assert meta is not None and spec is not None
    result = PodOutcome(name=meta.name or "", node=spec.nodeName or "")
    conditions = (pod.status.conditions or []) if pod.status else []
    scheduled = next((c for c in conditions if c.type == "PodScheduled"), None)
    if scheduled is not None and scheduled.status == "False":
        result.state, result.reason = "Unschedulable", scheduled.message or scheduled.reason or ""
    recorded = (meta.annotations or {}).get(CONTAINERS_ANNOTATION)
    if recorded:
        result.injected = json.loads(recorded)
        errors = [v["error"] for v in result.injected.values() if "error" in v]
        result.state = "CreateContainerError" if errors else "Running"
        result.reason = "; ".join(str(e) for e in errors)
    if result.node:
        try:
            plans = read_binding(meta.annotations or {})
        except InvalidPodRequest as error:
            result.reason = result.reason or str(error)
            return result
        for plan in plans:
            result.devices += [gpu_index.get(d, d) for d in plan.devices]
            result.request_mib, result.limit_mib = plan.request_mib, plan.limit_mib
            result.mode, result.portion = str(plan.mode), plan.compute_portion
    return result


def _waiting(pod: Pod) -> tuple[str, str] | None:
    for status in (pod.status.containerStatuses or []) if pod.status else []:
        waiting = status.state.waiting if status.state is not None else None
        if waiting is not None and waiting.reason in ("CreateContainerError", "CreateContainerConfigError"):
            return status.name, waiting.message or waiting.reason
    return None


def _running(pod: Pod) -> dict[str, str]:
    """Container name -> container ID of each running container of ``pod``."""
    out: dict[str, str] = {}
    for status in (pod.status.containerStatuses or []) if pod.status else []:
        if status.state is not None and status.state.running is not None and status.containerID:
            out[status.name] = status.containerID
    return out


def settled_on_real_node(pod: Pod) -> bool:
    """Every container running, one refused at create, or the pod reported unschedulable."""
    containers = len(pod.spec.containers) if pod.spec else 0
    if containers and len(_running(pod)) == containers:
        return True
    return _waiting(pod) is not None or settled(pod)


def real_outcome(pod: Pod, gpu_index: dict[str, str], node: RealNode) -> PodOutcome:
    """``outcome`` on the real node: what each container got, read from its running process."""
    result = outcome(pod, gpu_index)
    refused = _waiting(pod)
    if refused is not None:
        container, message = refused
        result.injected[container] = {"error": message}
        result.state, result.reason = "CreateContainerError", message
        return result
    for container, container_id in sorted(_running(pod).items()):
        pid = node.container_pid(container_id)
        result.injected[container] = injected_view(process_environ(pid), process_mounts(pid))
        result.state = "Running"
    return result


def enforced_condition(pod: Pod) -> str:
    """The pod's ``GpuMemoryEnforced`` condition as one line; empty when the agent wrote none."""
    for c in (pod.status.conditions or []) if pod.status else []:
        if c.type == keys.POD_MEMORY_ENFORCED_CONDITION:
            return f"{c.status} ({c.reason}): {c.message}"
    return ""


async def wait_enforced(
    client: AsyncClient, outcomes: list[PodOutcome], *, namespace: str = "default", timeout_s: float = 15.0
) -> None:
    """Fill each running fraction's ``enforced`` once its node agent has written the condition."""
    deadline = time.monotonic() + timeout_s
    for o in outcomes:
        if o.state != "Running" or o.request_mib is None:
            continue
        while True:
            o.enforced = enforced_condition(await client.get(Pod, o.name, namespace=namespace))
            if o.enforced or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.2)


async def gpu_names(client: AsyncClient) -> dict[str, str]:
    """GPU UUID -> ``node/index`` from the inventory the node agents published."""
    names: dict[str, str] = {}
    async for node in client.list(Node):
        raw = (node.metadata.annotations or {}).get(keys.NODE_GPUS_ANNOTATION)
        for gpu in json.loads(raw) if raw else []:
            names[gpu["uuid"]] = f"{node.metadata.name}/gpu{gpu['index']}"
    return names


async def submit_and_wait(
    client: AsyncClient,
    manifest: Path,
    *,
    namespace: str = "default",
    timeout_s: float = 60.0,
    real_node: RealNode | None = None,
) -> Pod:
    """Create the pod of ``manifest`` and wait until it settles (on ``real_node``: made runnable there,
    and settled when its containers run or are refused)."""
    (obj,) = load_all_yaml(manifest.read_text())
    done = settled
    if real_node is not None:
        obj, done = runnable_here(obj), settled_on_real_node
    with api_errors():
        created = await client.create(obj, namespace=namespace)
    name = created.metadata.name
    deadline = time.monotonic() + timeout_s
    while True:
        pod = await client.get(Pod, name, namespace=namespace)
        if done(pod) or time.monotonic() > deadline:
            return pod
        await asyncio.sleep(0.2)


def render(console: Console, outcomes: list[PodOutcome], *, read_inside: bool = False) -> None:
    """The placement table and what each container got (``read_inside``: read from its running process)."""
    table = Table(title="gpufrac demo: where each pod went", show_lines=True)
    for column in ("pod", "state", "node", "GPUs", "guaranteed MiB/GPU", "limit MiB/GPU", "mode"):
        table.add_column(column, overflow="fold")
    for o in outcomes:
        mode = o.mode + (f" ({o.portion:.2f} compute)" if o.portion is not None else "")
        table.add_row(
            o.name,
            o.state,
            o.node or "-",
            "\n".join(o.devices) or "-",
            str(o.request_mib) if o.request_mib is not None else "-",
            str(o.limit_mib) if o.limit_mib is not None else "-",
            mode or "-",
        )
    console.print(table)

    env = Table(
        title="what each running container's process has (its /proc environ and mounts; injected through NRI)"
        if read_inside
        else "what the node agent injected before each container started (through NRI)"
    )
    env.add_column("pod/container")
    env.add_column("environment and MPS mount", overflow="fold")
    for o in outcomes:
        for container, got in sorted(o.injected.items()):
            if "error" in got:
                env.add_row(f"{o.name}/{container}", f"[red]refused:[/] {got['error']}")
                continue
            lines = [f"{k}={v}" for k, v in sorted(dict(got.get("env", {})).items())]
            mount = got.get("mps_mount")
            if isinstance(mount, dict):
                lines.append(f"mount {mount.get('source')} -> {mount.get('destination')}")
            env.add_row(f"{o.name}/{container}", "\n".join(lines) or "(nothing: no GPU request)")
    console.print(env)

    limits = Table(
        title="GPU memory limits in force: set and read back through the driver (GpuMemoryEnforced)"
    )
    limits.add_column("pod")
    limits.add_column("condition", overflow="fold")
    for o in outcomes:
        if o.enforced:
            colour = "green" if o.enforced.startswith("True") else "red"
            limits.add_row(o.name, f"[{colour}]{o.enforced}[/]")
    if limits.row_count:
        console.print(limits)

    for o in outcomes:
        if o.state != "Running":
            console.print(f"[bold]{o.name}[/] is {o.state}: {o.reason}")
