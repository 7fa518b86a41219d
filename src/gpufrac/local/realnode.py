"""A real Kubernetes node on this machine: containerd 2.x with NRI, runc and a real kubelet.

The simulated kubelet (``gpufrac.local.kubelet``) shows what the node agent injects; this shows that it
happens in the real stack: the kubelet asks containerd's CRI to run the pod, containerd asks its NRI
plugins (our node agent) to adjust each container, and runc starts the process with the result. The
environment a test reads from ``/proc/<pid>/environ`` of the container's process is what the workload
really gets.

What is real and what is not:

- containerd (testenv/containerd, built from github.com/containerd/containerd/v2), Debian's runc, the
  kubelet (testenv/controlplane's module graph, so the API server's version) and the node agent are the
  programs a cluster runs; the kubelet registers the Node itself, with the managed label and taint.
- The GPUs are SIMULATED (the node agent's ``--backend=simulated``): this machine has none, no NVIDIA
  driver and no MPS. Nothing else is.
- Images come from no registry: ``gpufrac.local.ociimage`` writes a pause and a busybox image, imported
  with ``ctr images import``.
- The pod network is Debian's CNI plugins (a bridge with host-local addresses); the tests use host
  networking, which needs none of it, but the kubelet reports the node NotReady until the runtime's
  network is ready.

Settings that a container-in-a-VM test node needs, NOT production settings (docs/development.md):
kubelet ``cgroupDriver: cgroupfs``, ``cgroupsPerQOS: false``, ``enforceNodeAllocatable: []``,
``failSwapOn: false``, ``failCgroupV1: false`` (Kubernetes 1.35+ refuses a cgroup v1 host otherwise);
containerd's CRI ``restrict_oom_score_adj = true`` (the processes here lack CAP_SYS_RESOURCE, and runc
otherwise fails every sandbox with "can't get final child's PID from pipe: EOF"); the native snapshotter
(no overlay mount needed). Everything lives under one work directory:
sockets, containerd's root and state, the kubelet's root, pod logs.

It needs root and a mounted cgroup hierarchy; ``missing_requirements`` says what is missing.

containerd's built-in NRI validator is on: a pod that names our plugin in NRI's
``required-plugins.noderesource.dev`` annotation is refused by containerd itself while the node agent is
not connected. Beside the agent runs its validating plugin, ``gpufrac node-agent-validator``, as a
process of its own (as it is a container of its own in the agent's DaemonSet pod): it refuses a GPU
container whose final adjustment lacks the agent's injection, which is what keeps a GPU container from
starting without its limits while the agent hangs, dies or answers late (``gpufrac.node.nri.validator``).
``start_agent`` starts it when it is not running; ``stop_agent`` and ``kill_agent`` end the agent only.

Given a ``supervisor`` (``gpufrac up`` passes the embedded cluster's), the agent and its validator are
supervised as the DaemonSet's kubelet would keep them: one that exits is restarted with back-off, each
exit logged and counted (components ``node-agent-<node>`` and ``node-agent-validator-<node>``, as on
simulated nodes). ``stop_agent``, ``kill_agent`` and ``stop_validator`` take the process out of
supervision first: a test that ends the agent on purpose keeps it down until ``start_agent``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import socket
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import yaml
from lightkube import AsyncClient
from lightkube.resources.core_v1 import Node, Pod

from gpufrac.contract import keys
from gpufrac.contract.keys import CDI_GPU_KIND
from gpufrac.kube.errors import KubeError, api_errors
from gpufrac.local import ociimage
from gpufrac.local.featuregates import FEATURE_GATES
from gpufrac.local.processes import Spawned, spawn, terminate
from gpufrac.local.simnodes import NodeShape, gpu_uuid
from gpufrac.local.supervisor import Component, Supervisor
from gpufrac.mig.geometry import Slice
from gpufrac.mig.profiles import mig_model
from gpufrac.node.inventory.simulated import simulated_mig_uuid

TESTENV_BIN = Path(__file__).resolve().parents[3] / "testenv" / "bin"

#: The cgroup hierarchy the kubelet (cgroupfs driver, cgroup v1) and runc need.
CGROUP_MEMORY = Path("/sys/fs/cgroup/memory")


#: What a container of a test pod runs: sleep until stopped, and stop at once on SIGTERM.
SLEEP_COMMAND = ("/bin/sh", "-c", "trap 'exit 0' TERM; sleep 3600 & wait")

#: Debian's containernetworking-plugins (testenv/packages.sh).
CNI_BIN = Path("/usr/lib/cni")
#: The pod network of the node: a bridge with host-local addresses, no masquerading (no iptables).
POD_SUBNET = "10.244.0.0/24"

#: The taint the API server's TaintNodesByCondition admission gives every new Node.
NOT_READY_TAINT = "node.kubernetes.io/not-ready"


#: What NVIDIA's GPU feature discovery labels a GPU node with; the node of a bare cluster (no node agent
#: of ours yet) registers with it, and the chart's GpuFractioningConfig selects on it by default.
GPU_PRESENT_LABEL = "nvidia.com/gpu.present"

#: The ClusterIP of the ``kubernetes`` Service (the first address of testenv/controlplane's service
#: range, in its serving certificate) and the port in-cluster clients dial.
KUBERNETES_SERVICE_IP = "10.0.0.1"
KUBERNETES_SERVICE_PORT = 443


class RealNodeError(RuntimeError):
    """A part of the real node failed to start (the message says which, with its log)."""


@dataclass(frozen=True, slots=True)
class Binaries:
    containerd: Path
    ctr: Path
    shim: Path
    kubelet: Path
    runc: Path
    #: The controllers a real node's workloads need (Deployments, DaemonSets, ServiceAccount tokens)
    #: and the default scheduler, from the control plane's module graph (testenv/build.sh).
    controller_manager: Path
    kube_scheduler: Path


def binaries(bin_dir: Path = TESTENV_BIN) -> Binaries:
    """The programs of the real node; raises ``RealNodeError`` naming what is missing and how to get it."""
    runc = shutil.which("runc")
    found = Binaries(
        containerd=bin_dir / "containerd",
        ctr=bin_dir / "ctr",
        shim=bin_dir / "containerd-shim-runc-v2",
        kubelet=bin_dir / "kubelet",
        runc=Path(runc) if runc else Path("runc"),
        controller_manager=bin_dir / "kube-controller-manager",
        kube_scheduler=bin_dir / "kube-scheduler",
    )
    built = (
        found.containerd,
        found.ctr,
        found.shim,
        found.kubelet,
        found.controller_manager,
        found.kube_scheduler,
    )
    missing = [str(p) for p in built if not p.exists()]
    if missing:
        raise RealNodeError(f"missing {', '.join(missing)}: build them with `make testenv`")
    if runc is None:
        raise RealNodeError("runc is not on PATH: install Debian's runc (bash testenv/packages.sh)")
    if shutil.which("iptables") is None:
        raise RealNodeError(
            "iptables is not on PATH (the kubernetes Service's route): install Debian's iptables"
        )
    if not (CNI_BIN / "bridge").exists():
        raise RealNodeError(
            f"no CNI plugins in {CNI_BIN}: install containernetworking-plugins (bash testenv/packages.sh)"
        )
    if not ociimage.BUSYBOX.exists():
        raise RealNodeError(
            f"{ociimage.BUSYBOX} is missing: install busybox-static (bash testenv/packages.sh)"
        )
    return found


def missing_requirements() -> list[str]:
    """What this machine lacks for a real node (empty: it can run one): root and cgroup v1 memory."""
    missing = []
    if os.geteuid() != 0:
        missing.append("root (containerd, runc and the kubelet mount and create cgroups)")
    if not (CGROUP_MEMORY / "cgroup.procs").exists():
        missing.append(f"a cgroup v1 memory hierarchy at {CGROUP_MEMORY}")
    return missing


def _tail(log: Path, lines: int = 20) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def containerd_config(*, root: Path, bins: Binaries) -> str:
    """containerd's config (version 3): everything under ``root``, NRI on, the CRI as a test node needs.

    NRI's built-in validator is on: it refuses a container whose pod requires a plugin that is not
    connected (what makes GPU containers fail closed while the node agent is away). CDI is on, with specs
    only from ``<root>/cdi`` (``simulated_cdi_spec``), so containerd resolves the node agent's CDI requests
    as on a real GPU node and refuses unknown ones."""
    return f"""version = 3
