"""Applies the scheduler's ``gpufrac.io/gpu-layout`` to this node's idle GPUs and reports where each stands.

Each pass (every ``interval_s``, and at once when the layout changes) reads the agent's own Node (from
the agent's own-node informer: a watch, not a GET per pass), parses the layout (``gpufrac.node.mig.layout``)
and, for every GPU it names, walks ``next_step`` until the GPU is as wanted, each step read back from the
backend (NVML) before the next is chosen:

- **idle only**: before the first step of a change the GPU must have no container on it (the agent's
  mapping store: a record whose devices name the GPU, its index or one of its MIG slices); otherwise the
  GPU is ``Refused``, naming the pods and containers, and nothing is touched. A GPU already as wanted is
  ``Applied`` whatever runs on it.
- **reset gating**: a MIG mode change that waits for a GPU reset is ``NeedsReset`` unless the agent may
  reset GPUs (``mig.allow_gpu_reset``); an operator's reset (``nvidia-smi --gpu-reset``) lets the next pass
  carry on.
- **crash safety**: nothing is remembered between steps; a pass that dies after any step leaves a GPU
  that the next agent's inventory publishes as it is (its slices, its mode) and whose change the next pass
  finishes from what NVML says.
- after a change the inventory is republished (``republish``) *before* the status says ``Applied``, so
  whoever reads ``Applied`` finds the new slices in ``gpufrac.io/gpus``.

The status (``gpufrac.io/gpu-layout-status``) is ``{"generation": N, "gpus": {"<uuid>": {"state",
"message"}}}`` with the layout's generation, and a top-level ``message`` when the annotation as a whole
is unreadable. It is written only when it changes. ``Failed`` (NVML refused a step), ``Refused`` and
``NeedsReset`` are tried again at the next pass, so a GPU that becomes idle or is reset changes then.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any

from lightkube import AsyncClient
from lightkube.resources.core_v1 import Node
from pydantic import BaseModel, ConfigDict, Field

from gpufrac.contract import keys
from gpufrac.kube.errors import KubeError, api_errors
from gpufrac.kube.events import NORMAL, WARNING, ObjectRef
from gpufrac.kube.patch import merge_patch
from gpufrac.node.enforcement_audit import EventSink
from gpufrac.node.inventory.backend import GpuInfo, GpuInventoryBackend, InventoryUnavailable, NodeInventory
from gpufrac.node.inventory.publish import with_whole
from gpufrac.node.mapping import AllocationRecord
from gpufrac.node.mig.control import MigControl, MigControlError
from gpufrac.node.mig.layout import (
    LayoutRequest,
    LayoutState,
    Step,
    StepKind,
    WantedGpu,
    next_step,
    parse_layout,
)
from gpufrac.node.mig.modes import WholeGpus

log = logging.getLogger(__name__)

#: The Node's Event reason for each outcome a GPU's change comes to (Pending has none).
EVENT_REASONS = {
    LayoutState.APPLIED: "GpuLayoutApplied",
    LayoutState.NEEDS_RESET: "GpuLayoutNeedsReset",
    LayoutState.REFUSED: "GpuLayoutRefused",
    LayoutState.FAILED: "GpuLayoutFailed",
}

#: At most this many steps per GPU per pass (a 7-slice layout over another is 14 destroys and creates,
#: plus the mode and a reset); more means the backend does not do what it says.
MAX_STEPS = 24


class MigSettings(BaseModel):
    """The node agent's ``mig:`` section."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    layouts: bool = Field(
        True,
        description="apply the scheduler's gpufrac.io/gpu-layout to idle GPUs (MIG mode and slices, whole "
        "or fractions) and report gpufrac.io/gpu-layout-status; off: GPUs stay as the operator set them",
    )
    allow_gpu_reset: bool = Field(
        False,
        description="reset a GPU (nvidia-smi --gpu-reset) when a MIG mode change waits for one; off: the "
        "GPU's status says NeedsReset until an operator resets it (docs/node-agent.md, MIG)",
    )


@dataclass(frozen=True, slots=True)
class GpuOutcome:
    state: LayoutState
    message: str
    changed: bool = False

    def to_json(self) -> dict[str, str]:
        return {"state": self.state.value, "message": self.message}


def containers_on(gpu: GpuInfo, records: Iterable[AllocationRecord]) -> list[str]:
    """``namespace/pod/container`` of each container whose devices name ``gpu`` or one of its slices."""
    names = {gpu.uuid, str(gpu.index), *(s.uuid for s in gpu.mig_slices)}
    return sorted(
        {
            f"{r.pod_namespace}/{r.pod_name}/{r.container_name}"
            for r in records
            if any(d.rpartition("=")[2] in names for d in r.devices)
        }
    )


