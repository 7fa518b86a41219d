"""The node's container -> allocation mapping: one schema-versioned JSON record per GPU container.

The NRI plugin writes a record when it injects a container and deletes it when the container is
removed; the usage reporter and the audit read them (``allocations()`` is the usage collector's
``AllocationLookup``), and the MPS hooks restore their namespaces from them when the agent restarts.

Each record is its own file, ``<state dir>/containers/<container id>.json``, written atomically: a
temporary file in the same directory, fsync, rename over the old name, fsync of the directory. A crash
leaves the old record or the new one, never half of one. The files are a cache of what the runtime
knows, not a source of truth: after every (re)connection the runtime's Synchronize lists the containers
that exist and ``replace_all`` makes the store equal to it, so a record missed while the agent was down,
or one of a container removed meanwhile, is corrected there. The default state directory is under /run
(tmpfs): containers do not survive a reboot, neither need their records, and fsync costs nothing there.

Readers use the in-memory index, which changes at once; the files are written by one background thread
in submission order (``flush`` waits for it). CreateContainer therefore never waits for a disk: on a
state directory on disk, a synchronous fsync put the plugin's p99 at 26 ms (max 208 ms) under load,
against 5 ms on tmpfs (bench/nri_create_latency.py, docs/benchmarks.md). Nothing is lost by not waiting:
a record whose write a crash cut short is rebuilt by the Synchronize that follows the restart.

Schema (``schema: 1``): container_id, pod_namespace, pod_name, pod_uid, container_name, devices (list),
request_mib, limit_mib, mode (``time-slicing``/``sm-sharing``), portion (null unless sm-sharing with a
portion), exclusive (whole GPUs), pipe_dir (host directory mounted as the container's MPS directory,
null for whole GPUs), created_at (unix seconds), claims (list, empty unless the container's GPU is a share
of our DRA driver: the ``<namespace>/<name>`` of each ResourceClaim it runs in; its devices, memory, mode
and portion are then the claim's allocation as prepared, read back from the claim's CDI spec),
mig_profiles (list, empty unless the container runs on MIG slices: mode ``mig``, exclusive, devices the
slices' ``MIG-`` UUIDs, request and limit the smallest slice's MiB, and here each slice's profile in the
order of devices, ``?`` where the inventory did not know it). A record without ``claims`` (written before
it existed) reads as an annotation fraction. Unknown schema versions
are left on disk and skipped.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

SCHEMA_VERSION = 1

#: The record mode of a container on MIG slices (docs/mig.md): the hardware isolates it, nothing is set.
MIG_MODE = "mig"
#: A slice profile the inventory did not know when the record was made (a Synchronize before it was read).
UNKNOWN_PROFILE = "?"

#: What the agent accepts as a container id before it names a file or directory after it: containerd and
#: CRI-O use 64 hex digits; anything with a slash, a NUL, a leading dot or over 128 characters could
#: escape the state directory or fail to be a file name, and comes only from a broken or hostile runtime.
CONTAINER_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")


class InvalidContainerId(ValueError):
    """A container id the agent will not make a path of."""

    def __init__(self, container_id: str) -> None:
        shown = container_id if len(container_id) <= 80 else container_id[:80] + "..."
        super().__init__(
            f"container id {shown!r} is invalid: a container id is 1 to 128 letters, digits, '_', '.' or '-',"
            " starting with a letter or digit (the runtime sent something that could name a path outside"
            " the agent's state directory)"
        )
        self.container_id = container_id


def check_container_id(container_id: str) -> str:
    """``container_id`` when it is safe to name a file or directory after; raises ``InvalidContainerId``."""
    if CONTAINER_ID.fullmatch(container_id) is None:
        raise InvalidContainerId(container_id)
    return container_id


@dataclass(frozen=True, slots=True)
class AllocationRecord:
    container_id: str
    pod_namespace: str
    pod_name: str
    pod_uid: str
    container_name: str
    devices: tuple[str, ...]
    request_mib: int
    limit_mib: int
    mode: str
    portion: float | None
    exclusive: bool = False
    pipe_dir: str | None = None
    created_at: float = field(default_factory=time.time)
    #: ``<namespace>/<name>`` of the DRA claims whose prepared shares the container runs in (empty: an
    #: annotation fraction). Usage and faults count such a container like any fraction; the limit
    #: enforcer, the ``GpuMemoryEnforced`` condition and the MPS hooks leave it to the claim's CDI spec.
    claims: tuple[str, ...] = ()
    #: The profile of each device when the container runs on MIG slices (mode ``MIG_MODE``); else empty.
    mig_profiles: tuple[str, ...] = ()

    @property
    def is_mig(self) -> bool:
        """Runs on MIG slices: no memory limit, no MPS; the hardware enforces what it gets."""
        return self.mode == MIG_MODE

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["devices"] = list(self.devices)
        data["claims"] = list(self.claims)
        data["mig_profiles"] = list(self.mig_profiles)
        return {"schema": SCHEMA_VERSION, **data}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> AllocationRecord:
        if data.get("schema") != SCHEMA_VERSION:
            raise ValueError(
                f"unknown mapping schema {data.get('schema')!r} (this agent reads {SCHEMA_VERSION})"
            )
        portion = data.get("portion")
        return cls(
            container_id=str(data["container_id"]),
            pod_namespace=str(data["pod_namespace"]),
            pod_name=str(data["pod_name"]),
            pod_uid=str(data["pod_uid"]),
            container_name=str(data["container_name"]),
            devices=tuple(str(d) for d in data["devices"]),
            request_mib=int(data["request_mib"]),
            limit_mib=int(data["limit_mib"]),
            mode=str(data["mode"]),
            portion=None if portion is None else float(portion),
            exclusive=bool(data.get("exclusive", False)),
            pipe_dir=data.get("pipe_dir"),
            created_at=float(data.get("created_at", 0.0)),
            claims=tuple(str(c) for c in data.get("claims") or ()),
            mig_profiles=tuple(str(p) for p in data.get("mig_profiles") or ()),
        )


class MappingStore:
    """Records on disk with an in-memory index; every method is synchronous and cheap."""

    def __init__(self, *, directory: Path) -> None:
        self._dir = directory / "containers"
        self._dir.mkdir(parents=True, exist_ok=True)
        self._records: dict[str, AllocationRecord] = {}
        self._writer: ThreadPoolExecutor | None = None
        self._writer_lock = threading.Lock()
        self._last_write: Future[None] | None = None
        self._load()

    @property
    def directory(self) -> Path:
        return self._dir

    def _path(self, container_id: str) -> Path:
        return self._dir / f"{check_container_id(container_id)}.json"

    def _load(self) -> None:
        for path in sorted(self._dir.glob("*.json")):
            try:
                record = AllocationRecord.from_json(json.loads(path.read_text()))
            except (OSError, ValueError, KeyError, TypeError) as exc:
                log.warning("mapping: skipping %s: %s", path, exc)
                continue
            self._records[record.container_id] = record

    def get(self, container_id: str) -> AllocationRecord | None:
        return self._records.get(container_id)

    def allocations(self) -> list[AllocationRecord]:
        """Every GPU container this node hosts (the usage collector's ``AllocationLookup``)."""
        return list(self._records.values())

    def put(self, record: AllocationRecord) -> None:
        self._path(record.container_id)  # refuse a bad id now, not in the writer
        self._records[record.container_id] = record
        self._submit(self._write_file, record)

    def remove(self, container_id: str) -> AllocationRecord | None:
        record = self._records.pop(container_id, None)
        if record is not None:
            self._submit(self._unlink, container_id)
        return record

    def flush(self, timeout_s: float | None = 10.0) -> None:
        """Wait until every record put or removed so far is on disk (or its write failed and was logged)."""
        with self._writer_lock:
            last = self._last_write
        if last is not None:
            last.result(timeout=timeout_s)

    def close(self) -> None:
        self.flush()
        with self._writer_lock:
            if self._writer is not None:
                self._writer.shutdown(wait=True)
                self._writer = None

    def _submit(self, fn: Callable[[Any], None], arg: Any) -> None:
        with self._writer_lock:
            if self._writer is None:
                self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mapping-writer")
            self._last_write = self._writer.submit(self._logged, fn, arg)

    @staticmethod
    def _logged(fn: Callable[[Any], None], arg: Any) -> None:
        try:
            fn(arg)
        except OSError as exc:  # the index is right; Synchronize rewrites the file after a restart
            log.warning(
                "mapping: could not write %s: %s", arg if isinstance(arg, str) else arg.container_id, exc
            )

    def _write_file(self, record: AllocationRecord) -> None:
        path = self._path(record.container_id)
        tmp = path.with_name(f".{path.name}.tmp")
        data = json.dumps(record.to_json(), sort_keys=True).encode()
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.write(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
        self._sync_dir()

    def _unlink(self, container_id: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self._path(container_id).unlink()
            self._sync_dir()

    def replace_all(self, records: Iterable[AllocationRecord]) -> tuple[int, int]:
        """Make the store hold exactly ``records`` (after Synchronize); returns (written, removed)."""
        wanted = {r.container_id: r for r in records}
        removed = 0
        for stale in set(self._records) - wanted.keys():
            self.remove(stale)
            removed += 1
        written = 0
        for record in wanted.values():
            old = self._records.get(record.container_id)
            if old is None or _without_time(old) != _without_time(record):
                self.put(record if old is None else _keep_time(record, old))
                written += 1
        return written, removed

    def _sync_dir(self) -> None:
        fd = os.open(self._dir, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _without_time(record: AllocationRecord) -> dict[str, Any]:
    data = record.to_json()
    data.pop("created_at")
    return data


def _keep_time(record: AllocationRecord, old: AllocationRecord) -> AllocationRecord:
    data = record.to_json()
    data["created_at"] = old.created_at
    return AllocationRecord.from_json(data)
