"""SIMULATED process usage: a table the test (or the embedded cluster) controls.

There is no GPU in tests or in ``gpufrac up``; this backend stands in for NVML with the same answers
NVML gives (processes per GPU, used bytes, SM share). A test changes it through methods between
collections; another process can drive it through a JSON file that is re-read on every sample:

    {"gpus": [{"uuid": "GPU-…", "index": 0, "memory_total_bytes": 85899345920,
               "processes": [{"pid": 4242, "used_bytes": 1073741824, "sm_ratio": 0.5}]},
              {"uuid": "MIG-…", "index": 1, "memory_total_bytes": 10468982784,
               "parent_uuid": "GPU-…", "mig_profile": "1g.10gb", "processes": []}]}

An entry with ``parent_uuid`` is a SIMULATED MIG slice of that GPU (its profile in ``mig_profile``), as
the NVML backend reports a real one.

In the node agent (``--usage-backend simulated``) the GPUs themselves come from its simulated inventory
(``gpus``; ``inventory_devices`` turns the inventory's GPUs and MIG slices into the table's devices):
the file then only adds processes, an entry naming a known GPU by ``uuid`` may leave out
``index`` and ``memory_total_bytes``, and no file at all means every GPU is idle.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace
from pathlib import Path

from gpufrac.node.inventory.backend import GpuInfo, GpuMode
from gpufrac.node.usage.backend import GpuProcess, GpuProcesses

MIB = 1024**2


def inventory_devices(gpus: Iterable[GpuInfo]) -> tuple[GpuProcesses, ...]:
    """The inventory's GPUs, and the MIG slices of those in mode ``mig``, without processes: the devices
    the NVML backend would report for the same node (a slice under its MIG UUID, with its parent)."""
    devices: list[GpuProcesses] = []
    for gpu in gpus:
        devices.append(GpuProcesses(uuid=gpu.uuid, index=gpu.index, memory_total_bytes=gpu.mib * MIB))
        if gpu.mode is GpuMode.MIG:
            devices.extend(
                GpuProcesses(
                    uuid=s.uuid,
                    index=gpu.index,
                    memory_total_bytes=s.mib * MIB,
                    parent_uuid=gpu.uuid,
                    mig_profile=s.profile,
                )
                for s in gpu.mig_slices
            )
    return tuple(devices)


class SimulatedUsage:
    """In-memory GPUs and processes; ``sample()`` returns the current table."""

    def __init__(self, *, gpus: Sequence[GpuProcesses] = ()) -> None:
        self._lock = threading.Lock()
        self._gpus: dict[str, GpuProcesses] = {gpu.uuid: gpu for gpu in gpus}

    def add_gpu(
        self,
        *,
        uuid: str,
        index: int,
        memory_total_bytes: int,
        parent_uuid: str | None = None,
        mig_profile: str | None = None,
    ) -> None:
        """A GPU, or with ``parent_uuid`` a MIG slice of that GPU (``index`` is the parent's)."""
        with self._lock:
            self._gpus[uuid] = GpuProcesses(
                uuid=uuid,
                index=index,
                memory_total_bytes=memory_total_bytes,
                parent_uuid=parent_uuid,
                mig_profile=mig_profile,
            )

    def set_process(self, *, gpu: str, pid: int, used_bytes: int, sm_ratio: float = 0.0) -> None:
        """Start ``pid`` on ``gpu`` or change its usage."""
        with self._lock:
            current = self._gpus[gpu]
            others = tuple(p for p in current.processes if p.pid != pid)
            process = GpuProcess(pid=pid, used_bytes=used_bytes, sm_ratio=sm_ratio)
            self._gpus[gpu] = _replace_processes(current, (*others, process))

    def end_process(self, *, pid: int) -> None:
        """``pid`` exits: it leaves every GPU it was on."""
        with self._lock:
            for uuid, current in self._gpus.items():
                kept = tuple(p for p in current.processes if p.pid != pid)
                self._gpus[uuid] = _replace_processes(current, kept)

    def sample(self) -> Sequence[GpuProcesses]:
        with self._lock:
            return tuple(self._gpus.values())


class SimulatedUsageFile:
    """The same table read from a JSON file on every sample (a missing file means no processes).

    ``gpus`` gives the GPUs every sample has (the node agent's inventory); the file's entries are laid
    over them by uuid, and GPUs only the file names are added.
    """

    def __init__(self, *, path: Path | None, gpus: Callable[[], Sequence[GpuProcesses]] = tuple) -> None:
        self._path = path
        self._gpus = gpus

    def sample(self) -> Sequence[GpuProcesses]:
        table = {gpu.uuid: gpu for gpu in self._gpus()}
        try:
            document = json.loads(self._path.read_text()) if self._path is not None else {}
        except FileNotFoundError:
            document = {}
        for gpu in document.get("gpus", ()):
            known = table.get(gpu["uuid"])
            table[gpu["uuid"]] = GpuProcesses(
                uuid=gpu["uuid"],
                index=int(gpu["index"] if known is None or "index" in gpu else known.index),
                memory_total_bytes=int(
                    gpu["memory_total_bytes"]
                    if known is None or "memory_total_bytes" in gpu
                    else known.memory_total_bytes
                ),
                processes=tuple(
                    GpuProcess(
                        pid=int(p["pid"]),
                        used_bytes=int(p["used_bytes"]),
                        sm_ratio=float(p.get("sm_ratio", 0)),
                    )
                    for p in gpu.get("processes", ())
                ),
                parent_uuid=gpu.get("parent_uuid", known.parent_uuid if known is not None else None),
                mig_profile=gpu.get("mig_profile", known.mig_profile if known is not None else None),
            )
        return tuple(table.values())


def _replace_processes(gpu: GpuProcesses, processes: tuple[GpuProcess, ...]) -> GpuProcesses:
    return replace(gpu, processes=processes)
