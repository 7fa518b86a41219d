"""SIMULATED GPU inventory: GPUs described by a small YAML file or a flag, for tests and ``gpufrac up``.

Nothing here touches a GPU. The simulation can change while the agent runs, as a real node does when
a GPU falls off the bus or an operator enables MIG: in-process through ``remove_gpu`` / ``set_mig``, or
from outside by editing the YAML file, which is re-read whenever its modification time changes.

YAML::

    driver: 615.20.01          # NVIDIA driver version (decides the MPS mode and the driver-major label)
    cuda: "13.4"               # CUDA version the driver supports (informational)
    gpus:
      - {count: 4, model: H100-80GB}          # MiB from the model table below
      - {model: A100-80GB, mig: true}          # MIG enabled, no slices yet
      - {model: H100-80GB, mig: true, layout: ["3g.40gb@0", "2g.20gb@4", "1g.10gb@6"]}
      - {uuid: GPU-1234..., model: T4-16GB, reserved_mib: 450}   # an explicit UUID (count 1)
      - {model: L4-24GB, xid: 79}             # a GPU with a fatal XID since its last reset
      - {model: L4-24GB, lost: true}          # a GPU fallen off the bus

``reserved_mib`` SIMULATES what the driver reports as reserved for itself (NVML memory info v2); the
simulated driver reports 0 unless told, so a simulated GPU's usable memory is its total unless a test or
file says otherwise. Faults are SIMULATED too: ``set_xid`` (a critical XID event, as NVML's event set
delivers it), ``set_lost`` (GPU_IS_LOST), and ``reset_gpu`` (the GPU reset that clears an XID).

MIG is SIMULATED with each model's real profiles and placement rules (``gpufrac.mig``): ``mig: true``
needs a model with MIG tables (A100-40GB, A100-80GB, H100-80GB, H200-141GB), ``layout`` lists its GPU
instances as ``<profile>@<start>`` and must be a valid layout. The backend is also the SIMULATED
``MigControl`` (``gpufrac.node.mig.control``) with NVML's semantics: a MIG mode change is pending until
``reset_gpu`` (as on an A100, MIG User Guide "Deployment Considerations"; ``resetless=True`` makes it
immediate, as a driver that resets an idle GPU itself), a slice that overlaps another fails with
INSUFFICIENT_RESOURCES, and MIG cannot be disabled while slices exist (IN_USE). MIG device UUIDs are derived
from the GPU's UUID and the slice (``simulated_mig_uuid``), so a slice recreated where it was has the UUID
it had; with ``mig_state`` (the agent gives ``<state_dir>/sim-mig.json``) the MIG state outlives the agent
as the hardware's does, so a restarted agent finds what its predecessor made. ``crash_before(n)``
SIMULATES the agent being killed: the n-th MIG operation from then raises ``SimulatedCrash`` (not an
``Exception``: nothing in the agent catches it) before it changes anything.

Flag (``--sim-gpus``): ``COUNTxMODEL[:MIB|:mig]`` groups separated by commas, e.g. ``8xH100-80GB``,
``2xA100-40GB,1xL4-24GB:23034`` or ``2xH100-80GB,2xH100-80GB:mig`` (MIG enabled, no slices yet).

UUIDs not given are derived from the node name and GPU index (uuid5), the same derivation as the
simulated nodes of ``gpufrac.local.simnodes``, so a node agent that takes over a simulated node keeps
its GPUs' identities -- as a real machine does across agent restarts.
"""

from __future__ import annotations

import json
import os
import threading
import uuid
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import yaml

from gpufrac.mig.geometry import MigLayoutError, Slice, check_layout
from gpufrac.mig.profiles import mig_model
from gpufrac.node.inventory.backend import (
    APPLICATION_XIDS,
    GpuInfo,
    InventoryUnavailable,
    MigSliceInfo,
    NodeInventory,
    NvmlComputeMode,
)
from gpufrac.node.mig.control import MigControlError

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


def simulated_mig_uuid(gpu_uuid: str, slice_: Slice) -> str:
    """The MIG device UUID of a simulated slice: the same GPU and slice always give the same one."""
    return f"MIG-{uuid.uuid5(_UUID_NAMESPACE, f'{gpu_uuid}/{slice_}')}"


