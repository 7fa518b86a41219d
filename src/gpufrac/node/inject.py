"""A pod's annotations -> what one of its containers gets before its process starts (pure, no I/O).

The NRI plugin applies this plan at CreateContainer; the audit recomputes it for running containers and
compares. Both call ``plan_container``, so what is injected and what is checked are one rule.

The annotations are read by the contract's narrow reader for bound pods
(``gpufrac.contract.render.read_binding``, the inverse of what the binder renders) and nowhere else: the
node enforces what the binder wrote (devices, request/limit in MiB, compute portion), never re-derives it
from the user's request. A pod that breaks the contract, or is not placed, raises ``InvalidPodRequest``
whose message names the key, the value and the rule.

What a container gets (docs/node-agent.md has the same table for operators):

================================== ===================================================================
``NVIDIA_VISIBLE_DEVICES``         the assigned devices (``.gpus.devices``): GPU UUIDs or CDI names
``NVIDIA_GPU_MEMORY_REQUEST``      guaranteed MiB per device (fractional only)
``NVIDIA_GPU_MEMORY_LIMIT``        limit MiB per device (fractional only; both always: the toolkit hook
                                   ignores one alone)
``CUDA_MPS_PIPE_DIRECTORY``        the container's own MPS directory, a bind mount of a per-container
                                   leaf directory on the host (fractional only)
``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`` ``0=<limit>M,1=<limit>M,...``: ordinals as the container sees its
                                   devices (fractional only)
``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` floor(portion x 100), at least 1 (sm-sharing with a portion)
CDI devices                        every CDI name among the devices is also requested from the runtime,
                                   and with ``cdi_kind`` (the agent's default ``nvidia.com/gpu``) every
                                   UUID or index as ``<cdi_kind>=<device>``
================================== ===================================================================

A container on MIG slices (``BoundContainer.mig``: its devices are MIG device UUIDs, ``MIG-…``;
docs/mig.md) gets only ``NVIDIA_VISIBLE_DEVICES`` and its slices as CDI devices
(``nvidia.com/gpu=MIG-…``): no memory variables, no MPS directory or variables. The hardware isolates a
slice's memory and SMs; an MPS client would need the slice's own MPS daemon, which gpufrac does not run.

Why the CDI request for UUIDs: the operator requirement (docs/node-agent.md) sets the NVIDIA toolkit to
ignore ``NVIDIA_VISIBLE_DEVICES`` in unprivileged containers, so the variable alone would give the
container no GPU; the toolkit's CDI spec for the device is what adds the device nodes, libraries and the
memory-limit hook. The variable is still set (the legacy path, and the audit's record of what was
assigned); the toolkit's spec overwrites it with ``void``, which grants nothing.

Any of these variables the container already has (set by the user, or by a plugin before ours) is
removed first, so nothing a user writes in a manifest can widen what the scheduler granted.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from gpufrac.contract.errors import ContractError
from gpufrac.contract.render import BoundContainer, read_binding
from gpufrac.contract.request import ComputeMode

NVIDIA_VISIBLE_DEVICES = "NVIDIA_VISIBLE_DEVICES"
NVIDIA_GPU_MEMORY_REQUEST = "NVIDIA_GPU_MEMORY_REQUEST"
NVIDIA_GPU_MEMORY_LIMIT = "NVIDIA_GPU_MEMORY_LIMIT"
CUDA_MPS_PIPE_DIRECTORY = "CUDA_MPS_PIPE_DIRECTORY"
CUDA_MPS_PINNED_DEVICE_MEM_LIMIT = "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"
CUDA_MPS_ACTIVE_THREAD_PERCENTAGE = "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"

#: Every variable gpufrac owns in a GPU container; one the plan does not set must be absent.
ENFORCEMENT_ENV = (
    NVIDIA_VISIBLE_DEVICES,
    NVIDIA_GPU_MEMORY_REQUEST,
    NVIDIA_GPU_MEMORY_LIMIT,
    CUDA_MPS_PIPE_DIRECTORY,
    CUDA_MPS_PINNED_DEVICE_MEM_LIMIT,
    CUDA_MPS_ACTIVE_THREAD_PERCENTAGE,
)

#: The variables that carry a container's amounts. They are fixed when the container is created; a live
#: resize (``gpufrac.node.resize``) changes the pod's binding and the cgroup's limits, not a running
#: container's environment, so a resized container's values differ from its current plan.
AMOUNT_ENV = (
    NVIDIA_GPU_MEMORY_REQUEST,
    NVIDIA_GPU_MEMORY_LIMIT,
    CUDA_MPS_PINNED_DEVICE_MEM_LIMIT,
    CUDA_MPS_ACTIVE_THREAD_PERCENTAGE,
)

#: Where a container sees its MPS directory (the MPS supervisor's ``container_pipe_dir`` default).
CONTAINER_PIPE_DIR = "/run/nvidia/mps"
PIPE_MOUNT_OPTIONS = ("rbind", "rw", "nosuid", "nodev")

# vendor/class=name, as the CDI specification spells a fully-qualified device name
_CDI_KIND = r"[A-Za-z0-9][A-Za-z0-9.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*"
_CDI_NAME = re.compile(_CDI_KIND + r"=[A-Za-z0-9_.:-]+")
CDI_KIND_PATTERN = re.compile(_CDI_KIND)


@dataclass(frozen=True, slots=True)
class Mount:
    source: str
    destination: str
    options: tuple[str, ...] = PIPE_MOUNT_OPTIONS


@dataclass(frozen=True, slots=True)
class InjectionPlan:
    """Everything the node does to one GPU container at creation: the binding it enforces (``bound``, as
    the contract reads it; the node records it) and what that becomes in the container."""

    bound: BoundContainer
    env: tuple[tuple[str, str], ...]
    mounts: tuple[Mount, ...]
    cdi_devices: tuple[str, ...]

    @property
    def env_map(self) -> dict[str, str]:
        return dict(self.env)


def is_cdi_name(device: str) -> bool:
    """``nvidia.com/gpu=0`` is a CDI name; ``GPU-8f3c...`` (a UUID) is not."""
    return _CDI_NAME.fullmatch(device) is not None


#: How NVML spells a MIG device's UUID (``nvmlDeviceGetUUID`` on a MIG handle, R470 and later).
MIG_UUID_PREFIX = "MIG-"


def device_name(device: str) -> str:
    """The UUID or index a device names: the part after ``=`` of a CDI name, else the device."""
    return device.partition("=")[2] if is_cdi_name(device) else device


def is_mig_device(device: str) -> bool:
    """``MIG-…`` or a CDI name of one: a MIG slice, not a GPU."""
    return device_name(device).startswith(MIG_UUID_PREFIX)


def active_thread_percentage(portion: float) -> int:
    """An sm-sharing compute portion as MPS's active-thread percentage: floored, at least 1.

    Rounded to 6 places before flooring so that 0.29 (28.999999999999996 x 100 in binary) gives 29.
    """
    return min(100, max(1, math.floor(round(portion * 100, 6))))


def pinned_memory_limit(*, limit_mib: int, device_count: int) -> str:
    """``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT``: one ``<ordinal>=<MiB>M`` per device the container sees."""
    return ",".join(f"{ordinal}={limit_mib}M" for ordinal in range(device_count))


def pipe_leaf(*, root: str, container_id: str) -> str:
    """The host directory mounted as a container's MPS directory: one leaf per container, nothing above."""
    return f"{root.rstrip('/')}/{container_id}"


