"""The seam to the driver's per-cgroup GPU memory limit (CUDA 13.4, driver r615+).

NVML keeps, per GPU, a memory limit for a cgroup: ``nvmlDeviceSetMemoryLimits_v1`` and
``nvmlDeviceGetMemoryLimits_v1`` with ``nameSpace`` = the cgroup's full sysfs path, ``softLimit`` = the
bytes guaranteed before allocations may fail under pressure, ``hardLimit`` = the most the cgroup may
allocate, and ``currentUsed`` (get only). No limit reads soft 0 and hard ``NVML_DEVICE_MEMORY_LIMIT_MAX``;
removing the cgroup clears it; MIG handles answer NOT_SUPPORTED, and so does a driver before r615.

``MemoryLimitDriver`` is what the node agent calls; ``NvmlMemoryLimits`` is the REAL one (nvidia-ml-py,
untested here: no GPU in CI; ``scripts/gpu-check`` runs the same calls on hardware) and
``gpufrac.node.memlimit.simulated.SimulatedMemoryLimits`` the SIMULATED one with the same names, fields
and errors, so every caller runs the same code on both.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Protocol

MIB = 1 << 20
#: NVML_DEVICE_MEMORY_LIMIT_MAX: "no hard limit".
LIMIT_MAX = 0xFFFFFFFFFFFFFFFF

#: The NVML return codes the driver gives for these calls (pynvml's NVML_ERROR_* values).
NVML_ERROR_INVALID_ARGUMENT = 2
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_NO_PERMISSION = 4
NVML_ERROR_NOT_FOUND = 6
NVML_ERROR_FUNCTION_NOT_FOUND = 13
NVML_ERROR_GPU_IS_LOST = 15
NVML_ERROR_UNKNOWN = 999

_ERROR_NAMES = {
    NVML_ERROR_INVALID_ARGUMENT: "NVML_ERROR_INVALID_ARGUMENT",
    NVML_ERROR_NOT_SUPPORTED: "NVML_ERROR_NOT_SUPPORTED",
    NVML_ERROR_NO_PERMISSION: "NVML_ERROR_NO_PERMISSION",
    NVML_ERROR_NOT_FOUND: "NVML_ERROR_NOT_FOUND",
    NVML_ERROR_FUNCTION_NOT_FOUND: "NVML_ERROR_FUNCTION_NOT_FOUND",
    NVML_ERROR_GPU_IS_LOST: "NVML_ERROR_GPU_IS_LOST",
    NVML_ERROR_UNKNOWN: "NVML_ERROR_UNKNOWN",
}


class MemoryLimitError(Exception):
    """The driver refused a set or a get; ``code`` is NVML's return code, the message its meaning."""

    def __init__(self, code: int, detail: str) -> None:
        super().__init__(f"{_ERROR_NAMES.get(code, f'NVML error {code}')}: {detail}")
        self.code = code


@dataclass(frozen=True, slots=True)
class MemoryLimits:
    """What the driver holds for one cgroup on one GPU (bytes)."""

    soft: int
    hard: int
    current_used: int = 0

    @property
    def unlimited(self) -> bool:
        return self.soft == 0 and self.hard == LIMIT_MAX


class MemoryLimitDriver(Protocol):
    """Per-GPU, per-cgroup memory limits. ``gpu`` is a GPU UUID; ``cgroup`` the full sysfs path."""

    def set_limits(self, *, gpu: str, cgroup: str, soft: int, hard: int) -> None:
        """Raises ``MemoryLimitError`` when the driver refuses."""
        ...

    def get_limits(self, *, gpu: str, cgroup: str) -> MemoryLimits:
        """Raises ``MemoryLimitError`` when the driver refuses."""
        ...


def clear_limits(driver: MemoryLimitDriver, *, gpu: str, cgroup: str) -> None:
    """No limit: soft 0, hard NVML_DEVICE_MEMORY_LIMIT_MAX."""
    driver.set_limits(gpu=gpu, cgroup=cgroup, soft=0, hard=LIMIT_MAX)


class NvmlMemoryLimits:
    """REAL: the two NVML calls through nvidia-ml-py, one handle per GPU UUID (NVML is initialised once)."""

    def __init__(self) -> None:
        import pynvml  # imported here so the simulated path never loads libnvidia-ml

        self._nvml: Any = pynvml
        pynvml.nvmlInit()
        self._handles: dict[str, Any] = {}
        self._lock = threading.Lock()

    def close(self) -> None:
        self._nvml.nvmlShutdown()

    def _handle(self, gpu: str) -> Any:
        with self._lock:
            handle = self._handles.get(gpu)
            if handle is None:
                handle = self._handles[gpu] = self._call(self._nvml.nvmlDeviceGetHandleByUUID, gpu)
            return handle

    def _call(self, fn: Any, *args: Any) -> Any:
        try:
            return fn(*args)
        except self._nvml.NVMLError as exc:
            raise MemoryLimitError(int(exc.value), str(exc)) from exc

    def set_limits(self, *, gpu: str, cgroup: str, soft: int, hard: int) -> None:
        limits = self._nvml.c_nvmlSetMemoryLimits_v1_t()
        limits.nameSpace = cgroup.encode()
        limits.softLimit = soft
        limits.hardLimit = hard
        self._call(self._nvml.nvmlDeviceSetMemoryLimits_v1, self._handle(gpu), limits)

    def get_limits(self, *, gpu: str, cgroup: str) -> MemoryLimits:
        limits = self._nvml.c_nvmlGetMemoryLimits_v1_t()
        limits.nameSpace = cgroup.encode()
        self._call(self._nvml.nvmlDeviceGetMemoryLimits_v1, self._handle(gpu), limits)
        return MemoryLimits(
            soft=int(limits.softLimit), hard=int(limits.hardLimit), current_used=int(limits.currentUsed)
        )