class LayoutApplier:
    """The synchronous half: the steps of one pass against the backend and the control (NVML blocks)."""

    def __init__(
        self,
        *,
        backend: GpuInventoryBackend,
        control: MigControl,
        whole: WholeGpus,
        containers: Callable[[], Iterable[AllocationRecord]],
        allow_gpu_reset: bool,
    ) -> None:
        self._backend = backend
        self._control = control
        self._whole = whole
        self._containers = containers
        self._allow_reset = allow_gpu_reset

    def read(self) -> NodeInventory:
        return with_whole(self._backend.read(), self._whole())

    def starting(self, request: LayoutRequest) -> list[str]:
        """The GPUs of ``request`` whose change would take a step now: not yet as wanted, idle, and not
        waiting for a reset the agent may not do (their status is Pending until the pass is done)."""
        records = list(self._containers())
        out = []
        for gpu in self.read().gpus:
            wanted = request.gpus.get(gpu.uuid)
            step = next_step(gpu, wanted) if wanted is not None else None
            if step is None or containers_on(gpu, records):
                continue
            if step.kind is StepKind.RESET and not self._allow_reset:
                continue
            out.append(gpu.uuid)
        return out

    def apply(self, uuid: str, wanted: WantedGpu) -> GpuOutcome:
        changed = False
        for _ in range(MAX_STEPS):
            gpu = next((g for g in self.read().gpus if g.uuid == uuid), None)
            if gpu is None:
                return GpuOutcome(LayoutState.FAILED, f"GPU {uuid} is no longer in the inventory", changed)
            if gpu.withdrawn_because is not None:
                return GpuOutcome(
                    LayoutState.FAILED, f"GPU {uuid} is withdrawn ({gpu.withdrawn_because})", changed
                )
            step = next_step(gpu, wanted)
            if step is None:
                return GpuOutcome(LayoutState.APPLIED, wanted.describe(), changed)
            if not changed:
                users = containers_on(gpu, self._containers())
                if users:
                    return GpuOutcome(
                        LayoutState.REFUSED,
                        f"GPU {uuid} is not idle: {', '.join(users)} run(s) on it; its layout changes only "
                        f"when no container is on it (wanted {wanted.describe()})",
                    )
            if step.kind is StepKind.RESET and not self._allow_reset:
                turning = "on" if gpu.mig_pending_mode else "off"
                return GpuOutcome(
                    LayoutState.NEEDS_RESET,
                    f"MIG is switched {turning} on GPU {uuid} but takes effect only after a GPU reset, "
                    "which this agent does not do (mig.allow_gpu_reset is false): reset it "
                    f"(nvidia-smi --gpu-reset -i {uuid}) or allow the agent to",
                    changed,
                )
            try:
                self._do(gpu, step)
            except MigControlError as exc:
                return GpuOutcome(LayoutState.FAILED, f"{step} on GPU {uuid} failed: {exc}", changed)
            log.info("mig: GPU %s: %s", uuid, step)
            changed = True
        return GpuOutcome(
            LayoutState.FAILED, f"GPU {uuid} is not {wanted.describe()} after {MAX_STEPS} steps", changed
        )

    def _do(self, gpu: GpuInfo, step: Step) -> None:
        control = self._control
        match step.kind:
            case StepKind.DESTROY:
                assert step.slice is not None
                control.destroy_slice(gpu.uuid, step.slice)
            case StepKind.CREATE:
                assert step.slice is not None
                control.create_slice(gpu.uuid, step.slice.profile, step.slice.start)
            case StepKind.ENABLE_MIG | StepKind.DISABLE_MIG:
                control.set_mig_mode(gpu.uuid, step.kind is StepKind.ENABLE_MIG)
            case StepKind.RESET:
                control.reset_gpu(gpu.uuid)
            case StepKind.MARK_WHOLE | StepKind.UNMARK_WHOLE:
                self._whole.set(gpu.uuid, step.kind is StepKind.MARK_WHOLE)


