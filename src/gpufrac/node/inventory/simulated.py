"""SIMULATED GPU inventory: GPUs described by a small YAML file or a flag, for tests and ``gpufrac up``.

Nothing here touches a GPU. The simulation can change while the agent runs, as a real node does when
a GPU falls off the bus or an operator enables MIG: in-process through ``remove_gpu`` / ``set_mig``, or
from outside by editing the YAML file, which is re-read whenever its modification time changes.

YAML::

    driver: 615.20.01          # NVIDIA driver version (decides the MPS mode and the driver-major label)
    cuda: "13.4"               # CUDA version the driver supports (informational)
    gpus:
      - {count: 4, model: H100-80GB}          # MiB from the model table below
      - {model: L4-24GB, mib: 23034, mig: true}
      - {uuid: GPU-1234..., model: T4-16GB, reserved_mib: 450}   # an explicit UUID (count 1)
      - {model: L4-24GB, xid: 79}             # a GPU with a fatal XID since its last reset
      - {model: L4-24GB, lost: true}          # a GPU fallen off the bus

``reserved_mib`` SIMULATES what the driver reports as reserved for itself (NVML memory info v2); the
simulated driver reports 0 unless told, so a simulated GPU's usable memory is its total unless a test or
file says otherwise. Faults are SIMULATED too: ``set_xid`` (a critical XID event, as NVML's event set
delivers it), ``set_lost`` (GPU_IS_LOST), and ``reset_gpu`` (the GPU reset that clears an XID).

Flag (``--sim-gpus``): ``COUNTxMODEL[:MIB]`` groups separated by commas, e.g. ``8xH100-80GB`` or
``2xA100-40GB,1xL4-24GB:23034``.

UUIDs not given are derived from the node name and GPU index (uuid5), the same derivation as the
simulated nodes of ``gpufrac.local.simnodes``, so a node agent that takes over a simulated node keeps
its GPUs' identities -- as a real machine does across agent restarts.
"""

from __future__ import annotations

import threading
import uuid
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import yaml

from gpufrac.node.inventory.backend import (
    APPLICATION_XIDS,
    GpuInfo,
    InventoryUnavailable,
    NodeInventory,
    NvmlComputeMode,
)

#: Framebuffer MiB as NVML reports it for common data-centre GPUs.
MODEL_MIB: dict[str, int] = {
    "H100-80GB": 81559,
    "H200-141GB": 143771,
    "A100-40GB": 40960,
    "A100-80GB": 81920,
    "L40S-48GB": 46068,
    "L4-24GB": 23034,
    "A10-24GB": 23028,
    "T4-16GB": 15360,
}
DEFAULT_DRIVER = "615.20.01"
DEFAULT_CUDA = "13.4"

_UUID_NAMESPACE = uuid.UUID("6f1b8a52-6a3e-4bb2-9c9e-2a7d0d9b1c11")


def simulated_uuid(node: str, index: int) -> str:
    return f"GPU-{uuid.uuid5(_UUID_NAMESPACE, f'{node}/{index}')}"


@dataclass(frozen=True, slots=True)
class SimGpu:
    model: str
    mib: int
    uuid: str | None = None
    mig: bool = False
    compute_mode: NvmlComputeMode = NvmlComputeMode.DEFAULT
    reserved_mib: int = 0
    xid: int | None = None
    lost: bool = False


@dataclass(frozen=True, slots=True)
class SimSpec:
    driver: str = DEFAULT_DRIVER
    cuda: str = DEFAULT_CUDA
    gpus: tuple[SimGpu, ...] = ()


def _model_mib(model: str, mib: Any) -> int:
    if mib is not None:
        value = int(mib)
        if value <= 0:
            raise ValueError(f"GPU memory must be positive MiB, got {mib!r}")
        return value
    try:
        return MODEL_MIB[model]
    except KeyError:
        raise ValueError(
            f"unknown GPU model {model!r}: give its MiB or use one of {', '.join(MODEL_MIB)}"
        ) from None


def parse_flag(text: str, *, driver: str = DEFAULT_DRIVER) -> SimSpec:
    """``8xH100-80GB`` / ``2xA100-40GB,1xL4-24GB:23034`` -> a spec."""
    gpus: list[SimGpu] = []
    for group in filter(None, (g.strip() for g in text.split(","))):
        count_text, sep, rest = group.partition("x")
        if not sep or not count_text.isdigit():
            raise ValueError(f"--sim-gpus group {group!r} is not COUNTxMODEL[:MIB]")
        model, _, mib = rest.partition(":")
        gpus += [SimGpu(model=model, mib=_model_mib(model, mib or None))] * int(count_text)
    return SimSpec(driver=driver, gpus=tuple(gpus))


