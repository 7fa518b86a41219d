"""The embedded cluster: every gpufrac component around a real control plane, on one machine, no GPU.

What runs, and what is real:

- the control plane: a REAL kube-apiserver with embedded etcd (testenv/controlplane);
- the admission webhook: ``gpufrac admission`` as a process, registered with the API server through
  the same two webhook configurations a cluster gets (failurePolicy Fail, scoped to GPU pods);
- the Queue CRD (``queues.gpufrac.io``), read from the chart's ``crds/`` as ``helm install`` reads it, so
  ``kubectl get queues`` works and the scheduler follows Queue objects as in a cluster (docs/queues.md);
- the scheduler: ``gpufrac scheduler`` as a process, under its own service account
  (``gpufrac-system/gpufrac-scheduler``, a token from the TokenRequest API), so the webhook's rule
  "only the scheduler writes binder-owned keys" holds here exactly as in a cluster;
- per simulated node: a Node object (what a kubelet would register), NRI's REAL runtime-side library
  (``gpufrac-nriruntime``, standing in for containerd, with NRI's default validator on as the real node's
  containerd has it) and ``gpufrac node-agent`` as a process with the SIMULATED GPU backend, connected to
  that runtime as an NRI plugin and publishing the node's GPUs, with its usage metrics on a local port
  (``metrics_urls``, what ``gpufrac top`` reads); beside it ``gpufrac node-agent-validator``, the agent's
  validating plugin (``node-agent-validator-<node>``), so a GPU container is refused, not created bare,
  while the agent is away, hung or restarting; the webhook names both plugins in every GPU container's
  NRI required-plugins annotation, so one is refused while the validator is away too;
- the simulated kubelet (in this process): creates the containers of bound pods through the node's
  runtime, so the node agent's injection is what the pod records.

Every process logs to ``<work dir>/logs/`` and is supervised as a Deployment's container would be
(``gpufrac.local.supervisor``: a process that exits is restarted with back-off, each exit logged with its
code); the simulated kubelet, a task of this process, is restarted the same way when its watch fails.
Metrics and health ports listen on 127.0.0.1 only: the embedded cluster is a developer's, not a
network's. ``stop()`` ends them all (SIGTERM, then SIGKILL), in the reverse order of starting, even when
starting failed half-way. The control plane itself is not restarted: everything else keeps its state in
it, so its death ends the session (``gpufrac up`` says so).

``Timings`` shortens the periods the components allow to be configured (lease renewal, the scheduler's
retry of unschedulable pods, the simulated kubelet's watch deadline and resync, the node heartbeat), so
the soak test sees many of each within minutes; the defaults are the components' own.

With ``runtime="containerd"`` the one node is REAL instead (``gpufrac.local.realnode``): containerd with
NRI, runc and a real kubelet, which registers the Node itself; the node agent (still with simulated
GPUs) is containerd's NRI plugin, and pods run as runc containers. It needs root and cgroups. containerd
and the kubelet are the real node's own processes; its node agent and validator are supervised as on
simulated nodes (``node-agent-<node>``, ``node-agent-validator-<node>``: a crashed agent comes back), as
are the control plane's other components. Its pods are Deployments' and DaemonSets' too, so
kube-controller-manager and kube-scheduler (testenv/bin, the API server's module graph) run beside the
API server, and the ServiceAccount admission plugin is on. On simulated nodes kube-controller-manager runs
too (Deployments, Jobs, ReplicaSets, claim templates, garbage collection), without its node lifecycle
controller (``SIMULATED_NODE_CONTROLLERS``), and no kube-scheduler: gpufrac-scheduler places every pod.
``with_gpufrac=False`` stops there: Kubernetes
and the real node, none of gpufrac's processes -- the cluster ``helm install`` deploys gpufrac into
(tests/install/).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import ssl
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx2
import yaml
from lightkube import AsyncClient
from lightkube.codecs import load_all_yaml
from lightkube.models.authentication_v1 import TokenRequestSpec
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.models.rbac_v1 import RoleRef, Subject
from lightkube.resources.apiextensions_v1 import CustomResourceDefinition
from lightkube.resources.core_v1 import ConfigMap, Namespace, Node, ServiceAccount, ServiceAccountToken
from lightkube.resources.rbac_authorization_v1 import ClusterRoleBinding as ClusterRoleBindingResource

from gpufrac.contract import keys
from gpufrac.kube.errors import Conflict, NotFound, api_errors
from gpufrac.local.controlplane import REPO_ROOT, ControlPlane
from gpufrac.local.dra import install_device_classes
from gpufrac.local.featuregates import feature_gates_flag
from gpufrac.local.kubelet import SimulatedKubelet
from gpufrac.local.nriruntime import NriRuntime
from gpufrac.local.realnode import TESTENV_BIN, RealNode
from gpufrac.local.simnodes import NodeShape, node_names, sim_node
from gpufrac.local.supervisor import Backoff, Component, Supervisor

log = logging.getLogger(__name__)

#: Where metrics and health endpoints listen: this machine only.
LOOPBACK = "127.0.0.1"

#: The Queue CRD where the chart has it (its ``crds/`` links to deploy/crds/): one manifest, installed by
#: ``helm install`` in a cluster and by ``start`` here.
QUEUE_CRD_FILE = REPO_ROOT / "deploy" / "helm" / "gpufrac" / "crds" / "gpufrac.io_queues.yaml"

SYSTEM_NAMESPACE = "gpufrac-system"
SCHEDULER_ACCOUNT = "gpufrac-scheduler"
SCHEDULER_USER = f"system:serviceaccount:{SYSTEM_NAMESPACE}:{SCHEDULER_ACCOUNT}"


#: kube-apiserver flags of a cluster with a real node, after the control plane's own (testenv/controlplane):
#: the ServiceAccount admission plugin back on (kube-controller-manager creates the accounts it looks up,
#: and it gives pods their token volume), and webhook and aggregated-API calls routed to the Service's
#: endpoints, the pod IPs on the node's bridge, as no kube-proxy makes ClusterIPs reachable here.
REAL_NODE_APISERVER_ARGS = ("--disable-admission-plugins=", "--enable-aggregator-routing=true")

#: kube-controller-manager's controllers on simulated nodes: all of its defaults but the node lifecycle
#: controller. No kubelet renews a simulated Node's Lease or Ready heartbeat, so that controller would
#: mark every simulated node unreachable after its grace period and taint it, and its pods would be
#: evicted: on the real node the kubelet keeps both fresh and every controller runs.
SIMULATED_NODE_CONTROLLERS = ("*", "-node-lifecycle-controller")

#: The node runtimes ``ClusterShape.runtime`` accepts.
RUNTIMES = ("simulated", "containerd")


class ClusterError(RuntimeError):
    """A component of the embedded cluster failed to start (the message says which, with its log)."""


async def install_queue_crd(client: AsyncClient, *, timeout_s: float = 30.0) -> None:
    """Apply the chart's Queue CRD and wait until the API server serves it: the scheduler probes for it
    once at start (then only every minute), so it must be Established before the scheduler starts (here,
    and in a benchmark that starts one: bench/mixed_load.py)."""
    try:
        manifest = QUEUE_CRD_FILE.read_text()
    except OSError as error:
        raise ClusterError(
            f"the Queue CRD manifest {QUEUE_CRD_FILE} cannot be read ({error.strerror}): the embedded "
            "cluster runs from a checkout of the gpufrac repository, which has it (make demo)"
        ) from error
    (crd,) = load_all_yaml(manifest)
    name = crd.metadata.name
    with api_errors():
        await client.apply(crd, field_manager="gpufrac-local", force=True)
    deadline = time.monotonic() + timeout_s
    while True:
        with api_errors():
            got = await client.get(CustomResourceDefinition, name)
        conditions = (got.status.conditions or []) if got.status else []
        if any(c.type == "Established" and c.status == "True" for c in conditions):
            return
        if time.monotonic() > deadline:
            raise ClusterError(f"CRD {name} (from {QUEUE_CRD_FILE}) not Established after {timeout_s:.0f}s")
        await asyncio.sleep(0.1)


@dataclass(frozen=True, slots=True)
class ClusterShape:
    """How many simulated GPU nodes, and what each has."""

    nodes: int = 2
    node: NodeShape = field(default_factory=lambda: NodeShape(gpus=4, model="H100-80GB"))
    prefix: str = "gpu-node-"
    policy: str | None = "binpack"
    #: None: the scheduler service's default policy (what ``gpufrac up`` runs unless told otherwise).
    #: ``simulated`` (NRI's runtime side + the simulated kubelet, any number of nodes) or ``containerd``
    #: (one real node: containerd, runc and a kubelet).
    runtime: str = "simulated"
    #: gpufrac's DRA driver (docs/dra.md): the node agent's ``--dra`` and the chart's DeviceClasses; only
    #: with ``containerd`` (a claim is prepared by a real kubelet).
    dra: bool = False

    def __post_init__(self) -> None:
        if self.runtime not in RUNTIMES:
            raise ValueError(f"runtime {self.runtime!r}: must be one of {', '.join(RUNTIMES)}")
        if self.dra and self.runtime != "containerd":
            raise ValueError(
                f"dra=True with runtime {self.runtime!r}: claims are prepared by a real kubelet, so DRA "
                "needs runtime 'containerd'"
            )
        if self.runtime == "containerd" and self.nodes != 1:
            raise ValueError(f"nodes={self.nodes} with runtime 'containerd': a real node is one per machine")

    @property
    def node_names(self) -> list[str]:
        return node_names(self.nodes, prefix=self.prefix)


@dataclass(frozen=True, slots=True)
class Timings:
    """Periods of the components, for tests that must see many of them; None keeps a component's default.

    Real-time and not configurable here: the API server's watch bookmarks (about one a minute per watch)
    and the scheduler's and node agents' own watch deadlines.
    """

    lease_duration_s: float | None = None
    lease_renew_deadline_s: float | None = None
    lease_retry_period_s: float | None = None
    """The scheduler's leader election: it renews its Lease every retry period."""
    unschedulable_resync_s: float | None = None
    """The scheduler retries unschedulable pods at least this often."""
    node_heartbeat_s: float | None = None
    node_publish_interval_s: float | None = None
    kubelet_watch_timeout_s: int | None = None
    """The simulated kubelet's watch deadline (the API server bookmarks 2 s before it, then ends it)."""
    kubelet_resync_s: float | None = None
    """The simulated kubelet's informer re-delivers its whole store this often."""
    restart: Backoff = field(default_factory=Backoff)

    def scheduler_config(self, *, policy: str | None) -> dict[str, Any]:
        """The scheduler's configuration; ``policy`` None leaves the scheduler service's default."""
        election: dict[str, Any] = {"lease_namespace": SYSTEM_NAMESPACE}
        for key, value in (
            ("lease_duration_s", self.lease_duration_s),
            ("renew_deadline_s", self.lease_renew_deadline_s),
            ("retry_period_s", self.lease_retry_period_s),
        ):
            if value is not None:
                election[key] = value
        config: dict[str, Any] = {"http_host": LOOPBACK, "leader_election": election}
        if policy is not None:
            config["policy"] = policy
        if self.unschedulable_resync_s is not None:
            config["unschedulable_resync_s"] = self.unschedulable_resync_s
        return config

    def node_agent_config(self) -> dict[str, Any]:
        # The nodes' GPUs are SIMULATED and nothing else uses them: a MIG mode change the scheduler asks
        # for (mig.dynamic) is completed with the simulated GPU reset, so an isolation pod on `gpufrac up`
        # gets its slice. On a real node allow_gpu_reset stays false unless the operator sets it.
        config: dict[str, Any] = {
            "health_host": LOOPBACK,
            "usage": {"metrics_host": LOOPBACK},
            "mig": {"allow_gpu_reset": True},
        }
        if self.node_heartbeat_s is not None:
            config["heartbeat_s"] = self.node_heartbeat_s
        if self.node_publish_interval_s is not None:
            config["publish_interval_s"] = self.node_publish_interval_s
        return config

    def kubelet_informer(self) -> dict[str, Any]:
        options: dict[str, Any] = {}
        if self.kubelet_watch_timeout_s is not None:
            options["watch_timeout"] = self.kubelet_watch_timeout_s
        if self.kubelet_resync_s is not None:
            options["resync_period"] = self.kubelet_resync_s
        return options


