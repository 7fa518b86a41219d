"""``kubectl gpufrac`` against the real API server, with pods the real scheduler service placed.

The plugin runs as a separate process (``python -m gpufrac.kubectl``, what the ``kubectl-gpufrac``
console script runs) with ``--kubeconfig``, exactly as a user's shell would; its answers are checked
against the scheduler's own writes: the contract annotations on the bound pod, the PodScheduled
condition and the Events it recorded.
"""

from __future__ import annotations

import asyncio
import csv
import json
import os
import shutil
import socket
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml
from lightkube import AsyncClient
from lightkube.resources.core_v1 import Pod
from sched_harness import (
    Pool,
    add_nodes,
    condition,
    gpu_pod,
    running,
    scheduled_events,
    wait_bound,
    wait_for,
)

from gpufrac.contract import keys
from gpufrac.kube.patch import set_pod_condition
from gpufrac.local.controlplane import ControlPlane
from gpufrac.local.simnodes import NodeShape
from gpufrac.node.metrics import EnforcementCounters, MetricsServer, UsageExporter, registry_for
from gpufrac.node.usage.collect import FractionUsage, GpuUsage, UsageSnapshot
from gpufrac.operator.render import APP_NAME, METRICS_PORT_NAME

SHAPE = NodeShape(gpus=2, model="H100-80GB")


async def plugin(kubeconfig: Path, *args: str, kubectl: bool = False) -> tuple[int, str, str]:
    if kubectl:  # kubectl finds kubectl-gpufrac on PATH (the venv's bin, where the wheel puts it)
        command = ["kubectl", "gpufrac", *args, "--kubeconfig", str(kubeconfig)]
        env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    else:
        command = [sys.executable, "-m", "gpufrac.kubectl", "--kubeconfig", str(kubeconfig), *args]
        env = dict(os.environ)
    proc = await asyncio.create_subprocess_exec(
        *command, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=env
    )
    out, err = await asyncio.wait_for(proc.communicate(), timeout=60)
    return proc.returncode or 0, out.decode(), err.decode()


@pytest.fixture
async def placed(client: AsyncClient, pool: Pool):
    """One 2-GPU node; ``small`` bound by the scheduler, ``big`` (too much memory) and ``picky`` (a node
    selector nothing matches) reported unschedulable."""
    [node] = await add_nodes(client, pool, count=1, shape=SHAPE)
    async with running(client, pool.config()):
        await client.create(
            gpu_pod(
                pool,
                "small",
                {keys.memory_request_key("app"): "20Gi", keys.memory_limit_key("app"): "30Gi"},
            )
        )
        await client.create(gpu_pod(pool, "big", {keys.memory_request_key("app"): "200Gi"}))
        picky = gpu_pod(pool, "picky", {keys.memory_request_key("app"): "10Gi"})
        picky.spec.nodeSelector = {"example.com/no-such-label": "x"}  # memory fits; the selector does not
        await client.create(picky)
        await wait_bound(client, pool.namespace, 1, timeout=30)
        small = await client.get(Pod, "small", namespace=pool.namespace)

        async def reported() -> bool:
            waiting = [await client.get(Pod, name, namespace=pool.namespace) for name in ("big", "picky")]
            return all(condition(pod)[0] == "False" for pod in waiting)

        await wait_for(reported, timeout=20, what="PodScheduled=False on big and picky")

        async def small_reported() -> bool:  # Scheduled Events follow the binds, on purpose
            return len(await scheduled_events(client, pool.namespace)) == 1

        await wait_for(small_reported, timeout=20, what="the Scheduled Event of small")
        yield node, small