def parse_yaml(text: str) -> SimSpec:
    data = yaml.safe_load(text) or {}
    if not isinstance(data, dict):
        raise ValueError("the simulated GPU file must be a mapping with driver, cuda and gpus")
    gpus: list[SimGpu] = []
    for entry in data.get("gpus") or []:
        count = int(entry.get("count", 1))
        model = str(entry.get("model", "H100-80GB"))
        gpu = SimGpu(
            model=model,
            mib=_model_mib(model, entry.get("mib")),
            uuid=entry.get("uuid"),
            mig=bool(entry.get("mig", False)),
            compute_mode=NvmlComputeMode(entry.get("compute_mode", NvmlComputeMode.DEFAULT.value)),
            reserved_mib=int(entry.get("reserved_mib", 0)),
            xid=int(entry["xid"]) if entry.get("xid") is not None else None,
            lost=bool(entry.get("lost", False)),
        )
        if not 0 <= gpu.reserved_mib < gpu.mib:
            raise ValueError(
                f"reserved_mib={gpu.reserved_mib} must be at least 0 and below the GPU's {gpu.mib} MiB"
            )
        if gpu.uuid is not None and count != 1:
            raise ValueError(f"an explicit uuid ({gpu.uuid}) describes one GPU, not {count}")
        gpus += [gpu] * count
    return SimSpec(
        driver=str(data.get("driver", DEFAULT_DRIVER)),
        cuda=str(data.get("cuda", DEFAULT_CUDA)),
        gpus=tuple(gpus),
    )


class SimulatedInventory:
    """A ``GpuInventoryBackend`` over a ``SimSpec`` that tests (or a file) may change at any time."""

    def __init__(self, *, node_name: str, spec: SimSpec | None = None, config: Path | None = None) -> None:
        if (spec is None) == (config is None):
            raise ValueError("give the simulated GPUs as a spec or as a config file, one of them")
        self._node = node_name
        self._config = config
        self._mtime: float | None = None
        self._lock = threading.Lock()
        self._gpus: list[GpuInfo] = []
        self._driver = DEFAULT_DRIVER
        self._cuda = DEFAULT_CUDA
        self._unavailable: str | None = None
        #: Whether this backend holds the (simulated) driver open: from a read until close, as NVML does.
        self.holds_driver = False
        if spec is not None:
            self._apply(spec)
        else:
            self._reload()

    def _apply(self, spec: SimSpec) -> None:
        self._driver, self._cuda = spec.driver, spec.cuda
        self._gpus = [
            GpuInfo(
                uuid=gpu.uuid or simulated_uuid(self._node, index),
                index=index,
                minor=index,
                model=gpu.model,
                mib=gpu.mib,
                compute_mode=gpu.compute_mode,
                mig=gpu.mig,
                reserved_mib=gpu.reserved_mib,
                xid=gpu.xid,
                lost=gpu.lost,
            )
            for index, gpu in enumerate(spec.gpus)
        ]

    def _reload(self) -> None:
        assert self._config is not None
        try:
            mtime = self._config.stat().st_mtime_ns
        except OSError as exc:
            raise InventoryUnavailable(f"simulated GPU file {self._config}: {exc}") from exc
        if mtime == self._mtime:
            return
        try:
            spec = parse_yaml(self._config.read_text())
        except (OSError, ValueError, yaml.YAMLError) as exc:
            raise InventoryUnavailable(f"simulated GPU file {self._config}: {exc}") from exc
        self._apply(spec)
        self._mtime = mtime

    def read(self) -> NodeInventory:
        with self._lock:
            if self._unavailable is not None:
                raise InventoryUnavailable(self._unavailable)
            self.holds_driver = True  # as nvmlInit opens /dev/nvidiactl, until close (nvmlShutdown)
            if self._config is not None:
                self._reload()
            return NodeInventory(
                driver_version=self._driver, cuda_driver_version=self._cuda, gpus=tuple(self._gpus)
            )

    def close(self) -> None:
        self.holds_driver = False

    # -- changes a test makes, as a node would undergo them --------------------------------------------

    def remove_gpu(self, uuid_or_index: str | int) -> None:
        """The GPU is gone (fell off the bus, was taken out)."""
        with self._lock:
            self._gpus = [g for g in self._gpus if uuid_or_index not in (g.uuid, g.index)]

    def set_mig(self, uuid_or_index: str | int, *, enabled: bool = True) -> None:
        with self._lock:
            self._gpus = [
                replace(g, mig=enabled) if uuid_or_index in (g.uuid, g.index) else g for g in self._gpus
            ]

    def _change(self, uuid_or_index: str | int, **fields: Any) -> None:
        with self._lock:
            self._gpus = [
                replace(g, **fields) if uuid_or_index in (g.uuid, g.index) else g for g in self._gpus
            ]

    def set_xid(self, uuid_or_index: str | int, xid: int) -> None:
        """A critical XID event on the GPU, as NVML's event set reports it (application XIDs are not
        recorded, as the NVML backend does not record them)."""
        if xid not in APPLICATION_XIDS:
            self._change(uuid_or_index, xid=xid)

    def set_lost(self, uuid_or_index: str | int, *, lost: bool = True) -> None:
        """The GPU fell off the bus (NVML answers GPU_IS_LOST for it), or is back."""
        self._change(uuid_or_index, lost=lost)

    def reset_gpu(self, uuid_or_index: str | int) -> None:
        """A GPU reset: its XID is cleared."""
        self._change(uuid_or_index, xid=None)

    def set_reserved(self, uuid_or_index: str | int, mib: int) -> None:
        self._change(uuid_or_index, reserved_mib=mib)

    def set_driver(self, version: str) -> None:
        with self._lock:
            self._driver = version

    def set_unavailable(self, reason: str | None) -> None:
        """Make ``read`` fail as NVML does without a driver (None: working again)."""
        with self._lock:
            self._unavailable = reason
