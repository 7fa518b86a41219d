"""Which MPS the node runs, and which compute modes it can therefore enforce.

The mode follows the driver: MPS v3 (namespaces, per-process memory accounting) ships with r615
(CUDA 13.4); anything older gets classic MPS. The capability is derived from what is *running*, not
from what could run: a node whose daemon is down or failing to come up stops advertising sm-sharing,
because a container placed there would get neither its thread ceiling nor its memory cap.

Enforcement per mode (what the capability encodes):

- v3 (r615+): time-slicing memory is enforced by the cgroup GPU-memory limit (toolkit hook), sm-sharing
  by a namespace on the shared server (thread ceiling, pinned memory, memacct). Both modes.
- classic (< r615): sm-sharing containers are MPS clients with ``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`` and
  ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE``; time-slicing containers are not MPS clients and nothing on such a
  driver caps their memory, so time-slicing is not advertised.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import StrEnum

from gpufrac.contract import keys
from gpufrac.contract.request import ComputeMode

#: Which MPS control daemon serves on the node (``v3``, ``classic`` or ``none``), for operators.
MPS_LABEL = "gpufrac.io/mps"

V3_MIN_DRIVER_MAJOR = 615


class MpsMode(StrEnum):
    V3 = "v3"
    CLASSIC = "classic"


@dataclass(frozen=True, slots=True, order=True)
class DriverVersion:
    """An NVIDIA driver version as NVML reports it (``615.12.01``, ``580.65.06``)."""

    major: int
    minor: int = 0
    patch: int = 0

    @classmethod
    def parse(cls, text: str) -> DriverVersion:
        match = re.fullmatch(r"\s*(\d+)(?:\.(\d+))?(?:\.(\d+))?\s*", text)
        if match is None:
            raise ValueError(f"driver version {text!r} is not of the form MAJOR[.MINOR[.PATCH]]")
        major, minor, patch = (int(part) if part else 0 for part in match.groups())
        return cls(major=major, minor=minor, patch=patch)

    def __str__(self) -> str:
        return f"{self.major}.{self.minor:02d}.{self.patch:02d}"


def mode_for_driver(version: DriverVersion) -> MpsMode:
    """r615 and newer run MPS v3; older drivers run classic MPS."""
    return MpsMode.V3 if version.major >= V3_MIN_DRIVER_MAJOR else MpsMode.CLASSIC


@dataclass(frozen=True, slots=True)
class NodeMpsCapability:
    """What the node can enforce right now; published by the inventory publisher as labels.

    ``enforceable`` is the set the placement engine filters on. ``mps_running`` is False while the daemon
    is down beyond its grace (see ``capability_for``).
    """

    driver: DriverVersion
    mode: MpsMode
    mps_running: bool
    enforceable: frozenset[ComputeMode]

    def labels(self) -> dict[str, str]:
        """Node labels: one boolean per compute mode plus the MPS mode that is running."""
        out = {
            keys.COMPUTE_MODE_LABEL_PREFIX + m.value: str(m in self.enforceable).lower() for m in ComputeMode
        }
        out[MPS_LABEL] = self.mode.value if self.mps_running else "none"
        return out


def capability_for(*, driver: DriverVersion, mps_running: bool) -> NodeMpsCapability:
    """The capability of a node with this driver, given whether its MPS daemon is serving."""
    mode = mode_for_driver(driver)
    enforceable: set[ComputeMode] = set()
    if mode is MpsMode.V3:
        enforceable.add(ComputeMode.TIME_SLICING)
    if mps_running:
        enforceable.add(ComputeMode.SM_SHARING)
    return NodeMpsCapability(
        driver=driver, mode=mode, mps_running=mps_running, enforceable=frozenset(enforceable)
    )