async def test_nodes_shows_each_gpu_with_its_tenants_as_the_scheduler_placed_them(
    controlplane: ControlPlane, pool: Pool, placed
) -> None:
    node, small = placed
    code, out, err = await plugin(controlplane.kubeconfig, "nodes", "-o", "json")
    assert code == 0, err
    rows = [r for r in json.loads(out)["items"] if r["node"] == node]
    assert [r["index"] for r in rows] == [0, 1]
    [used] = [r for r in rows if r["tenants"]]
    assert used["uuid"] == small.metadata.annotations[keys.devices_key("app")].removeprefix("nvidia.com/gpu=")
    assert used["tenants"] == [
        {
            "namespace": pool.namespace,
            "pod": "small",
            "container": "app",
            "mode": "time-slicing",
            "request_mib": 20480,
            "limit_mib": 30720,
            "enforced": "Unknown",  # no node agent has written GpuMemoryEnforced here
        }
    ]
    assert used["guaranteedMiB"] == 20480
    assert used["freeMiB"] == used["usableMiB"] - 20480 == SHAPE.mib - 20480
    assert used["mode"] == "time-slicing" and used["model"] == SHAPE.model and used["health"] == "Ready"
    [idle] = [r for r in rows if not r["tenants"]]
    assert (idle["guaranteedMiB"], idle["freeMiB"], idle["mode"]) == (0, SHAPE.mib, "-")

    code, out, err = await plugin(controlplane.kubeconfig, "nodes", "-o", "yaml")
    assert code == 0, err
    assert [r for r in yaml.safe_load(out)["items"] if r["node"] == node] == rows

    code, out, _ = await plugin(controlplane.kubeconfig, "nodes")
    lines = [line.split() for line in out.splitlines()]
    assert lines[0] == [
        "NODE",
        "GPU",
        "MODEL",
        "USABLE(MiB)",
        "GUARANTEED(MiB)",
        "FREE(MiB)",
        "MODE",
        "TENANTS",
        "ENFORCED",
        "HEALTH",
    ]
    assert [node, str(used["index"]), SHAPE.model, str(SHAPE.mib), "20480", str(SHAPE.mib - 20480)] == lines[
        [line[:2] for line in lines].index([node, str(used["index"])])
    ][:6]
    code, out, _ = await plugin(controlplane.kubeconfig, "nodes", "-o", "wide")
    assert f"{pool.namespace}/small/app(20480)" in out and used["uuid"] in out


async def test_explain_says_where_a_pod_went_and_why_another_waits(
    controlplane: ControlPlane, pool: Pool, placed
) -> None:
    node, _ = placed
    code, out, err = await plugin(
        controlplane.kubeconfig, "explain", "small", "-n", pool.namespace, "-o", "json"
    )
    assert code == 0, err
    small = json.loads(out)
    assert small["node"] == node and small["scheduler"] == pool.scheduler_name
    assert [(g["container"], g["requestMiB"], g["limitMiB"]) for g in small["gpus"]] == [
        ("app", 20480, 30720)
    ]
    assert [e["reason"] for e in small["events"]] == ["Scheduled"]
    assert small["events"][0]["message"].startswith(f"Successfully assigned {pool.namespace}/small to {node}")

    code, out, err = await plugin(controlplane.kubeconfig, "explain", "big", "-n", pool.namespace)
    assert code == 0, err
    assert "Node:       <none> (not scheduled)" in out
    assert "PodScheduled: False (Unschedulable): 0/1 nodes are available: 1 insufficient GPU memory." in out
    assert "FailedScheduling" in out
    assert (
        "Fit now:    app: needs 1 GPU(s) on one node with 204800 MiB free each; it never fits here: the "
        "largest GPU has"
    ) in out
    assert "when tenants leave" not in out  # it never fits, whoever leaves

    code, out, err = await plugin(
        controlplane.kubeconfig, "explain", "picky", "-n", pool.namespace, "-o", "yaml"
    )
    assert code == 0, err
    picky = yaml.safe_load(out)
    assert picky["node"] is None and picky["scheduled"]["status"] == "False"
    [hint] = picky["fit"]
    assert hint.startswith("app: needs 1 GPU(s) on one node with 10240 MiB free each; node ")
    assert "GPU memory is not what blocks it" in hint


