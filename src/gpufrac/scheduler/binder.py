"""Bind a placed pod with its binder-owned annotations: a node agent must find the devices on the pod the
moment the pod lands on its node.

Two ways, one contract (``bind_mode``):

- ``atomic`` (default): ONE write. The Binding subresource carries the annotations in its metadata and
  the API server applies them together with ``nodeName`` in a single update, preconditioned on the
  pod's uid and the resourceVersion the decision was made on. There is no moment at which a pod has
  devices but no node, nothing to roll back, and half the API writes of the two-step form - which is
  what the API server, the bottleneck of a burst, pays for. A 409 whose pod, read back, differs from
  the one placed only in its status (the scheduler's own PodScheduled condition or a preemptor's
  nomination, written while the informer had not yet shown it) is bound once more on the version read:
  what the placement was computed from is unchanged. Any other change is a 409 the scheduler looks at
  again.
- ``patch-then-bind``: the two-step form (docs/scheduler.md). The annotations are merge-patched
  with the pod's resourceVersion (a pod changed since is not annotated: 409, the scheduler looks again;
  a pod the read-back shows bound since, by an earlier Binding of ours whose answer was lost, is BOUND),
  then the Binding carries the version that patch returned, so exactly the annotated pod is bound. If
  the Binding fails, the annotations are rolled back with the same precondition, restoring what the pod
  had (a user's explicit request is restored, a resolved one removed); a rollback that meets a 409 reads
  the pod: bound means the Binding did succeed (its answer was lost), otherwise it retries on the fresh
  version, touching only keys that still hold what this binder wrote.

A Binding that fails without a clear refusal (a lost answer, a 5xx) may have landed: the pod is read back
to know, and asked again while the API server fails to answer (``READ_BACK_S``), the pod's booking held
meanwhile; releasing it on a guess would hand its GPUs to another pod while the API shows this one bound
to them (tests/scheduler/test_scheduler_faults.py plays it).

Nothing is written when the contract refuses to render the placement (``UNWRITABLE``: a key the API
server would refuse, which a Binding would store unchecked and so make the pod impossible to update
again); the scheduler reports the pod unschedulable with the contract's sentence.

Either way, a pod left with binder-owned keys and no node (a two-step binder died between its writes,
or another binder misbehaved) is cleaned by ``clean_stale`` before it is placed again.
"""

from __future__ import annotations

import asyncio
import enum
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import httpx2
from lightkube import AsyncClient
from lightkube.resources.core_v1 import Pod

from gpufrac.contract import keys
from gpufrac.contract.errors import ContractError
from gpufrac.contract.render import DeviceChoice, render_binding
from gpufrac.contract.request import PodGpuRequest
from gpufrac.kube.binding import bind_pod
from gpufrac.kube.errors import Conflict, KubeError, NotFound, TooManyRequests, api_errors
from gpufrac.kube.patch import set_annotations
from gpufrac.placement.decision import ContainerPlacement, Placement

log = logging.getLogger(__name__)

_ROLLBACK_ATTEMPTS = 3
#: How many times a Binding answered 429 (throttled) is sent again before the bind fails.
_THROTTLED_RETRIES = 4
#: How long a binder keeps asking for a pod whose Binding failed without a clear answer (see ``_read_back``).
READ_BACK_S = 30.0


class Outcome(enum.Enum):
    BOUND = "bound"
    CONFLICT = "conflict"  # the pod changed under us: try again on its new version
    GONE = "gone"  # the pod was deleted
    BOUND_ELSEWHERE = "bound_elsewhere"  # someone else bound it
    NOT_LEADER = "not_leader"  # the lease was lost before a write
    FAILED = "failed"  # anything else: back off and retry
    CLEANED = "cleaned"  # stale binder-owned keys were removed
    UNWRITABLE = "unwritable"  # the contract refused to render the placement: nothing was written


@dataclass(frozen=True, slots=True)
class BindResult:
    outcome: Outcome
    detail: str = ""
    error_reason: str = ""  # for the bind-errors metric: conflict, not_found, invalid, other