class GpuLayoutExecutor:
    def __init__(
        self,
        *,
        client: AsyncClient,
        node_name: str,
        applier: LayoutApplier,
        republish: Callable[[], Awaitable[Any]],
        interval_s: float = 5.0,
        events: EventSink | None = None,
        paused: Callable[[], str | None] = lambda: None,
    ) -> None:
        """``events``: an Event on the Node each time a GPU's outcome changes (``EVENT_REASONS``), so
        ``kubectl describe node`` tells a NeedsReset or a Refused layout without reading annotations.
        ``paused``: why the driver may not be touched now (a driver upgrade in progress), else None; a
        pass then opens nothing, the layout waits until it is over."""
        self._events = events
        self._paused = paused
        self._client = client
        self._node = node_name
        self._applier = applier
        self._republish = republish
        self._interval_s = interval_s
        self._written: dict[str, Any] | None = None
        self._final: dict[str, Any] | None = None  # the last status written at the end of a pass
        self._watched = False
        self._cached: Node | None = None
        self._layout_seen: str | None = None
        self._wake = asyncio.Event()
        self.passes = 0

    # -- the own-node informer's handler (``watch``): the Node from its cache, a wake-up on a new layout --

    def watch(self) -> None:
        """Read the Node from the agent's own-node informer (``add_handler(self)``) instead of a GET per
        pass: a thousand nodes polling their Node every 5 s would be 200 reads a second."""
        self._watched = True

    def on_add(self, obj: Node) -> None:
        self._seen(obj)

    def on_update(self, old: Node, new: Node) -> None:
        self._seen(new)

    def on_delete(self, obj: Node) -> None:
        self._cached = None

    def _seen(self, node: Node) -> None:
        layout = ((node.metadata.annotations if node.metadata else None) or {}).get(
            keys.NODE_GPU_LAYOUT_ANNOTATION
        )
        if self._cached is None or layout != self._layout_seen:
            self._wake.set()  # a new layout: a pass now, not at the next interval
        self._cached, self._layout_seen = node, layout

    async def _read_node(self) -> Node | None:
        if self._watched:
            return self._cached
        with api_errors():
            return await self._client.get(Node, self._node)

    async def pass_once(self) -> dict[str, Any]:
        """Read the layout, change what it asks of idle GPUs, write the status; returns the status."""
        node = await self._read_node()
        if node is None:  # the informer has not listed it yet
            return self._written or {}
        annotations = (node.metadata.annotations if node.metadata else None) or {}
        text = annotations.get(keys.NODE_GPU_LAYOUT_ANNOTATION)
        if self._written is None:  # what an earlier agent wrote: rewriting the same is a no-op
            with contextlib.suppress(ValueError, TypeError):
                self._written = json.loads(annotations.get(keys.NODE_GPU_LAYOUT_STATUS_ANNOTATION) or "null")
                self._final = self._written
        if text is None:  # nothing asked: NVML is not opened for nothing
            return self._written or {}
        if (why := self._paused()) is not None:
            log.debug("mig: layout waits, the driver is not to be touched (%s)", why)
            return self._written or {}
        try:
            inventory = await asyncio.to_thread(self._applier.read)
        except InventoryUnavailable as exc:
            log.warning("mig: GPUs unreadable, layout not applied: %s", exc)
            return self._written or {}
        request = parse_layout(text, gpus={g.uuid: g for g in inventory.gpus})
        if request.error is not None:
            log.warning("mig: %s", request.error)
            status = {"generation": request.generation, "gpus": {}, "message": request.error}
            await self._write(status)
            return status
        outcomes = {u: GpuOutcome(LayoutState.REFUSED, why) for u, why in request.refused.items()}
        changing = await asyncio.to_thread(self._applier.starting, request)
        before = (
            (self._final or {}).get("gpus", {})
            if (self._final or {}).get("generation") == request.generation
            else {}
        )
        # A GPU whose last try failed is retried quietly: Pending and back at every pass would be noise.
        changing = [u for u in changing if before.get(u, {}).get("state") != LayoutState.FAILED.value]
        if changing:
            pending = {
                **(self._written or {}).get("gpus", {}),
                **{u: o.to_json() for u, o in outcomes.items()},
                **{
                    u: GpuOutcome(LayoutState.PENDING, f"changing to {request.gpus[u].describe()}").to_json()
                    for u in changing
                },
            }
            await self._write({"generation": request.generation, "gpus": pending}, final=False)
        changed = False
        for uuid, wanted in request.gpus.items():
            outcome = await asyncio.to_thread(self._applier.apply, uuid, wanted)
            changed |= outcome.changed
            if outcome.state is not LayoutState.APPLIED:
                log.warning("mig: GPU %s %s: %s", uuid, outcome.state.value, outcome.message)
            outcomes[uuid] = outcome
        if changed:
            await self._republish()  # before Applied: the new slices are published when it says so
        status = {
            "generation": request.generation,
            "gpus": {u: o.to_json() for u, o in sorted(outcomes.items())},
        }
        await self._write(status)
        return status

    def _tell(self, status: dict[str, Any]) -> None:
        """Events for the GPUs whose outcome is new since the last status written."""
        if self._events is None:
            return
        before = (self._final or {}).get("gpus", {})
        node = ObjectRef(kind="Node", namespace="default", name=self._node)
        for uuid, outcome in status.get("gpus", {}).items():
            reason = EVENT_REASONS.get(LayoutState(outcome["state"]))
            if reason is None or before.get(uuid) == outcome:
                continue
            self._events.emit(
                regarding=node,
                type=NORMAL if outcome["state"] == LayoutState.APPLIED else WARNING,
                reason=reason,
                message=f"GPU {uuid}: {outcome['message']} (layout generation {status.get('generation')})",
            )

    async def _write(self, status: dict[str, Any], *, final: bool = True) -> None:
        if final:
            self._tell(status)
            self._final = status
        if status == self._written:
            return
        await merge_patch(
            self._client,
            Node,
            name=self._node,
            patch={
                "metadata": {
                    "annotations": {
                        keys.NODE_GPU_LAYOUT_STATUS_ANNOTATION: json.dumps(status, separators=(",", ":"))
                    }
                }
            },
        )
        self._written = status

    async def run(self) -> None:
        """A pass every ``interval_s``; a failed API call or GPU read is retried at the next (a layout
        pass never ends the agent: its other duties go on)."""
        while True:
            try:
                await self.pass_once()
            except (KubeError, InventoryUnavailable) as exc:
                log.warning("mig: layout pass on node %s: %s", self._node, exc)
            except Exception:
                log.exception("mig: layout pass on node %s failed", self._node)
            self.passes += 1
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self._interval_s):
                    await self._wake.wait()