root = "{root}/root"
state = "{root}/state"
temp = "{root}/tmp"
disabled_plugins = ["io.containerd.internal.v1.tracing", "io.containerd.tracing.processor.v1.otlp"]

[grpc]
  address = "{root}/containerd.sock"

[ttrpc]
  address = "{root}/containerd.sock.ttrpc"

[debug]
  address = "{root}/debug.sock"

[plugins."io.containerd.internal.v1.opt"]
  path = "{root}/opt"

[plugins."io.containerd.nri.v1.nri"]
  disable = false
  socket_path = "{root}/nri.sock"
  plugin_path = "{root}/nri-plugins"
  plugin_config_path = "{root}/nri-conf.d"
  plugin_registration_timeout = "5s"
  plugin_request_timeout = "2s"

[plugins."io.containerd.nri.v1.nri".default_validator]
  enable = true

[plugins."io.containerd.cri.v1.images"]
  snapshotter = "native"

[plugins."io.containerd.cri.v1.images".pinned_images]
  sandbox = "{ociimage.PAUSE.ref}"

[plugins."io.containerd.cri.v1.runtime"]
  restrict_oom_score_adj = true
  enable_selinux = false
  disable_apparmor = true
  enable_cdi = true
  cdi_spec_dirs = ["{root}/cdi"]