def device_name(uuid: str, *, style: str) -> str:
    return f"{keys.GPU_RESOURCE}={uuid}" if style == "cdi" else uuid


#: Renderings by what they depend on but the devices: the request (the very object: the pods of one
#: template share theirs, ``objects.gpu_request``) and each container's mode and booked amounts; the
#: devices key of each container is written per pod. Cleared when full.
_RENDERED: dict[tuple[Any, ...], tuple[PodGpuRequest, dict[str, str], tuple[tuple[str, int], ...]]] = {}
_RENDERED_MAX = 1024


def binding_annotations(request: PodGpuRequest, placement: Placement, *, device_style: str) -> dict[str, str]:
    """The contract's rendering of ``placement``, with exactly the amounts the engine booked.

    Per container: its devices (named per ``device_style``), the request and limit MiB and the compute
    portion of the ``Placement``, never resolved again from the GPU's size; and the compute mode the pod
    was placed in, written when it is not the one the pod asked for (the Preferred mode policy's
    fallback), so the node enforces, and a restarted scheduler books, the mode the GPU holds. A pod of a
    shape rendered before takes that rendering with its own devices (``_RENDERED``).
    """
    shape = (id(request), device_style, tuple(_container_shape(c) for c in placement.containers))
    known = _RENDERED.get(shape)
    if known is not None and known[0] is request:
        written = dict(known[1])
        for key, index in known[2]:
            uuids = placement.containers[index].uuids
            if len(set(uuids)) != len(uuids):
                return _render(request, placement, device_style=device_style)  # refused there, as a bug
            written[key] = ",".join(device_name(u, style=device_style) for u in uuids)
        return written
    written = _render(request, placement, device_style=device_style)
    if len(_RENDERED) >= _RENDERED_MAX:
        _RENDERED.clear()
    devices = tuple((keys.devices_key(c.container), i) for i, c in enumerate(placement.containers))
    _RENDERED[shape] = (request, dict(written), devices)
    return written


def _container_shape(container: ContainerPlacement) -> tuple[Any, ...]:
    """What a container's rendering depends on but its devices' names: the first device's amounts."""
    first = container.devices[0] if container.devices else None
    return (
        container.container,
        container.mode,
        container.exclusive,
        container.mig,
        len(container.devices),
        None if first is None else (first.request_mib, first.limit_mib, first.compute_portion),
    )


def _render(request: PodGpuRequest, placement: Placement, *, device_style: str) -> dict[str, str]:
    by_name = {c.container: c for c in request.containers}
    placed_request = []
    rendered = []
    for container in placement.containers:
        asked = by_name[container.container]
        first = container.devices[0]
        placed_request.append(asked if asked.mode is container.mode else replace(asked, mode=container.mode))
        rendered.append(
            DeviceChoice(
                container=container.container,
                devices=tuple(device_name(u, style=device_style) for u in container.uuids),
                compute_portion=first.compute_portion,
                request_mib=first.request_mib,
                limit_mib=first.limit_mib,
            )
        )
    written = render_binding(PodGpuRequest(containers=tuple(placed_request)), rendered)
    for container in placement.containers:
        if (
            not (container.exclusive or container.mig)
            and container.mode is not by_name[container.container].mode
        ):
            written[keys.compute_mode_key(container.container)] = container.mode.value
    return written