@dataclass(frozen=True, slots=True)
class KubeletFailure:
    """One failure of the simulated kubelet (restarted like the processes)."""

    error: str
    restart_in_s: float


class LocalCluster:
    """Start with ``await cluster.start()`` (or ``async with``); ``await cluster.stop()`` ends it all."""

    def __init__(
        self,
        *,
        shape: ClusterShape = ClusterShape(),
        work_dir: Path | None = None,
        timings: Timings = Timings(),
        with_gpufrac: bool = True,
        progress: Callable[[str], None] = lambda _msg: None,
    ) -> None:
        if not with_gpufrac and shape.runtime != "containerd":
            raise ValueError(
                f"with_gpufrac=False with runtime {shape.runtime!r}: only a real node (runtime "
                "'containerd') can run what `helm install` deploys"
            )
        self.shape = shape
        self.with_gpufrac = with_gpufrac
        self.timings = timings
        self._given_dir = work_dir
        self._progress = progress
        self.work_dir = Path(work_dir) if work_dir else Path(tempfile.mkdtemp(prefix="gpufrac-up-"))
        self.controlplane = ControlPlane(
            data_dir=self.work_dir / "controlplane",
            apiserver_args=REAL_NODE_APISERVER_ARGS if shape.runtime == "containerd" else (),
        )
        self.supervisor = Supervisor(backoff=timings.restart, report=progress)
        self._runtimes: dict[str, NriRuntime] = {}
        self.real_node: RealNode | None = None
        self.metrics_urls: dict[str, str] = {}  # node name → its agent's /metrics
        self.scheduler_url: str | None = None  # the scheduler's /metrics, /healthz, /readyz
        self._readiness: dict[str, tuple[str, Path | None]] = {}  # component → its /readyz (and CA)
        self.kubelet: SimulatedKubelet | None = None
        self.kubelet_failures: list[KubeletFailure] = []
        self._kubelet_task: asyncio.Task[None] | None = None
        self.client: AsyncClient | None = None

    async def __aenter__(self) -> LocalCluster:
        await self.start()
        return self

    async def __aexit__(self, *_exc: object) -> None:
        await self.stop()

    @property
    def kubeconfig(self) -> Path:
        return self.controlplane.kubeconfig

    @property
    def logs(self) -> Path:
        return self.work_dir / "logs"

    @property
    def runtimes(self) -> dict[str, NriRuntime]:
        """Each simulated node's NRI runtime (what stands in for containerd), by node name."""
        return dict(self._runtimes)

    def runtime_pids(self) -> dict[str, int]:
        """The NRI runtime process of each node (what stands in for containerd)."""
        return {node: pid for node, runtime in self._runtimes.items() if (pid := runtime.pid) is not None}

    @property
    def components(self) -> dict[str, Component]:
        """The supervised processes by name: ``admission``, ``scheduler``, ``node-agent-<node>``,
        ``node-agent-validator-<node>``, ``kube-controller-manager`` (and ``kube-scheduler`` with the real
        node)."""
        return self.supervisor.components

    # -- start ----------------------------------------------------------------------------------------

    async def start(self) -> None:
        self.logs.mkdir(parents=True, exist_ok=True)
        try:
            self._progress("starting the control plane (kube-apiserver + etcd)")
            await asyncio.to_thread(self.controlplane.start)
            self.client = self.controlplane.async_client(field_manager="gpufrac-local")
            if self.shape.runtime == "containerd":
                self._progress("starting kube-controller-manager and kube-scheduler")
                await self._start_kube_components()
            else:
                self._progress("starting kube-controller-manager (Deployments, Jobs, ReplicaSets, claims)")
                await self._start_kube_components(
                    kube_scheduler=False, controllers=SIMULATED_NODE_CONTROLLERS
                )
            if not self.with_gpufrac:
                # Kubernetes only, with a real node whose GPUs nothing of ours manages yet.
                await self._start_real_node()
                return
            self._progress("installing the Queue CRD")
            await self._install_queue_crd()
            self._progress("starting the admission webhook")
            await self._start_admission()
            await self._create_node_lease_namespace()
            if self.shape.runtime == "containerd":
                await self._start_real_node()
                if self.shape.dra:
                    self._progress("installing the chart's DRA DeviceClasses")
                    await install_device_classes(self.client, work_dir=self.work_dir)
            else:
                self._progress(f"registering {self.shape.nodes} simulated GPU nodes")
                await self._create_nodes()
                self._progress("starting a node agent and an NRI runtime per node")
                await asyncio.gather(*(self._start_node(name) for name in self.shape.node_names))
            await self._wait_nodes_published()
            self._progress("starting the scheduler")
            await self._start_scheduler()
            await self._name_local_agents()
            if self.shape.runtime == "simulated":
                self.kubelet = SimulatedKubelet(
                    client=self.client,
                    runtimes=self._runtimes,
                    informer_options=self.timings.kubelet_informer(),
                )
                self._kubelet_task = asyncio.create_task(
                    self._supervise_kubelet(self.kubelet), name="kubelet"
                )
        except BaseException:
            await self.stop()
            raise

    async def _supervise_kubelet(self, kubelet: SimulatedKubelet) -> None:
        """Run the simulated kubelet; when it fails, report it and run it again after the back-off."""
        quick = 0
        while True:
            started = time.monotonic()
            try:
                await kubelet.run()
                error = "returned"
            except Exception as failure:
                error = f"{type(failure).__name__}: {failure}"
            quick = self.timings.restart.quick_exits(ran_s=time.monotonic() - started, before=quick)
            delay = self.timings.restart.delay(quick)
            self.kubelet_failures.append(KubeletFailure(error=error, restart_in_s=delay))
            line = f"simulated kubelet failed ({error}); restart {len(self.kubelet_failures)} in {delay:.1f}s"
            log.info("%s", line)
            self._progress(line)
            await asyncio.sleep(delay)

    async def wait_ready(self, name: str, *, timeout_s: float = 60.0) -> None:
        """Wait until component ``name`` runs and answers its readiness probe (after a restart too)."""
        url, ca_file = self._readiness[name]
        await self._wait_http(
            self.components[name], url, ca_file=ca_file, timeout_s=timeout_s, starting=False
        )

    def _spawn(self, name: str, argv: list[str]) -> Component:
        return self.supervisor.start(name, argv, log=self.logs / f"{name}.log")

    def _write_config(self, name: str, config: dict[str, Any]) -> Path:
        path = self.work_dir / f"{name}.yaml"
        path.write_text(yaml.safe_dump(config, sort_keys=True))
        return path

    def _failed(self, process: Component, what: str) -> ClusterError:
        tail = "\n".join(process.log.read_text(errors="replace").splitlines()[-20:])
        return ClusterError(f"{process.name}: {what}; last lines of {process.log}:\n{tail}")

    async def _start_admission(self) -> None:
        port = _free_port()
        tls_dir = self.work_dir / "admission-tls"
        configuration = self.work_dir / "webhooks.yaml"
        process = self._spawn(
            "admission",
            [
                *_gpufrac(),
                "admission",
                f"--host={LOOPBACK}",
                f"--port={port}",
                f"--tls-dir={tls_dir}",
                f"--write-configuration={configuration}",
                f"--scheduler-user={SCHEDULER_USER}",
                # Every node here runs the agent's validator beside the agent: GPU containers require both.
                f"--required-nri-plugin={keys.NRI_PLUGIN_NAME}",
                f"--required-nri-plugin={keys.NRI_VALIDATOR_PLUGIN_NAME}",
                "--log-format=text",
            ],
        )
        await self._wait_http(process, f"https://{LOOPBACK}:{port}/readyz", ca_file=tls_dir / "ca.crt")
        assert self.client is not None
        for obj in load_all_yaml(configuration.read_text()):
            with api_errors():
                await self.client.create(obj)

    async def _wait_http(
        self,
        process: Component,
        url: str,
        *,
        ca_file: Path | None = None,
        insecure: bool = False,
        timeout_s: float = 60.0,
        starting: bool = True,
    ) -> None:
        """Wait for ``url`` to answer 200 (over TLS trusting ``ca_file``, once the process wrote it, or
        with ``insecure`` any certificate: a Kubernetes component's self-signed one).

        While ``starting``, an exit is a failure to start; later, the supervisor restarts it and this
        waits for the new process.
        """
        self._readiness.setdefault(process.name, (url, ca_file))
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if starting and (process.exits or process.popen.poll() is not None):
                code = process.exits[0].code if process.exits else process.popen.returncode
                raise self._failed(process, f"exited with {code}")
            if ca_file is None or ca_file.exists():
                verify: ssl.SSLContext | bool = (
                    ssl.create_default_context(cafile=str(ca_file)) if ca_file else not insecure
                )
                try:
                    async with httpx2.AsyncClient(verify=verify, trust_env=False, timeout=2.0) as http:
                        if (await http.get(url)).status_code == 200:
                            return
                except (httpx2.HTTPError, OSError, ssl.SSLError):
                    pass
            await asyncio.sleep(0.2)
        raise self._failed(process, f"not ready at {url} after {timeout_s:.0f}s")

    async def _install_queue_crd(self, timeout_s: float = 30.0) -> None:
        assert self.client is not None
        await install_queue_crd(self.client, timeout_s=timeout_s)

    async def _create_node_lease_namespace(self) -> None:
        """Where the node agents renew their heartbeat Leases (the chart creates it in a cluster)."""
        assert self.client is not None
        try:
            with api_errors():
                await self.client.create(Namespace(metadata=ObjectMeta(name=keys.NODE_LEASE_NAMESPACE)))
        except Conflict as error:
            if not error.already_exists:
                raise

    async def _create_nodes(self) -> None:
        """Node objects as a kubelet registers them: no GPU inventory (the node agent publishes it)."""
        assert self.client is not None
        for name in self.shape.node_names:
            node = sim_node(name=name, shape=self.shape.node, agent_published=True)
            try:
                with api_errors():
                    await self.client.create(node)
            except Conflict as error:
                if not error.already_exists:
                    raise
            # The status is dropped on create; a kubelet reports it right after registering.
            with api_errors():
                await self.client.patch(Node.Status, name, {"status": node.status.to_dict()})
                await self.client.patch(
                    Node, name, {"spec": {"taints": [t.to_dict() for t in node.spec.taints]}}
                )

    async def _start_node(self, name: str) -> None:
        node_dir = self.work_dir / "nodes" / name
        node_dir.mkdir(parents=True, exist_ok=True)
        # NRI's default validator on, as containerd is configured on the real node (docs/deploy.md): a GPU
        # container is refused while the agent is not connected, and the agent's validator beside it
        # refuses one whose adjustment lacks the injection (a hung or killed agent).
        runtime = NriRuntime(
            socket_path=node_dir / "nri.sock", cgroup_root=node_dir / "cgroupfs", default_validator=True
        )
        await runtime.start()
        self._runtimes[name] = runtime
        validator_port = _free_port()
        validator = self._spawn(
            f"node-agent-validator-{name}",
            [
                *_gpufrac(),
                "node-agent-validator",
                f"--nri-socket={runtime.socket_path}",
                f"--health-host={LOOPBACK}",
                f"--health-port={validator_port}",
                "--log-format=text",
            ],
        )
        shape = self.shape.node
        metrics_port, health_port = _free_port(), _free_port()
        # The simulated driver keys limits by the runtime's (simulated) cgroup directories.
        agent_config = {**self.timings.node_agent_config(), "cgroup_root": str(runtime.cgroup_root)}
        config = self._write_config(f"node-agent-{name}", agent_config)
        process = self._spawn(
            f"node-agent-{name}",
            [
                *_gpufrac(),
                "node-agent",
                f"--config={config}",
                f"--node-name={name}",
                f"--kubeconfig={self.kubeconfig}",
                f"--nri-socket={runtime.socket_path}",
                "--backend=simulated",
                f"--sim-gpus={shape.gpus}x{shape.model}:{shape.mib}",
                f"--state-dir={node_dir / 'state'}",
                f"--health-port={health_port}",
                f"--metrics-port={metrics_port}",
                # No CRI runtime here (the NRI runtime side only): nothing to audit against.
                "--no-audit",
                "--log-format=text",
            ],
        )
        self.metrics_urls[name] = f"http://{LOOPBACK}:{metrics_port}/metrics"
        # Ready means registered and synchronized with the NRI runtime (gpufrac.node.agent).
        await self._wait_http(validator, f"http://{LOOPBACK}:{validator_port}/readyz")
        await self._wait_http(process, f"http://{LOOPBACK}:{health_port}/readyz")

    async def _start_real_node(self) -> None:
        assert self.client is not None
        (name,) = self.shape.node_names
        node = RealNode(
            name=name,
            kubeconfig=self.kubeconfig,
            client=self.client,
            work_dir=self.work_dir / "nodes" / name,
            logs=self.logs,
            shape=self.shape.node,
            agent_argv=_gpufrac,
            apiserver=self.controlplane.server,
            with_agent=self.with_gpufrac,
            progress=self._progress,
            dra=self.shape.dra,
            supervisor=self.supervisor,
        )
        self.real_node = node
        await node.start()
        if self.with_gpufrac:
            self.metrics_urls[name] = node.metrics_url

    async def _start_kube_components(
        self, *, kube_scheduler: bool = True, controllers: tuple[str, ...] = ("*",)
    ) -> None:
        """kube-controller-manager and kube-scheduler, as the admin, on loopback ports of their own, with
        the embedded cluster's feature gates (``local.featuregates``: the scheduler allocates and the
        controller manager expands ResourceClaimTemplates and deallocates claims with them).
        ``controllers`` is the controller manager's ``--controllers``; without ``kube_scheduler`` only the
        controller manager runs (simulated nodes: gpufrac-scheduler places every pod there).

        The controller manager signs legacy ServiceAccount token Secrets with the API server's own
        service-account key (``--service-account-private-key-file``; the API server verifies tokens
        with its public half), publishes the cluster CA as each namespace's ``kube-root-ca.crt``
        (``--root-ca-file``, which every projected token volume needs) and runs each controller under
        its own ServiceAccount, with the RBAC roles the API server bootstraps for it. No leader
        election: one of each runs. Both serve ``/healthz`` over TLS with a self-signed certificate
        (``--cert-dir``), authenticated and authorized by delegation to the API server.
        """
        kubeconfig = str(self.kubeconfig)
        pki = self.controlplane.ca_file.parent
        common = [
            f"--kubeconfig={kubeconfig}",
            f"--authentication-kubeconfig={kubeconfig}",
            f"--authorization-kubeconfig={kubeconfig}",
            "--leader-elect=false",
            f"--bind-address={LOOPBACK}",
            "--v=1",
            *filter(None, [feature_gates_flag()]),
        ]
        controller_manager, scheduler = (
            TESTENV_BIN / "kube-controller-manager",
            TESTENV_BIN / "kube-scheduler",
        )
        for binary in (controller_manager, scheduler) if kube_scheduler else (controller_manager,):
            if not binary.exists():
                raise ClusterError(f"missing {binary}: build it with `make testenv`")
        started = []
        for name, binary, flags in (
            (
                "kube-controller-manager",
                controller_manager,
                [
                    f"--service-account-private-key-file={pki / 'sa.key'}",
                    f"--root-ca-file={self.controlplane.ca_file}",
                    "--use-service-account-credentials=true",
                    f"--controllers={','.join(controllers)}",
                ],
            ),
            *([("kube-scheduler", scheduler, [])] if kube_scheduler else []),
        ):
            port = _free_port()
            process = self._spawn(
                name,
                [
                    str(binary),
                    *common,
                    *flags,
                    f"--secure-port={port}",
                    f"--cert-dir={self.work_dir / name}",
                ],
            )
            started.append((process, f"https://{LOOPBACK}:{port}/healthz"))
        for process, url in started:
            await self._wait_http(process, url, insecure=True)
        await self._wait_default_service_account()

    async def _wait_default_service_account(self, timeout_s: float = 60.0) -> None:
        """Wait for ``default/default``: with the ServiceAccount admission plugin on, a pod in a
        namespace is refused until the controller manager has created that namespace's account."""
        assert self.client is not None
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                with api_errors():
                    await self.client.get(ServiceAccount, "default", namespace="default")
                return
            except NotFound:
                if time.monotonic() > deadline:
                    raise ClusterError(
                        f"kube-controller-manager created no default/default ServiceAccount within "
                        f"{timeout_s:.0f}s (see {self.logs / 'kube-controller-manager.log'})"
                    ) from None
                await asyncio.sleep(0.2)

    async def _wait_nodes_published(self, timeout_s: float = 60.0) -> None:
        assert self.client is not None
        deadline = time.monotonic() + timeout_s
        pending = set(self.shape.node_names)
        while pending and time.monotonic() < deadline:
            for name in sorted(pending):
                node = await self.client.get(Node, name)
                annotations = node.metadata.annotations or {}
                conditions = {c.type: c.status for c in (node.status.conditions or [])} if node.status else {}
                if (
                    annotations.get(keys.NODE_GPUS_ANNOTATION)
                    and conditions.get(keys.NODE_READY_CONDITION) == "True"
                ):
                    pending.discard(name)
            if pending:
                await asyncio.sleep(0.2)
        if pending:
            raise ClusterError(
                f"node agents did not publish {sorted(pending)} within {timeout_s:.0f}s (see {self.logs})"
            )

    async def _start_scheduler(self) -> None:
        kubeconfig = await self._scheduler_kubeconfig()
        port = _free_port()
        config = self._write_config("scheduler", self.timings.scheduler_config(policy=self.shape.policy))
        process = self._spawn(
            "scheduler",
            [
                *_gpufrac(),
                "scheduler",
                f"--config={config}",
                f"--kubeconfig={kubeconfig}",
                f"--http-port={port}",
                # A Deployment's restarted container keeps its pod name, so it takes its own Lease back
                # at once instead of waiting for it to expire.
                f"--identity={SCHEDULER_ACCOUNT}-0",
                "--log-format=text",
            ],
        )
        self.scheduler_url = f"http://{LOOPBACK}:{port}"
        await self._wait_http(process, f"{self.scheduler_url}/readyz")

    async def _name_local_agents(self) -> None:
        """The node agents' metrics URLs in a ConfigMap (``keys.LOCAL_NODE_AGENTS_CONFIGMAP``): they are
        local processes here, not the DaemonSet's pods ``kubectl gpufrac top`` looks for first."""
        assert self.client is not None
        config_map = ConfigMap(
            metadata=ObjectMeta(
                name=keys.LOCAL_NODE_AGENTS_CONFIGMAP, namespace=keys.LOCAL_NODE_AGENTS_NAMESPACE
            ),
            data=dict(sorted(self.metrics_urls.items())),
        )
        with api_errors():
            await self.client.apply(config_map, field_manager="gpufrac-local", force=True)

    async def _scheduler_kubeconfig(self) -> Path:
        """A kubeconfig for the scheduler's own service account, with a TokenRequest token."""
        assert self.client is not None
        for obj in (
            Namespace(metadata=ObjectMeta(name=SYSTEM_NAMESPACE)),
            ServiceAccount(metadata=ObjectMeta(name=SCHEDULER_ACCOUNT, namespace=SYSTEM_NAMESPACE)),
            ClusterRoleBindingResource(
                metadata=ObjectMeta(name="gpufrac-scheduler-local"),
                # The embedded cluster grants cluster-admin for brevity; deploy/ grants the narrow role.
                roleRef=RoleRef(
                    apiGroup="rbac.authorization.k8s.io", kind="ClusterRole", name="cluster-admin"
                ),
                subjects=[Subject(kind="ServiceAccount", name=SCHEDULER_ACCOUNT, namespace=SYSTEM_NAMESPACE)],
            ),
        ):
            try:
                with api_errors():
                    await self.client.create(obj)
            except Conflict as error:
                if not error.already_exists:
                    raise
        with api_errors():
            token = await self.client.create(
                ServiceAccountToken(
                    metadata=ObjectMeta(), spec=TokenRequestSpec(audiences=[], expirationSeconds=24 * 3600)
                ),
                name=SCHEDULER_ACCOUNT,
                namespace=SYSTEM_NAMESPACE,
            )
        admin = yaml.safe_load(self.kubeconfig.read_text())
        cluster = admin["clusters"][0]
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [cluster],
            "users": [{"name": SCHEDULER_ACCOUNT, "user": {"token": token.status.token}}],
            "contexts": [
                {"name": "scheduler", "context": {"cluster": cluster["name"], "user": SCHEDULER_ACCOUNT}}
            ],
            "current-context": "scheduler",
        }
        path = self.work_dir / "scheduler.kubeconfig"
        path.write_text(yaml.safe_dump(config))
        path.chmod(0o600)
        return path

    # -- stop -----------------------------------------------------------------------------------------

    async def stop(self) -> None:
        """End everything this cluster started, newest first; safe to call twice."""
        try:
            if self._kubelet_task is not None:
                self._kubelet_task.cancel()
                await asyncio.gather(self._kubelet_task, return_exceptions=True)
                self._kubelet_task = None
            await self.supervisor.stop()
            if self.real_node is not None:
                await self.real_node.stop()
                self.real_node = None
            self.metrics_urls.clear()
            for runtime in self._runtimes.values():
                with contextlib.suppress(Exception):
                    await runtime.stop()
            self._runtimes.clear()
            if self.client is not None:
                with contextlib.suppress(Exception):
                    await self.client.close()
                self.client = None
        finally:
            # The control plane last: the components above talk to it while they stop.
            await asyncio.to_thread(self.controlplane.stop)
            if self._given_dir is None:
                shutil.rmtree(self.work_dir, ignore_errors=True)


def _gpufrac() -> list[str]:
    """How to start a gpufrac component: the same interpreter, so the same installation."""
    return [sys.executable, "-m", "gpufrac"]


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind((LOOPBACK, 0))
        return int(sock.getsockname()[1])
