"""SIMULATED: the driver's per-cgroup GPU memory limits, with NVML's names, fields and errors.

There is no GPU here, so this stands in for ``nvmlDeviceSetMemoryLimits_v1`` / ``_GetMemoryLimits_v1``
(``gpufrac.node.memlimit.driver``) and answers as the driver does:

- a driver before r615, or a MIG-enabled GPU's handle: NVML_ERROR_NOT_SUPPORTED;
- a GPU the node does not have: NVML_ERROR_NOT_FOUND (what ``nvmlDeviceGetHandleByUUID`` says);
- a cgroup path that is not absolute, or not under the cgroup root: NVML_ERROR_INVALID_ARGUMENT;
- a cgroup directory that does not exist: NVML_ERROR_NOT_FOUND. The directory is checked on the real
  filesystem, so a limit is only ever "set" on a cgroup that exists (on the real node, the container's
  real cgroup; in the embedded cluster, the directory its simulated runtime made);
- no limit reads soft 0, hard NVML_DEVICE_MEMORY_LIMIT_MAX; a removed cgroup's limits are forgotten.
- ``currentUsed`` is what the state's ``used`` says for the cgroup (0 when nothing is written): nothing
  here allocates GPU memory, so a test or the embedded cluster plays a container's use with
  ``set_used``; the real driver measures it. The shrink rule of a live resize reads it
  (``gpufrac.node.memlimit.enforce.apply_guarded``), and a limit change applies to a cgroup whatever runs
  in it, as the real driver's is assumed to (``scripts/gpu-check``'s resize step checks that on hardware).

The state is a JSON file shared by every process of the node (the agent, a test, ``gpufrac up``), so a
test can play the driver's faults by editing it, as an operator could reset a real driver:

    {"limits": {"<gpu uuid>": {"<cgroup path>": {"soft": B, "hard": B}}},
     "used":   {"<gpu uuid>": {"<cgroup path>": B}},
     "refuse": {"<gpu uuid>": <NVML error code>},     # every set on that GPU fails with the code
     "ignore_sets": ["<gpu uuid>"]}                   # sets "succeed" and change nothing

Writes go through a lock file and an atomic rename; reads take the same lock.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from gpufrac.node.inventory.backend import GpuInfo
from gpufrac.node.memlimit.driver import (
    LIMIT_MAX,
    NVML_ERROR_INVALID_ARGUMENT,
    NVML_ERROR_NOT_FOUND,
    NVML_ERROR_NOT_SUPPORTED,
    MemoryLimitError,
    MemoryLimits,
)
from gpufrac.node.mps.mode import V3_MIN_DRIVER_MAJOR, DriverVersion

#: The first driver with per-cgroup memory limits (the same release as MPS v3).
MIN_DRIVER_MAJOR = V3_MIN_DRIVER_MAJOR


class SimulatedMemoryLimits:
    """``MemoryLimitDriver`` over a JSON file. ``gpus`` and ``driver_version`` are the node's (inventory)."""

    def __init__(
        self,
        *,
        path: Path,
        gpus: Callable[[], Sequence[GpuInfo]],
        driver_version: Callable[[], str],
        cgroup_root: Path = Path("/sys/fs/cgroup"),
    ) -> None:
        self._path = path
        self._lock_path = path.with_name(path.name + ".lock")
        self._gpus = gpus
        self._driver_version = driver_version
        self._root = os.path.realpath(cgroup_root)
        path.parent.mkdir(parents=True, exist_ok=True)

    @property
    def path(self) -> Path:
        return self._path

    # -- the two calls -------------------------------------------------------------------------------

    def set_limits(self, *, gpu: str, cgroup: str, soft: int, hard: int) -> None:
        self._check(gpu=gpu, cgroup=cgroup)
        if not 0 <= soft <= LIMIT_MAX or not 0 <= hard <= LIMIT_MAX or (hard != LIMIT_MAX and soft > hard):
            raise MemoryLimitError(
                NVML_ERROR_INVALID_ARGUMENT, f"softLimit {soft} and hardLimit {hard} (soft must be <= hard)"
            )
        with self._state() as state:
            refused = state.get("refuse", {}).get(gpu)
            if refused is not None:
                raise MemoryLimitError(
                    int(refused), f"the driver refused the limit on {gpu} (simulated fault)"
                )
            if gpu in state.get("ignore_sets", []):
                return
            per_gpu = state.setdefault("limits", {}).setdefault(gpu, {})
            if soft == 0 and hard == LIMIT_MAX:
                per_gpu.pop(cgroup, None)
            else:
                per_gpu[cgroup] = {"soft": soft, "hard": hard}

    def get_limits(self, *, gpu: str, cgroup: str) -> MemoryLimits:
        self._check(gpu=gpu, cgroup=cgroup)
        with self._state() as state:
            held = state.get("limits", {}).get(gpu, {}).get(cgroup)
            used = int(state.get("used", {}).get(gpu, {}).get(cgroup, 0))
        if held is None:
            return MemoryLimits(soft=0, hard=LIMIT_MAX, current_used=used)
        return MemoryLimits(soft=int(held["soft"]), hard=int(held["hard"]), current_used=used)

    # -- what tests and the embedded cluster change -----------------------------------------------------

    def set_used(self, *, gpu: str, cgroup: str, used: int) -> None:
        """SIMULATED usage: what ``currentUsed`` reads for the cgroup."""
        with self._state() as state:
            state.setdefault("used", {}).setdefault(gpu, {})[cgroup] = used

    def tamper(self, *, gpu: str, cgroup: str, soft: int = 0, hard: int = LIMIT_MAX) -> None:
        """Change a held limit behind the agent's back (an operator, a driver reset): no checks."""
        with self._state() as state:
            per_gpu = state.setdefault("limits", {}).setdefault(gpu, {})
            if soft == 0 and hard == LIMIT_MAX:
                per_gpu.pop(cgroup, None)
            else:
                per_gpu[cgroup] = {"soft": soft, "hard": hard}

    def refuse(self, *, gpu: str, code: int | None) -> None:
        """Every set on ``gpu`` fails with ``code`` from now on (None: stop refusing)."""
        with self._state() as state:
            refusals = state.setdefault("refuse", {})
            if code is None:
                refusals.pop(gpu, None)
            else:
                refusals[gpu] = code

    def ignore_sets(self, *, gpu: str, ignore: bool = True) -> None:
        """Sets on ``gpu`` succeed and change nothing (a driver that lies): only a read-back sees it."""
        with self._state() as state:
            ignored = set(state.get("ignore_sets", []))
            if ignore:
                ignored.add(gpu)
            else:
                ignored.discard(gpu)
            state["ignore_sets"] = sorted(ignored)

    def held(self) -> dict[str, dict[str, MemoryLimits]]:
        """Every limit held now, by GPU and cgroup (removed cgroups' limits are dropped first)."""
        with self._state() as state:
            return {
                gpu: {cg: MemoryLimits(soft=int(v["soft"]), hard=int(v["hard"])) for cg, v in per_gpu.items()}
                for gpu, per_gpu in state.get("limits", {}).items()
                if per_gpu
            }

    # -- internals --------------------------------------------------------------------------------------

    def _check(self, *, gpu: str, cgroup: str) -> None:
        version = DriverVersion.parse(self._driver_version())
        if version.major < MIN_DRIVER_MAJOR:
            raise MemoryLimitError(
                NVML_ERROR_NOT_SUPPORTED,
                f"driver {version} has no per-cgroup memory limits (r{MIN_DRIVER_MAJOR}+)",
            )
        info = next((g for g in self._gpus() if g.uuid == gpu), None)
        if info is None:
            raise MemoryLimitError(NVML_ERROR_NOT_FOUND, f"no GPU {gpu} on this node")
        if info.mig:
            raise MemoryLimitError(NVML_ERROR_NOT_SUPPORTED, f"{gpu} is a MIG-enabled GPU")
        if not cgroup.startswith("/") or "\x00" in cgroup:
            raise MemoryLimitError(NVML_ERROR_INVALID_ARGUMENT, f"nameSpace {cgroup!r} is not a cgroup path")
        real = os.path.realpath(cgroup)
        if real != self._root and not real.startswith(self._root + os.sep):
            raise MemoryLimitError(
                NVML_ERROR_INVALID_ARGUMENT, f"nameSpace {cgroup!r} is not under the cgroup root {self._root}"
            )
        if not os.path.isdir(cgroup):
            raise MemoryLimitError(NVML_ERROR_NOT_FOUND, f"cgroup {cgroup} does not exist")

    @contextlib.contextmanager
    def _state(self) -> Iterator[dict[str, Any]]:
        with open(self._lock_path, "a+") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                state = self._read()
                before = json.dumps(state, sort_keys=True)
                self._forget_removed(state)
                yield state
                if json.dumps(state, sort_keys=True) != before:
                    self._write(state)
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def _read(self) -> dict[str, Any]:
        try:
            data = json.loads(self._path.read_text())
        except FileNotFoundError:
            return {}
        return data if isinstance(data, dict) else {}

    def _write(self, state: dict[str, Any]) -> None:
        tmp = self._path.with_name(f".{self._path.name}.tmp")
        tmp.write_text(json.dumps(state, sort_keys=True))
        os.replace(tmp, self._path)

    @staticmethod
    def _forget_removed(state: dict[str, Any]) -> None:
        """Removing a cgroup clears its limits (the driver's rule)."""
        for section in ("limits", "used"):
            for per_gpu in state.get(section, {}).values():
                for cgroup in [cg for cg in per_gpu if not os.path.isdir(cg)]:
                    del per_gpu[cgroup]


