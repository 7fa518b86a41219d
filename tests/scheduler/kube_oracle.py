"""kube-scheduler (testenv/bin, v1.34, the API server's module graph) as the oracle for differential tests.

It runs as a real process against the session's control plane with one profile, ``ORACLE``, so it only
places pods that name it. Preemption (the DefaultPreemption PostFilter) is off: the oracle must answer
"feasible or not", never evict the cluster it is asked about.

How feasibility of one chosen node is asked honestly: the other nodes are cordoned
(``spec.unschedulable``), which only kube-scheduler's NodeUnschedulable filter looks at; affinity and
spread domains still count every node, as kube-scheduler counts cordoned nodes. The pod is created with a
scheduling gate, read back (the API server may rewrite fields such as ``matchLabelKeys``), and released
by removing the gate; the answer is where it is bound, or its PodScheduled=False condition.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

import yaml
from lightkube import Client
from lightkube.resources.core_v1 import Node, Pod
from lightkube.types import PatchType

ORACLE = "kube-oracle"
GATE = "gpufrac.io/parity-probe"


def kube_scheduler_binary() -> Path:
    return Path(__file__).resolve().parents[2] / "testenv" / "bin" / "kube-scheduler"


class KubeScheduler:
    """The process; ``stop`` ends it (SIGTERM, then SIGKILL) and returns its log tail on failure."""

    def __init__(self, *, kubeconfig: Path, workdir: Path) -> None:
        self.config_path = workdir / "kube-scheduler.yaml"
        self.log_path = workdir / "kube-scheduler.log"
        config = {
            "apiVersion": "kubescheduler.config.k8s.io/v1",
            "kind": "KubeSchedulerConfiguration",
            "clientConnection": {"kubeconfig": str(kubeconfig), "qps": 200, "burst": 400},
            "leaderElection": {"leaderElect": False},
            "profiles": [
                {
                    "schedulerName": ORACLE,
                    "plugins": {"postFilter": {"disabled": [{"name": "DefaultPreemption"}]}},
                }
            ],
        }
        self.config_path.write_text(yaml.safe_dump(config))
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> KubeScheduler:
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(
                [str(kube_scheduler_binary()), f"--config={self.config_path}", "--secure-port=0", "-v=1"],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        return self

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def log_tail(self, lines: int = 30) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=10)


@dataclass(frozen=True)
class Verdict:
    """Where the oracle bound the pod (None: unschedulable), with its message when it refused."""

    node: str | None
    message: str = ""


def released(client: Client, pod: Pod, *, oracle: KubeScheduler, timeout: float = 20.0) -> Verdict:
    """Remove the probe gate from ``pod`` and wait for kube-scheduler's answer."""
    meta = pod.metadata
    client.patch(Pod, meta.name, {"spec": {"schedulingGates": None}}, namespace=meta.namespace)
    deadline = time.monotonic() + timeout
    while True:
        now = client.get(Pod, meta.name, namespace=meta.namespace)
        if now.spec.nodeName:
            return Verdict(now.spec.nodeName)
        for c in (now.status.conditions if now.status else None) or []:
            if c.type == "PodScheduled" and c.status == "False" and c.reason == "Unschedulable":
                return Verdict(None, c.message or "")
        if not oracle.alive():
            raise AssertionError(f"kube-scheduler exited:\n{oracle.log_tail()}")
        if time.monotonic() > deadline:
            raise AssertionError(f"kube-scheduler gave no answer for {meta.name} in {timeout:.0f}s")
        time.sleep(0.02)


def cordon(client: Client, nodes: list[str], *, open_nodes: Collection[str]) -> None:
    """Cordon every node of ``nodes`` but ``open_nodes``."""
    for name in nodes:
        flag = name not in open_nodes
        client.patch(Node, name, {"spec": {"unschedulable": flag or None}}, patch_type=PatchType.MERGE)