[plugins."io.containerd.cri.v1.runtime".cni]
  bin_dirs = ["{CNI_BIN}"]
  conf_dir = "{root}/cni-conf.d"

[plugins."io.containerd.cri.v1.runtime".containerd]
  default_runtime_name = "runc"

[plugins."io.containerd.cri.v1.runtime".containerd.runtimes.runc]
  runtime_type = "io.containerd.runc.v2"
  snapshotter = "native"

[plugins."io.containerd.cri.v1.runtime".containerd.runtimes.runc.options]
  BinaryName = "{bins.runc}"
  SystemdCgroup = false
"""


#: The variable each simulated CDI device sets in a container: ``<prefix><index>=<uuid>``.
SIMULATED_CDI_ENV_PREFIX = "GPUFRAC_SIMULATED_CDI_GPU_"
#: The variable each simulated MIG device sets: ``<prefix><index>_<start>_<profile>=<MIG uuid>``.
SIMULATED_CDI_MIG_ENV_PREFIX = "GPUFRAC_SIMULATED_CDI_MIG_"


def simulated_cdi_spec(*, node: str, gpus: int, model: str | None = None) -> dict[str, object]:
    """A CDI spec of kind ``nvidia.com/gpu`` for a simulated node's GPUs, named by UUID and by index, and,
    for a ``model`` with MIG profiles, every MIG device its GPUs could have, named by MIG UUID.

    Simulated because the machine has no GPU and no NVIDIA toolkit: ``nvidia-ctk cdi generate`` would
    give each device its ``/dev/nvidia<N>`` node and the driver's libraries and hooks (and set
    ``NVIDIA_VISIBLE_DEVICES=void``); these devices only set ``GPUFRAC_SIMULATED_CDI_GPU_<index>=<uuid>``,
    which shows from inside the container that containerd injected exactly that device. A MIG device
    (``--device-name-strategy=uuid`` names it by its ``MIG-`` UUID) sets
    ``GPUFRAC_SIMULATED_CDI_MIG_<index>_<start>_<profile>=<MIG uuid>``; its UUID is the one the simulated
    inventory gives the slice (``simulated_mig_uuid``), for every profile at every start, since the spec is
    written before any slice exists (``nvidia-ctk`` is re-run after a layout change on a real node).
    """
    tables = mig_model(model) if model is not None else None
    devices = []
    for index in range(gpus):
        uuid = gpu_uuid(node, index)
        edits = {"env": [f"{SIMULATED_CDI_ENV_PREFIX}{index}={uuid}"]}
        devices += [{"name": uuid, "containerEdits": edits}, {"name": str(index), "containerEdits": edits}]
        for profile in tables.profiles if tables is not None else ():
            for start in profile.starts:
                mig = simulated_mig_uuid(uuid, Slice(profile.name, start))
                variable = f"{SIMULATED_CDI_MIG_ENV_PREFIX}{index}_{start}_{profile.name.replace('.', '_')}"
                devices.append({"name": mig, "containerEdits": {"env": [f"{variable}={mig}"]}})
    return {"cdiVersion": "0.5.0", "kind": CDI_GPU_KIND, "devices": devices}


def kubelet_config(
    *, root: Path, endpoint: str, port: int, healthz_port: int, managed: bool = True
) -> dict[str, object]:
    """The KubeletConfiguration of the test node (see the module docstring for why each setting).

    ``managed``: the node registers with gpufrac's managed taint, as the embedded cluster's node agent
    expects to find it; without it the node registers untainted, as a GPU node does before
    ``helm install`` (the installed node agent taints it)."""
    taints = [
        {
            "key": keys.MANAGED_TAINT_KEY,
            "value": keys.MANAGED_TAINT_VALUE,
            "effect": keys.MANAGED_TAINT_EFFECT,
        }
    ]
    return {
        "apiVersion": "kubelet.config.k8s.io/v1beta1",
        "kind": "KubeletConfiguration",
        "containerRuntimeEndpoint": endpoint,
        "imageServiceEndpoint": endpoint,
        "cgroupDriver": "cgroupfs",
        "cgroupsPerQOS": False,
        "enforceNodeAllocatable": [],
        "failSwapOn": False,
        # Kubernetes 1.35+ refuses cgroup v1 hosts unless told otherwise (KEP-5573); these test machines
        # have a cgroup v1 hierarchy only. Not a production setting.
        "failCgroupV1": False,
        "localStorageCapacityIsolation": False,
        "address": "127.0.0.1",
        "port": port,
        "readOnlyPort": 0,
        "healthzBindAddress": "127.0.0.1",
        "healthzPort": healthz_port,
        "authentication": {"anonymous": {"enabled": False}, "webhook": {"enabled": False}},
        "authorization": {"mode": "AlwaysAllow"},
        "podLogsDirectory": str(root / "pod-logs"),
        "registerWithTaints": taints if managed else [],
        # The disk of a shared test machine may be fuller than a node's defaults allow.
        "evictionHard": {"memory.available": "1Mi", "nodefs.available": "1%", "imagefs.available": "1%"},
        "imageGCHighThresholdPercent": 100,
        "imageGCLowThresholdPercent": 99,
        "serializeImagePulls": False,
        "featureGates": dict(FEATURE_GATES),  # the embedded cluster's one setting (docs/dra.md)
    }


@dataclass(frozen=True, slots=True)
class ServiceRoute:
    """What kube-proxy would do for the one Service a pod's in-cluster client needs: DNAT the
    ``kubernetes`` Service's ClusterIP:443 to the API server's loopback address.

    Two rules in iptables' nat table: PREROUTING for pods on the CNI bridge, OUTPUT for host-network
    pods. A pod's packet DNATed to 127.0.0.1 is delivered only with ``route_localnet`` on (kube-proxy
    sets the same for its localhost node ports); the previous value is put back on ``remove``. The API
    server's certificate names the ClusterIP, so clients verify it as in a cluster. One real node per
    machine: the rules are the machine's.
    """

    host: str
    port: int
    saved_route_localnet: str = "0"

    ROUTE_LOCALNET = Path("/proc/sys/net/ipv4/conf/all/route_localnet")

    @classmethod
    def to(cls, apiserver: str) -> ServiceRoute:
        """The route to ``apiserver`` (``https://127.0.0.1:PORT``)."""
        host, _, port = apiserver.removeprefix("https://").rpartition(":")
        return cls(host=host, port=int(port), saved_route_localnet=cls.ROUTE_LOCALNET.read_text().strip())

    def _rules(self) -> list[list[str]]:
        match = ["-d", f"{KUBERNETES_SERVICE_IP}/32", "-p", "tcp", "--dport", str(KUBERNETES_SERVICE_PORT)]
        target = ["-j", "DNAT", "--to-destination", f"{self.host}:{self.port}"]
        return [["PREROUTING", *match, *target], ["OUTPUT", *match, *target]]

    def add(self) -> None:
        self.ROUTE_LOCALNET.write_text("1")
        for rule in self._rules():
            done = subprocess.run(["iptables", "-t", "nat", "-I", *rule], capture_output=True, text=True)
            if done.returncode != 0:
                raise RealNodeError(f"iptables -t nat -I {' '.join(rule)}: {done.stderr.strip()}")

    def remove(self) -> None:
        for rule in self._rules():
            subprocess.run(["iptables", "-t", "nat", "-D", *rule], capture_output=True, check=False)
        self.ROUTE_LOCALNET.write_text(self.saved_route_localnet)


def process_environ(pid: int) -> dict[str, str]:
    """The environment process ``pid`` started with, as the kernel keeps it (``/proc/<pid>/environ``)."""
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    env: dict[str, str] = {}
    for entry in raw.split(b"\0"):
        if entry:
            key, _, value = entry.decode(errors="replace").partition("=")
            env[key] = value
    return env


def process_mounts(pid: int) -> list[dict[str, str]]:
    """The mounts of process ``pid``'s mount namespace (``/proc/<pid>/mountinfo``): ``destination`` is
    where it is mounted, ``source`` the path inside the filesystem it comes from."""
    mounts = []
    for line in Path(f"/proc/{pid}/mountinfo").read_text().splitlines():
        fields = line.split()
        if len(fields) > 4:
            mounts.append({"source": fields[3], "destination": fields[4]})
    return mounts


def runnable_here(pod: Pod) -> Pod:
    """``pod`` made runnable on this node: no registry (the busybox image, never pulled; the command
    sleeps until SIGTERM), the host's network, no service-account token (no controller issues one)."""
    assert pod.spec is not None
    for container in pod.spec.containers:
        container.image = ociimage.WORKLOAD.ref
        container.imagePullPolicy = "Never"
        container.command = list(SLEEP_COMMAND)
        container.args = None
    pod.spec.hostNetwork = True
    pod.spec.automountServiceAccountToken = False
    pod.spec.terminationGracePeriodSeconds = 1
    return pod


class RealNode:
    """containerd + runc + a real kubelet + our node agent (simulated GPUs) as one Kubernetes node.

    ``await node.start()`` returns when the kubelet's Node is Ready and the node agent has published the
    GPUs; ``stop_agent()`` / ``start_agent()`` take the node agent out of and back into containerd's
    path; ``await node.stop()`` ends everything (newest first) and removes the containers' cgroups.
    """

    def __init__(
        self,
        *,
        name: str,
        kubeconfig: Path,
        client: AsyncClient,
        work_dir: Path,
        logs: Path,
        shape: NodeShape = NodeShape(gpus=4, model="H100-80GB"),
        agent_argv: Callable[[], list[str]],
        apiserver: str,
        with_agent: bool = True,
        progress: Callable[[str], None] = lambda _msg: None,
        dra: bool = False,
        supervisor: Supervisor | None = None,
    ) -> None:
        self.name = name
        self.with_agent = with_agent
        self._apiserver = apiserver
        self._service_route: ServiceRoute | None = None
        self.shape = shape
        self._kubeconfig = kubeconfig
        self._client = client
        self.root = work_dir
        self.logs = logs
        self._agent_argv = agent_argv
        self.dra = dra
        self._progress = progress
        self.bins = binaries()
        self.metrics_url = ""
        self._containerd: Spawned | None = None
        self._kubelet: Spawned | None = None
        self._supervisor = supervisor
        self._agent: Spawned | Component | None = None
        self._validator: Spawned | Component | None = None
        self._validator_port = 0

    @property
    def containerd_socket(self) -> Path:
        return self.root / "containerd.sock"

    @property
    def cri_endpoint(self) -> str:
        return f"unix://{self.containerd_socket}"

    @property
    def nri_socket(self) -> Path:
        return self.root / "nri.sock"

    # -- start ----------------------------------------------------------------------------------------

    async def start(self) -> None:
        missing = missing_requirements()
        if missing:
            raise RealNodeError(f"this machine cannot run a real node: it lacks {'; '.join(missing)}")
        self.root.mkdir(parents=True, exist_ok=True)
        self.logs.mkdir(parents=True, exist_ok=True)
        try:
            self._progress("starting containerd (NRI on) with runc")
            await self._start_containerd()
            self._progress("importing the pause and busybox images")
            await self._import_images()
            self._progress("routing the kubernetes Service's ClusterIP to the API server (no kube-proxy)")
            self._service_route = ServiceRoute.to(self._apiserver)
            await asyncio.to_thread(self._service_route.add)
            self._progress(f"starting the kubelet of {self.name}")
            await self._start_kubelet()
            if self.with_agent:
                self._progress("starting the node agent on containerd's NRI socket (simulated GPUs)")
                await self.start_agent()
        except BaseException:
            await self.stop()
            raise

    def _write_cni_config(self) -> None:
        conf_dir = self.root / "cni-conf.d"
        conf_dir.mkdir(parents=True, exist_ok=True)
        network = {
            "cniVersion": "1.0.0",
            "name": "gpufrac-test",
            "plugins": [
                {
                    "type": "bridge",
                    "bridge": "gpufrac0",
                    "isGateway": True,
                    "ipMasq": False,
                    "ipam": {
                        "type": "host-local",
                        "ranges": [[{"subnet": POD_SUBNET}]],
                        # The default route through the bridge: without it a pod reaches only its
                        # subnet, not the kubernetes Service's ClusterIP (ServiceRoute).
                        "routes": [{"dst": "0.0.0.0/0"}],
                        "dataDir": str(self.root / "cni-ipam"),
                    },
                }
            ],
        }
        (conf_dir / "10-gpufrac-test.conflist").write_text(json.dumps(network, indent=2))

    async def _start_containerd(self) -> None:
        self._write_cni_config()
        config = self.root / "containerd.toml"
        config.write_text(containerd_config(root=self.root, bins=self.bins))
        cdi_dir = self.root / "cdi"
        cdi_dir.mkdir(exist_ok=True)
        spec = simulated_cdi_spec(node=self.name, gpus=self.shape.gpus, model=self.shape.model)
        (cdi_dir / "gpufrac-simulated.json").write_text(json.dumps(spec, indent=1))
        # containerd finds the shim on PATH (containerd-shim-runc-v2, next to it in testenv/bin).
        path = f"{self.bins.shim.parent}:{os.environ.get('PATH', '/usr/bin:/bin')}"
        self._containerd = spawn(
            name="containerd",
            argv=[str(self.bins.containerd), "--config", str(config), "--log-level", "info"],
            logs=self.logs,
            env={"PATH": path},
        )
        await self._wait(self._containerd, "answer on its socket", self._containerd_answers)

    async def restart_containerd(self) -> None:
        """Stop containerd (SIGTERM) and start it again on the same state, as an upgrade does: running
        containers stay (their shims outlive containerd), every NRI plugin connection drops."""
        containerd, self._containerd = self._containerd, None
        if containerd is not None:
            await asyncio.to_thread(terminate, containerd.popen)
        await self._start_containerd()

    async def restart_kubelet(self) -> None:
        """Stop the kubelet (SIGTERM) and start it again on the same root, as a node upgrade does: running
        pods stay, the kubelet finds its checkpoints (prepared DRA claims among them) and its plugins'
        registration sockets again."""
        kubelet, self._kubelet = self._kubelet, None
        if kubelet is not None:
            await asyncio.to_thread(terminate, kubelet.popen)
        await self._start_kubelet()

    async def _containerd_answers(self) -> bool:
        if not self.containerd_socket.exists():
            return False
        done = await asyncio.to_thread(
            subprocess.run, [*self.ctr_argv(), "version"], capture_output=True, timeout=10
        )
        return done.returncode == 0

    def ctr_argv(self) -> list[str]:
        """``ctr`` on this node's containerd, in the CRI's namespace."""
        return [str(self.bins.ctr), "--address", str(self.containerd_socket), "--namespace", "k8s.io"]

    async def _import_images(self) -> None:
        for spec in (ociimage.PAUSE, ociimage.WORKLOAD):
            await self.import_image(
                ociimage.write_archive(spec, self.root / "images" / f"{spec.ref.split('/')[-1]}.tar")
            )

    async def import_image(self, archive: Path) -> None:
        """``ctr images import`` an OCI archive into the CRI's namespace, unpacked for the kubelet (the
        image name is the archive's ``io.containerd.image.name`` annotation)."""
        done = await asyncio.to_thread(
            subprocess.run,
            [*self.ctr_argv(), "images", "import", "--local", "--snapshotter", "native", str(archive)],
            capture_output=True,
            text=True,
            timeout=300,
        )
        if done.returncode != 0:
            raise RealNodeError(f"ctr images import {archive} failed: {done.stderr.strip()}")

    async def _start_kubelet(self) -> None:
        kubelet_root = self.root / "kubelet"
        kubelet_root.mkdir(parents=True, exist_ok=True)
        (self.root / "pod-logs").mkdir(exist_ok=True)
        config = self.root / "kubelet.yaml"
        healthz = _free_port()
        config.write_text(
            yaml.safe_dump(
                kubelet_config(
                    root=self.root,
                    endpoint=self.cri_endpoint,
                    port=_free_port(),
                    healthz_port=healthz,
                    managed=self.with_agent,
                )
            )
        )
        self._kubelet = spawn(
            name="kubelet",
            argv=[
                str(self.bins.kubelet),
                f"--config={config}",
                f"--kubeconfig={self._kubeconfig}",
                f"--root-dir={kubelet_root}",
                f"--cert-dir={kubelet_root / 'pki'}",
                f"--hostname-override={self.name}",
                f"--node-labels={keys.MANAGED_LABEL if self.with_agent else GPU_PRESENT_LABEL}=true",
                "--v=1",
            ],
            logs=self.logs,
        )
        await self._wait(self._kubelet, "register a Ready Node", self._node_ready, timeout_s=120)

    async def _node_ready(self) -> bool:
        """Ready, and without the ``not-ready`` taint admission put on the new Node (kube-controller-
        manager's node lifecycle controller removes it once the kubelet reports Ready)."""
        try:
            with api_errors():
                node = await self._client.get(Node, self.name)
        except KubeError:
            return False
        conditions = {c.type: c.status for c in (node.status.conditions or [])} if node.status else {}
        taints = {t.key for t in (node.spec.taints or [])} if node.spec else set()
        return conditions.get("Ready") == "True" and NOT_READY_TAINT not in taints

    async def start_agent(self, *, extra_args: Sequence[str] = ()) -> None:
        """Start the node agent (simulated GPUs) on containerd's NRI and CRI sockets; wait until published.
        ``extra_args`` are added to its command line (benchmarks: ``--memory-limits off``)."""
        if self._validator is None or self._validator.popen.poll() is not None:
            await self.start_validator()
        if self._agent is not None and self._agent.popen.poll() is None:
            return
        await self.stop_agent()  # a supervised one waiting for its restart: started here instead
        shape = self.shape
        metrics_port = _free_port()
        # The DRA driver's plugin sockets go under this kubelet's root and its CDI specs where containerd
        # reads them (``containerd_config``); settings without a flag go through the config file.
        config = self.root / "node-agent.yaml"
        config.write_text(
            yaml.safe_dump(
                {
                    "kubelet_dir": str(self.root / "kubelet"),
                    "cdi_dir": str(self.root / "cdi"),
                    # The SIMULATED driver keys limits by the node's REAL cgroups (runc's, under containerd).
                    "cgroup_root": "/sys/fs/cgroup",
                }
            )
        )
        self._agent = self._start(
            "node-agent",
            [
                *self._agent_argv(),
                "node-agent",
                f"--node-name={self.name}",
                f"--kubeconfig={self._kubeconfig}",
                f"--nri-socket={self.nri_socket}",
                f"--cri-endpoint={self.cri_endpoint}",
                "--backend=simulated",
                f"--sim-gpus={shape.gpus}x{shape.model}:{shape.mib}",
                f"--state-dir={self.root / 'node-agent'}",
                "--health-port=0",
                f"--metrics-port={metrics_port}",
                "--log-format=text",
                f"--config={config}",
                *(["--dra"] if self.dra else []),
                *extra_args,
            ],
        )
        self.metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
        await self._wait(self._agent, "publish the node's GPUs", self._agent_ready, timeout_s=60)

    async def _agent_ready(self) -> bool:
        with api_errors():
            node = await self._client.get(Node, self.name)
        conditions = {c.type: c.status for c in (node.status.conditions or [])} if node.status else {}
        annotations = node.metadata.annotations or {}
        return bool(annotations.get(keys.NODE_GPUS_ANNOTATION)) and (
            conditions.get(keys.NODE_READY_CONDITION) == "True"
        )

    @property
    def agent_pid(self) -> int | None:
        return self._agent.popen.pid if self._agent is not None else None

    async def start_validator(self) -> None:
        """Start the agent's validating NRI plugin on containerd's NRI socket; wait until it is in
        containerd's path (its /readyz: registered and synchronized)."""
        await self.stop_validator()
        self._validator_port = _free_port()
        self._validator = self._start(
            "node-agent-validator",
            [
                *self._agent_argv(),
                "node-agent-validator",
                f"--nri-socket={self.nri_socket}",
                "--health-host=127.0.0.1",
                f"--health-port={self._validator_port}",
                "--log-format=text",
            ],
        )
        await self._wait(
            self._validator, "register with containerd's NRI", self._validator_ready, timeout_s=60
        )

    async def _validator_ready(self) -> bool:
        def get() -> bool:
            try:
                with socket.create_connection(("127.0.0.1", self._validator_port), timeout=1) as conn:
                    conn.sendall(b"GET /readyz HTTP/1.1\r\nHost: x\r\n\r\n")
                    return conn.recv(64).startswith(b"HTTP/1.1 200")
            except OSError:
                return False

        return await asyncio.to_thread(get)

    @property
    def validator_pid(self) -> int | None:
        return self._validator.popen.pid if self._validator is not None else None

    def _start(self, name: str, argv: list[str]) -> Spawned | Component:
        """Start ``name`` (``node-agent``, ``node-agent-validator``): supervised as ``<name>-<node>`` when
        this node has a supervisor, else a plain child process."""
        if self._supervisor is None:
            return spawn(name=name, argv=argv, logs=self.logs)
        supervised = f"{name}-{self.name}"
        return self._supervisor.start(supervised, argv, log=self.logs / f"{supervised}.log")

    async def _unsupervised(self, process: Spawned | Component) -> subprocess.Popen[bytes]:
        """Its current process, no longer restarted by the supervisor (if it had one)."""
        if self._supervisor is not None and isinstance(process, Component):
            await self._supervisor.release(process.name)
        return process.popen

    async def stop_validator(self) -> None:
        """SIGTERM the validator and wait until it has exited."""
        validator, self._validator = self._validator, None
        if validator is not None:
            await asyncio.to_thread(terminate, await self._unsupervised(validator))

    async def kill_agent(self) -> None:
        """SIGKILL the node agent, as a crash or the OOM killer does: none of its shutdown runs. It stays
        down (unsupervised) until ``start_agent``."""
        agent, self._agent = self._agent, None
        if agent is not None:
            popen = await self._unsupervised(agent)
            popen.kill()
            await asyncio.to_thread(popen.wait)

    async def stop_agent(self) -> None:
        """SIGTERM the node agent (it leaves containerd's NRI path) and wait until it has exited."""
        agent, self._agent = self._agent, None
        if agent is not None:
            await asyncio.to_thread(terminate, await self._unsupervised(agent))

    async def _wait(
        self, process: Spawned | Component, what: str, ready: Callable[[], object], *, timeout_s: float = 60.0
    ) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if process.popen.poll() is not None:
                raise RealNodeError(
                    f"{process.name} exited with {process.popen.returncode} before it could {what}; "
                    f"last lines of {process.log}:\n{_tail(process.log)}"
                )
            if await ready():  # type: ignore[misc]
                return
            await asyncio.sleep(0.2)
        raise RealNodeError(
            f"{process.name} did not {what} within {timeout_s:.0f}s; last lines of {process.log}:\n"
            f"{_tail(process.log)}"
        )

    # -- inside the containers ------------------------------------------------------------------------

    def container_pid(self, container_id: str) -> int:
        """The host PID of a running container's process (``containerd://<id>`` or ``<id>``), as runc
        reported it to containerd's shim; raises ``RealNodeError`` when the container has no process."""
        bare = container_id.removeprefix("containerd://")
        pid_file = self.root / "state" / "io.containerd.runtime.v2.task" / "k8s.io" / bare / "init.pid"
        try:
            return int(pid_file.read_text().strip())
        except (OSError, ValueError) as error:
            raise RealNodeError(f"container {bare} has no process on {self.name} ({error})") from None

    # -- stop -----------------------------------------------------------------------------------------

    async def stop(self) -> None:
        """End the agent and its validator, the kubelet, every container, then containerd; safe to call
        twice."""
        await self.stop_agent()
        await self.stop_validator()
        kubelet, self._kubelet = self._kubelet, None
        if kubelet is not None:
            await asyncio.to_thread(terminate, kubelet.popen)
        containerd, self._containerd = self._containerd, None
        if containerd is not None:
            with contextlib.suppress(Exception):
                await self._remove_containers()
            await asyncio.to_thread(terminate, containerd.popen)
        await asyncio.to_thread(self._unmount)
        route, self._service_route = self._service_route, None
        if route is not None:
            await asyncio.to_thread(route.remove)

    async def _remove_containers(self) -> None:
        """Kill every task and remove every container, so no shim or container process outlives us."""
        listed = await asyncio.to_thread(
            subprocess.run,
            [*self.ctr_argv(), "containers", "list", "-q"],
            capture_output=True,
            text=True,
            timeout=30,
        )
        for container in listed.stdout.split():
            await asyncio.to_thread(
                subprocess.run,
                [*self.ctr_argv(), "tasks", "kill", "--signal", "SIGKILL", container],
                capture_output=True,
                timeout=30,
            )
        for container in listed.stdout.split():
            for _ in range(50):
                gone = await asyncio.to_thread(
                    subprocess.run,
                    [*self.ctr_argv(), "tasks", "delete", "--force", container],
                    capture_output=True,
                    timeout=30,
                )
                if gone.returncode == 0 or b"not found" in gone.stderr:
                    break
                await asyncio.sleep(0.1)
            await asyncio.to_thread(
                subprocess.run,
                [*self.ctr_argv(), "containers", "delete", container],
                capture_output=True,
                timeout=30,
            )

    def _unmount(self) -> None:
        """Unmount whatever the kubelet and containerd left mounted under the work directory."""
        with open("/proc/self/mounts") as mounts:
            targets = [line.split()[1] for line in mounts if line.split()[1].startswith(str(self.root) + "/")]
        for target in sorted(targets, key=len, reverse=True):
            subprocess.run(["umount", "-l", target], capture_output=True, check=False)
