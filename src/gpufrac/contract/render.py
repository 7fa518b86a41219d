"""From a placed request to what others read: the binder's annotations, and the node agent's plan.

The binder writes, per container: the devices, the request and limit in whole MiB (a portion resolved on
the chosen GPU as floor(portion x GPU MiB)), and for sm-sharing the compute portion. Writing the MiB for
every fractional container, not only for portions, makes a bound pod self-describing: the node agent
(ours or the upstream operator's) reads only ``nvidia.com/container.<c>.*`` and never needs the GPU size
or the pod-level KAI forms, and a restarted scheduler books exactly what was booked before.

``render -> parse`` is stable: parsing a pod with the rendered keys and rendering again gives the same
keys (an explicit request wins over ``gpu-fraction`` once devices are assigned).

Every key rendered passes the API server's annotation-key rule (``keys.annotation_key_problem``). The
Binding that carries them is merged into the pod without that check, and a pod holding an invalid key
can never be updated again (not even to remove a finalizer), so an unwritable key is a ``ContractError``
here, and ``parse_pod`` refuses such a pod up front (``unwritable_keys``): the webhook at creation,
``gpufrac validate`` on a manifest, the scheduler as an unschedulable pod.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from gpufrac.contract import keys as k
from gpufrac.contract.errors import InvalidPodRequest, NotPlaced, RuleViolation, UnwritableKey
from gpufrac.contract.quantities import format_mib
from gpufrac.contract.request import ComputeMode, ContainerGpuRequest, PodGpuRequest


@dataclass(frozen=True, slots=True)
class ContainerPlacement:
    """Where one container was placed: its GPUs (``device_count`` of them) and their size.

    ``gpu_mib`` is the memory of the chosen GPUs (the smallest one, if they differ): a portion resolves
    against it. ``compute_portion`` overrides the share derived from the request (sm-sharing only).
    """

    container: str
    devices: tuple[str, ...]
    gpu_mib: int
    compute_portion: float | None = None


def format_portion(portion: float) -> str:
    """A compute portion as written: the shortest text that parses back to the same float."""
    if not 0 < portion <= 1:
        raise ValueError(f"a compute portion must be in (0, 1], got {portion}")
    return repr(float(portion))


def binder_keys(container: ContainerGpuRequest) -> tuple[str, ...]:
    """The keys ``render_binding`` writes for ``container``: devices; request and limit unless
    exclusive; the compute portion for sm-sharing."""
    name = container.container
    written = [k.devices_key(name)]
    if not container.exclusive:
        written += [k.memory_request_key(name), k.memory_limit_key(name)]
    if container.mode is ComputeMode.SM_SHARING:
        written.append(k.compute_portion_key(name))
    return tuple(written)


def _unwritable(container: str, key: str, problem: str) -> UnwritableKey:
    detail = f"the scheduler must write {key}, and {problem}"
    name_part = key.split("/", 1)[-1]
    most = k.QUALIFIED_NAME_MAX_CHARS - (len(name_part) - len(container))
    if len(name_part) > k.QUALIFIED_NAME_MAX_CHARS and most > 0:
        detail += f"; this GPU request allows container names of at most {most} characters"
    return UnwritableKey(key=f"spec.containers[{container}].name", value=container, detail=detail)


def unwritable_keys(request: PodGpuRequest) -> list[RuleViolation]:
    """One ``UnwritableKey`` per container of ``request`` whose binder keys the API server would refuse
    (the first such key of each container)."""
    found: list[RuleViolation] = []
    for container in request.containers:
        for key in binder_keys(container):
            problem = k.annotation_key_problem(key)
            if problem is not None:
                found.append(_unwritable(container.container, key, problem))
                break
    return found


def render_binding(request: PodGpuRequest, placements: Iterable[ContainerPlacement]) -> dict[str, str]:
    """The binder-owned (and resolved) annotations for ``request`` placed as ``placements``.

    Every container of the request needs exactly one placement with ``device_count`` devices; anything
    else is a bug in the caller and raises ``ValueError``. A key the API server would refuse raises
    ``InvalidPodRequest`` (``UnwritableKey``): the pod cannot be placed, and a Binding would store it.
    """
    by_name = {p.container: p for p in placements}
    wanted = {c.container for c in request.containers}
    if set(by_name) != wanted:
        raise ValueError(
            f"placements for {sorted(by_name)} do not match the request's containers {sorted(wanted)}"
        )
    rendered: dict[str, str] = {}
    problems: list[RuleViolation] = []
    for container in request.containers:
        written = _render_container(container, by_name[container.container])
        for key in written:
            problem = k.annotation_key_problem(key)
            if problem is not None:
                problems.append(_unwritable(container.container, key, problem))
                break
        rendered.update(written)
    if problems:
        raise InvalidPodRequest(problems)
    return rendered


def _render_container(container: ContainerGpuRequest, placement: ContainerPlacement) -> dict[str, str]:
    name = container.container
    if len(placement.devices) != container.device_count or len(set(placement.devices)) != len(
        placement.devices
    ):
        raise ValueError(
            f"container {name} needs {container.device_count} distinct devices, got {placement.devices}"
        )
    if placement.gpu_mib < 1:
        raise ValueError(f"container {name}: gpu_mib must be positive, got {placement.gpu_mib}")
    out = {k.devices_key(name): ",".join(placement.devices)}
    if not container.exclusive:
        request_mib = container.request_mib(placement.gpu_mib)
        limit_mib = max(request_mib, container.limit_mib(placement.gpu_mib))
        out[k.memory_request_key(name)] = format_mib(request_mib)
        out[k.memory_limit_key(name)] = format_mib(limit_mib)
    if container.mode is ComputeMode.SM_SHARING:
        portion = placement.compute_portion
        if portion is None:
            portion = container.compute_portion
        if portion is None:
            portion = container.compute_portion_on(placement.gpu_mib)
        assert portion is not None  # sm-sharing always has a share
        out[k.compute_portion_key(name)] = format_portion(portion)
    return out


@dataclass(frozen=True, slots=True)
class ContainerPlan:
    """What the node agent enforces for one container: the devices and, per device, MiB and compute.

    ``request_mib``/``limit_mib`` are None for an exclusive container (it owns whole GPUs, nothing to
    cap); ``compute_portion`` is None unless sm-sharing.
    """

    container: str
    devices: tuple[str, ...]
    mode: ComputeMode
    request_mib: int | None
    limit_mib: int | None
    compute_portion: float | None
    exclusive: bool


def node_plan(request: PodGpuRequest) -> tuple[ContainerPlan, ...]:
    """The plan of a bound pod; raises ``InvalidPodRequest`` (``NotPlaced``) for what it cannot enforce.

    A container is enforceable once it has devices and, unless exclusive, its memory in MiB (a portion
    that the binder has not resolved cannot be enforced: the node agent does not guess the GPU size).
    """
    plans: list[ContainerPlan] = []
    problems: list[RuleViolation] = []
    for container in request.containers:
        name = container.container
        if not container.devices:
            problems.append(NotPlaced(key=k.devices_key(name), value="", detail="no devices are assigned"))
            continue
        if container.exclusive:
            plans.append(
                ContainerPlan(
                    container=name,
                    devices=container.devices,
                    mode=container.mode,
                    request_mib=None,
                    limit_mib=None,
                    compute_portion=container.compute_portion,
                    exclusive=True,
                )
            )
            continue
        request_mib = container.request.mib if container.request is not None else None
        limit_mib = container.limit.mib if container.limit is not None else request_mib
        if request_mib is None or limit_mib is None:
            problems.append(
                NotPlaced(
                    key=k.memory_request_key(name),
                    value="",
                    detail="the memory portion is not resolved to MiB",
                )
            )
            continue
        plans.append(
            ContainerPlan(
                container=name,
                devices=container.devices,
                mode=container.mode,
                request_mib=request_mib,
                limit_mib=limit_mib,
                compute_portion=container.compute_portion,
                exclusive=False,
            )
        )
    if problems:
        raise InvalidPodRequest(problems)
    return tuple(plans)