async def test_nodes_and_explain_show_the_node_agents_gpu_memory_enforced_condition(
    controlplane: ControlPlane, client: AsyncClient, pool: Pool, placed
) -> None:
    node, small = placed
    uuid = small.metadata.annotations[keys.devices_key("app")].removeprefix("nvidia.com/gpu=")
    cgroup = f"/sys/fs/cgroup/kubepods.slice/kubepods-pod{small.metadata.uid.replace('-', '_')}.slice/cri-1"

    async def nodes() -> tuple[dict, dict]:
        code, out, err = await plugin(controlplane.kubeconfig, "nodes", "-o", "json")
        assert code == 0, err
        listed = json.loads(out)
        [used] = [r for r in listed["items"] if r["node"] == node and r["tenants"]]
        [summary] = [n for n in listed["nodes"] if n["node"] == node]
        return used, summary

    used, summary = await nodes()  # the agent has not said anything yet
    assert (used["enforced"], used["tenants"][0]["enforced"]) == ("0/1", "Unknown")
    assert summary == {
        "node": node,
        "fractions": 1,
        "verified": 0,
        "unverified": [f"{pool.namespace}/small/app"],
    }

    # What the node agent writes once the driver read the limits back (gpufrac.node.memlimit.condition).
    read_back = f"app: soft 20480 MiB, hard 30720 MiB read back on 1 GPU(s) ({uuid}) for cgroup {cgroup}"
    await set_pod_condition(
        client,
        name="small",
        namespace=pool.namespace,
        type=keys.POD_MEMORY_ENFORCED_CONDITION,
        status="True",
        reason=keys.POD_REASON_LIMITS_READ_BACK,
        message=read_back,
    )
    used, summary = await nodes()
    assert (used["enforced"], used["tenants"][0]["enforced"]) == ("1/1", "True")
    assert summary == {"node": node, "fractions": 1, "verified": 1, "unverified": []}
    code, out, _ = await plugin(controlplane.kubeconfig, "nodes")
    lines = [line.split() for line in out.splitlines()]
    assert ["NODE", "FRACTIONS", "LIMIT-VERIFIED", "UNVERIFIED"] in lines
    assert [node, "1", "1", "<none>"] in lines
    code, out, err = await plugin(controlplane.kubeconfig, "explain", "small", "-n", pool.namespace)
    assert code == 0, err
    assert "GpuMemoryEnforced: True (LimitsReadBack) since 20" in out
    [row] = [line for line in out.splitlines() if line.startswith("app ") and "LimitsReadBack" in line]
    assert row.split(None, 3) == ["app", "True", "LimitsReadBack", read_back.removeprefix("app: ")]

    # The audit found the limit cleared and could not set it again.
    lost = (
        f"app: not in force: cgroup {cgroup}: {uuid}: soft 20480 MiB, hard 30720 MiB wanted, "
        "the driver holds no limit"
    )
    await set_pod_condition(
        client,
        name="small",
        namespace=pool.namespace,
        type=keys.POD_MEMORY_ENFORCED_CONDITION,
        status="False",
        reason=keys.POD_REASON_LIMITS_NOT_IN_FORCE,
        message=lost,
    )
    used, summary = await nodes()
    assert (used["enforced"], summary["verified"], summary["unverified"]) == (
        "0/1",
        0,
        [f"{pool.namespace}/small/app"],
    )
    code, out, err = await plugin(
        controlplane.kubeconfig, "explain", "small", "-n", pool.namespace, "-o", "yaml"
    )
    assert code == 0, err
    enforced = yaml.safe_load(out)["enforced"]
    assert (enforced["status"], enforced["reason"], enforced["message"]) == (
        "False",
        "LimitsNotInForce",
        lost,
    )
    assert enforced["containers"] == [
        {
            "container": "app",
            "status": "False",
            "reason": "LimitsNotInForce",
            "message": lost.removeprefix("app: "),
        }
    ]


