"""REAL process usage from NVML (nvidia-ml-py). Untested here: no GPU in CI; imported only.

Per GPU, every sample asks NVML for the compute processes (classic and MPS clients; with MPS the
clients are listed by the MPS query, not the plain one) and for the per-process SM utilization samples
newer than the last one seen on that GPU, so each reading covers exactly one interval. NVML raises
NOT_FOUND when no process ran a kernel since the last sample: that is an idle GPU, not an error.
``usedGpuMemory`` is None where the driver hides it (no permission, some MPS setups); such a process is
reported with 0 bytes rather than dropped, so attribution and the unknown-process audit still see it.

A GPU in MIG mode (``nvmlDeviceGetMigMode``) is reported without processes, and each of its MIG devices
(``nvmlDeviceGetMigDeviceHandleByIndex`` up to ``nvmlDeviceGetMaxMigDeviceCount``; an index without a
device raises NOT_FOUND) as a device of its own: its UUID (``MIG-…``), its memory and the processes NVML
lists on the MIG handle, with the parent's UUID and the profile from the MIG device's name
(``nvmlDeviceGetName`` on a MIG handle answers e.g. "NVIDIA H100 80GB HBM3 MIG 1g.10gb", NVML reference).
The slices are read again at every sample: the node agent re-partitions idle GPUs (docs/mig.md).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from gpufrac.node.usage.backend import GpuProcess, GpuProcesses


class NvmlUsage:
    """Reads every GPU NVML can see. Call ``close()`` (or use as a context manager) to shut NVML down."""

    def __init__(self) -> None:
        import pynvml  # nvidia-ml-py; imported here so the simulated path never loads libnvidia-ml

        self._nvml: Any = pynvml
        pynvml.nvmlInit()
        self._handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
        self._last_seen: dict[int, int] = defaultdict(int)

    def __enter__(self) -> NvmlUsage:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._nvml.nvmlShutdown()

    def sample(self) -> Sequence[GpuProcesses]:
        devices: list[GpuProcesses] = []
        for index, handle in enumerate(self._handles):
            slices = self._mig_devices(handle)
            if slices is None:
                devices.append(self._read(index, handle))
                continue
            parent = _text(self._nvml.nvmlDeviceGetUUID(handle))
            devices.append(
                GpuProcesses(
                    uuid=parent,
                    index=index,
                    memory_total_bytes=int(self._nvml.nvmlDeviceGetMemoryInfo(handle).total),
                )
            )
            devices.extend(
                replace(
                    self._read(index, mig, sm_ratios=False),
                    parent_uuid=parent,
                    mig_profile=mig_profile(_text(self._nvml.nvmlDeviceGetName(mig))),
                )
                for mig in slices
            )
        return tuple(devices)

    def _mig_devices(self, handle: Any) -> list[Any] | None:
        """The MIG device handles of a GPU in MIG mode; None for a GPU that is not."""
        nvml = self._nvml
        try:
            current, _pending = nvml.nvmlDeviceGetMigMode(handle)
        except nvml.NVMLError_NotSupported:
            return None
        if current != nvml.NVML_DEVICE_MIG_ENABLE:
            return None
        found = []
        for i in range(nvml.nvmlDeviceGetMaxMigDeviceCount(handle)):
            try:
                found.append(nvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, i))
            except nvml.NVMLError_NotFound:
                continue
        return found

    def _read(self, index: int, handle: Any, *, sm_ratios: bool = True) -> GpuProcesses:
        """One device's processes; ``sm_ratios`` False for a MIG device, which has no per-process
        utilization samples of its own (NVML answers NOT_SUPPORTED there)."""
        nvml = self._nvml
        used: dict[int, int] = {}
        queries = (nvml.nvmlDeviceGetComputeRunningProcesses, nvml.nvmlDeviceGetMPSComputeRunningProcesses)
        for query in queries:
            try:
                for info in query(handle):
                    used.setdefault(info.pid, int(info.usedGpuMemory or 0))
            except nvml.NVMLError_NotSupported:
                continue
        return GpuProcesses(
            uuid=_text(nvml.nvmlDeviceGetUUID(handle)),
            index=index,
            memory_total_bytes=int(nvml.nvmlDeviceGetMemoryInfo(handle).total),
            processes=tuple(
                GpuProcess(pid=pid, used_bytes=b, sm_ratio=sm)
                for pid, b, sm in _join(used, self._sm_ratios(index, handle) if sm_ratios else {})
            ),
        )

    def _sm_ratios(self, index: int, handle: Any) -> dict[int, float]:
        nvml = self._nvml
        try:
            samples = nvml.nvmlDeviceGetProcessUtilization(handle, self._last_seen[index])
        except (nvml.NVMLError_NotFound, nvml.NVMLError_NotSupported):
            return {}
        totals: dict[int, list[float]] = defaultdict(list)
        for s in samples:
            totals[s.pid].append(float(s.smUtil))
            self._last_seen[index] = max(self._last_seen[index], int(s.timeStamp))
        return {pid: min(1.0, sum(v) / len(v) / 100.0) for pid, v in totals.items()}


def mig_profile(device_name: str) -> str | None:
    """The profile in a MIG device's NVML name ("NVIDIA A100-SXM4-40GB MIG 1g.5gb" -> "1g.5gb")."""
    _, marker, profile = device_name.rpartition(" MIG ")
    return profile.strip() or None if marker else None


def _join(used: dict[int, int], sm: dict[int, float]) -> list[tuple[int, int, float]]:
    return [(pid, used.get(pid, 0), sm.get(pid, 0.0)) for pid in sorted(used.keys() | sm.keys())]


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value
