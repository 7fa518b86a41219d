"""REAL process usage from NVML (nvidia-ml-py). Untested here: no GPU in CI; imported only.

Per GPU, every sample asks NVML for the compute processes (classic and MPS clients; with MPS the
clients are listed by the MPS query, not the plain one) and for the per-process SM utilization samples
newer than the last one seen on that GPU, so each reading covers exactly one interval. NVML raises
NOT_FOUND when no process ran a kernel since the last sample: that is an idle GPU, not an error.
``usedGpuMemory`` is None where the driver hides it (no permission, some MPS setups); such a process is
reported with 0 bytes rather than dropped, so attribution and the unknown-process audit still see it.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
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
        return tuple(self._read(index, handle) for index, handle in enumerate(self._handles))

    def _read(self, index: int, handle: Any) -> GpuProcesses:
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
                for pid, b, sm in _join(used, self._sm_ratios(index, handle))
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


def _join(used: dict[int, int], sm: dict[int, float]) -> list[tuple[int, int, float]]:
    return [(pid, used.get(pid, 0), sm.get(pid, 0.0)) for pid in sorted(used.keys() | sm.keys())]


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value
