"""Gangs: pods that start together or not at all (scheduler-plugins' and KAI Scheduler's PodGroups).

A pod joins a gang with scheduler-plugins' label ``scheduling.x-k8s.io/pod-group`` (PodGroup
``scheduling.x-k8s.io/v1alpha1``) or KAI Scheduler's annotation ``pod-group-name`` (PodGroup
``scheduling.run.ai/v2alpha2``); the PodGroup's ``spec.minMember`` says how many must run together,
its ``spec.scheduleTimeoutSeconds`` (scheduler-plugins) how long they may wait for it.

The PodGroup is read once per gang (and again after ``REFRESH_S``), by a GET in the background: a
cluster without the CRD costs nothing until a pod names a gang, and then answers "not found", which is
what the pod is told. While it is first read, the members wait without a report; the read's end
retries them.

Placement of a gang is one engine statement (``Engine.schedule(..., gang=True, min_member=n)``): the
members not yet placed are placed together, at least ``minMember`` minus the members already running,
or none of them. Members wait, with the reason in their PodScheduled condition, until enough of them
exist; after the timeout the reason says the gang timed out and a ``GangTimeout`` Warning is emitted
once (the pods stay pending and are placed as soon as the gang fits).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

import httpx2
from lightkube import AsyncClient
from lightkube.generic_resource import create_namespaced_resource
from lightkube.resources.core_v1 import Pod

from gpufrac.contract.keys import KAI_POD_GROUP_ANNOTATION, POD_GROUP_LABEL
from gpufrac.kube.errors import KubeError, NotFound, api_errors

log = logging.getLogger(__name__)

SCHEDULER_PLUGINS = "scheduling.x-k8s.io/v1alpha1"
KAI = "scheduling.run.ai/v2alpha2"
POD_GROUPS = {
    SCHEDULER_PLUGINS: create_namespaced_resource("scheduling.x-k8s.io", "v1alpha1", "PodGroup", "podgroups"),
    KAI: create_namespaced_resource("scheduling.run.ai", "v2alpha2", "PodGroup", "podgroups"),
}

REFRESH_S = 30.0
"""How long a PodGroup read stays good (a changed minMember is seen after at most this)."""

DEFAULT_TIMEOUT_S = 600.0
"""How long a gang may wait when its PodGroup names no timeout (KAI's PodGroup has none)."""

FORGET_AFTER_S = 3600.0
"""A gang none of whose pods was tried for this long is forgotten (its PodGroup read, its waiting
time): a scheduler that runs for months sees a PodGroup per job. Parked pods are tried again far more
often than this, so a gang still waiting keeps its timeout."""


@dataclass(frozen=True, slots=True)
class GangKey:
    api: str
    namespace: str
    name: str

    def __str__(self) -> str:
        return f"{self.namespace}/{self.name}"


def gang_of(pod: Pod) -> GangKey | None:
    meta = pod.metadata
    name = (meta.labels or {}).get(POD_GROUP_LABEL)
    if name:
        return GangKey(SCHEDULER_PLUGINS, meta.namespace or "", name)
    name = (meta.annotations or {}).get(KAI_POD_GROUP_ANNOTATION)
    if name:
        return GangKey(KAI, meta.namespace or "", name)
    return None


@dataclass(frozen=True, slots=True)
class GangSpec:
    min_member: int
    timeout_s: float


@dataclass(slots=True)
class _Read:
    spec: GangSpec | None  # None: not found
    at: float
    error: str = ""


def spec_of(obj: Any, key: GangKey) -> GangSpec:
    """The gang's rule from its PodGroup; a clear error naming the field when it is not usable."""
    spec = obj.spec or {}
    minimum = spec.get("minMember", 1)
    if not isinstance(minimum, int) or isinstance(minimum, bool) or minimum < 1:
        raise ValueError(f"PodGroup {key} spec.minMember={minimum!r} must be a whole number of at least 1")
    timeout = spec.get("scheduleTimeoutSeconds", DEFAULT_TIMEOUT_S)
    if not isinstance(timeout, int | float) or isinstance(timeout, bool) or timeout <= 0:
        raise ValueError(f"PodGroup {key} spec.scheduleTimeoutSeconds={timeout!r} must be a positive number")
    return GangSpec(minimum, float(timeout))


class Gangs:
    """The scheduler's knowledge of gangs: their PodGroups (read in the background), and when each
    gang was first seen waiting (for its timeout)."""

    def __init__(
        self,
        *,
        client: AsyncClient,
        spawn: Callable[[Coroutine[Any, Any, None]], None],
        retry: Callable[[], None],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._client = client
        self._spawn = spawn
        self._retry = retry
        self._clock = clock
        self._reads: dict[GangKey, _Read] = {}
        self._reading: set[GangKey] = set()
        self._waiting_since: dict[GangKey, float] = {}
        self._timed_out: set[GangKey] = set()
        self._seen: dict[GangKey, float] = {}
        self._pruned_at = clock()

    def spec(self, key: GangKey) -> GangSpec | str | None:
        """The gang's rule, the sentence saying why its members cannot be placed, or None while the
        PodGroup is first read (the members wait for a moment: reporting that would race the report
        that follows)."""
        read = self._reads.get(key)
        now = self._clock()
        self._seen[key] = now
        self._prune(now)
        if (read is None or now - read.at > REFRESH_S) and key not in self._reading:
            self._reading.add(key)
            self._spawn(self._read(key))
        if read is None:
            return None
        if read.error:
            return read.error
        if read.spec is None:
            return f"PodGroup {key} ({key.api}) not found"
        return read.spec

    def waited(self, key: GangKey) -> tuple[float, bool]:
        """Seconds the gang has waited, and whether this is the first time it passed its timeout."""
        now = self._clock()
        since = self._waiting_since.setdefault(key, now)
        read = self._reads.get(key)
        timeout = read.spec.timeout_s if read is not None and read.spec is not None else DEFAULT_TIMEOUT_S
        late = now - since > timeout
        first = late and key not in self._timed_out
        if first:
            self._timed_out.add(key)
        return now - since, first

    def timed_out(self, key: GangKey) -> bool:
        return key in self._timed_out

    def placed(self, key: GangKey) -> None:
        self._waiting_since.pop(key, None)
        self._timed_out.discard(key)

    def __len__(self) -> int:
        """Gangs known (seen within ``FORGET_AFTER_S``)."""
        return len(self._seen)

    def _prune(self, now: float) -> None:
        if now - self._pruned_at < REFRESH_S:
            return
        self._pruned_at = now
        for key in [k for k, at in self._seen.items() if now - at > FORGET_AFTER_S]:
            del self._seen[key]
            self._reading.discard(key)  # a read in flight for an hour is not coming back
            self._reads.pop(key, None)
            self._waiting_since.pop(key, None)
            self._timed_out.discard(key)

    async def _read(self, key: GangKey) -> None:
        try:
            with api_errors():
                obj = await self._client.get(POD_GROUPS[key.api], key.name, namespace=key.namespace)
            self._store(key, _Read(spec_of(obj, key), self._clock()))
        except NotFound:
            self._store(key, _Read(None, self._clock()))
        except httpx2.HTTPStatusError as error:  # a 404 without a Status: the API serves no such kind
            if error.response.status_code != 404:
                raise
            text = f"PodGroup {key} ({key.api}) not found: the API serves no {key.api} PodGroups"
            self._store(key, _Read(None, self._clock(), error=text))
        except (KubeError, ValueError) as error:
            self._store(key, _Read(None, self._clock(), error=str(error)))
        finally:
            self._reading.discard(key)
        self._retry()

    def _store(self, key: GangKey, read: _Read) -> None:
        """Keep a read only for a gang still known (one forgotten while it was read is not brought back)."""
        if key in self._seen:
            self._reads[key] = read