def plan_container(
    *,
    annotations: Mapping[str, str],
    container: str,
    env: Iterable[str] = (),
    pipe_source: str,
    container_pipe_dir: str = CONTAINER_PIPE_DIR,
    cdi_kind: str = "",
) -> tuple[InjectionPlan | None, tuple[str, ...]]:
    """The plan of ``container`` and the enforcement variables to remove from its current ``env``.

    Returns ``(None, ())`` for a container without a GPU ask (nothing is touched). ``env`` is the
    container's ``KEY=value`` list as the runtime hands it over; ``pipe_source`` the host leaf directory
    (``pipe_leaf``). ``cdi_kind`` (``vendor/class``, empty: none) names the CDI device requested for each
    device that is a UUID or an index. Raises ``InvalidPodRequest`` for a pod that breaks the contract or
    is not placed.
    """
    placed = next((c for c in read_binding(annotations) if c.container == container), None)
    if placed is None:
        return None, ()
    plan = plan_bound(
        placed, pipe_source=pipe_source, container_pipe_dir=container_pipe_dir, cdi_kind=cdi_kind
    )
    present = {entry.partition("=")[0] for entry in env}
    return plan, tuple(key for key in ENFORCEMENT_ENV if key in present)


def cdi_requests(devices: Iterable[str], *, cdi_kind: str) -> tuple[str, ...]:
    """The CDI devices to request for ``devices``: CDI names as they are, UUIDs and indices as
    ``<cdi_kind>=<device>`` (none when ``cdi_kind`` is empty)."""
    return tuple(d if is_cdi_name(d) else f"{cdi_kind}={d}" for d in devices if cdi_kind or is_cdi_name(d))