class SimulatedCrash(BaseException):
    """The node agent killed between two MIG steps (SIMULATED; a BaseException so nothing catches it)."""


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
    layout: tuple[str, ...] = ()


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
    """``8xH100-80GB`` / ``2xA100-40GB,1xL4-24GB:23034`` / ``1xA100-80GB:mig`` (MIG on) -> a spec."""
    gpus: list[SimGpu] = []
    for group in filter(None, (g.strip() for g in text.split(","))):
        count_text, sep, rest = group.partition("x")
        if not sep or not count_text.isdigit():
            raise ValueError(f"--sim-gpus group {group!r} is not COUNTxMODEL[:MIB]")
        model, _, mib = rest.partition(":")
        mig = mib == "mig"
        gpu = SimGpu(model=model, mib=_model_mib(model, None if mig else mib or None), mig=mig)
        _check_mig(gpu)
        gpus += [gpu] * int(count_text)
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
            layout=tuple(str(t) for t in entry.get("layout") or ()),
        )
        _check_mig(gpu)
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


def _check_mig(gpu: SimGpu) -> None:
    """``mig`` and ``layout`` of a simulated GPU: a MIG model, a valid layout (one sentence otherwise)."""
    if not gpu.mig and not gpu.layout:
        return
    model = mig_model(gpu.model)
    if model is None:
        raise ValueError(
            f"mig=true on model {gpu.model!r} is invalid: MIG is simulated for A100-40GB, A100-80GB, "
            "H100-80GB and H200-141GB only"
        )
    if not gpu.mig:
        raise ValueError(f"layout={list(gpu.layout)} is invalid: a MIG layout needs mig: true")
    try:
        check_layout(model, [Slice.parse(t) for t in gpu.layout])
    except MigLayoutError as exc:
        raise ValueError(f"layout={list(gpu.layout)} is invalid: {exc}") from None