def stale_binding_keys(annotations: Mapping[str, str]) -> dict[str, None]:
    """The keys a binder wrote on a pod it never bound, as a removal patch.

    Devices and compute portions are binder-owned outright. A request/limit next to ``gpu-fraction`` is
    the binder's resolution of the portion (a user cannot write both), so it goes too; explicit amounts
    a user wrote are left (the binder rewrites them with the same MiB).
    """
    prefix = keys.NVIDIA_CONTAINER_PREFIX  # every binder-owned key has it: most keys are told by it alone
    if not any(key.startswith(prefix) and keys.is_binder_owned(key) for key in annotations):
        return {}  # nothing a binder writes alone: whatever else is there, the user wrote
    removal: dict[str, None] = {}
    fraction_target = None
    if keys.GPU_FRACTION in annotations:
        fraction_target = annotations.get(keys.GPU_FRACTION_CONTAINER_NAME)
    for key in annotations:
        split = keys.split_container_key(key)
        if split is None or split.prefix != keys.NVIDIA_CONTAINER_PREFIX:
            continue
        if keys.is_binder_owned(key) or (
            keys.GPU_FRACTION in annotations
            and split.suffix in (keys.MEMORY_REQUEST, keys.MEMORY_LIMIT)
            and (fraction_target is None or split.container == fraction_target.strip())
        ):
            removal[key] = None
    return removal


#: What a write or read raises when the API server did not (or may not have) done it.
_API_ERRORS = (KubeError, httpx2.HTTPError, OSError)


def _failed_bind(
    error: Exception, *, current: Pod | None, pod: Pod, placement: Placement, written: dict[str, str]
) -> BindResult:
    """What a failed Binding means, given the pod as read back afterwards (None: not bound, or unknown).

    A Binding whose answer was lost may still have landed: the pod bound to our node with our
    annotations is BOUND; bound anywhere else (or another pod of that name) is BOUND_ELSEWHERE.
    """
    if current is not None and current.spec and current.spec.nodeName:
        annotations = current.metadata.annotations or {}
        if (
            current.metadata.uid == pod.metadata.uid
            and current.spec.nodeName == placement.node
            and all(annotations.get(k) == v for k, v in written.items())
        ):
            return BindResult(Outcome.BOUND)
        return BindResult(Outcome.BOUND_ELSEWHERE, f"bound to {current.spec.nodeName}", _error_reason(error))
    return _write_outcome(error, doing="binding failed: ")


def _write_outcome(error: Exception, *, doing: str = "") -> BindResult:
    """What a failed write means when nothing needs reading back: the pod is gone, changed since it was
    read (a conflict), or the write failed (``doing`` names the write in the detail)."""
    reason = _error_reason(error)
    if isinstance(error, NotFound):
        return BindResult(Outcome.GONE, str(error), reason)
    outcome = Outcome.CONFLICT if isinstance(error, Conflict) else Outcome.FAILED
    return BindResult(outcome, f"{doing}{error}", reason)


def _only_status_moved(pod: Pod, current: Pod | None) -> bool:
    """Whether ``current`` is ``pod`` unbound and unchanged but for its status (and version): what the
    placement was computed from (spec, labels, annotations) is what the API holds."""
    if current is None or current.metadata.uid != pod.metadata.uid or current.metadata.deletionTimestamp:
        return False
    if current.spec is None or current.spec.nodeName:
        return False
    return (
        current.spec == pod.spec
        and (current.metadata.labels or {}) == (pod.metadata.labels or {})
        and (current.metadata.annotations or {}) == (pod.metadata.annotations or {})
    )


def _error_reason(error: Exception) -> str:
    if isinstance(error, Conflict):
        return "conflict"
    if isinstance(error, NotFound):
        return "not_found"
    if isinstance(error, KubeError) and error.code == 422:
        return "invalid"
    return "other"


class BindMode(enum.StrEnum):
    ATOMIC = "atomic"
    PATCH_THEN_BIND = "patch-then-bind"