async def test_conventions_bad_output_missing_pod_and_kubectl_discovery(
    controlplane: ControlPlane, pool: Pool, tmp_path: Path
) -> None:
    code, _, err = await plugin(controlplane.kubeconfig, "nodes", "-o", "xml")
    assert code == 2
    assert "--output 'xml': allowed formats are wide, json, yaml" in err

    code, _, err = await plugin(controlplane.kubeconfig, "explain", "nope", "-n", pool.namespace)
    assert code == 1
    assert 'pods "nope" not found' in err

    code, _, err = await plugin(controlplane.kubeconfig, "nodes", "--context", "no-such-context")
    assert code == 2 and "no-such-context" in err

    unreachable = tmp_path / "unreachable.kubeconfig"
    config = yaml.safe_load(controlplane.kubeconfig.read_text())
    for cluster in config["clusters"]:
        cluster["cluster"]["server"] = f"https://127.0.0.1:{_closed_port()}"
    unreachable.write_text(yaml.safe_dump(config))
    code, _, err = await plugin(unreachable, "nodes")
    assert code == 1 and "error: cannot reach the API server: ConnectError" in err, err

    if shutil.which("kubectl") is None:
        pytest.skip("kubectl is not installed: plugin discovery not checked")
    code, out, err = await plugin(controlplane.kubeconfig, "nodes", "-o", "json", kubectl=True)
    assert code == 0, err
    assert json.loads(out)["kind"] == "GpuList"


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _routable_ip() -> str:
    """This machine's address on its outgoing interface (the API server refuses to proxy to loopback)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.255", 9))  # UDP connect sends nothing: it only picks the interface
        except OSError:
            pytest.skip("no non-loopback interface: the API server's pod proxy cannot reach this machine")
        return s.getsockname()[0]


def _agent_exporter() -> UsageExporter:
    """A node agent's exporter holding one fraction (the GPU itself is simulated: no NVML here)."""
    exporter = UsageExporter(node="gpu-node-7", counters=EnforcementCounters())
    allocation = SimpleNamespace(
        container_id="c1",
        pod_namespace="team-a",
        pod_name="infer",
        pod_uid="u1",
        container_name="app",
        devices=("GPU-7",),
        request_mib=10240,
        limit_mib=20480,
        mode="time-slicing",
        portion=None,
    )
    fraction = FractionUsage(
        allocation=allocation,
        gpu_uuid="GPU-7",
        gpu_index=0,
        request_bytes=10240 << 20,
        limit_bytes=20480 << 20,
        used_bytes=3 << 30,
        sm_ratio=0.25,
        pids=(7,),
        entitlement_ratio=1.0,
        received_ratio=1.0,
    )
    gpu = GpuUsage("GPU-7", 0, 80 << 30, 3 << 30, 10240 << 20, 0, 1, True)
    exporter.update(UsageSnapshot(time.time(), (gpu,), (fraction,), ()), duration_seconds=0.01)
    return exporter


async def test_top_finds_the_node_agent_pods_and_reads_them_through_the_api_server(
    controlplane: ControlPlane, client: AsyncClient, pool: Pool
) -> None:
    code, _, err = await plugin(controlplane.kubeconfig, "top", "--once", "-n", pool.namespace)
    assert code == 1 and "no running node agent pods" in err

    ip = _routable_ip()
    server = MetricsServer(registry=registry_for(_agent_exporter()), host="0.0.0.0", port=0)
    try:
        agent = Pod.from_dict(
            {
                "metadata": {
                    "name": "agent-7",
                    "namespace": pool.namespace,
                    "labels": {"app.kubernetes.io/name": APP_NAME},
                },
                "spec": {
                    "containers": [
                        {
                            "name": "agent",
                            "image": "gpufrac",
                            "ports": [{"name": METRICS_PORT_NAME, "containerPort": server.port}],
                        }
                    ]
                },
            }
        )
        await client.create(agent)
        # No kubelet runs here: the test reports the pod Running at this machine's address, as one would.
        await client.patch(
            Pod.Status,
            "agent-7",
            {"status": {"phase": "Running", "podIP": ip, "podIPs": [{"ip": ip}]}},
            namespace=pool.namespace,
        )
        code, out, err = await plugin(controlplane.kubeconfig, "top", "--once", "-n", pool.namespace)
    finally:
        server.close()
    assert code == 0, err
    assert "gpu-node-7" in out
    assert "team-a/infer/app" in out
    assert "unreachable" not in out