class SimulatedInventory:
    """A ``GpuInventoryBackend`` over a ``SimSpec`` that tests (or a file) may change at any time."""

    def __init__(
        self,
        *,
        node_name: str,
        spec: SimSpec | None = None,
        config: Path | None = None,
        resetless: bool = False,
        mig_state: Path | None = None,
    ) -> None:
        """``resetless``: a MIG mode change takes effect at once (the driver resets the idle GPU itself).
        ``mig_state``: a file that keeps the GPUs' MIG state (mode, pending mode, slices) across agent
        restarts, as the hardware does; read once here, written after every MIG change."""
        self._resetless = resetless
        self._mig_state = mig_state
        self._crash_in: int | None = None
        #: Every MIG operation that changed something, in order: ("create", uuid, "3g.40gb@0"), ...
        self.mig_operations: list[tuple[str, str, str]] = []
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
        self._restore_mig()

    def _restore_mig(self) -> None:
        """The MIG state an earlier agent left on the simulated GPUs (a new agent on the same machine)."""
        if self._mig_state is None or not self._mig_state.exists():
            return
        try:
            saved = json.loads(self._mig_state.read_text())
            for gpu in list(self._gpus):
                state = saved.get(gpu.uuid)
                if state is None or mig_model(gpu.model) is None:
                    continue
                layout = tuple(str(t) for t in state["slices"])
                self._put(
                    replace(
                        gpu,
                        mig=bool(state["mig"]),
                        mig_pending=bool(state["pending"]),
                        mig_slices=_slices(gpu.uuid, gpu.model, layout),
                    )
                )
        except (OSError, ValueError, KeyError, TypeError, MigLayoutError) as exc:
            raise InventoryUnavailable(f"simulated MIG state {self._mig_state}: {exc}") from exc

    def _save_mig(self) -> None:
        if self._mig_state is None:
            return
        state = {
            g.uuid: {
                "mig": g.mig,
                "pending": g.mig_pending_mode,
                "slices": [s.slice_name for s in g.mig_slices],
            }
            for g in self._gpus
            if mig_model(g.model) is not None
        }
        tmp = self._mig_state.with_name(f".{self._mig_state.name}.tmp")
        tmp.write_text(json.dumps(state, sort_keys=True))
        os.replace(tmp, self._mig_state)

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
                mig_pending=gpu.mig,
                mig_slices=_slices(gpu.uuid or simulated_uuid(self._node, index), gpu.model, gpu.layout),
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
        """An operator enabled (or disabled) MIG and reset the GPU: no slices yet."""
        self._change(uuid_or_index, mig=enabled, mig_pending=enabled, mig_slices=())

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
        """A GPU reset: its XID is cleared and a pending MIG mode becomes current (``MigControl``)."""
        self._step()
        with self._lock:
            gpu = self._find(uuid_or_index)
            mode = gpu.mig_pending_mode
            slices = gpu.mig_slices if mode else ()
            self._put(replace(gpu, xid=None, mig=mode, mig_pending=mode, mig_slices=slices))
            self.mig_operations.append(("reset", gpu.uuid, "mig" if mode else "no mig"))
            self._save_mig()

    # -- the SIMULATED MigControl (gpufrac.node.mig.control) ---------------------------------------------

    def crash_before(self, operations: int) -> None:
        """The ``operations``-th MIG operation from now raises ``SimulatedCrash`` instead of running."""
        self._crash_in = operations

    def _step(self) -> None:
        if self._crash_in is not None:
            self._crash_in -= 1
            if self._crash_in <= 0:
                self._crash_in = None
                raise SimulatedCrash("the node agent was killed (simulated) before this MIG step")

    def _find(self, uuid_or_index: str | int) -> GpuInfo:
        gpu = next((g for g in self._gpus if uuid_or_index in (g.uuid, g.index)), None)
        if gpu is None:
            raise MigControlError("NVML_ERROR_NOT_FOUND", f"no GPU {uuid_or_index} on this node")
        return gpu

    def _put(self, gpu: GpuInfo) -> None:
        self._gpus = [gpu if g.uuid == gpu.uuid else g for g in self._gpus]

    def set_mig_mode(self, gpu: str, enabled: bool) -> bool:
        self._step()
        with self._lock:
            info = self._find(gpu)
            if mig_model(info.model) is None:
                raise MigControlError("NVML_ERROR_NOT_SUPPORTED", f"{info.model} {gpu} has no MIG")
            if not enabled and info.mig_slices:
                raise MigControlError(
                    "NVML_ERROR_IN_USE", f"GPU {gpu} still has GPU instances: destroy them first"
                )
            now = enabled if self._resetless else info.mig
            self._put(replace(info, mig=now, mig_pending=enabled))
            self.mig_operations.append(("mode", gpu, "mig" if enabled else "no mig"))
            self._save_mig()
            return now != enabled

    def create_slice(self, gpu: str, profile: str, start: int) -> str:
        self._step()
        with self._lock:
            info = self._find(gpu)
            model = mig_model(info.model)
            if model is None or not info.mig:
                raise MigControlError("NVML_ERROR_NOT_SUPPORTED", f"MIG is not enabled on GPU {gpu}")
            wanted = Slice(profile, start)
            if model.profile(profile) is None:
                raise MigControlError(
                    "NVML_ERROR_INVALID_ARGUMENT", f"{model.model} has no GPU instance profile {profile}"
                )
            try:
                check_layout(model, [*(Slice(s.profile, s.start) for s in info.mig_slices), wanted])
            except MigLayoutError as exc:
                raise MigControlError("NVML_ERROR_INSUFFICIENT_RESOURCES", str(exc)) from None
            (created,) = _slices(gpu, info.model, (str(wanted),))
            self._put(replace(info, mig_slices=(*info.mig_slices, created)))
            self.mig_operations.append(("create", gpu, str(wanted)))
            self._save_mig()
            return created.uuid

    def destroy_slice(self, gpu: str, slice_: Slice) -> None:
        self._step()
        with self._lock:
            info = self._find(gpu)
            kept = tuple(s for s in info.mig_slices if (s.profile, s.start) != (slice_.profile, slice_.start))
            if len(kept) == len(info.mig_slices):
                raise MigControlError("NVML_ERROR_NOT_FOUND", f"GPU {gpu} has no GPU instance {slice_}")
            self._put(replace(info, mig_slices=kept))
            self.mig_operations.append(("destroy", gpu, str(slice_)))
            self._save_mig()

    def set_reserved(self, uuid_or_index: str | int, mib: int) -> None:
        self._change(uuid_or_index, reserved_mib=mib)

    def set_driver(self, version: str) -> None:
        with self._lock:
            self._driver = version

    def set_unavailable(self, reason: str | None) -> None:
        """Make ``read`` fail as NVML does without a driver (None: working again)."""
        with self._lock:
            self._unavailable = reason


def _slices(gpu_uuid: str, model_name: str, layout: tuple[str, ...]) -> tuple[MigSliceInfo, ...]:
    model = mig_model(model_name)
    if model is None:
        return ()
    out = []
    for text in layout:
        slice_ = Slice.parse(text)
        profile = model.profile(slice_.profile)
        assert profile is not None  # checked by _check_mig / create_slice
        out.append(
            MigSliceInfo(
                profile=slice_.profile,
                start=slice_.start,
                uuid=simulated_mig_uuid(gpu_uuid, slice_),
                mib=profile.memory_mib,
            )
        )
    return tuple(out)
