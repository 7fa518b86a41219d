"""gpufrac's NRI handler: the injection plan as a container adjustment, and the mapping kept in step.

At CreateContainer the pod's annotations become an ``InjectionPlan`` (``gpufrac.node.inject``, pure),
which becomes NRI's ``ContainerAdjustment``: enforcement variables the container already has are removed
(``-KEY``, NRI's removal marker), then the plan's variables, the per-container MPS directory mount and
the CDI devices are added. NRI only replaces a variable the container brings: a removal never reaches the
runtime (``unremovable_variable``), so a container that brings one its plan does not set (a MIG or whole-
GPU container's memory or MPS variable) is refused, naming it. CDI devices: CDI names as assigned, UUIDs
and indices as ``<cdi_kind>=<device>`` (the NVIDIA toolkit's spec brings the device nodes and the memory-
limit hook; the toolkit ignores the plain variable in unprivileged containers). A container without a
gpufrac ask gets nothing, so a CDI device it asked for itself is what the runtime resolved before NRI and
is reported as a foreign GPU (below). The host leaf directory is created before answering (the runtime
bind-mounts it), the container's record is written to the mapping store, and only then does the runtime
get its answer.
When the MPS supervisor runs (``hooks``), it may re-point the MPS directory mount at a v3 namespace
directory or the classic pipe directory (``gpufrac.node.mps.containers.apply_adjustment``); the private
leaf is created only when the mount still points at it.

Classic MPS has ONE pipe directory for the node: its control daemon, its server and every client talk
through named pipes and sockets in it (NVIDIA: the directory "should be consistent across all MPS
clients sharing the same MPS server, and the MPS control daemon"), and the server makes its own there
when it starts -- after the container exists -- so no per-container leaf can hold what a client needs,
and a bind mount of single files would miss what appears later. Every sm-sharing container therefore
sees the control socket and can send the control daemon its commands, as any local client can; v3
(per-namespace directories) is what isolates tenants. What the plan can narrow, it does: the shared
directory (``shared_pipe_dir``) is mounted read-only, nosuid, nodev, noexec
(``mps.containers.read_only_shared_pipe``, which DRA claims get too) -- connecting to a socket or
opening a pipe does not need a writable mount, so a container can use MPS but cannot remove, replace or
plant an entry that other tenants' clients would then talk to.
``shared_pipe_writable`` gives the write access back should a driver's client need it.

Devices are checked against this node's inventory before anything is injected: every assigned device
must be a usable GPU of the node, by UUID, by index, or as the CDI name ``nvidia.com/gpu=<uuid|index>``.
``all``, a UUID of another node's GPU or a withdrawn (faulty, prohibited) one fails the container, naming
the key, the value and the device; so does any device while the inventory has not been read. What the
scheduler assigned is on the node by construction, so only a forged or stale assignment is refused.
MIG (``gpufrac.node.nri.mig``): a container placed on MIG slices gets exactly its slices as CDI devices
and nothing of a fraction (no memory variables, no MPS, no memory limit at start); each must be a slice
this node publishes, and a fraction or whole GPU naming a slice or a GPU in mode ``mig`` is refused. Its
record (mode ``mig``) carries the slices' profiles; its start books it with the limit enforcer as held
by the hardware, so the pod's ``GpuMemoryEnforced`` condition says "MIG slice <profile> (<uuid>)".
A GPU container's id names its leaf directory and its mapping record, so it is checked first
(``gpufrac.node.mapping.check_container_id``): an id with a slash, a NUL, a leading dot or over 128
characters fails the container (and is skipped at Synchronize) before any path is made from it.

A container gpufrac has no ask for, but that the device plugin gave a GPU (``NVIDIA_VISIBLE_DEVICES``
other than ``void``/``none``, a device-list mount under ``/var/run/nvidia-container-devices``, or an
``nvidia.com/`` CDI device) -- a pod of another scheduler on a node whose GPUs gpufrac shares -- uses a
GPU outside gpufrac's books. By default it is created as it is and reported (a Warning Event
``GpuOutsideGpufrac`` on its pod, ``gpufrac_enforcement_violations_total{kind="foreign_gpu"}``);
``foreign_gpus="refuse"`` fails it instead, with that reason. Namespaces in ``foreign_gpus_exempt``
(system pods that set ``NVIDIA_VISIBLE_DEVICES`` in their manifests) are left alone.

A container whose GPU is a share our DRA driver prepared (its CDI device ``gpu.gpufrac.io/claim=<claim
uid>-<device>``, ``keys.DRA_CDI_KIND``) gets nothing from NRI -- the claim's CDI spec carries its
injection -- but it is recorded like an annotation fraction, so usage, ``gpufrac top`` and the audit
attribute its GPU processes to it: the record's GPUs, request and limit MiB, mode and portion are the
claim's allocation as the kubelet plugin prepared it, read back from the spec in ``cdi_dir``
(``gpufrac.node.dra.prepare.read_prepared``), and ``claims`` names the claims. A container whose shares
are not all of one size and mode, or whose spec cannot be read, is logged and not recorded. The limit
enforcer, the MPS hooks and the ``GpuMemoryEnforced`` condition leave claim records alone: the spec's
variables and the claim's own MPS namespace are what enforces them (docs/dra.md).

At StartContainer (subscribed when ``limits`` is given) the container's cgroup exists and its workload
has not run: the driver's per-cgroup memory limit is set and read back there
(``gpufrac.node.memlimit.enforcer``), and a start whose limit is not in force fails (fail-closed) with
the GPU, the cgroup, the values and the driver's error. Synchronize reads the limits of running
fractions and sets them again where they are missing.

Failure policy. A pod that breaks the contract, or is not placed yet, fails the container with the
contract's message, which names the key (fail-closed): the kubelet shows it as the container's error
and retries. With ``fail_open`` the container is created instead, without GPU enforcement -- and
without any enforcement variable the user set, so an unparseable pod never gets more than nothing --
and a warning is logged; an MPS daemon that is not serving then only costs the MPS part of the plan.

Synchronize (after every connection) recomputes the plan of every container the runtime reports and
makes the mapping store equal to it; a container whose annotations no longer parse is logged and left
out (it exists, it cannot be failed any more, and the audit reports it). Synchronize does not take a
running container's injection on trust: the runtime reports each container's environment as created,
and a GPU container whose enforcement variables differ from its plan (created while the agent was away,
or fail-open) is not recorded as enforced; it is reported instead -- a Warning Event on its pod
(``GpuInjectionMissing``, as the audit says it) and the ``gpufrac_containers_without_injection`` gauge,
which drops again when the container is removed.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Literal

from gpufrac._generated.nri import api_pb2 as api
from gpufrac.contract import keys
from gpufrac.contract.errors import ContractError
from gpufrac.contract.keys import CDI_GPU_KIND, DEVICE_PLUGIN_CDI_GPU_KIND
from gpufrac.kube.events import WARNING, ObjectRef
from gpufrac.node.dra.prepare import PreparedDevice, read_prepared
from gpufrac.node.enforcement_audit import REASON_MISSING_INJECTION, EventSink
from gpufrac.node.inject import (
    CONTAINER_PIPE_DIR,
    ENFORCEMENT_ENV,
    NVIDIA_VISIBLE_DEVICES,
    InjectionPlan,
    injection_problems,
    is_cdi_name,
    pipe_leaf,
    plan_container,
)
from gpufrac.node.inventory.backend import GpuInfo
from gpufrac.node.mapping import (
    MIG_MODE,
    AllocationRecord,
    InvalidContainerId,
    MappingStore,
    check_container_id,
)
from gpufrac.node.memlimit.enforcer import LimitEnforcer
from gpufrac.node.metrics import FOREIGN_GPU, EnforcementCounters
from gpufrac.node.mps.containers import ContainerHooks, apply_adjustment, read_only_shared_pipe
from gpufrac.node.mps.supervisor import MpsUnavailable
from gpufrac.node.nri.mig import mig_device_problem, slice_mib, slice_profiles
from gpufrac.node.nri.plugin import ContainerRejected

log = logging.getLogger(__name__)

#: Looks up a GPU's total MiB by UUID (the inventory); None when unknown.
DeviceMib = Callable[[str], int | None]
#: The node's usable GPUs (the latest inventory); None while it has not been read.
NodeGpus = Callable[[], Sequence[GpuInfo] | None]
#: Where NVIDIA's device plugin lists a container's devices with its volume-mounts strategy.
DEVICE_LIST_MOUNT_ROOT = "/var/run/nvidia-container-devices"
REASON_FOREIGN_GPU = "GpuOutsideGpufrac"
#: What the agent does with such a container: create it and report it, or refuse it.
ForeignGpuPolicy = Literal["report", "refuse"]
CDI_GPU_KINDS = (CDI_GPU_KIND, DEVICE_PLUGIN_CDI_GPU_KIND)


def claim_devices(container: api.Container) -> tuple[str, ...]:
    """The names (``<claim uid>-<device>``) of the shares our DRA driver prepared for ``container``."""
    prefix = keys.DRA_CDI_KIND + "="
    return tuple(d.name[len(prefix) :] for d in container.CDI_devices if d.name.startswith(prefix))


def device_plugin_gpu(container: api.Container) -> str | None:
    """How ``container`` was given a GPU without gpufrac (the device plugin's ways), or None. A share our
    DRA driver prepared (its CDI device, ``keys.DRA_CDI_KIND``) is gpufrac's, whatever else it carries."""
    if any(device.name.startswith(keys.DRA_CDI_KIND + "=") for device in container.CDI_devices):
        return None
    for entry in container.env:
        key, _, value = entry.partition("=")
        if key == NVIDIA_VISIBLE_DEVICES and value.strip() not in ("", "void", "none"):
            return f"{NVIDIA_VISIBLE_DEVICES}={value}"
    for mount in container.mounts:
        if mount.destination.startswith(DEVICE_LIST_MOUNT_ROOT + "/"):
            return f"the device-list mount {mount.destination}"
    for device in container.CDI_devices:
        if device.name.startswith("nvidia.com/"):
            return f"the CDI device {device.name}"
    return None


def foreign_device(devices: Sequence[str], gpus: Sequence[GpuInfo]) -> str | None:
    """The first of ``devices`` that is not one of ``gpus`` (by UUID, index or CDI name); None if all are."""
    names = {g.uuid for g in gpus} | {str(g.index) for g in gpus}
    for device in devices:
        name = device
        if is_cdi_name(device):
            kind, _, name = device.partition("=")
            if kind not in CDI_GPU_KINDS:
                return device
        if name not in names:
            return device
    return None


def unremovable_variable(plan: InjectionPlan, *, container: api.Container, pod: api.PodSandbox) -> str | None:
    """Why ``container`` cannot be given its plan: it brings an enforcement variable the plan does not set
    (a MIG or whole-GPU container's memory or MPS variable, a time-slicing fraction's active-thread
    percentage); None when it brings none.

    NRI can replace such a variable but not remove it: its adaptation (v0.12.3, ``result.adjustEnv``)
    applies a removal to the adjustments of earlier plugins and to the request, never to the merged
    adjustment the runtime applies to the container's spec, so containerd keeps the container's own
    value (containerd#13432); the validator then sees it too. Refused, so the container never runs with
    a value the scheduler did not grant."""
    own = dict(entry.partition("=")[::2] for entry in container.env)
    for key in ENFORCEMENT_ENV:
        if key in own and key not in plan.env_map:
            return (
                f"container {container.name} of pod {pod.namespace}/{pod.name} sets {key}={own[key]!r} in "
                "its environment, which its GPU assignment does not set and the runtime cannot remove (NRI "
                "replaces a variable a container brings but does not remove it); remove it from the manifest"
            )
    return None


class GpuInjector:
    """The ``NriHandler`` of the node agent."""

    def __init__(
        self,
        *,
        store: MappingStore,
        pipe_root: Path,
        container_pipe_dir: str = CONTAINER_PIPE_DIR,
        fail_open: bool = False,
        hooks: ContainerHooks | None = None,
        device_mib: DeviceMib | None = None,
        node_gpus: NodeGpus | None = None,
        events: EventSink | None = None,
        counters: EnforcementCounters | None = None,
        foreign_gpus: ForeignGpuPolicy = "report",
        foreign_gpus_exempt: frozenset[str] = frozenset(),
        shared_pipe_dir: str | None = None,
        shared_pipe_writable: bool = False,
        cdi_kind: str = CDI_GPU_KIND,
        limits: LimitEnforcer | None = None,
        cdi_dir: Path | None = None,
    ) -> None:
        """``node_gpus`` is what assigned devices are checked against (the agent always gives it; None
        skips the check, for tests of the plan alone). ``cdi_kind`` is the CDI kind requested for devices
        given as UUIDs or indices (``gpufrac.node.inject.cdi_requests``; empty: none). ``limits`` sets and
        reads back the driver's per-cgroup memory limit at StartContainer (None: the variables only).
        ``cdi_dir`` is where the DRA plugin writes claims' CDI specs, read to record a claim's container
        (None: such a container is not recorded)."""
        self._store = store
        self._pipe_root = pipe_root
        self._container_pipe_dir = container_pipe_dir
        self._fail_open = fail_open
        self._hooks = hooks
        self._device_mib = device_mib or (lambda _uuid: None)
        self._node_gpus = node_gpus
        self._events = events
        self._counters = counters
        self._refuse_foreign = foreign_gpus == "refuse"
        self._foreign_exempt = foreign_gpus_exempt
        self._shared_pipe_dir = None if shared_pipe_writable else shared_pipe_dir
        self._cdi_kind = cdi_kind
        self._limits = limits
        self._cdi_dir = cdi_dir
        #: Running GPU containers Synchronize found without their injection: id -> what is wrong.
        self.unenforced: dict[str, str] = {}
        self.runtime: tuple[str, str] | None = None
        self.refused = 0
        self.failed_open = 0

    def events(self) -> Iterable[int]:
        start = (api.START_CONTAINER,) if self._limits is not None else ()
        return (api.CREATE_CONTAINER, *start, api.STOP_CONTAINER, api.REMOVE_CONTAINER)

    async def configure(self, *, config: str, runtime_name: str, runtime_version: str) -> None:
        self.runtime = (runtime_name, runtime_version)

    async def shutdown(self) -> None:
        log.info("nri: the runtime is shutting down")

    # -- CreateContainer --------------------------------------------------------------------------------

    async def create_container(
        self, *, pod: api.PodSandbox, container: api.Container
    ) -> api.ContainerAdjustment | None:
        started = time.perf_counter()
        where = {"pod": f"{pod.namespace}/{pod.name}", "container": container.name, "id": container.id}
        source = pipe_leaf(root=str(self._pipe_root), container_id=container.id)
        try:
            plan, present = plan_container(
                annotations=pod.annotations,
                container=container.name,
                env=container.env,
                pipe_source=source,
                container_pipe_dir=self._container_pipe_dir,
                cdi_kind=self._cdi_kind,
            )
        except ContractError as exc:
            return self._refuse(f"gpufrac: {exc}", container=container, where=where)
        if plan is None:
            self._check_foreign_gpu(pod=pod, container=container, where=where)
            record = self._claim_record(pod=pod, container=container)
            if record is not None:
                self._store.put(record)
            return None
        try:  # before any path is made from it: the leaf directory, the mapping record, MPS's state
            check_container_id(container.id)
        except InvalidContainerId as exc:
            return self._refuse(f"gpufrac: {exc}", container=container, where=where)
        unknown = self._not_on_node(plan, annotations=pod.annotations)
        if unknown is not None:
            return self._refuse(f"gpufrac: {unknown}", container=container, where=where)
        brought = unremovable_variable(plan, container=container, pod=pod)
        if brought is not None:
            return self._refuse(f"gpufrac: {brought}", container=container, where=where)

        if self._hooks is not None and not plan.bound.mig:  # a MIG slice is no MPS client
            try:
                plan = apply_adjustment(plan, await self._hooks.on_create(plan, container_id=container.id))
            except MpsUnavailable as exc:
                if not self._fail_open:
                    self.refused += 1
                    log.warning("nri: refusing container: MPS unavailable: %s", exc, extra=where)
                    raise ContainerRejected(f"gpufrac: MPS is not available on this node: {exc}") from exc
                self.failed_open += 1
                log.warning("nri: MPS unavailable, creating without it (fail-open): %s", exc, extra=where)

        plan = read_only_shared_pipe(plan, shared_pipe_dir=self._shared_pipe_dir)
        mount_source = next((m.source for m in plan.mounts), None)
        if mount_source == source:  # our private leaf (MPS may have re-pointed the mount at its own)
            os.makedirs(source, mode=0o755, exist_ok=True)
        self._store.put(self._record(pod=pod, container=container, plan=plan))

        adjust = api.ContainerAdjustment()
        for key in present:
            adjust.env.add(key=f"-{key}")
        for key, value in plan.env:
            adjust.env.add(key=key, value=value)
        existing = {m.destination for m in container.mounts}
        for mount in plan.mounts:
            if mount.destination in existing:  # a user's mount over the MPS directory is replaced, not kept
                adjust.mounts.add(destination=f"-{mount.destination}")
            adjust.mounts.add(
                destination=mount.destination, type="bind", source=mount.source, options=list(mount.options)
            )
        for name in plan.cdi_devices:
            adjust.CDI_devices.add(name=name)
        log.info(
            "nri: injected %s",
            ",".join(plan.bound.devices),
            extra={
                **where,
                "mode": plan.bound.mode.value,
                "request_mib": plan.bound.request_mib,
                "limit_mib": plan.bound.limit_mib,
                "elapsed_ms": round((time.perf_counter() - started) * 1000, 3),
            },
        )
        return adjust

    def _check_foreign_gpu(
        self, *, pod: api.PodSandbox, container: api.Container, where: dict[str, str]
    ) -> None:
        how = device_plugin_gpu(container)
        if how is None or pod.namespace in self._foreign_exempt:
            return
        message = (
            f"gpufrac: container {container.name} of pod {pod.namespace}/{pod.name} was given a GPU outside "
            f"gpufrac ({how}), on a node whose GPUs gpufrac shares: it would use memory no one accounts "
            "for; schedule it with gpufrac's scheduler (nvidia.com/gpu becomes an exclusive gpufrac "
            "request) or run it on a node gpufrac does not manage"
        )
        if self._counters is not None:
            self._counters.violation(kind=FOREIGN_GPU)
        if self._events is not None:
            self._events.emit(
                regarding=ObjectRef(kind="Pod", namespace=pod.namespace, name=pod.name, uid=pod.uid),
                type=WARNING,
                reason=REASON_FOREIGN_GPU,
                message=message + ("; refused" if self._refuse_foreign else ""),
            )
        if self._refuse_foreign:
            self.refused += 1
            log.warning("nri: refusing container: %s", message, extra=where)
            raise ContainerRejected(message)
        log.warning("nri: %s", message, extra=where)

    def _not_on_node(self, plan: InjectionPlan, *, annotations: Mapping[str, str]) -> str | None:
        """Why ``plan``'s devices cannot be given on this node; None when they are all its usable GPUs."""
        if self._node_gpus is None:
            return None
        key = keys.devices_key(plan.bound.container)
        value = annotations.get(key, ",".join(plan.bound.devices))
        gpus = self._node_gpus()
        if gpus is None:
            return f'{key}="{value}" cannot be checked: this node\'s GPU inventory has not been read yet'
        mig = mig_device_problem(key=key, value=value, bound=plan.bound, gpus=gpus)
        if mig is not None or plan.bound.mig:
            return mig
        device = foreign_device(plan.bound.devices, gpus)
        if device is None:
            return None
        return (
            f'{key}="{value}" is invalid: "{device}" is not in this node\'s GPU inventory '
            f"({len(gpus)} usable GPU{'' if len(gpus) == 1 else 's'}, named by UUID, index or "
            f"{' or '.join(CDI_GPU_KINDS)}=<UUID|index>)"
        )

    def _refuse(
        self, message: str, *, container: api.Container, where: dict[str, str]
    ) -> api.ContainerAdjustment | None:
        if not self._fail_open:
            self.refused += 1
            log.warning("nri: refusing container: %s", message, extra=where)
            raise ContainerRejected(message)
        self.failed_open += 1
        log.warning("nri: creating container without GPU enforcement (fail-open): %s", message, extra=where)
        present = {entry.partition("=")[0] for entry in container.env}
        strip = [key for key in ENFORCEMENT_ENV if key in present]
        if not strip:
            return None
        adjust = api.ContainerAdjustment()
        for key in strip:
            adjust.env.add(key=f"-{key}")
        return adjust

    def _record(
        self, *, pod: api.PodSandbox, container: api.Container, plan: InjectionPlan
    ) -> AllocationRecord:
        bound = plan.bound
        if bound.mig:  # the slices' memory, and their profiles for the condition and metrics
            gpus = self._node_gpus() if self._node_gpus is not None else None
            mib = slice_mib(bound.devices, gpus)
            return self._new_record(
                pod=pod,
                container=container,
                devices=bound.devices,
                request_mib=mib,
                limit_mib=mib,
                mode=MIG_MODE,
                portion=None,
                exclusive=True,
                pipe_dir=None,
                mig_profiles=slice_profiles(bound.devices, gpus),
            )
        return self._new_record(
            pod=pod,
            container=container,
            devices=bound.devices,
            request_mib=bound.request_mib,
            limit_mib=bound.limit_mib,
            mode=bound.mode.value,
            portion=bound.compute_portion,
            exclusive=bound.exclusive,
            pipe_dir=next((m.source for m in plan.mounts), None),
        )

    def _new_record(
        self,
        *,
        pod: api.PodSandbox,
        container: api.Container,
        devices: tuple[str, ...],
        request_mib: int | None,
        limit_mib: int | None,
        mode: str,
        portion: float | None,
        exclusive: bool,
        pipe_dir: str | None,
        claims: tuple[str, ...] = (),
        mig_profiles: tuple[str, ...] = (),
    ) -> AllocationRecord:
        """A container's usage record; an exclusive device is the whole GPU (everything on it is the
        container's), the smallest of its devices when there are several (a MIG slice's amounts are
        given: the inventory's slices, not the GPUs', know them)."""
        if exclusive and not mig_profiles:
            sizes = [self._device_mib(d) for d in devices]
            request_mib = limit_mib = min((m for m in sizes if m is not None), default=0)
        return AllocationRecord(
            container_id=container.id,
            pod_namespace=pod.namespace,
            pod_name=pod.name,
            pod_uid=pod.uid,
            container_name=container.name,
            devices=devices,
            request_mib=request_mib or 0,
            limit_mib=limit_mib or 0,
            mode=mode,
            portion=portion,
            exclusive=exclusive,
            pipe_dir=pipe_dir,
            claims=claims,
            mig_profiles=mig_profiles,
        )

    def _claim_record(
        self,
        *,
        pod: api.PodSandbox,
        container: api.Container,
        prepared: Callable[[], Mapping[str, PreparedDevice]] | None = None,
    ) -> AllocationRecord | None:
        """The record of a container running in shares our DRA driver prepared (module docstring); None
        for any other container, and for one whose shares cannot be read or differ (logged).
        ``prepared`` gives the node's prepared shares by name (default: read the specs now)."""
        names = claim_devices(container)
        if not names or self._cdi_dir is None:
            return None
        where = {"pod": f"{pod.namespace}/{pod.name}", "container": container.name, "id": container.id}
        try:
            check_container_id(container.id)
        except InvalidContainerId as exc:
            log.warning("nri: not recording a claim container: %s", exc, extra=where)
            return None
        by_name = prepared() if prepared is not None else self._prepared_shares()
        shares: list[PreparedDevice] = [by_name[n] for n in names if n in by_name]
        missing = [n for n in names if n not in by_name]
        if missing or not shares:
            log.warning(
                "nri: claim container not recorded (its usage is not reported): no prepared share %s in %s",
                ", ".join(missing),
                self._cdi_dir,
                extra=where,
            )
            return None
        first = shares[0].bound
        sizes = {
            (s.bound.mode, s.bound.request_mib, s.bound.limit_mib, s.bound.compute_portion) for s in shares
        }
        if len(sizes) > 1:
            log.warning(
                "nri: claim container not recorded (its usage is not reported): its shares %s differ in "
                "memory or mode, and a record holds one request and limit per container",
                ", ".join(names),
                extra=where,
            )
            return None
        return self._new_record(
            pod=pod,
            container=container,
            devices=tuple(s.bound.devices[0] for s in shares),
            request_mib=first.request_mib,
            limit_mib=first.limit_mib,
            mode=first.mode.value,
            portion=first.compute_portion,
            exclusive=first.exclusive,  # a share without consumed memory: the whole GPU
            pipe_dir=shares[0].pipe_source,
            claims=tuple(dict.fromkeys(s.claim for s in shares)),
        )

    def _prepared_shares(self) -> dict[str, PreparedDevice]:
        return {d.key: d for d in read_prepared(self._cdi_dir)} if self._cdi_dir is not None else {}

    # -- the rest of the lifecycle ----------------------------------------------------------------------

    async def start_container(self, *, pod: api.PodSandbox, container: api.Container) -> None:
        """The driver's per-cgroup limit, set and read back before the workload runs (fail closed); a MIG
        container's slices are booked as held by the hardware (nothing to set)."""
        record = self._store.get(container.id)
        if self._limits is None or record is None or record.claims:
            return
        if record.exclusive and not record.is_mig:
            return
        started = time.perf_counter()
        booked = self._limits.enforce(
            record=record, pid=container.pid, cgroups_path=container.linux.cgroups_path
        )
        where = {"pod": f"{pod.namespace}/{pod.name}", "container": container.name, "id": container.id}
        if booked.in_force:
            log.info(
                "nri: GPU memory limit in force: %s",
                booked.describe(),
                extra={**where, "elapsed_ms": round((time.perf_counter() - started) * 1000, 3)},
            )
            return
        message = self._limits.refusal(booked)
        if self._fail_open:
            self.failed_open += 1
            log.warning(
                "nri: starting without the driver's GPU memory limit (fail-open): %s", message, extra=where
            )
            return
        self.refused += 1
        log.warning("nri: refusing to start: %s", message, extra=where)
        raise ContainerRejected(message)

    async def stop_container(self, *, pod: api.PodSandbox, container: api.Container) -> None:
        record = self._store.get(container.id)
        if self._hooks is not None and record is not None and not record.claims and not record.is_mig:
            await self._hooks.on_stop(container_id=container.id)

    async def remove_container(self, *, pod: api.PodSandbox, container: api.Container) -> None:
        if self.unenforced.pop(container.id, None) is not None:
            self._count_unenforced()
        if self._limits is not None:
            self._limits.forget(container.id)
        record = self._store.remove(container.id)
        if record is None or record.claims or record.is_mig:  # a claim's MPS namespace lives with its claim
            return
        if self._hooks is not None:
            await self._hooks.on_remove(container_id=container.id)
        if record.pipe_dir == pipe_leaf(root=str(self._pipe_root), container_id=container.id):
            with contextlib.suppress(OSError):  # already gone, or not empty: never remove more than ours
                os.rmdir(record.pipe_dir)

    async def validate_container_adjustment(
        self, request: api.ValidateContainerAdjustmentRequest
    ) -> str | None:
        """Not subscribed: the agent adjusts; a plugin of its own judges the result
        (``gpufrac.node.nri.validator``), so that a hung agent cannot also be the one that lets it pass."""
        return None

    async def synchronize(
        self, *, pods: Sequence[api.PodSandbox], containers: Sequence[api.Container]
    ) -> None:
        by_id = {p.id: p for p in pods}
        records: list[AllocationRecord] = []
        live: list[tuple[str, InjectionPlan]] = []
        unenforced: dict[str, str] = {}
        adopt: list[tuple[AllocationRecord, int, str]] = []
        shares: dict[str, PreparedDevice] | None = None

        def prepared() -> dict[str, PreparedDevice]:  # read once, and only if a claim container runs
            nonlocal shares
            if shares is None:
                shares = self._prepared_shares()
            return shares

        for container in containers:
            pod = by_id.get(container.pod_sandbox_id)
            if pod is None:
                continue
            try:
                check_container_id(container.id)
            except InvalidContainerId as exc:
                log.warning(
                    "nri: synchronize: skipping a container of %s/%s: %s", pod.namespace, pod.name, exc
                )
                continue
            source = pipe_leaf(root=str(self._pipe_root), container_id=container.id)
            try:
                plan, _ = plan_container(
                    annotations=pod.annotations,
                    container=container.name,
                    pipe_source=source,
                    container_pipe_dir=self._container_pipe_dir,
                )
            except ContractError as exc:
                log.warning(
                    "nri: synchronize: container %s of %s/%s runs but its annotations break the contract: %s",
                    container.name,
                    pod.namespace,
                    pod.name,
                    exc,
                    extra={"id": container.id},
                )
                continue
            if plan is None:
                claimed = self._claim_record(pod=pod, container=container, prepared=prepared)
                if claimed is not None:
                    records.append(claimed)
                continue
            problems = injection_problems(
                expected=plan.env_map,
                actual=dict(entry.partition("=")[::2] for entry in container.env),
                managed_keys=ENFORCEMENT_ENV,
                # Injected and recorded by this agent: a live resize since may have changed its amounts.
                amounts_may_differ=self._store.get(container.id) is not None,
            )
            if problems:  # never recorded as enforced; reported while it can still run
                if container.state != api.CONTAINER_STOPPED:
                    unenforced[container.id] = "; ".join(problems)
                    if container.id not in self.unenforced:  # once per container, not per reconnection
                        self._report_unenforced(
                            pod=pod, container=container, problems=unenforced[container.id]
                        )
                continue
            record = self._record(pod=pod, container=container, plan=plan)
            records.append(record)
            if not record.is_mig:  # MPS's live set
                live.append((container.id, plan))
            limited = not record.exclusive or record.is_mig
            if self._limits is not None and limited and container.state == api.CONTAINER_RUNNING:
                adopt.append((record, container.pid, container.linux.cgroups_path))
        self.unenforced = unenforced
        self._count_unenforced()
        written, removed = self._store.replace_all(records)
        if self._limits is not None:  # running fractions keep (or get back) the driver's limit
            for record, pid, cgroups_path in adopt:
                self._limits.adopt(record=record, pid=pid, cgroups_path=cgroups_path)
        if self._hooks is not None:  # MPS: namespaces of running containers survive an agent restart
            await self._hooks.on_synchronize(live)
        log.info(
            "nri: synchronized with the runtime",
            extra={
                "pods": len(pods),
                "containers": len(containers),
                "gpu_containers": len(records),
                "without_injection": len(unenforced),
                "records_written": written,
                "records_removed": removed,
            },
        )

    def _report_unenforced(self, *, pod: api.PodSandbox, container: api.Container, problems: str) -> None:
        where = f"{pod.namespace}/{pod.name} container {container.name}"
        message = (
            f"{where} runs without the GPU enforcement it needs ({problems}): it was created while the "
            "node agent was not in the runtime's path (or fail-open); it is not recorded as enforced"
        )
        log.warning("nri: synchronize: %s", message, extra={"id": container.id})
        if self._events is not None:
            self._events.emit(
                regarding=ObjectRef(kind="Pod", namespace=pod.namespace, name=pod.name, uid=pod.uid),
                type=WARNING,
                reason=REASON_MISSING_INJECTION,
                message=message,
            )

    def _count_unenforced(self) -> None:
        if self._counters is not None:
            self._counters.running_without_injection(len(self.unenforced))