class SimulatedToolkitHook:
    """SIMULATED: the NVIDIA container toolkit's memory-limit hook (``apply-cuda-memory-limits``).

    The real hook runs when runc creates the container, reads the container's ``NVIDIA_GPU_MEMORY_REQUEST``
    and ``NVIDIA_GPU_MEMORY_LIMIT`` (whole MiB; both, or it does nothing) and sets that limit on the
    container's cgroup for each GPU of ``NVIDIA_VISIBLE_DEVICES``. Plural names, one variable alone or
    devices that are not UUIDs set nothing, as with the real hook. Writes through the simulated driver's
    state file, as the driver would hold what the hook set."""

    def __init__(self, *, path: Path) -> None:
        self._driver = SimulatedMemoryLimits(path=path, gpus=tuple, driver_version=lambda: "0")

    def __call__(self, *, env: dict[str, str], cgroup: str) -> bool:
        """Apply what ``env`` asks for to ``cgroup``; True when it set a limit."""
        try:
            request = int(env["NVIDIA_GPU_MEMORY_REQUEST"])
            limit = int(env["NVIDIA_GPU_MEMORY_LIMIT"])
        except (KeyError, ValueError):
            return False
        devices = [d for d in env.get("NVIDIA_VISIBLE_DEVICES", "").split(",") if d.startswith("GPU-")]
        for gpu in devices:
            self._driver.tamper(gpu=gpu, cgroup=cgroup, soft=request << 20, hard=limit << 20)
        return bool(devices)
