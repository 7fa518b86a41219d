"""A CRI runtime over the real wire protocol, a /proc tree on disk, and the audit's other seams.

``FakeRuntime`` is a gRPC server implementing runtime.v1 ``RuntimeService`` from the same generated
messages the client uses, with an in-memory container table: the audit's CRI calls cross a real
unix-socket gRPC connection exactly as they would to containerd or CRI-O.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest

ROOT = Path(__file__).resolve().parents[3]


def _generated() -> bool:
    try:
        return importlib.util.find_spec("gpufrac._generated.cri") is not None
    except ModuleNotFoundError:  # not even gpufrac._generated
        return False


if not _generated():  # `make testenv` has not run yet: generate now, as it would
    subprocess.run([sys.executable, str(ROOT / "scripts" / "gen-cri-protos")], check=True)
    importlib.invalidate_caches()

from gpufrac._generated.cri import api_pb2, api_pb2_grpc  # noqa: E402
from gpufrac.node.cri.client import CriClient  # noqa: E402
from gpufrac.node.inject import EnvPlanner  # noqa: E402
from gpufrac.node.mapping import MappingStore  # noqa: E402


@dataclass
class FakeContainer:
    id: str
    name: str
    sandbox_id: str
    env: list[str]
    state: int = api_pb2.CONTAINER_RUNNING


class FakeRuntime(api_pb2_grpc.RuntimeServiceServicer):
    def __init__(self) -> None:
        self.containers: dict[str, FakeContainer] = {}
        self.sandboxes: dict[str, tuple[str, str, str, dict[str, str]]] = {}
        self.stopped: list[tuple[str, int]] = []
        self.fail_stops = 0
        self.fail_status = 0
        self.fail_lists = 0

    def add_pod(self, *, namespace: str, name: str, annotations: Mapping[str, str] | None = None) -> str:
        sandbox_id = f"sandbox-{namespace}-{name}"
        self.sandboxes[sandbox_id] = (namespace, name, f"uid-{name}", dict(annotations or {}))
        return sandbox_id

    def add_container(self, *, id: str, sandbox_id: str, name: str, env: Mapping[str, str]) -> None:
        self.containers[id] = FakeContainer(
            id=id, name=name, sandbox_id=sandbox_id, env=[f"{k}={v}" for k, v in env.items()]
        )

    def running(self, container_id: str) -> bool:
        return self.containers[container_id].state == api_pb2.CONTAINER_RUNNING

    def _labels(self, c: FakeContainer) -> dict[str, str]:
        namespace, pod, uid, _ = self.sandboxes[c.sandbox_id]
        return {
            "io.kubernetes.pod.namespace": namespace,
            "io.kubernetes.pod.name": pod,
            "io.kubernetes.pod.uid": uid,
            "io.kubernetes.container.name": c.name,
        }

    def ListContainers(self, request, context):
        if self.fail_lists:
            self.fail_lists -= 1
            context.abort(grpc.StatusCode.UNAVAILABLE, "runtime restarting")
        wanted = request.filter.state.state if request.filter.HasField("state") else None
        return api_pb2.ListContainersResponse(
            containers=[
                api_pb2.Container(
                    id=c.id,
                    pod_sandbox_id=c.sandbox_id,
                    metadata=api_pb2.ContainerMetadata(name=c.name),
                    state=c.state,
                    labels=self._labels(c),
                )
                for c in self.containers.values()
                if wanted is None or c.state == wanted
            ]
        )

    def ListPodSandbox(self, request, context):
        return api_pb2.ListPodSandboxResponse(
            items=[
                api_pb2.PodSandbox(
                    id=sid,
                    metadata=api_pb2.PodSandboxMetadata(name=name, namespace=ns, uid=uid),
                    annotations=annotations,
                )
                for sid, (ns, name, uid, annotations) in self.sandboxes.items()
            ]
        )

    def ContainerStatus(self, request, context):
        if self.fail_status:
            self.fail_status -= 1
            context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "runtime slow")
        c = self.containers.get(request.container_id)
        if c is None:
            context.abort(grpc.StatusCode.NOT_FOUND, f"container {request.container_id} not found")
        info = {}
        if request.verbose:
            info["info"] = json.dumps({"pid": 4242, "runtimeSpec": {"process": {"env": c.env}}})
        return api_pb2.ContainerStatusResponse(
            status=api_pb2.ContainerStatus(
                id=c.id, state=c.state, metadata=api_pb2.ContainerMetadata(name=c.name)
            ),
            info=info,
        )

    def StopContainer(self, request, context):
        if self.fail_stops:
            self.fail_stops -= 1
            context.abort(grpc.StatusCode.UNAVAILABLE, "runtime busy")
        c = self.containers.get(request.container_id)
        if c is None:
            context.abort(grpc.StatusCode.NOT_FOUND, f"container {request.container_id} not found")
        c.state = api_pb2.CONTAINER_EXITED
        self.stopped.append((request.container_id, request.timeout))
        return api_pb2.StopContainerResponse()


@pytest.fixture
def runtime():
    state = FakeRuntime()
    directory = tempfile.mkdtemp(prefix="cri", dir="/tmp")  # unix socket paths are limited to 107 bytes
    endpoint = f"unix://{directory}/cri.sock"
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    api_pb2_grpc.add_RuntimeServiceServicer_to_server(state, server)
    server.add_insecure_port(endpoint)
    server.start()
    state.endpoint = endpoint
    try:
        yield state
    finally:
        server.stop(grace=None).wait()
        shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture
async def cri(runtime):
    client = CriClient(endpoint=runtime.endpoint, timeout_s=5)
    try:
        yield client
    finally:
        await client.close()


@dataclass
class Events:
    emitted: list[tuple[str, str, str, str, str]] = field(default_factory=list)

    def emit(self, *, regarding, type: str, reason: str, message: str) -> None:
        self.emitted.append((regarding.kind, regarding.namespace, regarding.name, reason, message))

    def reasons(self) -> list[str]:
        return [e[3] for e in self.emitted]


@pytest.fixture
def events() -> Events:
    return Events()


@pytest.fixture
def planner() -> EnvPlanner:
    """The NRI plugin's own plan, recomputed from the pod's annotations (the audit's REAL planner)."""
    return EnvPlanner()


@pytest.fixture
def allocations(tmp_path: Path) -> MappingStore:
    return MappingStore(directory=tmp_path / "state")


@pytest.fixture
def proc_root(tmp_path: Path) -> Path:
    return tmp_path / "proc"


@pytest.fixture
def spawn(proc_root: Path):
    """Lays out /proc/<pid>/cgroup for a process of ``container_id`` (None: a host process)."""

    def write(*, pid: int, container_id: str | None) -> None:
        _write_cgroup(proc_root, pid=pid, container_id=container_id)

    return write


def _write_cgroup(proc_root: Path, *, pid: int, container_id: str | None) -> None:
    d = proc_root / str(pid)
    d.mkdir(parents=True, exist_ok=True)
    path = (
        f"/kubepods.slice/kubepods-pod1.slice/cri-containerd-{container_id}.scope"
        if container_id
        else "/user.slice/session-1.scope"
    )
    (d / "cgroup").write_text(f"0::{path}\n")
    (d / "comm").write_text("python3\n")