async def simulate_binpack(*source: str) -> tuple[str, str]:
    """``gpufrac simulate <source> --policy binpack --seeds 42`` as a user runs it: (stdout, stderr)."""
    done = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "gpufrac",
        "simulate",
        *source,
        *("--policy", "binpack", "--seeds", "42", "--workers", "1", "--json", "--no-plot"),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(done.communicate(), timeout=120)
    assert done.returncode == 0, err.decode()
    return out.decode(), err.decode()


async def test_whatif_replays_the_cluster_and_exports_it_for_offline_replay(
    controlplane: ControlPlane, pool: Pool, placed, tmp_path: Path
) -> None:
    node, _ = placed
    args = [
        "whatif",
        "--policy",
        "binpack,fgd-align",
        "--seeds",
        "42",
        "--export",
        str(tmp_path),
        "-o",
        "json",
    ]
    code, out, err = await plugin(controlplane.kubeconfig, *args)
    assert code == 0, err
    assert f"pod {pool.namespace}/big: asks for more than a whole GPU" in err  # 200Gi on an 80 GB GPU

    nodes = {row["sn"]: row for row in csv.DictReader((tmp_path / "cluster_nodes.csv").open())}
    assert (nodes[node]["gpu"], nodes[node]["model"]) == ("2", SHAPE.model)
    pods = {row["name"]: row for row in csv.DictReader((tmp_path / "cluster_pods.csv").open())}
    assert pods[f"{pool.namespace}/small"]["gpu_milli"] == str(round(20480 / SHAPE.mib * 1000))
    assert pods[f"{pool.namespace}/picky"]["num_gpu"] == "1"  # waiting pods are part of the mix too
    assert f"{pool.namespace}/big" not in pods

    report = json.loads(out)
    assert [r["policy"] for r in report["runs"]] == ["binpack", "fgd-align"]
    today = report["today"]
    assert today["allocatedGpus"] >= round(20480 / SHAPE.mib, 2) - 0.01  # at least small's share
    assert [row["policy"] for row in today["policies"]] == ["binpack", "fgd-align"]
    for row in today["policies"]:
        assert 0 < row["gpusPlaced"] <= today["gpus"]
        assert row["moreThanToday"] == pytest.approx(row["gpusPlaced"] - today["allocatedGpus"], abs=0.011)

    code, out, err = await plugin(controlplane.kubeconfig, "whatif", "--policy", "binpack", "--seeds", "42")
    assert code == 0, err
    assert "GPU allocation on trace cluster" in out
    assert f"of {today['gpus']} GPUs' worth guaranteed" in out
    assert "binpack: " in out and " than today)" in out

    # The export replays offline to the same figure (same pods, nodes and seed).
    replay_out, _ = await simulate_binpack(
        "--trace", str(tmp_path / "cluster_pods.csv"), "--nodes", str(tmp_path / "cluster_nodes.csv")
    )
    [offline] = json.loads(replay_out)["runs"]
    [online] = [r for r in report["runs"] if r["policy"] == "binpack"]
    assert (offline["placed"], offline["failed"]) == (online["placed"], online["failed"])

    # `gpufrac simulate --from-cluster` reads the same snapshot through the same kubeconfig and replays
    # it to the same figures, and its --export writes the same CSVs.
    again = tmp_path / "again"
    cluster_out, cluster_err = await simulate_binpack(
        "--from-cluster", "--kubeconfig", str(controlplane.kubeconfig), "--export", str(again)
    )
    assert f"pod {pool.namespace}/big: asks for more than a whole GPU" in cluster_err
    [from_cluster] = json.loads(cluster_out)["runs"]
    assert (from_cluster["placed"], from_cluster["failed"]) == (online["placed"], online["failed"])
    for name in ("cluster_nodes.csv", "cluster_pods.csv"):
        assert (again / name).read_text() == (tmp_path / name).read_text()


def test_simulate_refuses_cluster_flags_without_from_cluster(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from gpufrac.cli import app

    result = CliRunner().invoke(app, ["simulate", "--export", str(tmp_path), "--no-plot"])
    assert result.exit_code == 2
    assert "--export go with --from-cluster" in result.output
