"""The kubelet's DRA plugin: registration and the ``v1.DRAPlugin`` service, over two unix sockets.

How the kubelet finds a DRA driver (k8s.io/kubernetes ``pkg/kubelet/pluginmanager`` and
``pkg/kubelet/cm/dra/plugin``): it watches ``<kubelet root>/plugins_registry/`` for sockets, calls
``pluginregistration.Registration/GetInfo`` on each new one, and registers a plugin whose ``type`` is
``DRAPlugin`` under its ``name`` (the driver name) with the gRPC ``endpoint`` it names and the first
service of ``supported_versions`` it knows (``v1.DRAPlugin`` here). It reports the outcome with
``NotifyRegistrationStatus``. From then on it calls ``NodePrepareResources`` before a pod's containers
start and ``NodeUnprepareResources`` after they are gone, each with the claims of our driver.

Prepare reads each claim from the API server (the request carries only namespace, name and UID), turns
its allocation into a CDI spec with ``gpufrac.node.dra.prepare`` (the NRI path's planner) and answers
with the CDI device IDs; unprepare removes the spec. Each claim gets its own answer, so one bad claim
fails only its pod, with a message that says why. Both are idempotent: the kubelet retries them, and a
restarted agent finds its state in the spec files.

The messages are generated at build time from the pinned ``k8s.io/kubelet`` module
(``scripts/gen-kubelet-protos``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import grpc
from lightkube import AsyncClient
from lightkube.resources.resource_v1 import ResourceClaim

from gpufrac.contract import keys
from gpufrac.kube.errors import KubeError, NotFound, api_errors
from gpufrac.node.dra.prepare import (
    DEFAULT_CDI_DIR,
    AllocationError,
    PreparedShare,
    cdi_spec,
    make_pipe_leaves,
    modes_in_use,
    prepare_claim,
    refuse_mixed_modes,
    remove_spec,
    write_spec,
)

try:
    from gpufrac._generated.kubelet.dra.v1 import api_pb2 as dra_pb2
    from gpufrac._generated.kubelet.dra.v1 import api_pb2_grpc as dra_grpc
    from gpufrac._generated.kubelet.pluginregistration.v1 import api_pb2 as reg_pb2
    from gpufrac._generated.kubelet.pluginregistration.v1 import api_pb2_grpc as reg_grpc
except ImportError as exc:  # pragma: no cover - a checkout without `make testenv`
    raise ImportError(
        "the kubelet's DRA plugin messages are generated at build time: run "
        "`.venv/bin/python scripts/gen-kubelet-protos` (or `make testenv`)"
    ) from exc

log = logging.getLogger(__name__)

#: ``pluginregistration.DRAPlugin`` and ``dra/v1.DRAPluginService`` of k8s.io/kubelet.
PLUGIN_TYPE = "DRAPlugin"
SERVICE_VERSION = "v1.DRAPlugin"
DEFAULT_KUBELET_DIR = Path("/var/lib/kubelet")
_UNIX_PATH_MAX = 107  # sun_path is 108 bytes with the terminating NUL

#: The node's devices: our device name -> GPU UUID (the inventory's current view).
DeviceUuids = Callable[[], Mapping[str, str]]


class _Registration(reg_grpc.RegistrationServicer):  # type: ignore[misc]
    def __init__(self, plugin: DraPlugin) -> None:
        self._plugin = plugin

    async def GetInfo(self, request: Any, context: Any) -> Any:
        return reg_pb2.PluginInfo(
            type=PLUGIN_TYPE,
            name=keys.DRA_DRIVER_NAME,
            endpoint=str(self._plugin.endpoint),
            supported_versions=[SERVICE_VERSION],
        )

    async def NotifyRegistrationStatus(self, request: Any, context: Any) -> Any:
        self._plugin.registered = bool(request.plugin_registered)
        self._plugin.registration_error = request.error or None
        if request.plugin_registered:
            log.info("dra: the kubelet registered driver %s", keys.DRA_DRIVER_NAME)
        else:
            log.error("dra: the kubelet refused driver %s: %s", keys.DRA_DRIVER_NAME, request.error)
        return reg_pb2.RegistrationStatusResponse()


class _Service(dra_grpc.DRAPluginServicer):  # type: ignore[misc]
    def __init__(self, plugin: DraPlugin) -> None:
        self._plugin = plugin

    async def NodePrepareResources(self, request: Any, context: Any) -> Any:
        response = dra_pb2.NodePrepareResourcesResponse()
        for claim in request.claims:
            answer = response.claims[claim.uid]
            try:
                for share in await self._plugin.prepare(
                    namespace=claim.namespace, name=claim.name, uid=claim.uid
                ):
                    answer.devices.append(
                        dra_pb2.Device(
                            request_names=[share.request],
                            pool_name=share.pool,
                            device_name=share.device,
                            cdi_device_ids=list(share.cdi_device_ids),
                        )
                    )
            except (AllocationError, KubeError, OSError) as exc:  # OSError: the spec or leaf not written
                log.warning("dra: cannot prepare claim %s/%s: %s", claim.namespace, claim.name, exc)
                answer.error = str(exc)
        return response

    async def NodeUnprepareResources(self, request: Any, context: Any) -> Any:
        response = dra_pb2.NodeUnprepareResourcesResponse()
        for claim in request.claims:
            answer = response.claims[claim.uid]
            try:
                self._plugin.unprepare(uid=claim.uid)
            except OSError as exc:
                answer.error = f"removing the CDI spec of claim {claim.namespace}/{claim.name}: {exc}"
        return response


class DraPlugin:
    """The two gRPC servers; ``start``/``stop`` own the sockets."""

    def __init__(
        self,
        *,
        client: AsyncClient,
        devices: DeviceUuids,
        kubelet_dir: Path = DEFAULT_KUBELET_DIR,
        cdi_dir: Path = DEFAULT_CDI_DIR,
        pipe_root: str,
    ) -> None:
        self._client = client
        self._devices = devices
        self._cdi_dir = cdi_dir
        self._pipe_root = pipe_root
        self.endpoint = kubelet_dir / "plugins" / keys.DRA_DRIVER_NAME / "dra.sock"
        self.registration_socket = kubelet_dir / "plugins_registry" / f"{keys.DRA_DRIVER_NAME}-reg.sock"
        self.registered: bool | None = None
        self.registration_error: str | None = None
        self._servers: list[grpc.aio.Server] = []
        self._prepare_lock = asyncio.Lock()

    async def prepare(self, *, namespace: str, name: str, uid: str) -> tuple[PreparedShare, ...]:
        """Read the claim, check it is the pod's (same UID) and fits the GPU's mode, write its CDI spec."""
        try:
            with api_errors():
                obj = await self._client.get(ResourceClaim, name, namespace=namespace)
        except NotFound:
            raise AllocationError(
                f"ResourceClaim {namespace}/{name} does not exist (deleted before its pod started)"
            ) from None
        claim = obj.to_dict()
        if (claim.get("metadata") or {}).get("uid") != uid:
            raise AllocationError(
                f"ResourceClaim {namespace}/{name} has uid {claim['metadata'].get('uid')}, not {uid}: "
                "it was deleted and created again; the pod's claim is gone"
            )
        shares = prepare_claim(claim, uuids=self._devices(), pipe_root=self._pipe_root)
        async with self._prepare_lock:  # the check and the write as one step: two prepares cannot both pass
            in_use = await asyncio.to_thread(modes_in_use, self._cdi_dir, other_than=uid)
            refuse_mixed_modes(shares, in_use=in_use)
            await asyncio.to_thread(make_pipe_leaves, shares)
            await asyncio.to_thread(write_spec, self._cdi_dir, uid, cdi_spec(uid, shares))
        return shares

    def unprepare(self, *, uid: str) -> None:
        remove_spec(self._cdi_dir, uid, pipe_root=self._pipe_root)

    async def start(self) -> None:
        """Serve the DRA service first, then the registration socket (the kubelet calls the endpoint as
        soon as it has registered it). Raises ``ValueError`` for a socket path a unix socket cannot have."""
        for path in (self.endpoint, self.registration_socket):
            if len(str(path)) > _UNIX_PATH_MAX:
                raise ValueError(
                    f"kubelet_dir gives the socket {path} of {len(str(path))} characters: a unix socket path "
                    f"has at most {_UNIX_PATH_MAX}"
                )
        try:
            for path, add in (
                (self.endpoint, lambda s: dra_grpc.add_DRAPluginServicer_to_server(_Service(self), s)),
                (
                    self.registration_socket,
                    lambda s: reg_grpc.add_RegistrationServicer_to_server(_Registration(self), s),
                ),
            ):
                path.parent.mkdir(parents=True, exist_ok=True)
                path.unlink(missing_ok=True)  # a socket left by an earlier agent
                server = grpc.aio.server()
                add(server)
                self._servers.append(server)
                server.add_insecure_port(f"unix://{path}")
                await server.start()
        except BaseException:
            await self.stop()  # the one that started must not outlive a failed start
            raise

    async def stop(self) -> None:
        # The registration socket goes first, so that the kubelet stops sending work it would lose.
        for server in reversed(self._servers):
            with contextlib.suppress(Exception):
                await server.stop(grace=1.0)
        self._servers.clear()
        self.registration_socket.unlink(missing_ok=True)
        self.endpoint.unlink(missing_ok=True)
