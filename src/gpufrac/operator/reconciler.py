"""The operator service: GpuFractioningConfigs in, node-agent DaemonSets and config status out.

Level-triggered, like every Kubernetes controller: a change only marks a config dirty, and reconciling a
config looks at everything afresh (the config, its DaemonSet, the Nodes, all from the informers) and
makes the cluster match. So a missed or repeated event costs nothing, and a restart needs no memory.

What marks a config dirty: the config itself; a DaemonSet carrying its ``gpufrac.io/config`` label (its
controller's numbers changed, or someone edited or deleted it); a Node whose labels or agent condition
changed (a Node heartbeat is not a change, so a large cluster does not keep the operator busy).

Writes. The DaemonSet goes out by server-side apply under the field manager ``gpufrac-operator``, forced:
the operator owns the fields it renders, and someone's hand edit of them is undone. It is applied only
when the hash annotation of the rendered manifest differs from the one on the cluster, or when the
DaemonSet's generation moved since this replica applied it (a hand edit). The status is
written through the status subresource only when it differs from what the config shows. A config that is
deleted has its DaemonSets deleted explicitly as well: the ownerReference lets the garbage collector do it
in a cluster, but the operator does not rely on a controller it cannot see.

Nodes whose agent fell silent (its heartbeat Lease expired) have their readiness condition marked Unknown
by the leader (``gpufrac.operator.silent_agents``), from a fourth informer on the node Leases.

Two replicas: both keep informers current; only the Lease holder writes, and it checks ``is_leader``
right before each write. Losing the lease ends ``run()`` with ``LeadershipLost`` (the process exits 1 and
comes back as a standby), as the scheduler does.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import httpx2
from lightkube import AsyncClient
from lightkube.resources.apps_v1 import DaemonSet
from lightkube.resources.coordination_v1 import Lease
from lightkube.resources.core_v1 import Node
from lightkube.types import PatchType
from prometheus_client import CollectorRegistry, Counter, Gauge

from gpufrac.contract import keys
from gpufrac.kube.errors import KubeError, NotFound, api_errors
from gpufrac.kube.informer import Informer, object_key
from gpufrac.kube.lease import LeaseTiming
from gpufrac.kube.patch import merge_patch
from gpufrac.kube.stream import ALL_NAMESPACES, Selection
from gpufrac.operator.render import (
    CONFIG_LABEL,
    HASH_ANNOTATION,
    MANAGED_BY,
    node_gpu_count,
    render_daemonset,
    sized_gpu_count,
)
from gpufrac.operator.resource import GpuFractioningConfig, read_config
from gpufrac.operator.silent_agents import SilentAgents
from gpufrac.operator.status import DaemonSetView, NodeView, compute_status, selects
from gpufrac.process.build_info import register_build_info
from gpufrac.process.controller import ControllerRunner, Election, Handler, default_identity

log = logging.getLogger(__name__)

COMPONENT = "gpufrac-operator"
FIELD_MANAGER = "gpufrac-operator"


@dataclass(frozen=True, slots=True)
class OperatorSettings:
    http_host: str = "0.0.0.0"
    http_port: int = 8080
    leader_elect: bool = True
    lease_name: str = "gpufrac-operator"
    lease_namespace: str = "gpufrac-system"
    lease_timing: LeaseTiming = field(default_factory=LeaseTiming)
    #: Every config is reconciled again this often even without a change (a lost write is retried).
    resync_s: float = 300.0
    retry_initial_s: float = 0.5
    retry_max_s: float = 30.0
    #: A managed node whose agent has not renewed its Lease for this long is marked Unknown.
    node_heartbeat_expiry_s: float = 180.0


class _Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        register_build_info(self.registry, component="operator")
        self.reconciles = Counter(
            "gpufrac_operator_reconciles", "Config reconciles by result.", ["result"], registry=self.registry
        )
        self.leader = Gauge(
            "gpufrac_operator_is_leader", "1 while this replica leads.", registry=self.registry
        )
        self.nodes = Gauge(
            "gpufrac_operator_config_nodes",
            "Per config: desired and ready agents, selected nodes below the driver gate.",
            ["config", "state"],
            registry=self.registry,
        )

    def set_config(self, name: str, status: dict[str, Any]) -> None:
        self.nodes.labels(name, "desired").set(status["desiredNodes"])
        self.nodes.labels(name, "ready").set(status["readyNodes"])
        self.nodes.labels(name, "below_min_driver").set(status["nodesBelowMinDriver"])

    def forget_config(self, name: str) -> None:
        for state in ("desired", "ready", "below_min_driver"):
            with contextlib.suppress(KeyError):
                self.nodes.remove(name, state)


class Operator:
    """Run with ``await operator.run()``; cancel the task to stop it cleanly."""

    def __init__(
        self,
        *,
        client: AsyncClient,
        settings: OperatorSettings = OperatorSettings(),
        identity: str | None = None,
        lease_client: AsyncClient | None = None,
    ) -> None:
        self.settings = settings
        self.identity = identity or default_identity()
        self._client = client
        self.configs: Informer[Any] = Informer(
            client=client, resource=GpuFractioningConfig, resync_period=settings.resync_s, name="configs"
        )
        self.daemonsets: Informer[DaemonSet] = Informer(
            client=client,
            resource=DaemonSet,
            selection=Selection(
                namespace=ALL_NAMESPACES, labels=f"app.kubernetes.io/managed-by={MANAGED_BY}"
            ),
            name="daemonsets",
        )
        self.nodes: Informer[Node] = Informer(client=client, resource=Node, name="nodes")
        self.configs.add_handler(Handler(changed=self._config_changed, deleted=self._config_deleted))
        self.daemonsets.add_handler(Handler(changed=self._daemonset_changed, deleted=self._daemonset_deleted))
        self.nodes.add_handler(Handler(changed=self._node_changed, deleted=self._node_deleted))
        self.leases: Informer[Lease] = Informer(
            client=client,
            resource=Lease,
            selection=Selection(namespace=keys.NODE_LEASE_NAMESPACE),
            name="node-leases",
        )
        self.silent_agents = SilentAgents(
            client=client,
            nodes=self.nodes,
            leases=self.leases,
            expiry_s=settings.node_heartbeat_expiry_s,
            is_leader=self.is_leader,
        )
        self.leases.add_handler(Handler(changed=self._lease_changed, deleted=self._lease_deleted))

        self.metrics = _Metrics()
        self.runner = ControllerRunner(
            name="operator",
            client=client,
            identity=self.identity,
            informers=(self.configs, self.daemonsets, self.nodes, self.leases),
            lead=self._work,
            background=(self.silent_agents.run,),
            registry=self.metrics.registry,
            http_host=settings.http_host,
            http_port=settings.http_port,
            election=Election(
                lease_name=settings.lease_name,
                lease_namespace=settings.lease_namespace,
                timing=settings.lease_timing,
            )
            if settings.leader_elect
            else None,
            lease_client=lease_client,
        )
        self.elector = self.runner.elector
        self._dirty: set[str] = set()
        #: DaemonSet key -> (hash, generation) of this replica's last apply.
        self._applied: dict[str, tuple[str, int | None]] = {}
        self._wake = asyncio.Event()
        self._failures: dict[str, int] = {}
        self._retries: dict[str, asyncio.TimerHandle] = {}

    # -- running ------------------------------------------------------------------------------------------

    @property
    def probe_port(self) -> int:
        return self.runner.probe_port

    @property
    def synced(self) -> bool:
        return self.runner.synced

    def is_leader(self) -> bool:
        return self.runner.is_leader()

    @property
    def reconciling(self) -> bool:
        """True once this replica leads and works through configs."""
        return self.runner.working

    async def run(self) -> None:
        await self.runner.run()

    async def _work(self) -> None:
        """The leader's work (started by the runner once synced and leading); stops writing when
        cancelled, before the lease is handed over."""
        try:
            await self._reconcile_forever()
        finally:
            for handle in self._retries.values():
                handle.cancel()
            self.metrics.leader.set(0)

    async def _reconcile_forever(self) -> None:
        self.metrics.leader.set(1)
        log.info("reconciling %d configs as leader %s", len(self.configs.store), self.identity)
        # Everything once: configs changed while no one led, DaemonSets whose config is gone.
        self._dirty.update(self.configs.store.keys())
        self._dirty.update(_config_of(ds) for ds in self.daemonsets.store if _config_of(ds))
        self._wake.set()
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._dirty:
                name = self._dirty.pop()
                try:
                    settled = await self.reconcile(name)
                except (KubeError, httpx2.HTTPError, OSError) as error:
                    self.metrics.reconciles.labels("error").inc()
                    self._retry_later(name, error)
                except Exception as error:
                    # A bug met by one config must not stop the others: log it, retry with backoff.
                    log.exception("reconciling %s failed unexpectedly", name, extra={"config": name})
                    self.metrics.reconciles.labels("error").inc()
                    self._retry_later(name, error)
                else:
                    if settled:
                        self.metrics.reconciles.labels("ok").inc()
                        self._failures.pop(name, None)
                    else:
                        self.metrics.reconciles.labels("error").inc()
                        self._retry_later(name, RuntimeError("the DaemonSet could not be written"))
                await asyncio.sleep(0)

    def _retry_later(self, name: str, error: BaseException) -> None:
        failures = self._failures[name] = self._failures.get(name, 0) + 1
        delay = min(self.settings.retry_max_s, self.settings.retry_initial_s * 2 ** (failures - 1))
        log.warning(
            "reconciling %s failed (%s), retrying in %.1fs", name, error, delay, extra={"config": name}
        )
        old = self._retries.pop(name, None)
        if old is not None:
            old.cancel()
        self._retries[name] = asyncio.get_running_loop().call_later(delay, self._enqueue, name)

    def _enqueue(self, name: str) -> None:
        self._retries.pop(name, None)
        self._dirty.add(name)
        self._wake.set()

    # -- reconciling --------------------------------------------------------------------------------------

    async def reconcile(self, name: str) -> bool:
        """Make the DaemonSet and the status of config ``name`` match the cluster.

        Transient failures raise; a DaemonSet the API refuses (missing namespace, RBAC) is reported in the
        status and answered False, so it is retried with backoff until a person fixes the cause.
        """
        obj = self.configs.store.get(name)
        owned = [ds for ds in self.daemonsets.store if _config_of(ds) == name]
        if obj is None or obj.metadata.deletionTimestamp is not None:
            for ds in owned:
                await self._delete(ds, why="its config is gone")
                self._applied.pop(object_key(ds), None)
            self.metrics.forget_config(name)
            return True
        try:
            spec = read_config(obj)
        except ValueError as error:
            log.error("config %s cannot be rendered: %s", name, error, extra={"config": name})
            return True
        gpus = sized_gpu_count(
            node_gpu_count(labels)
            for node in self.nodes.store
            if selects(spec.agent.node_selector, labels := dict(node.metadata.labels or {}))
        )
        desired = render_daemonset(spec, gpus_per_node=gpus)
        key = f"{spec.namespace}/{desired['metadata']['name']}"
        for ds in owned:
            if object_key(ds) != key:
                await self._delete(ds, why=f"config {name} now runs its agent as {key}")
        current = self.daemonsets.store.get(key)
        want = desired["metadata"]["annotations"][HASH_ANNOTATION]
        apply_error: str | None = None
        # Apply when the rendering changed, or when the spec changed since our own last apply (someone
        # edited it: its generation moved). After a restart every DaemonSet is applied once.
        if (
            current is None
            or _hash_of(current) != want
            or self._applied.get(key) != (want, current.metadata.generation)
        ):
            try:
                current = await self._apply(desired)
                if current is not None:
                    self._applied[key] = (want, current.metadata.generation)
            except KubeError as error:
                if error.code in (0, 409, 429) or error.code >= 500:
                    raise
                # 404 (namespace missing), 403, 422: a person must act; say so in the status.
                apply_error = str(error)
                log.error("could not write DaemonSet %s: %s", key, error, extra={"config": name})
        status = compute_status(
            config=spec,
            daemonset=DaemonSetView.of(current) if current is not None else None,
            nodes=[NodeView.of(node) for node in self.nodes.store],
            apply_error=apply_error,
            previous=obj.status,
            now=datetime.now(UTC),
        )
        self.metrics.set_config(name, status)
        if status != (obj.status or {}) and self.is_leader():
            await merge_patch(self._client, GpuFractioningConfig.Status, name=name, patch={"status": status})
        return apply_error is None

    async def _apply(self, manifest: dict[str, Any]) -> DaemonSet | None:
        meta = manifest["metadata"]
        if not self.is_leader():
            return None
        log.info("applying DaemonSet %s/%s", meta["namespace"], meta["name"], extra={"config": _owner(meta)})
        with api_errors():
            return await self._client.patch(  # type: ignore[no-any-return]
                DaemonSet,
                meta["name"],
                manifest,
                namespace=meta["namespace"],
                patch_type=PatchType.APPLY,
                field_manager=FIELD_MANAGER,
                force=True,
            )

    async def _delete(self, ds: DaemonSet, *, why: str) -> None:
        if not self.is_leader():
            return
        log.info("deleting DaemonSet %s: %s", object_key(ds), why)
        with contextlib.suppress(NotFound), api_errors():
            await self._client.delete(DaemonSet, ds.metadata.name, namespace=ds.metadata.namespace)

    # -- events -------------------------------------------------------------------------------------------

    def _mark(self, name: str) -> None:
        self._dirty.add(name)
        self._wake.set()

    def _config_changed(self, old: Any, new: Any) -> None:
        self._mark(new.metadata.name)

    def _config_deleted(self, obj: Any) -> None:
        self._mark(obj.metadata.name)

    def _daemonset_changed(self, old: DaemonSet | None, new: DaemonSet) -> None:
        self._daemonset_deleted(new)

    def _daemonset_deleted(self, ds: DaemonSet) -> None:
        name = _config_of(ds)
        if name:
            self._mark(name)

    def _lease_changed(self, old: Lease | None, new: Lease) -> None:
        self.silent_agents.changed()

    def _lease_deleted(self, lease: Lease) -> None:
        self.silent_agents.changed()

    def _node_changed(self, old: Node | None, new: Node) -> None:
        self.silent_agents.changed()
        if old is not None and NodeView.of(old) == NodeView.of(new):
            return
        self._node_deleted(new)

    def _node_deleted(self, node: Node) -> None:
        self.silent_agents.changed()
        for name in self.configs.store.keys():  # noqa: SIM118 (a Store, not a dict)
            self._mark(name)


def _config_of(ds: DaemonSet) -> str:
    return (ds.metadata.labels or {}).get(CONFIG_LABEL, "")


def _hash_of(ds: DaemonSet) -> str | None:
    return (ds.metadata.annotations or {}).get(HASH_ANNOTATION)


def _owner(meta: dict[str, Any]) -> str:
    return str(meta["labels"].get(CONFIG_LABEL, ""))


__all__ = ["COMPONENT", "FIELD_MANAGER", "Operator", "OperatorSettings"]
