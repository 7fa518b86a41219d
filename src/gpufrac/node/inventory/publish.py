"""Publishes the node's GPUs and what it can enforce on its Node object, and keeps them current.

What the scheduler (and an operator) reads from the Node:

- annotation ``gpufrac.io/gpus``: the usable GPUs, ``[{"uuid", "index", "model", "mib", "total_mib",
  "reserved_mib", "mode"}]``, ``mib`` being the memory the scheduler may pack (the total less the driver's
  and the MPS server's reserve: ``gpufrac.node.inventory.reserve``) and ``mode`` what the GPU serves
  (``fractions``, ``mig`` or ``whole``; always written, a reader takes a missing one, an older agent's, as
  ``fractions``). A GPU in mode ``mig`` also has ``"mig": [{"profile", "start", "uuid", "mib"}]``, its GPU
  instances by start (docs/mig.md). A GPU that disappears, falls off the bus, reports a fatal XID or is
  prohibited from running contexts is left out -- withdrawn -- so no new pod lands on it (containers
  already there keep running; their pods get an Event, see ``gpufrac.node.gpu_faults``).
- labels: ``gpufrac.io/managed=true``, the driver major
  (``gpu-fractioning.kai.scheduler/nvidia-driver-version.major``), the compute modes the node can enforce
  memory for (``gpufrac.io/compute-mode.time-slicing|sm-sharing``, ``gpufrac.io/mps``: an input, see
  below), and for selectors the GPU model (when all are one model), count and CUDA version.
- the taint ``gpufrac.io/managed=true:NoSchedule``, so that other schedulers keep off the node.
- condition ``gpu-fractioning.nvidia.com/Ready`` (status subresource): True only when there are usable
  GPUs, the inventory can be read, the NRI plugin is in the runtime's path, the GPU stack passes its gate
  (``gpufrac.node.gpustack``: driver, toolkit and device plugin versions; label
  ``gpufrac.io/gpu-stack-gate``) and at least one compute mode is enforceable; otherwise False with a
  reason and a message that say what is missing.

The capability is an input (``capability``): it follows the driver (r615+: the cgroup GPU-memory limit
makes time-slicing enforceable) and whether MPS is serving (sm-sharing), which the MPS supervisor knows.

The backend is polled every ``interval_s``; the Node is patched only when what it should say changed,
and re-asserted every ``resync_s`` (ten minutes by default: a repair of labels someone else removed). The
agent's heartbeat is not a Node write: it is the node's Lease (``gpufrac.node.heartbeat``), so a cluster
of many nodes does not re-send every Node to every Node watcher each minute. Writes are merge patches
of our own keys only, and a strategic merge of the one condition, so the kubelet's labels and conditions
are never touched. ``mark_stopped`` (SIGTERM) sets the condition to False so that the scheduler stops
placing GPU pods while nothing would enforce their limits.

With ``slices`` (the DRA driver, ``gpufrac.node.dra.slices``) the same read also keeps the node's
ResourceSlice current: it follows every change of the inventory and the capability, from the same
poll, so the annotation and the slice never tell two stories. A failed slice write is logged and
retried at the next interval without holding up the Node.

Another node stack on the same node. NVIDIA's GPU-fractioning operator writes the same condition type
for its own daemons (``fractiond``, ``mpsd``), with reasons of its own. Before each write the agent reads
the Node back: a condition whose reason is none of gpufrac's (``keys.NODE_AGENT_REASONS``), or one that
changed since this agent last wrote it, was written by someone else. The agent then reports the conflict
-- its readiness becomes False with reason ``ConflictingNodeStack``, the annotation
``gpufrac.io/node-stack-conflict`` says what it found (the scheduler places nothing on such a node), a
Warning Event goes on the Node -- and stops writing the condition, so the two writers do not flap it at
every write. While the conflict lasts the Node is re-read each interval (a read, no write); once the
condition is gone (or, to an agent that has not written it yet, carries one of gpufrac's reasons), the
annotation is removed and the agent writes the condition as before.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Callable, Collection
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import Any

from lightkube import AsyncClient
from lightkube.resources.core_v1 import Node
from lightkube.types import PatchType

from gpufrac.contract import keys
from gpufrac.kube.errors import Conflict, KubeError, api_errors
from gpufrac.kube.events import WARNING, ObjectRef
from gpufrac.kube.patch import merge_patch
from gpufrac.node import labels as names
from gpufrac.node.dra.slices import ResourceSlicePublisher
from gpufrac.node.enforcement_audit import EventSink
from gpufrac.node.gpustack import GATE_LABEL, GpuStackGate, StackVerdict
from gpufrac.node.inventory.backend import (
    GpuInfo,
    GpuInventoryBackend,
    GpuMode,
    InventoryUnavailable,
    NodeInventory,
)
from gpufrac.node.inventory.reserve import MemoryReserveSettings, driver_reserve_mib, usable_mib
from gpufrac.node.mps.mode import DriverVersion, NodeMpsCapability

log = logging.getLogger(__name__)

#: The node's capability for a driver version (the MPS supervisor's view, or an assumption).
CapabilityFor = Callable[[DriverVersion], NodeMpsCapability]


@dataclass(frozen=True, slots=True)
class NodeState:
    """What the node agent says on its Node (labels with None are removed)."""

    labels: dict[str, str | None]
    gpus: tuple[dict[str, Any], ...]
    ready: bool
    reason: str
    message: str

    @property
    def gpus_annotation(self) -> str:
        return json.dumps(list(self.gpus), separators=(",", ":"))


def desired_state(
    *,
    inventory: NodeInventory | None,
    unavailable: str | None = None,
    capability: NodeMpsCapability | None = None,
    nri_connected: bool = True,
    missing: dict[str, int] | None = None,
    stack: StackVerdict | None = None,
    reserve: MemoryReserveSettings | None = None,
    mps_reserve: bool = False,
    driver_upgrade: str | None = None,
    limits_canary: str | None = None,
) -> NodeState:
    """Pure: the Node's labels, inventory and readiness for what the backend and the agent report.

    ``missing`` maps the UUIDs of GPUs seen earlier but no longer reported to their last index.
    ``stack``: the GPU stack gate's verdict (``gpufrac.node.gpustack``; None: not gated).
    ``reserve``: memory held back per GPU (``gpufrac.node.inventory.reserve``; ``mps_reserve``: the node
    runs MPS, so the MPS server's share too); each GPU's ``mib`` is then its usable memory, with
    ``total_mib`` and ``reserved_mib`` beside it. None: ``mib`` is the total.
    ``driver_upgrade`` is the GPU Operator's upgrade state while it upgrades the driver: the node is then
    not ready, whatever else holds, and ``inventory`` is the last one read before the agent let go of
    NVML (its GPUs stay published: the pods on them are still there).
    ``limits_canary``: why the driver's per-cgroup memory limit has not passed the agent's canary (None:
    it passed, or the agent does not set limits); the node is then not ready.
    """
    if driver_upgrade is not None:
        upgrading = NodeState(
            labels={keys.MANAGED_LABEL: "true"},
            gpus=(),
            ready=False,
            reason=names.REASON_DRIVER_UPGRADE,
            message="",
        )
        if inventory is not None:
            base = desired_state(inventory=inventory, capability=capability, nri_connected=nri_connected)
            upgrading = replace(upgrading, labels=base.labels, gpus=base.gpus)
        return replace(
            upgrading,
            message=f"the GPU Operator is upgrading the NVIDIA driver (state {driver_upgrade}): MPS is "
            "stopped and the agent has let go of NVML so that the driver can unload; no new GPU pods are "
            "placed here until the upgrade is done",
        )
    node_labels: dict[str, str | None] = {keys.MANAGED_LABEL: "true"}
    if inventory is None:
        return NodeState(
            labels={**node_labels, names.GPU_COUNT_LABEL: "0", names.GPU_MODEL_LABEL: None},
            gpus=(),
            ready=False,
            reason=names.REASON_INVENTORY_UNAVAILABLE,
            message=f"the GPUs cannot be read ({unavailable}); every GPU is withdrawn until they can",
        )
    usable = inventory.usable
    if reserve is None:
        gpus = tuple(
            _with_mode(g, {"uuid": g.uuid, "index": g.index, "model": g.model, "mib": g.mib}) for g in usable
        )
    else:
        gpus = tuple(
            _with_mode(
                g,
                {
                    "uuid": g.uuid,
                    "index": g.index,
                    "model": g.model,
                    "mib": usable_mib(g, settings=reserve, mps=mps_reserve),
                    "total_mib": g.mib,
                    "reserved_mib": driver_reserve_mib(g, settings=reserve)
                    + (reserve.mps_server_mib if mps_reserve else 0),
                },
            )
            for g in usable
        )
    models = {g.model for g in usable}
    node_labels.update(
        {
            names.GPU_COUNT_LABEL: str(len(usable)),
            names.GPU_MODEL_LABEL: _label_value(next(iter(models))) if len(models) == 1 else None,
            names.CUDA_DRIVER_LABEL: _label_value(inventory.cuda_driver_version),
        }
    )
    try:
        driver: DriverVersion | None = DriverVersion.parse(inventory.driver_version)
    except ValueError:
        driver = None
    if driver is not None:
        node_labels[names.DRIVER_MAJOR_LABEL] = str(driver.major)
    if capability is not None:
        node_labels.update(capability.labels())
    if stack is not None:
        node_labels[GATE_LABEL] = stack.label
    notes = [f"GPU {g.index} ({g.uuid}) withdrawn: {why}" for g, why in inventory.withdrawn]
    notes += [
        f"GPU {index} ({uuid}) withdrawn: it is gone" for uuid, index in sorted((missing or {}).items())
    ]
    suffix = "".join(f"; {note}" for note in notes)

    def state(ready: bool, reason: str, message: str) -> NodeState:
        return NodeState(labels=node_labels, gpus=gpus, ready=ready, reason=reason, message=message + suffix)

    if not usable:
        found = "no GPU was found" if not inventory.gpus else "no GPU is usable"
        return state(False, names.REASON_NO_GPUS, found)
    if not nri_connected:
        return state(
            False,
            names.REASON_NRI_NOT_CONNECTED,
            "the NRI plugin is not connected to the container runtime, so GPU containers would start "
            "without their limits; check that NRI is enabled in the runtime and its socket is mounted",
        )
    if stack is not None and stack.blocks:
        assert stack.reason is not None
        return state(False, stack.reason, stack.message)
    if limits_canary is not None:
        return state(
            False,
            keys.NODE_REASON_MEMORY_LIMIT_CANARY_FAILED,
            f"the driver's per-cgroup GPU memory limit could not be set and read back on a test cgroup "
            f"({limits_canary}), so no fraction's limit could be verified; no GPU pods are placed here",
        )
    modes = sorted(m.value for m in capability.enforceable) if capability is not None else []
    if capability is not None and not modes:
        return state(
            False,
            names.REASON_NO_ENFORCEABLE_MODE,
            f"driver {inventory.driver_version} cannot cap time-slicing memory (needs r615+) and MPS is not "
            "serving, so no compute mode can be enforced",
        )
    model_text = ", ".join(sorted(models))
    return state(
        True,
        names.REASON_READY,
        f"{len(usable)} GPU(s) ({model_text}) on driver {inventory.driver_version}; enforceable: "
        + (", ".join(modes) if modes else "as configured")
        + (f"; {stack.message}" if stack is not None and stack.overridden else ""),
    )


def _with_mode(gpu: GpuInfo, entry: dict[str, Any]) -> dict[str, Any]:
    """``entry`` with the GPU's mode and, for a MIG GPU, its slices by start (docs/mig.md)."""
    entry["mode"] = gpu.mode.value
    if gpu.mode is GpuMode.MIG:
        entry["mig"] = [
            {"profile": s.profile, "start": s.start, "uuid": s.uuid, "mib": s.mib}
            for s in sorted(gpu.mig_slices, key=lambda s: (s.start, s.profile))
        ]
    return entry


def with_whole(inventory: NodeInventory, whole: Collection[str]) -> NodeInventory:
    """``inventory`` with the GPUs the node agent serves whole marked so (no backend knows that mode: it is
    the layout executor's record, ``gpufrac.node.mig_layout``)."""
    if not whole and not any(g.whole for g in inventory.gpus):
        return inventory
    return replace(inventory, gpus=tuple(replace(g, whole=g.uuid in whole) for g in inventory.gpus))


def _label_value(text: str) -> str:
    """A label value: at most 63 of [A-Za-z0-9._-], starting and ending alphanumeric."""
    cleaned = "".join(c if c.isalnum() or c in "._-" else "-" for c in text)[:63]
    return cleaned.strip("._-")


class InventoryPublisher:
    def __init__(
        self,
        *,
        client: AsyncClient,
        node_name: str,
        backend: GpuInventoryBackend,
        capability: CapabilityFor | None = None,
        nri_connected: Callable[[], bool] | None = None,
        limits_canary: Callable[[], str | None] | None = None,
        interval_s: float = 5.0,
        resync_s: float = 600.0,
        taint: bool = True,
        events: EventSink | None = None,
        stack_gate: GpuStackGate | None = None,
        memory_reserve: MemoryReserveSettings | None = None,
        mps_reserve: bool = False,
        on_inventory: Callable[[NodeInventory], None] | None = None,
        driver_upgrade: Callable[[], str | None] | None = None,
        slices: ResourceSlicePublisher | None = None,
        whole_gpus: Callable[[], Collection[str]] | None = None,
    ) -> None:
        """``stack_gate``: the GPU stack gate (``gpufrac.node.gpustack``) readiness is withheld by.
        ``memory_reserve`` / ``mps_reserve``: publish usable memory (``desired_state``).
        ``on_inventory``: called with every successful read (``gpufrac.node.gpu_faults``).
        ``whole_gpus``: the UUIDs the node agent serves whole (``gpufrac.node.mig_layout``)."""
        self._whole_gpus = whole_gpus or frozenset
        self._on_inventory = on_inventory
        self._stack_gate = stack_gate
        self._memory_reserve = memory_reserve
        self._mps_reserve = mps_reserve
        self._client = client
        self._driver_upgrade = driver_upgrade or (lambda: None)
        self._node = node_name
        self._backend = backend
        self._capability = capability
        self._nri_connected = nri_connected or (lambda: True)
        self._limits_canary = limits_canary or (lambda: None)
        self._interval_s = interval_s
        self._resync_s = resync_s
        self._taint = taint
        self._events = events
        self._slices = slices
        #: What the last read saw (None: the inventory could not be read) and the capability it implied.
        self._read: tuple[NodeInventory | None, NodeMpsCapability | None] = (None, None)
        self._changed = asyncio.Event()
        self._refreshes: list[asyncio.Future[None]] = []  # callers of refresh() waiting for the next publish
        self.published: NodeState | None = None
        self.inventory: NodeInventory | None = None  # the last successful read
        self.publishes = 0
        self._last_write = 0.0
        self._transition: tuple[bool, str] | None = None
        self._seen: dict[str, int] = {}  # every GPU this agent has seen: uuid -> index
        self._desired: NodeState | None = None  # what the backend said at the last write
        self._written: tuple[str, str, str, str] | None = None  # status, reason, message, heartbeat
        #: What another node stack's condition says while it writes ours (None: no conflict).
        self.conflict: str | None = None

    def poke(self) -> None:
        """Re-read now (the NRI plugin connected or dropped, the MPS capability changed)."""
        self._changed.set()

    async def refresh(self) -> None:
        """Re-read now and return once a publish that began after this call is over (``run`` must be
        running): the MIG layout executor's changes are on the Node before it reports them done."""
        done = asyncio.get_running_loop().create_future()
        self._refreshes.append(done)
        self.poke()
        await done

    async def read_state(self) -> NodeState:
        upgrade = self._driver_upgrade()
        if upgrade is not None:  # the driver is being unloaded: do not touch NVML, say why from memory
            return desired_state(
                inventory=self.inventory,
                capability=self._capability_of(self.inventory),
                nri_connected=self._nri_connected(),
                driver_upgrade=upgrade,
                reserve=self._memory_reserve,
                mps_reserve=self._mps_reserve,
            )
        try:
            inventory = await asyncio.to_thread(self._backend.read)
        except InventoryUnavailable as exc:
            self._read = (None, None)
            return desired_state(inventory=None, unavailable=str(exc))
        inventory = with_whole(inventory, self._whole_gpus())
        self.inventory = inventory
        if self._on_inventory is not None:
            self._on_inventory(inventory)
        self._seen.update({g.uuid: g.index for g in inventory.gpus})
        present = {g.uuid for g in inventory.gpus}
        missing = {uuid: index for uuid, index in self._seen.items() if uuid not in present}
        capability = None
        try:
            driver: DriverVersion | None = DriverVersion.parse(inventory.driver_version)
        except ValueError:
            driver = None
        if self._capability is not None and driver is not None:
            capability = self._capability(driver)
        stack = await self._stack_gate.verdict(driver=driver) if self._stack_gate is not None else None
        self._read = (self._packable(inventory), capability)
        return desired_state(
            inventory=inventory,
            capability=capability,
            nri_connected=self._nri_connected(),
            missing=missing,
            stack=stack,
            reserve=self._memory_reserve,
            mps_reserve=self._mps_reserve,
            limits_canary=self._limits_canary(),
        )

    def _packable(self, inventory: NodeInventory) -> NodeInventory:
        """``inventory`` with each GPU's memory as the scheduler may pack it (``desired_state``'s ``mib``),
        so the DRA slice offers what the annotation path offers, never the driver's or MPS's reserve."""
        if self._memory_reserve is None:
            return inventory
        reserve, mps = self._memory_reserve, self._mps_reserve
        return replace(
            inventory,
            gpus=tuple(replace(g, mib=usable_mib(g, settings=reserve, mps=mps)) for g in inventory.gpus),
        )

    def _capability_of(self, inventory: NodeInventory | None) -> NodeMpsCapability | None:
        if self._capability is None or inventory is None:
            return None
        try:
            return self._capability(DriverVersion.parse(inventory.driver_version))
        except ValueError:
            return None

    async def publish_once(self, *, force: bool = False) -> NodeState:
        """Patch the Node if what it should say changed (or ``force``); returns the state."""
        state = await self.read_state()
        loop = asyncio.get_running_loop()
        due = force or state != self._desired or loop.time() - self._last_write >= self._resync_s
        if not due and self.conflict is not None:  # the other stack may be gone: look, without writing
            with api_errors():
                due = self._foreign_condition(await self._client.get(Node, self._node)) is None
        if due:
            await self._write(state)
            self._last_write = loop.time()
            if state != self._desired:
                log.info(
                    "inventory: published %d GPU(s), %s=%s (%s)",
                    len(state.gpus),
                    keys.NODE_READY_CONDITION,
                    state.ready,
                    state.reason,
                    extra={"node": self._node, "detail": state.message},
                )
            self._desired = state
            self.publishes += 1
        if self._slices is not None:
            try:
                await self._slices.sync(inventory=self._read[0], capability=self._read[1], force=due)
            except KubeError as exc:
                log.warning("dra: could not update ResourceSlice %s: %s", self._slices.name, exc)
        self.published = self._shown(state)
        return self.published

    def _shown(self, state: NodeState) -> NodeState:
        """The agent's readiness: the backend's, unless another node stack writes the condition."""
        if self.conflict is None:
            return state
        return NodeState(
            labels=state.labels,
            gpus=state.gpus,
            ready=False,
            reason=names.REASON_CONFLICTING_STACK,
            message=self.conflict,
        )

    async def run(self) -> None:
        """Publish, then keep publishing on change; a failed write is retried at the next interval."""
        while True:
            waiting, self._refreshes = self._refreshes, []
            try:
                await self.publish_once()
            except KubeError as exc:
                log.warning("inventory: could not update node %s: %s", self._node, exc)
            finally:
                for done in waiting:
                    if not done.done():
                        done.set_result(None)
            self._changed.clear()
            if self._refreshes:  # asked for during this publish: publish again at once
                self._changed.set()
            # asyncio.timeout, not wait_for: on Python 3.11 wait_for loses a cancellation that
            # arrives as the event is set, and this loop would then never stop.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self._interval_s):
                    await self._changed.wait()

    async def mark_stopped(self) -> None:
        """Condition False: the agent is stopping, nothing would inject limits into new containers."""
        base = self.published or desired_state(inventory=None, unavailable="the agent has not read them")
        self._desired = None
        if self.conflict is not None:  # the condition is the other stack's: leave it alone
            return
        reason = names.REASON_AGENT_STOPPED
        message = "the gpufrac node agent is not running; GPU containers would start without their limits"
        if self._driver_upgrade() is not None:  # evicted for the upgrade: say what is going on
            upgrading = desired_state(inventory=None, driver_upgrade=self._driver_upgrade())
            reason, message = upgrading.reason, upgrading.message
        await self._write_condition(ready=False, reason=reason, message=message)
        self.published = NodeState(labels=base.labels, gpus=base.gpus, ready=False, reason=reason, message="")

    # -- writes -----------------------------------------------------------------------------------------

    def _foreign_condition(self, node: Node) -> str | None:
        """What the readiness condition says when someone other than this agent wrote it; else None."""
        for c in (node.status.conditions or []) if node.status else []:
            if c.type != keys.NODE_READY_CONDITION:
                continue
            said = f"{c.status}, reason {c.reason!r}, message {c.message!r}"
            if c.reason == keys.NODE_REASON_AGENT_HEARTBEAT_EXPIRED:
                return None  # the operator's word while this agent's Lease had expired: overwrite it
            if c.reason not in keys.NODE_AGENT_REASONS:
                return (
                    f"{keys.NODE_READY_CONDITION} is {said}: gpufrac's node agent never writes that reason, "
                    "so another GPU-fractioning node stack (NVIDIA's gpu-fractioning operator) manages this "
                    "node too; gpufrac places no GPU pods here until only one stack runs on it"
                )
            stamp = c.lastHeartbeatTime
            heartbeat = stamp.strftime("%Y-%m-%dT%H:%M:%SZ") if isinstance(stamp, datetime) else str(stamp)
            if (
                self._written is not None
                and (c.status, c.reason, c.message or "", heartbeat) != self._written
            ):
                return (
                    f"{keys.NODE_READY_CONDITION} is {said}, which this agent did not write (it wrote "
                    f"{self._written[1]!r}): another node agent writes this node's condition too; gpufrac "
                    "places no GPU pods here until only one runs"
                )
        return None

    def _note_conflict(self, found: str | None, *, uid: str) -> None:
        """Record what was found; the Event and the warning once per conflict, not per change in it."""
        if found == self.conflict:
            return
        if found is not None and self.conflict is None:
            log.warning("inventory: %s", found, extra={"node": self._node})
            if self._events is not None:
                self._events.emit(
                    regarding=ObjectRef(kind="Node", namespace="default", name=self._node, uid=uid),
                    type=WARNING,
                    reason=names.REASON_CONFLICTING_STACK,
                    message=found,
                )
        elif self.conflict is not None:
            log.info(
                "inventory: %s is no longer written by another node stack; writing it again",
                keys.NODE_READY_CONDITION,
                extra={"node": self._node},
            )
            self._written = None  # the condition is not the one this agent wrote last
        self.conflict = found

    async def _write(self, state: NodeState) -> None:
        with api_errors():
            current = await self._client.get(Node, self._node)
        self._note_conflict(
            self._foreign_condition(current), uid=(current.metadata.uid if current.metadata else None) or ""
        )
        node = await merge_patch(
            self._client,
            Node,
            name=self._node,
            patch={
                "metadata": {
                    "labels": state.labels,
                    "annotations": {
                        keys.NODE_GPUS_ANNOTATION: state.gpus_annotation,
                        keys.NODE_STACK_CONFLICT_ANNOTATION: self.conflict,
                    },
                }
            },
        )
        if self._taint:
            await self._ensure_taint(node)
        if self.conflict is not None:  # the other stack's condition: writing it would start a flap
            return
        if self._transition is None:  # keep the transition time of a condition an earlier agent set
            for condition in (node.status.conditions or []) if node.status else []:
                if condition.type == keys.NODE_READY_CONDITION and condition.lastTransitionTime is not None:
                    stamp = condition.lastTransitionTime
                    text = stamp.strftime("%Y-%m-%dT%H:%M:%SZ") if isinstance(stamp, datetime) else str(stamp)
                    self._transition = (condition.status == "True", text)
        await self._write_condition(ready=state.ready, reason=state.reason, message=state.message)

    async def _ensure_taint(self, node: Node) -> None:
        """Add the managed taint unless present. The taint list is replaced as a whole, so the patch is
        preconditioned on the resourceVersion just read; a concurrent change is re-read once."""
        for attempt in range(2):
            taints = [t.to_dict() for t in (node.spec.taints or [])] if node.spec else []
            if any(t.get("key") == keys.MANAGED_TAINT_KEY for t in taints):
                return
            taints.append(
                {
                    "key": keys.MANAGED_TAINT_KEY,
                    "value": keys.MANAGED_TAINT_VALUE,
                    "effect": keys.MANAGED_TAINT_EFFECT,
                }
            )
            try:
                await merge_patch(
                    self._client,
                    Node,
                    name=self._node,
                    patch={"spec": {"taints": taints}},
                    resource_version=node.metadata.resourceVersion if node.metadata else None,
                )
                return
            except Conflict:
                if attempt == 1:
                    raise
                with api_errors():
                    node = await self._client.get(Node, self._node)

    async def _write_condition(self, *, ready: bool, reason: str, message: str) -> None:
        now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        status = "True" if ready else "False"
        condition: dict[str, Any] = {
            "type": keys.NODE_READY_CONDITION,
            "status": status,
            "reason": reason,
            "message": message,
            "lastHeartbeatTime": now,
        }
        if self._transition is None or self._transition[0] != ready:
            self._transition = (ready, now)
        condition["lastTransitionTime"] = self._transition[1]
        with api_errors():
            await self._client.patch(
                Node.Status,
                self._node,
                {"status": {"conditions": [condition]}},
                patch_type=PatchType.STRATEGIC,
            )
        self._written = (status, reason, message, now)
