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

Before a spec is written, and as one step with the write (a lock: two prepares cannot both pass), the
node checks what the GPU already holds: one compute mode per GPU (``prepare.refuse_mixed_modes``) and
its memory, prepared claims and annotation pods together (``gpufrac.node.dra.ledger``). With MPS
(``mps``: the agent's ``MpsService.hooks``) each share then gets what an annotation container gets at
CreateContainer -- an sm-sharing share its namespace on the shared server, with the same ceiling and
memory cap -- and the spec mounts that directory; unprepare removes the spec first, then the namespace
(an agent that dies in between leaves an orphan the next reconcile deletes, never a spec without its
namespace). ``prepared_plans`` is the MPS live set's claim half: the spec files, plus the prepares in
flight between namespace and spec.

The messages are generated at build time from the pinned ``k8s.io/kubelet`` module
(``scripts/gen-kubelet-protos``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import grpc
from lightkube import AsyncClient
from lightkube.resources.core_v1 import Pod
from lightkube.resources.resource_v1 import ResourceClaim

from gpufrac.contract import keys
from gpufrac.contract.dra import AllocationError
from gpufrac.kube.errors import KubeError, NotFound, api_errors
from gpufrac.node.dra.ledger import (
    NodeGpu,
    claim_holdings,
    pod_holdings,
    pod_modes,
    pod_shares,
    refuse_overcommit,
)
from gpufrac.node.dra.prepare import (
    DEFAULT_CDI_DIR,
    PreparedShare,
    cdi_device_name,
    cdi_spec,
    make_pipe_leaves,
    modes_of,
    prepare_claim,
    prepared_plan,
    read_claim,
    read_prepared,
    refuse_mixed_modes,
    remove_spec,
    spec_path,
    write_spec,
)
from gpufrac.node.inject import InjectionPlan
from gpufrac.node.mps.containers import ContainerHooks, apply_adjustment, read_only_shared_pipe
from gpufrac.node.mps.supervisor import MpsUnavailable

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

#: The node's devices: our device name -> the GPU (the inventory's current view, as the slice offers it).
NodeDevices = Callable[[], Mapping[str, NodeGpu]]


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
            except (AllocationError, MpsUnavailable, KubeError, OSError) as exc:  # OSError: spec, leaf
                log.warning("dra: cannot prepare claim %s/%s: %s", claim.namespace, claim.name, exc)
                answer.error = str(exc)
        return response

    async def NodeUnprepareResources(self, request: Any, context: Any) -> Any:
        response = dra_pb2.NodeUnprepareResourcesResponse()
        for claim in request.claims:
            answer = response.claims[claim.uid]
            try:
                await self._plugin.unprepare(uid=claim.uid)
            except OSError as exc:
                answer.error = f"removing the CDI spec of claim {claim.namespace}/{claim.name}: {exc}"
        return response


class DraPlugin:
    """The two gRPC servers; ``start``/``stop`` own the sockets."""

    def __init__(
        self,
        *,
        client: AsyncClient,
        node_name: str,
        devices: NodeDevices,
        kubelet_dir: Path = DEFAULT_KUBELET_DIR,
        cdi_dir: Path = DEFAULT_CDI_DIR,
        pipe_root: str,
        mps: ContainerHooks | None = None,
        shared_pipe_dir: str | None = None,
    ) -> None:
        """``mps``: the MPS hooks (None: the node runs no MPS); ``shared_pipe_dir``: classic MPS's pipe
        directory, mounted read-only as for annotation containers (None: writable, or no MPS)."""
        self._client = client
        self._node_name = node_name
        self._devices = devices
        self._cdi_dir = cdi_dir
        self._pipe_root = pipe_root
        self._mps = mps
        self._shared_pipe_dir = shared_pipe_dir
        self.endpoint = kubelet_dir / "plugins" / keys.DRA_DRIVER_NAME / "dra.sock"
        self.registration_socket = kubelet_dir / "plugins_registry" / f"{keys.DRA_DRIVER_NAME}-reg.sock"
        self.registered: bool | None = None
        self.registration_error: str | None = None
        self._servers: list[grpc.aio.Server] = []
        self._prepare_lock = asyncio.Lock()
        self._in_flight: dict[str, InjectionPlan] = {}  # shares whose namespace exists, spec not yet

    def prepared_plans(self) -> list[tuple[str, InjectionPlan]]:
        """Each prepared share as ``(key, plan)``: from the spec files, and the prepares in flight."""
        plans = {d.key: prepared_plan(d) for d in read_prepared(self._cdi_dir)}
        return list({**plans, **self._in_flight}.items())

    async def _pods_here(self) -> list[dict[str, Any]]:
        """The pods bound to this node, as the API server has them (``gpufrac.node.dra.ledger``: why)."""
        with api_errors():
            return [
                pod.to_dict()
                async for pod in self._client.list(
                    Pod, namespace="*", fields={"spec.nodeName": self._node_name}
                )
            ]

    async def prepare(self, *, namespace: str, name: str, uid: str) -> tuple[PreparedShare, ...]:
        """Read the claim, check it is the pod's (same UID) and fits the GPU (its mode, its memory), give
        each share its MPS setup, write its CDI spec."""
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
        gpus = self._devices()
        shares = prepare_claim(
            claim, uuids={device: gpu.uuid for device, gpu in gpus.items()}, pipe_root=self._pipe_root
        )
        async with self._prepare_lock:  # the checks and the write as one step: two prepares cannot both pass
            prepared = await asyncio.to_thread(read_prepared, self._cdi_dir, other_than=uid)
            pods = pod_shares(await self._pods_here(), gpus=gpus.values())
            in_use = modes_of(prepared)
            for gpu_uuid, modes in pod_modes(pods).items():
                for mode, holders in modes.items():
                    in_use.setdefault(gpu_uuid, {}).setdefault(mode, set()).update(holders)
            refuse_mixed_modes(shares, in_use=in_use)
            held = claim_holdings(prepared, gpus=gpus.values())
            for gpu_uuid, holdings in pod_holdings(pods).items():
                held.setdefault(gpu_uuid, []).extend(holdings)
            refuse_overcommit(shares, gpus=gpus.values(), held=held, claim=f"{namespace}/{name}")
            # A retried prepare of a claim already prepared (its containers may run) keeps its MPS setup
            # whatever happens now; a first one leaves nothing behind when it fails.
            undo = not spec_path(self._cdi_dir, uid).exists()
            shares = await self._with_mps(shares, uid=uid, undo=undo)
            try:
                await asyncio.to_thread(make_pipe_leaves, shares)
                spec = cdi_spec(uid, shares, claim=f"{namespace}/{name}")
                await asyncio.to_thread(write_spec, self._cdi_dir, uid, spec)
            except BaseException:
                if undo:
                    await self._release(keys=[cdi_device_name(uid, s.device) for s in shares])
                raise
            finally:
                for share in shares:
                    self._in_flight.pop(cdi_device_name(uid, share.device), None)
        return shares

    async def _with_mps(
        self, shares: tuple[PreparedShare, ...], *, uid: str, undo: bool
    ) -> tuple[PreparedShare, ...]:
        """Each share with its MPS setup (the hooks an annotation container's CreateContainer calls); on a
        failure (``MpsUnavailable``: the daemon is not serving) the error stands and the kubelet retries;
        with ``undo`` what was set up is released first."""
        if self._mps is None:
            return shares
        done: list[PreparedShare] = []
        try:
            for share in shares:
                key = cdi_device_name(uid, share.device)
                self._in_flight[key] = share.plan  # in the live set before its namespace exists
                plan = apply_adjustment(share.plan, await self._mps.on_create(share.plan, container_id=key))
                plan = read_only_shared_pipe(plan, shared_pipe_dir=self._shared_pipe_dir)
                done.append(replace(share, plan=plan))
        except BaseException:
            keys = [cdi_device_name(uid, s.device) for s in shares]
            if undo:
                await self._release(keys=keys)
            for key in keys:
                self._in_flight.pop(key, None)
            raise
        return tuple(done)

    async def _release(self, *, keys: list[str]) -> None:
        for key in keys:
            self._in_flight.pop(key, None)
            if self._mps is not None:
                await self._mps.on_remove(container_id=key)

    async def unprepare(self, *, uid: str) -> None:
        """Remove the claim's spec, then its shares' MPS setup (idempotent)."""
        async with self._prepare_lock:
            shares = await asyncio.to_thread(read_claim, self._cdi_dir, uid)
            await asyncio.to_thread(remove_spec, self._cdi_dir, uid, pipe_root=self._pipe_root)
            await self._release(keys=[d.key for d in shares])

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