def plan_bound(
    placed: BoundContainer,
    *,
    pipe_source: str,
    container_pipe_dir: str = CONTAINER_PIPE_DIR,
    cdi_kind: str = "",
) -> InjectionPlan:
    """The injection for one placed container, however it was placed: the NRI path reads ``placed`` from
    the binder's annotations (``plan_container``), the DRA path from a claim's allocation
    (``gpufrac.node.dra.prepare``). One planner, so both front doors enforce the same way."""
    devices = placed.devices
    env: list[tuple[str, str]] = [(NVIDIA_VISIBLE_DEVICES, ",".join(devices))]
    mounts: tuple[Mount, ...] = ()
    if not placed.exclusive and not placed.mig:
        assert placed.request_mib is not None and placed.limit_mib is not None  # read_binding guarantees
        env += [
            (NVIDIA_GPU_MEMORY_REQUEST, str(placed.request_mib)),
            (NVIDIA_GPU_MEMORY_LIMIT, str(placed.limit_mib)),
            (CUDA_MPS_PIPE_DIRECTORY, container_pipe_dir),
            (
                CUDA_MPS_PINNED_DEVICE_MEM_LIMIT,
                pinned_memory_limit(limit_mib=placed.limit_mib, device_count=len(devices)),
            ),
        ]
        if placed.mode is ComputeMode.SM_SHARING and placed.compute_portion is not None:
            env.append(
                (CUDA_MPS_ACTIVE_THREAD_PERCENTAGE, str(active_thread_percentage(placed.compute_portion)))
            )
        mounts = (Mount(source=pipe_source, destination=container_pipe_dir),)
    return InjectionPlan(
        bound=placed,
        env=tuple(env),
        mounts=mounts,
        cdi_devices=cdi_requests(devices, cdi_kind=cdi_kind),
    )


class RunningContainer(Protocol):
    """The part of a running container the planner reads (``gpufrac.node.cri.client.RunningContainer``)."""

    @property
    def id(self) -> str: ...
    @property
    def name(self) -> str: ...
    @property
    def pod_annotations(self) -> Mapping[str, str]: ...


class EnvPlanner:
    """The audit's ``InjectionPlanner``: the environment ``plan_container`` gives a running container."""

    managed_keys: frozenset[str] = frozenset(ENFORCEMENT_ENV)

    def __init__(
        self, *, container_pipe_dir: str = CONTAINER_PIPE_DIR, recorded: Callable[[str], bool] | None = None
    ) -> None:
        """``recorded(container_id)``: the agent injected the container and keeps its record, so its
        amount variables may be those it was created with, before a resize (``AMOUNT_ENV``)."""
        self._container_pipe_dir = container_pipe_dir
        self._recorded = recorded or (lambda _container_id: False)

    def amounts_may_differ(self, *, container: RunningContainer) -> bool:
        return self._recorded(container.id)

    def expected_env(self, *, container: RunningContainer) -> Mapping[str, str] | None:
        try:
            plan, _ = plan_container(
                annotations=container.pod_annotations,
                container=container.name,
                pipe_source="",
                container_pipe_dir=self._container_pipe_dir,
            )
        except ContractError:
            return None  # such a container was refused at creation; nothing to compare against
        return None if plan is None else plan.env_map


#: What NVIDIA's generated CDI specs set ``NVIDIA_VISIBLE_DEVICES`` to (``nvidia-ctk cdi generate``).
CDI_SPEC_VISIBLE_DEVICES = "void"


def injection_problems(
    *,
    expected: Mapping[str, str],
    actual: Mapping[str, str],
    managed_keys: Sequence[str] | frozenset[str],
    amounts_may_differ: bool = False,
) -> list[str]:
    """Each way ``actual`` differs from the plan, in words (values compared, not just presence). One rule
    for every judge: the audit (running containers, through CRI), Synchronize (after a reconnection) and
    the NRI validator (a container about to be created, ``gpufrac.node.nri.validator``).

    ``NVIDIA_VISIBLE_DEVICES=void`` where devices are planned is no problem: the NVIDIA toolkit's CDI spec,
    requested for the container's devices (``cdi_requests``), sets it after the plan's variables are
    applied, and ``void`` gives no GPU through the variable.

    ``amounts_may_differ`` (a running container the agent injected and recorded): the amount variables
    (``AMOUNT_ENV``) must be there but may hold the amounts it was created with, since a live resize
    changed the binding after (the cgroup's limits, not these variables, follow it).
    """
    problems = []
    for key, value in sorted(expected.items()):
        if key == NVIDIA_VISIBLE_DEVICES and actual.get(key) == CDI_SPEC_VISIBLE_DEVICES:
            continue
        if key not in actual:
            problems.append(f"{key} missing, want {value!r}")
        elif actual[key] != value and not (amounts_may_differ and key in AMOUNT_ENV):
            problems.append(f"{key}={actual[key]!r}, want {value!r}")
    for key in sorted(set(managed_keys) - expected.keys()):
        if key in actual:
            problems.append(f"{key}={actual[key]!r} set, want it absent")
    return problems