class Binder:
    def __init__(
        self,
        *,
        client: AsyncClient,
        fence: Callable[[], bool],
        device_style: str = "uuid",
        mode: BindMode = BindMode.ATOMIC,
        read_back_s: float = READ_BACK_S,
    ) -> None:
        self._client = client
        self._read_back_s = read_back_s
        self._fence = fence
        self._device_style = device_style
        self._mode = mode

    async def bind(self, pod: Pod, *, request: PodGpuRequest, placement: Placement) -> BindResult:
        """Bind ``pod`` to ``placement.node`` with the annotations that describe ``placement``."""
        try:
            written = binding_annotations(request, placement, device_style=self._device_style)
        except ContractError as error:  # e.g. a key the API server refuses, which a Binding would store
            return BindResult(Outcome.UNWRITABLE, str(error), "invalid")
        if self._mode is BindMode.ATOMIC:
            return await self._bind_atomically(pod, placement=placement, written=written)
        return await self._patch_then_bind(pod, placement=placement, written=written)

    async def _bind_atomically(
        self, pod: Pod, *, placement: Placement, written: dict[str, str]
    ) -> BindResult:
        """One write: the Binding carries the annotations, applied with nodeName in one update."""
        meta = pod.metadata
        version = meta.resourceVersion
        for attempt in range(2):
            if not self._fence():
                return BindResult(Outcome.NOT_LEADER)
            try:
                if not await self._send_binding(
                    pod, node=placement.node, version=version, annotations=written
                ):
                    return BindResult(Outcome.NOT_LEADER)
                return BindResult(Outcome.BOUND)
            except NotFound as error:
                return _write_outcome(error)
            except _API_ERRORS as error:
                # The write may have happened and only its answer been lost: read the pod to know.
                try:
                    current = await self._read_back(meta.name, meta.namespace)
                except NotFound:
                    return BindResult(Outcome.GONE, str(error), _error_reason(error))
                if attempt == 0 and isinstance(error, Conflict) and _only_status_moved(pod, current):
                    # Our own status writes (the PodScheduled condition, a preemptor's nomination) move
                    # the version the informer has not shown yet: the placement still describes the pod.
                    version = current.metadata.resourceVersion  # type: ignore[union-attr]
                    continue
                return _failed_bind(error, current=current, pod=pod, placement=placement, written=written)
        raise AssertionError("unreachable")  # pragma: no cover - the loop always returns

    async def _patch_then_bind(
        self, pod: Pod, *, placement: Placement, written: dict[str, str]
    ) -> BindResult:
        """Two writes: the annotations (preconditioned), then the Binding; the first undone on failure."""
        meta = pod.metadata
        before = meta.annotations or {}
        restore: dict[str, str | None] = {key: before.get(key) for key in written}
        if not self._fence():
            return BindResult(Outcome.NOT_LEADER)
        version = meta.resourceVersion
        if written:
            try:
                patched = await set_annotations(
                    self._client,
                    Pod,
                    name=meta.name,
                    namespace=meta.namespace,
                    annotations=dict(written),
                    resource_version=meta.resourceVersion,
                )
            except Conflict as error:
                # A pod bound since (a Binding of ours whose answer was lost, or another binder's) is
                # told apart from one merely changed: read back, bound means BOUND or BOUND_ELSEWHERE.
                try:
                    current = await self._read_back(meta.name, meta.namespace)
                except NotFound:
                    return BindResult(Outcome.GONE, str(error), "not_found")
                if current is not None and current.spec and current.spec.nodeName:
                    return _failed_bind(error, current=current, pod=pod, placement=placement, written=written)
                return BindResult(Outcome.CONFLICT, str(error), "conflict")
            except _API_ERRORS as error:
                return _write_outcome(error, doing="annotating failed: ")
            version = patched.metadata.resourceVersion
        if not self._fence():
            await self._roll_back(pod, restore=restore, written=written, version=version)
            return BindResult(Outcome.NOT_LEADER)
        try:
            if not await self._send_binding(pod, node=placement.node, version=version, annotations=None):
                await self._roll_back(pod, restore=restore, written=written, version=version)
                return BindResult(Outcome.NOT_LEADER)
            return BindResult(Outcome.BOUND)
        except NotFound as error:
            return _write_outcome(error)
        except _API_ERRORS as error:
            current = await self._roll_back(pod, restore=restore, written=written, version=version)
            return _failed_bind(error, current=current, pod=pod, placement=placement, written=written)

    async def _roll_back(
        self, pod: Pod, *, restore: dict[str, str | None], written: dict[str, str], version: str | None
    ) -> Pod | None:
        """Undo ``written``; returns the pod as last read when that shows it bound, else None."""
        if not written:
            return None
        meta = pod.metadata
        patch = dict(restore)
        for _ in range(_ROLLBACK_ATTEMPTS):
            try:
                await set_annotations(
                    self._client,
                    Pod,
                    name=meta.name,
                    namespace=meta.namespace,
                    annotations=patch,
                    resource_version=version,
                )
                return None
            except NotFound:
                return None
            except Conflict:
                pass
            except _API_ERRORS as error:
                log.warning("rollback of %s/%s failed: %s", meta.namespace, meta.name, error)
            try:
                current = await self._read_back(meta.name, meta.namespace)
            except NotFound:
                return None
            if current is None:
                continue
            if current.spec and current.spec.nodeName:
                return current
            now = current.metadata.annotations or {}
            patch = {k: v for k, v in restore.items() if now.get(k) == written[k]}
            if not patch:
                return None
            version = current.metadata.resourceVersion
        log.error(
            "could not roll back the annotations of %s/%s; it is cleaned before it is placed again",
            meta.namespace,
            meta.name,
        )
        return None

    async def _send_binding(
        self, pod: Pod, *, node: str, version: str | None, annotations: dict[str, str] | None
    ) -> bool:
        """POST the Binding. A 429 is the API server shedding load before it ran the request (priority
        and fairness): it is sent again after the server's ``Retry-After``, as client-go does for
        kube-scheduler, instead of failing the bind (a FailedBinding Warning, the GPUs released and the
        pod placed again, sooner than the server asked). False: the lease was lost while waiting."""
        meta = pod.metadata
        throttled = 0
        while True:
            try:
                await bind_pod(
                    self._client,
                    name=meta.name,
                    namespace=meta.namespace,
                    node=node,
                    uid=meta.uid,
                    resource_version=version,
                    annotations=annotations,
                )
                return True
            except TooManyRequests as error:
                if throttled == _THROTTLED_RETRIES:
                    raise
                throttled += 1
                log.info(
                    "binding %s/%s throttled (%s); sent again in %.1fs",
                    meta.namespace,
                    meta.name,
                    error,
                    error.wait_s,
                )
                await asyncio.sleep(error.wait_s)
            if not self._fence():
                return False

    async def _read_back(self, name: str, namespace: str) -> Pod | None:
        """The pod as the API holds it now, asked again (with backoff, for ``read_back_s``) while the API
        server fails to answer; None when it never did. Raises ``NotFound`` when the pod is gone.

        Only this read tells whether a Binding whose answer was lost landed. Until it answers, the pod's
        booking stays held (its bind is in flight), because releasing it on a guess would hand its GPUs
        to the next pod while the API may already show this one bound to them.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._read_back_s
        delay = 0.1
        while True:
            try:
                with api_errors():
                    return await self._client.get(Pod, name, namespace=namespace)
            except NotFound:
                raise
            except _API_ERRORS as error:
                if loop.time() + delay > deadline:
                    log.warning(
                        "cannot read back %s/%s: %s; its bind's outcome is unknown", namespace, name, error
                    )
                    return None
                log.info("cannot read back %s/%s (%s); asking again in %.1fs", namespace, name, error, delay)
            await asyncio.sleep(delay)
            delay = min(2.0, delay * 2)

    async def clean_stale(self, pod: Pod) -> BindResult:
        """Remove the keys a dead binder left on an unbound pod (at its current version)."""
        meta = pod.metadata
        removal = stale_binding_keys(meta.annotations or {})
        if not removal:
            return BindResult(Outcome.CLEANED)
        if not self._fence():
            return BindResult(Outcome.NOT_LEADER)
        try:
            await set_annotations(
                self._client,
                Pod,
                name=meta.name,
                namespace=meta.namespace,
                annotations=dict(removal),
                resource_version=meta.resourceVersion,
            )
        except _API_ERRORS as error:
            return _write_outcome(error)
        log.info("cleaned binder-owned annotations left on unbound pod %s/%s", meta.namespace, meta.name)
        return BindResult(Outcome.CLEANED)
