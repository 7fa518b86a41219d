"""REAL CRI client: ListContainers, ListPodSandbox, ContainerStatus(verbose), StopContainer.

The runtimes put the OCI spec a container was created with into ContainerStatus's verbose ``info``
map: containerd and CRI-O both serialise it as JSON under ``info["info"]`` → ``runtimeSpec`` →
``process.env``. That is the environment the process actually started with, after every NRI plugin
and OCI hook ran, which is exactly what the audit must compare.

Pod identity comes from the labels the kubelet sets on every container (``io.kubernetes.pod.*``) and
the pod's annotations from its sandbox, so the audit can recognise a fractional container even when
the node agent never saw it being created.

Async (grpc.aio) because the agent's other loops are asyncio tasks; one channel for the agent's life.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field

import grpc

try:
    from gpufrac._generated.cri import api_pb2, api_pb2_grpc
except ImportError as error:  # pragma: no cover - only without a build
    raise ImportError(
        "CRI messages are generated at build time: run `.venv/bin/python scripts/gen-cri-protos` "
        "(part of `make testenv`)"
    ) from error

POD_NAME = "io.kubernetes.pod.name"
POD_NAMESPACE = "io.kubernetes.pod.namespace"
POD_UID = "io.kubernetes.pod.uid"
CONTAINER_NAME = "io.kubernetes.container.name"


class CriError(Exception):
    """A CRI call failed; ``code`` is the gRPC status code (``NOT_FOUND`` for a container that is gone)."""

    def __init__(self, *, call: str, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"CRI {call} failed: {code.name}: {details}")
        self.code = code


@dataclass(frozen=True, slots=True)
class RunningContainer:
    id: str
    name: str
    pod_namespace: str
    pod_name: str
    pod_uid: str
    sandbox_id: str
    pod_annotations: Mapping[str, str] = field(default_factory=dict)


class CriClient:
    """One channel to the runtime socket (``unix:///run/containerd/containerd.sock`` or CRI-O's)."""

    def __init__(self, *, endpoint: str, timeout_s: float = 5.0) -> None:
        self._channel = grpc.aio.insecure_channel(endpoint)
        self._stub = api_pb2_grpc.RuntimeServiceStub(self._channel)
        self._timeout = timeout_s

    async def close(self) -> None:
        await self._channel.close()

    async def running_containers(self) -> list[RunningContainer]:
        """Running containers with their pod's identity and annotations (the pod's sandbox)."""
        running = api_pb2.ContainerStateValue(state=api_pb2.CONTAINER_RUNNING)
        containers = await self._call(
            "ListContainers",
            self._stub.ListContainers,
            api_pb2.ListContainersRequest(filter=api_pb2.ContainerFilter(state=running)),
        )
        sandboxes = await self._call(
            "ListPodSandbox", self._stub.ListPodSandbox, api_pb2.ListPodSandboxRequest()
        )
        annotations = {s.id: dict(s.annotations) for s in sandboxes.items}
        return [
            RunningContainer(
                id=c.id,
                name=c.labels.get(CONTAINER_NAME, c.metadata.name),
                pod_namespace=c.labels.get(POD_NAMESPACE, ""),
                pod_name=c.labels.get(POD_NAME, ""),
                pod_uid=c.labels.get(POD_UID, ""),
                sandbox_id=c.pod_sandbox_id,
                pod_annotations=annotations.get(c.pod_sandbox_id, {}),
            )
            for c in containers.containers
        ]

    async def environment(self, container_id: str) -> dict[str, str] | None:
        """The environment the container's process was created with; None if the runtime hides the spec."""
        status = await self._call(
            "ContainerStatus",
            self._stub.ContainerStatus,
            api_pb2.ContainerStatusRequest(container_id=container_id, verbose=True),
        )
        return environment_in(status.info)

    async def stop(self, container_id: str, *, grace_s: int = 10) -> None:
        """Stop the container (SIGTERM, SIGKILL after ``grace_s``); the kubelet then recreates it."""
        await self._call(
            "StopContainer",
            self._stub.StopContainer,
            api_pb2.StopContainerRequest(container_id=container_id, timeout=grace_s),
            timeout_s=self._timeout + grace_s,
        )

    async def _call(self, name: str, method, request, *, timeout_s: float | None = None):
        try:
            return await method(request, timeout=timeout_s or self._timeout)
        except grpc.aio.AioRpcError as error:
            raise CriError(call=name, code=error.code(), details=error.details() or "") from error


def environment_in(info: Mapping[str, str]) -> dict[str, str] | None:
    """``process.env`` of the OCI spec in a verbose ContainerStatus ``info`` map."""
    raw = info.get("info")
    if not raw:
        return None
    try:
        env = json.loads(raw)["runtimeSpec"]["process"]["env"]
    except (ValueError, KeyError, TypeError):
        return None
    result: dict[str, str] = {}
    for entry in env or ():
        key, _, value = entry.partition("=")
        result.setdefault(key, value)  # getenv() returns the first of duplicate entries
    return result
