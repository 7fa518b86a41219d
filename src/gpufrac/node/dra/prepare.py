"""A claim's allocation -> the CDI spec that carries its share into the container (the kubelet plugin's
NodePrepareResources, minus the gRPC).

The kubelet asks the DRA driver to prepare a claim before it starts the pod's containers; the driver
answers with CDI device names, and the runtime applies those devices' container edits. gpufrac's edits
are the injection the NRI path gives an annotation pod: the claim's allocation is read into the same
``BoundContainer`` the binder's annotations become, and ``gpufrac.node.inject.plan_bound`` -- the one
planner -- turns it into env and mounts. Only the delivery differs: NRI adjusts the container, here a
CDI spec file does.

The allocation is read by the contract's one reader of our driver's wire format
(``gpufrac.contract.dra.read_allocation``: what each field means, what is refused), the reader
gpufrac-scheduler books claims with too, so both sides hold exactly the same share; here each share it
reads gets its MPS leaf and its plan.

The spec is one file per claim, written atomically (temporary file, then rename) and removed at
unprepare; writing it again gives the same file, removing a missing one is fine. Each share's MPS leaf
directory is made at prepare (the runtime bind-mounts it) and removed with the spec when empty. Those
files are the only state, so a restarted agent neither loses nor doubles a prepared claim: ``read_prepared``
reads each share back (its GPU and mode from the device's annotations, its memory and compute from the
env the planner wrote) as the ``BoundContainer`` it was planned from -- what the node holds on each GPU
(one mode per GPU, the memory booked) and the MPS namespaces that must live.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpufrac.contract import keys
from gpufrac.contract.dra import AllocationError, read_allocation
from gpufrac.contract.render import BoundContainer
from gpufrac.contract.request import ComputeMode
from gpufrac.node.inject import (
    CUDA_MPS_ACTIVE_THREAD_PERCENTAGE,
    NVIDIA_GPU_MEMORY_LIMIT,
    NVIDIA_GPU_MEMORY_REQUEST,
    InjectionPlan,
    pipe_leaf,
    plan_bound,
)

#: The CDI kind of the specs this driver writes: ``gpu.gpufrac.io/claim=<claim uid>-<device>``.
CDI_KIND = keys.DRA_CDI_KIND
CDI_VERSION = "0.6.0"
#: Device annotations of our specs (CDI 0.6.0): which GPU a share is on and in which compute mode, so
#: that the node can tell, from the specs alone, what a GPU already holds.
MODE_ANNOTATION = f"{keys.DRA_DRIVER_NAME}/compute-mode"
UUID_ANNOTATION = f"{keys.DRA_DRIVER_NAME}/uuid"
#: ``<namespace>/<name>`` of the claim a spec device belongs to: who holds a GPU, said in refusals.
CLAIM_ANNOTATION = f"{keys.DRA_DRIVER_NAME}/claim"
#: Where CDI-enabled runtimes look for specs (containerd's and CRI-O's default ``cdi_spec_dirs``).
DEFAULT_CDI_DIR = Path("/var/run/cdi")


@dataclass(frozen=True, slots=True)
class PreparedShare:
    """One allocated device of a claim and what its container gets."""

    request: str
    pool: str
    device: str
    plan: InjectionPlan
    cdi_device_ids: tuple[str, ...]


def prepare_claim(
    claim: Mapping[str, Any],
    *,
    uuids: Mapping[str, str],
    pipe_root: str,
    cdi_kind: str = keys.CDI_GPU_KIND,
) -> tuple[PreparedShare, ...]:
    """Pure: the shares of ``claim`` (a ResourceClaim as a dict) that this driver prepares.

    ``uuids`` maps our device names to GPU UUIDs (the node's inventory); ``pipe_root`` is the host
    directory under which each share gets its MPS leaf; ``cdi_kind`` names the GPU's own CDI device (the
    NVIDIA toolkit's spec, which adds the device nodes and the memory-limit hook). Raises
    ``AllocationError``.
    """
    uid = str((claim.get("metadata") or {}).get("uid") or "")
    shares: list[PreparedShare] = []
    for share in read_allocation(claim, uuids=uuids):
        name = cdi_device_name(uid, share.device)
        plan = plan_bound(
            share.bound, pipe_source=pipe_leaf(root=pipe_root, container_id=name), cdi_kind=cdi_kind
        )
        shares.append(
            PreparedShare(
                request=share.request,
                pool=share.pool,
                device=share.device,
                plan=plan,
                cdi_device_ids=(f"{CDI_KIND}={name}", *plan.cdi_devices),
            )
        )
    return tuple(shares)


def cdi_device_name(claim_uid: str, device: str) -> str:
    return f"{claim_uid}-{device}"


def cdi_spec(claim_uid: str, shares: Iterable[PreparedShare], *, claim: str = "") -> dict[str, Any]:
    """The CDI spec (one device per share) with each share's env and mounts as container edits;
    ``claim`` (``<namespace>/<name>``) is recorded beside each device to say who holds the GPU."""
    return {
        "cdiVersion": CDI_VERSION,
        "kind": CDI_KIND,
        "devices": [
            {
                "name": cdi_device_name(claim_uid, share.device),
                "annotations": {
                    MODE_ANNOTATION: share.plan.bound.mode.value,
                    UUID_ANNOTATION: share.plan.bound.devices[0],
                    **({CLAIM_ANNOTATION: claim} if claim else {}),
                },
                "containerEdits": {
                    "env": [f"{key}={value}" for key, value in share.plan.env],
                    "mounts": [
                        {"hostPath": m.source, "containerPath": m.destination, "options": list(m.options)}
                        for m in share.plan.mounts
                    ],
                },
            }
            for share in shares
        ],
    }


def spec_path(cdi_dir: Path, claim_uid: str) -> Path:
    return cdi_dir / f"{keys.DRA_DRIVER_NAME}-{claim_uid}.json"


def write_spec(cdi_dir: Path, claim_uid: str, spec: Mapping[str, Any]) -> Path:
    """Write the claim's spec atomically: a runtime never reads half a file, a rerun rewrites the same."""
    cdi_dir.mkdir(parents=True, exist_ok=True)
    path = spec_path(cdi_dir, claim_uid)
    fd, tmp = tempfile.mkstemp(dir=cdi_dir, prefix=".", suffix=".tmp")  # not *.json: runtimes scan those
    try:
        with os.fdopen(fd, "w") as out:
            json.dump(spec, out, indent=2, sort_keys=True)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


@dataclass(frozen=True, slots=True)
class PreparedDevice:
    """One share of a prepared claim as its CDI spec records it.

    ``key`` is the spec device's name (``<claim uid>-<device>``): it names the share's MPS namespace and
    its default-socket directory as a container id names a container's. ``bound`` is what the planner
    was given: the GPU, the mode, request and limit MiB (None: the whole GPU) and the compute portion."""

    claim_uid: str
    claim: str  # <namespace>/<name>, or the UID for a spec written without it
    key: str
    bound: BoundContainer
    pipe_source: str | None  # the host directory the spec mounts as the MPS directory


def _int_env(env: Mapping[str, str], key: str) -> int | None:
    try:
        return int(env[key]) if key in env else None
    except ValueError:
        return None


def _read_device(uid: str, device: Mapping[str, Any]) -> PreparedDevice | None:
    notes = device.get("annotations") or {}
    if MODE_ANNOTATION not in notes or UUID_ANNOTATION not in notes or not device.get("name"):
        return None
    try:
        mode = ComputeMode(notes[MODE_ANNOTATION])
    except ValueError:
        return None
    edits = device.get("containerEdits") or {}
    env = dict(str(e).partition("=")[::2] for e in edits.get("env") or [])
    request = _int_env(env, NVIDIA_GPU_MEMORY_REQUEST)
    limit = _int_env(env, NVIDIA_GPU_MEMORY_LIMIT)
    percent = _int_env(env, CUDA_MPS_ACTIVE_THREAD_PERCENTAGE)
    mounts = edits.get("mounts") or []
    return PreparedDevice(
        claim_uid=uid,
        claim=str(notes.get(CLAIM_ANNOTATION) or uid),
        key=str(device["name"]),
        bound=BoundContainer(
            container=str(device["name"]),
            devices=(str(notes[UUID_ANNOTATION]),),
            mode=mode,
            request_mib=request,
            limit_mib=(limit if limit is not None else request) if request is not None else None,
            # The planner wrote floor(portion x 100); that percent over 100 plans the same ceiling again.
            compute_portion=percent / 100 if percent is not None and mode is ComputeMode.SM_SHARING else None,
            exclusive=request is None,
        ),
        pipe_source=str(mounts[0].get("hostPath")) if mounts else None,
    )


def _read_spec(path: Path, uid: str) -> list[PreparedDevice]:
    try:
        spec = json.loads(path.read_text())
    except (OSError, ValueError):
        return []  # removed meanwhile, or not ours to judge
    devices = spec.get("devices") if isinstance(spec, dict) else None
    read = (_read_device(uid, d) for d in devices or () if isinstance(d, dict))
    return [d for d in read if d is not None]


def read_prepared(cdi_dir: Path, *, other_than: str | None = None) -> list[PreparedDevice]:
    """Every share of the claims prepared in ``cdi_dir`` (the claim ``other_than`` left out: a retried
    prepare does not conflict with itself), read back from their specs. A spec that cannot be read
    (removed meanwhile, or not ours) is skipped."""
    found: list[PreparedDevice] = []
    prefix = f"{keys.DRA_DRIVER_NAME}-"
    for path in sorted(cdi_dir.glob(f"{prefix}*.json")) if cdi_dir.is_dir() else ():
        uid = path.name[len(prefix) : -len(".json")]
        if uid != other_than:
            found.extend(_read_spec(path, uid))
    return found


def read_claim(cdi_dir: Path, claim_uid: str) -> list[PreparedDevice]:
    """The shares of one prepared claim (none when it has no spec)."""
    return _read_spec(spec_path(cdi_dir, claim_uid), claim_uid)


def prepared_plan(device: PreparedDevice) -> InjectionPlan:
    """The injection plan a prepared share was written from (``plan_bound`` of what its spec records)."""
    return plan_bound(device.bound, pipe_source=device.pipe_source or "")


#: GPU UUID -> compute mode -> who holds the GPU in it (``claim <ns>/<name>``, ``pod <ns>/<name>``).
ModesInUse = dict[str, dict[str, set[str]]]


def modes_of(prepared: Iterable[PreparedDevice]) -> ModesInUse:
    """What mode each GPU is held in by the prepared claims ``prepared``."""
    found: ModesInUse = {}
    for device in prepared:
        modes = found.setdefault(device.bound.devices[0], {})
        modes.setdefault(device.bound.mode.value, set()).add(f"claim {device.claim}")
    return found


def refuse_mixed_modes(
    shares: Iterable[PreparedShare], *, in_use: Mapping[str, Mapping[str, set[str]]]
) -> None:
    """One compute mode per GPU holds for claims too: a share whose GPU is already held in the other mode
    (by prepared claims, or annotation pods: ``in_use`` says by whom) is refused (``AllocationError``), so
    the pod does not start instead of mixing modes.

    The stock kube-scheduler does not know the rule, so this is the node's last word, not placement:
    such a pod waits in ContainerCreating with the reason in its Events (docs/dra.md)."""
    for share in shares:
        uuid = share.plan.bound.devices[0]
        mode = share.plan.bound.mode.value
        others = {m: uids for m, uids in (in_use.get(uuid) or {}).items() if m != mode and uids}
        if others:
            held = "; ".join(f"{m} by {', '.join(sorted(uids))}" for m, uids in sorted(others.items()))
            raise AllocationError(
                f"request {share.request} asks for {mode} on GPU {uuid}, which is held in {held}: one "
                "compute mode per GPU (modes never mix on a GPU); the claim waits until those are released"
            )


def make_pipe_leaves(shares: Iterable[PreparedShare]) -> None:
    """Create each share's MPS leaf directory on the host before the runtime bind-mounts it (the NRI path
    makes its leaf at CreateContainer; a claim's is made at prepare)."""
    for share in shares:
        for mount in share.plan.mounts:
            os.makedirs(mount.source, mode=0o755, exist_ok=True)


def remove_spec(cdi_dir: Path, claim_uid: str, *, pipe_root: str | None = None) -> bool:
    """Remove the claim's spec and, with ``pipe_root``, the empty leaf directories it mounted from there
    (never anything else); False when there was no spec (unprepare twice, or never prepared)."""
    path = spec_path(cdi_dir, claim_uid)
    try:
        spec = json.loads(path.read_text())
    except FileNotFoundError:
        return False
    except (OSError, ValueError):
        spec = {}
    if pipe_root is not None:
        root = pipe_root.rstrip("/") + "/"
        for device in spec.get("devices") or []:
            for mount in (device.get("containerEdits") or {}).get("mounts") or []:
                source = str(mount.get("hostPath") or "")
                if source.startswith(root) and "/" not in source[len(root) :]:
                    with contextlib.suppress(OSError):  # gone already, or not empty: leave it
                        os.rmdir(source)
    path.unlink(missing_ok=True)
    return True
