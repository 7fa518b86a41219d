"""The simulated kubelet: runs pods bound to simulated nodes through each node's REAL NRI runtime side.

The embedded cluster has no kubelet and no containerd. What the product cares about on a node is what
happens between "the pod is bound" and "the container's process starts": the runtime asks its NRI
plugins to adjust the container, and our node agent injects the memory limits, devices and MPS pipe
there. So this kubelet does exactly that part for real — it creates every container through the node's
``gpufrac-nriruntime`` (NRI's own runtime-side adaptation library, testenv/nriruntime), with our node
agent connected to it as an ordinary NRI plugin — and simulates the rest (no image, no process).

What each container received (the environment our plugin injected, its MPS mount, or the error it
failed with) is written on the Pod as the ``gpufrac.io/simulated-containers`` annotation (JSON), so
``gpufrac demo`` and tests can show it; then the pod's status becomes Running (or stays Pending with a
``CreateContainerError`` status, as a real kubelet reports a refused create, or ``RunContainerError``
for a refused start: the node agent refuses to start a fraction whose GPU memory limit it could not set
and read back). A refused create is tried again, as a real kubelet's pod worker does, with a back-off
(``retry_initial_s`` doubling to ``retry_max_s``): NRI's validators refuse a GPU container while the node
agent is away, hung or restarting, and the pod runs once it is back. A deleted pod's containers
are stopped and removed, which is what lets the node agent drop their mapping records.

Graceful deletion runs as a kubelet runs it: a pod whose ``deletionTimestamp`` is set (``kubectl delete``,
an eviction, a preemption or reclaim) has its containers stopped and removed through the runtime, and
then the kubelet confirms the deletion (DELETE with a grace period of 0 and the pod's ``uid`` as a
precondition), which is what removes the pod from the API server. A simulated container has no process
to signal, so it stops at once, where a real kubelet sends SIGTERM and waits up to the grace period.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from lightkube import AsyncClient
from lightkube.models.meta_v1 import DeleteOptions, Preconditions
from lightkube.resources.core_v1 import Pod
from lightkube.types import PatchType

from gpufrac.kube.errors import Conflict, KubeError, NotFound, api_errors
from gpufrac.kube.informer import Informer
from gpufrac.kube.patch import set_annotations
from gpufrac.kube.stream import ALL_NAMESPACES, Selection, delete_object
from gpufrac.local.nriruntime import ContainerCreateFailed, NriRuntime, NriRuntimeError

log = logging.getLogger(__name__)

#: Where the simulated kubelet records what each container got from the runtime and its plugins.
CONTAINERS_ANNOTATION = "gpufrac.io/simulated-containers"

#: Variables worth showing: what the node agent injects (the rest of the environment is the user's).
INJECTED_PREFIXES = ("NVIDIA_", "CUDA_MPS_")


@dataclass(slots=True)
class _RunningPod:
    node: str
    container_ids: list[str] = field(default_factory=list)
    sandbox: bool = False
    #: Containers created so far: name -> (what it received, its status); a retry creates only the rest.
    created: dict[str, tuple[dict[str, Any], dict[str, Any]]] = field(default_factory=dict)
    refusals: int = 0


def injected_view(env: Mapping[str, str], mounts: list[dict[str, Any]]) -> dict[str, Any]:
    """The part of a created container that the node agent decided: its env and its MPS mount."""
    shown = {k: v for k, v in sorted(env.items()) if k.startswith(INJECTED_PREFIXES)}
    pipe = env.get("CUDA_MPS_PIPE_DIRECTORY")
    mount = next((m for m in mounts if pipe and m.get("destination") == pipe), None)
    view: dict[str, Any] = {"env": shown}
    if mount is not None:
        view["mps_mount"] = {"source": mount.get("source"), "destination": mount.get("destination")}
    return view


class SimulatedKubelet:
    """Runs the pods bound to ``runtimes``' nodes (one NRI runtime per simulated node name).

    Run ``await kubelet.run()`` as a task; cancel it to stop (pods are left as they are, like a kubelet
    that goes away). When its informer fails, ``run()`` raises that failure instead of going on deaf
    (the embedded cluster reports it and runs the kubelet again); a second ``run()`` resumes with the
    same store and the same running pods.
    """

    def __init__(
        self,
        *,
        client: AsyncClient,
        runtimes: Mapping[str, NriRuntime],
        informer_options: Mapping[str, Any] | None = None,
        retry_initial_s: float = 0.5,
        retry_max_s: float = 10.0,
    ) -> None:
        self._retry_initial_s = retry_initial_s
        self._retry_max_s = retry_max_s
        self._client = client
        self._runtimes = dict(runtimes)
        self._queue: asyncio.Queue[tuple[str, Pod]] = asyncio.Queue()
        self._running: dict[str, _RunningPod] = {}
        #: Pods whose deletion this kubelet is carrying out (by uid), so that each is confirmed once.
        self._terminating: set[str] = set()
        self.informer: Informer[Pod] = Informer(
            client=client,
            resource=Pod,
            selection=Selection(namespace=ALL_NAMESPACES, fields="spec.nodeName!="),
            name="kubelet-pods",
            **dict(informer_options or {}),
        )
        self.informer.add_handler(self)

    # -- informer handlers: only enqueue ------------------------------------------------------------

    def on_add(self, obj: Pod) -> None:
        self._offer(obj)

    def on_update(self, old: Pod, new: Pod) -> None:
        self._offer(new)

    def on_delete(self, obj: Pod) -> None:
        if obj.metadata is None:
            return
        self._terminating.discard(obj.metadata.uid or "")
        if obj.metadata.uid in self._running:
            self._queue.put_nowait(("delete", obj))

    def _offer(self, pod: Pod) -> None:
        assert pod.metadata is not None and pod.spec is not None
        if pod.spec.nodeName not in self._runtimes:
            return
        if pod.metadata.deletionTimestamp is not None:
            if pod.metadata.uid not in self._terminating:
                self._terminating.add(pod.metadata.uid or "")
                self._queue.put_nowait(("terminate", pod))
            return
        if pod.metadata.uid in self._running:
            return
        if (pod.metadata.annotations or {}).get(CONTAINERS_ANNOTATION):
            return  # already run by an earlier kubelet of this cluster
        self._running[pod.metadata.uid] = _RunningPod(node=pod.spec.nodeName)
        self._queue.put_nowait(("run", pod))

    # -- the work --------------------------------------------------------------------------------------

    async def run(self) -> None:
        watcher = asyncio.create_task(self.informer.run(), name="kubelet-informer")
        worker = asyncio.create_task(self._work(), name="kubelet-worker")
        try:
            done, _ = await asyncio.wait({watcher, worker}, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                task.result()  # raises the informer's (or the worker's) failure
            raise RuntimeError("the kubelet's pod informer stopped")
        finally:
            for task in (watcher, worker):
                task.cancel()
            await asyncio.gather(watcher, worker, return_exceptions=True)

    async def _work(self) -> None:
        while True:
            op, pod = await self._queue.get()
            try:
                if op in ("run", "retry"):
                    await self._run_pod(pod)
                elif op == "terminate":
                    await self._terminate(pod)
                else:
                    await self._remove_pod(pod)
            except (KubeError, NriRuntimeError, OSError) as error:
                meta = pod.metadata
                assert meta is not None
                log.warning("kubelet: %s %s/%s failed: %s", op, meta.namespace, meta.name, error)
            except Exception:
                # One pod must never stop the kubelet for all others.
                log.exception("kubelet: %s %s failed unexpectedly", op, pod.metadata and pod.metadata.name)

    async def _run_pod(self, pod: Pod) -> None:
        meta, spec = pod.metadata, pod.spec
        assert meta is not None and spec is not None and meta.uid is not None
        running = self._running.get(meta.uid)
        if running is None:  # deleted while a retry waited
            return
        runtime = self._runtimes[spec.nodeName]  # type: ignore[index]
        annotations = dict(meta.annotations or {})
        if not running.sandbox:
            await runtime.run_pod(
                id=meta.uid,
                name=meta.name or "",
                namespace=meta.namespace or "",
                uid=meta.uid,
                annotations=annotations,
                labels=dict(meta.labels or {}),
            )
            running.sandbox = True
        received: dict[str, Any] = {}
        statuses: list[dict[str, Any]] = []
        failed = refused = False
        for container in spec.containers:
            if container.name in running.created:
                received[container.name], status = running.created[container.name]
                statuses.append(status)
                failed = failed or "waiting" in status["state"]
                continue
            container_id = f"{meta.uid}-{container.name}"
            env = {e.name: e.value or "" for e in (container.env or []) if e.valueFrom is None}
            try:
                created = await runtime.create_container(
                    id=container_id,
                    pod_id=meta.uid,
                    name=container.name,
                    env=env,
                    annotations=annotations,
                    args=list(container.command or []) + list(container.args or []),
                )
            except ContainerCreateFailed as error:
                failed = refused = True
                received[container.name] = {"error": str(error)}
                statuses.append(_waiting(container.name, container.image, str(error)))
                continue
            running.container_ids.append(container_id)
            try:
                await runtime.start_container(container_id)
            except NriRuntimeError as error:  # a plugin refused the start (the GPU memory limit not in force)
                failed = True
                received[container.name] = {**injected_view(created.env, created.mounts), "error": str(error)}
                statuses.append(
                    _waiting(container.name, container.image, str(error), reason="RunContainerError")
                )
            else:
                received[container.name] = injected_view(created.env, created.mounts)
                statuses.append(_running(container.name, container.image))
            running.created[container.name] = (received[container.name], statuses[-1])

        await set_annotations(
            self._client,
            Pod,
            name=meta.name or "",
            namespace=meta.namespace,
            annotations={CONTAINERS_ANNOTATION: json.dumps(received, sort_keys=True)},
        )
        await self._patch_status(pod, statuses=statuses, running=not failed)
        if refused:  # as a real kubelet's pod worker: the next sync creates what was refused
            delay = min(self._retry_max_s, self._retry_initial_s * 2**running.refusals)
            running.refusals += 1
            asyncio.get_running_loop().call_later(delay, self._queue.put_nowait, ("retry", pod))
        log.info(
            "kubelet: %s/%s on %s %s",
            meta.namespace,
            meta.name,
            spec.nodeName,
            "refused" if failed else "running",
        )

    async def _patch_status(self, pod: Pod, *, statuses: list[dict[str, Any]], running: bool) -> None:
        meta = pod.metadata
        assert meta is not None
        now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        ready = "True" if running else "False"
        status: dict[str, Any] = {
            "phase": "Running" if running else "Pending",
            "hostIP": "127.0.0.1",
            "startTime": now,
            "containerStatuses": statuses,
            "conditions": [
                {"type": t, "status": s, "lastTransitionTime": now}
                for t, s in (("Initialized", "True"), ("ContainersReady", ready), ("Ready", ready))
            ],
        }
        with api_errors():
            await self._client.patch(
                Pod.Status,
                meta.name or "",
                {"status": status},
                namespace=meta.namespace,
                patch_type=PatchType.STRATEGIC,
            )

    async def _terminate(self, pod: Pod) -> None:
        """Stop the pod's containers, then confirm its deletion to the API server, as a kubelet does."""
        meta = pod.metadata
        assert meta is not None and meta.uid is not None
        await self._remove_pod(pod)
        try:
            await delete_object(
                self._client,
                Pod,
                name=meta.name or "",
                namespace=meta.namespace,
                options=DeleteOptions(gracePeriodSeconds=0, preconditions=Preconditions(uid=meta.uid)),
            )
        except (NotFound, Conflict):
            pass  # gone already, or the name is a namesake's now (the uid precondition failed)
        except KubeError:
            self._terminating.discard(meta.uid)  # the next update of the pod tries again
            raise
        log.info("kubelet: %s/%s terminated and its deletion confirmed", meta.namespace, meta.name)

    async def _remove_pod(self, pod: Pod) -> None:
        meta = pod.metadata
        assert meta is not None and meta.uid is not None
        running = self._running.pop(meta.uid, None)
        if running is None:
            return
        runtime = self._runtimes[running.node]
        for container_id in running.container_ids:
            with contextlib.suppress(NriRuntimeError):
                await runtime.stop_container(container_id)
            with contextlib.suppress(NriRuntimeError):
                await runtime.remove_container(container_id)
        with contextlib.suppress(NriRuntimeError):
            await runtime.stop_pod(meta.uid)
        with contextlib.suppress(NriRuntimeError):
            await runtime.remove_pod(meta.uid)


def _running(name: str, image: str | None) -> dict[str, Any]:
    now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    return {
        "name": name,
        "image": image or "",
        "imageID": "",
        "ready": True,
        "restartCount": 0,
        "started": True,
        "state": {"running": {"startedAt": now}},
    }


def _waiting(
    name: str, image: str | None, message: str, *, reason: str = "CreateContainerError"
) -> dict[str, Any]:
    return {
        "name": name,
        "image": image or "",
        "imageID": "",
        "ready": False,
        "restartCount": 0,
        "state": {"waiting": {"reason": reason, "message": message}},
    }
