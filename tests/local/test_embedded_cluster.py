"""The embedded cluster end to end: what `gpufrac demo` shows, asserted from the API objects.

One LocalCluster (real control plane, admission webhook, scheduler process, node agents on NRI's real
runtime side, simulated kubelet) runs the demo's pods; every check reads Pods and Nodes back from the
API server, never a component's memory.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import subprocess
import sys
from collections.abc import AsyncIterator, Callable

import pytest
from lightkube import ApiError
from lightkube.codecs import load_all_yaml
from lightkube.resources.core_v1 import Node, Pod
from rich.console import Console

from gpufrac.contract import keys
from gpufrac.local.cluster import ClusterShape, LocalCluster
from gpufrac.local.controlplane import REPO_ROOT
from gpufrac.local.demo import DEMO_PODS, PodOutcome, gpu_names, outcome, submit_and_wait
from gpufrac.local.kubelet import CONTAINERS_ANNOTATION
from gpufrac.local.simnodes import NodeShape
from gpufrac.node.top import render, scrape

pytestmark = pytest.mark.kube


@pytest.fixture(scope="module")
async def cluster() -> AsyncIterator[LocalCluster]:
    local = LocalCluster(shape=ClusterShape(nodes=2, node=NodeShape(gpus=4, model="H100-80GB")))
    async with local:
        yield local


@pytest.fixture(scope="module")
async def outcomes(cluster: LocalCluster) -> dict[str, PodOutcome]:
    assert cluster.client is not None
    pods = [await submit_and_wait(cluster.client, manifest) for manifest in DEMO_PODS]
    names = await gpu_names(cluster.client)
    return {o.name: o for o in (outcome(pod, names) for pod in pods)}


async def test_node_agents_published_every_gpu(cluster: LocalCluster) -> None:
    assert cluster.client is not None
    async for node in cluster.client.list(Node):
        gpus = json.loads(node.metadata.annotations[keys.NODE_GPUS_ANNOTATION])
        assert [g["index"] for g in gpus] == [0, 1, 2, 3]
        assert {g["mib"] for g in gpus} == {81559}
        ready = {c.type: c.status for c in node.status.conditions}
        assert ready[keys.NODE_READY_CONDITION] == "True"


README_SECTION = "## Try it: a fraction on `gpufrac up`"


def readme_walkthrough() -> list[tuple[str, list[str]]]:
    """The README's walkthrough: each ``$ `` command of its ``console`` block with the output lines shown."""
    text = (REPO_ROOT / "README.md").read_text()
    section = text[text.index(README_SECTION) :]
    block = section[section.index("```console\n") + len("```console\n") :]
    block = block[: block.index("\n```")]
    steps: list[tuple[str, list[str]]] = []
    for line in block.splitlines():
        if line.startswith("$ "):
            steps.append((line[2:], []))
        else:
            steps[-1][1].append(line)
    return steps


def _shown(line: str) -> re.Pattern[str]:
    """A line the README shows, as a pattern: ``…`` stands for anything, runs of spaces for any run."""
    parts = (re.escape(" ".join(part.split())) for part in line.split("…"))
    return re.compile(".*".join(parts))


def _missing(shown: list[str], output: str) -> list[str]:
    """The README's lines that ``output`` lacks, matched in order (lines it leaves out are skipped)."""
    lines = iter(" ".join(line.split()) for line in output.splitlines())
    return [line for line in shown if not any(_shown(line).fullmatch(actual) for actual in lines)]


async def test_the_readme_walkthrough_runs_as_written(cluster: LocalCluster) -> None:
    """The README's "Try it" block, command by command, in a shell from the clone's root, on the embedded
    cluster with `gpufrac up`'s nodes (this module's cluster, which differs from `gpufrac up` only in
    the demo's binpack policy: the walkthrough's outputs leave the node and GPUs it got as ``…``). Every
    output line the README shows must appear, in order. It runs before the demo's pods exist and removes
    its pod (the walkthrough's last step). ``kubectl gpufrac`` reads are run again for up to 20 s, as the
    README tells a user to (the node agents collect every 5 s)."""
    assert (cluster.shape.nodes, cluster.shape.node) == (2, NodeShape(gpus=4, model="H100-80GB"))
    exports: list[str] = []
    for command, shown in readme_walkthrough():
        if command.startswith("export KUBECONFIG="):
            printed = command.split()[1].removeprefix("KUBECONFIG=")
            assert _shown(printed).fullmatch(str(cluster.kubeconfig)), (printed, cluster.kubeconfig)
            command = f"export KUBECONFIG={cluster.kubeconfig}"
        script = "\n".join([*exports, command])
        deadline = asyncio.get_running_loop().time() + (20 if command.startswith("kubectl gpufrac") else 0)
        while True:
            done = await asyncio.to_thread(
                subprocess.run,
                ["bash", "-euc", script],
                cwd=REPO_ROOT,
                env={k: v for k, v in os.environ.items() if k != "KUBECONFIG"},
                capture_output=True,
                text=True,
                timeout=90,
            )
            missing = _missing(shown, done.stdout)
            if (done.returncode == 0 and not missing) or asyncio.get_running_loop().time() > deadline:
                break
            await asyncio.sleep(1)
        assert done.returncode == 0, f"$ {command}\n{done.stdout}{done.stderr}"
        assert not missing, f"$ {command}: the README shows lines the output lacks: {missing}\n{done.stdout}"
        if command.startswith("export "):
            exports.append(command)


async def test_reference_pods_run_with_their_limits_injected(outcomes: dict[str, PodOutcome]) -> None:
    inference = outcomes["inference"]
    assert inference.state == "Running"
    assert len(set(inference.devices)) == 4 and {d.split("/")[0] for d in inference.devices} == {
        inference.node
    }
    env = inference.injected["app"]["env"]
    assert env["NVIDIA_GPU_MEMORY_REQUEST"] == "40960"
    assert env["NVIDIA_GPU_MEMORY_LIMIT"] == "61440"
    assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "50"
    assert len(env["NVIDIA_VISIBLE_DEVICES"].split(",")) == 4

    notebook = outcomes["notebook"]
    assert notebook.state == "Running" and notebook.mode == "time-slicing"
    # gpu-fraction 0.5 / limit 0.8 resolved on an 81559 MiB GPU by floor.
    assert (notebook.request_mib, notebook.limit_mib) == (40779, 65247)
    assert notebook.injected["app"]["env"]["NVIDIA_GPU_MEMORY_REQUEST"] == "40779"
    assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" not in notebook.injected["app"]["env"]


async def test_modes_never_share_a_gpu_and_small_pods_are_packed(outcomes: dict[str, PodOutcome]) -> None:
    sm_gpus = set(outcomes["inference"].devices)
    time_sliced = set(outcomes["notebook"].devices) | set(outcomes["packed"].devices)
    assert not sm_gpus & time_sliced
    assert set(outcomes["packed"].devices) <= set(outcomes["notebook"].devices)


async def test_unschedulable_pods_say_why_per_node(outcomes: dict[str, PodOutcome]) -> None:
    conflict = outcomes["mode-conflict"]
    assert conflict.state == "Unschedulable" and not conflict.node
    assert conflict.reason.startswith("0/2 nodes are available")
    assert "compute-mode conflict" in conflict.reason
    too_big = outcomes["too-big"]
    assert too_big.state == "Unschedulable"
    assert "2 insufficient GPU memory" in too_big.reason


async def test_admission_rejects_a_bad_request_with_the_contract_message(cluster: LocalCluster) -> None:
    assert cluster.client is not None
    (pod,) = load_all_yaml((DEMO_PODS[0].parent / "demo" / "packed.yaml").read_text())
    pod.metadata.name = "bad-limit"
    pod.metadata.annotations[keys.memory_limit_key("app")] = "1Gi"  # below the 16Gi request
    with pytest.raises(ApiError) as rejected:
        await cluster.client.create(pod, namespace="default")
    assert keys.memory_limit_key("app") in str(rejected.value)


async def test_only_the_scheduler_writes_devices(
    cluster: LocalCluster, outcomes: dict[str, PodOutcome]
) -> None:
    assert cluster.client is not None
    pod = await cluster.client.get(Pod, "packed", namespace="default")
    assert pod.metadata.annotations[CONTAINERS_ANNOTATION]
    with pytest.raises(ApiError) as refused:
        await cluster.client.patch(
            Pod,
            "packed",
            {"metadata": {"annotations": {keys.devices_key("app"): "GPU-stolen"}}},
            namespace="default",
        )
    assert refused.value.status.code in (400, 403)


async def test_gpufrac_top_shows_the_inference_fractions_from_the_agents_metrics(
    cluster: LocalCluster, outcomes: dict[str, PodOutcome]
) -> None:
    inference = outcomes["inference"]
    url = cluster.metrics_urls[inference.node]
    deadline = asyncio.get_running_loop().time() + 15  # the agents collect every 5 s
    while True:
        (view,) = await asyncio.to_thread(scrape, [url])
        rows = {
            gpu.uuid: f
            for gpu in view.gpus.values()
            for (namespace, pod, container, _mode), f in gpu.fractions.items()
            if (namespace, pod, container) == ("default", "inference", "app")
        }
        if len(rows) == 4 or asyncio.get_running_loop().time() > deadline:
            break
        await asyncio.sleep(0.5)
    assert view.error is None and view.node == inference.node
    assert len(rows) == 4
    assert {f["request"] for f in rows.values()} == {40960 * 1024**2}
    assert {f["limit"] for f in rows.values()} == {61440 * 1024**2}
    assert {f["used"] for f in rows.values()} == {0}
    console = Console(record=True, width=200)
    console.print(render([view]))
    assert console.export_text().count("default/inference/app") == 4

    # kubectl gpufrac top with no address: gpufrac up's agents are processes, not pods; it finds them.
    done = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "gpufrac.kubectl", "--kubeconfig", str(cluster.kubeconfig), "top", "--once"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("default/inference/app") == 4


def _kubectl(cluster: LocalCluster, *args: str, stdin: str | None = None) -> str:
    """``kubectl`` against the embedded cluster, as a user of `gpufrac up` runs it with its KUBECONFIG."""
    done = subprocess.run(
        ["kubectl", f"--kubeconfig={cluster.kubeconfig}", *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, f"kubectl {' '.join(args)}: {done.stderr}"
    return done.stdout


def _refusal(pod: Pod) -> str:
    """The PodScheduled=False message (why the scheduler left the pod pending); empty when none."""
    conditions = (pod.status.conditions or []) if pod.status else []
    return next((c.message or "" for c in conditions if c.type == "PodScheduled" and c.status == "False"), "")


async def _wait_pod(cluster: LocalCluster, name: str, until: Callable[[Pod], bool], what: str) -> Pod:
    assert cluster.client is not None
    deadline = asyncio.get_running_loop().time() + 60
    while True:
        pod = await cluster.client.get(Pod, name, namespace="default")
        if until(pod):
            return pod
        assert asyncio.get_running_loop().time() < deadline, f"{name}: not {what} in 60s ({_refusal(pod)})"
        await asyncio.sleep(0.2)


def _bound(pod: Pod) -> bool:
    return bool(pod.spec.nodeName)


def _refused(pod: Pod) -> bool:
    return bool(_refusal(pod))


async def test_queue_objects_are_served_and_honoured(cluster: LocalCluster) -> None:
    """`gpufrac up` installs the Queue CRD: kubectl creates and lists Queues, and the embedded scheduler
    admits a pod to a queue only once its Queue exists, and caps the queue at its limit."""
    assert cluster.client is not None
    queue = "embedded-team"
    packed = (DEMO_PODS[0].parent / "demo" / "packed.yaml").read_text()  # 16Gi, time-slicing

    async def submit(name: str) -> None:
        (pod,) = load_all_yaml(packed)
        pod.metadata.name = name
        pod.metadata.labels = {keys.QUEUE_LABEL: queue}
        await cluster.client.create(pod, namespace="default")

    names = ("queued-first", "queued-second")
    try:
        await submit(names[0])
        waiting = await _wait_pod(cluster, names[0], _refused, "refused")
        assert not waiting.spec.nodeName
        assert _refusal(waiting) == f"queue {queue} (label {keys.QUEUE_LABEL}) is not configured"

        # 16384 MiB fits the limit once, not twice.
        manifest = (
            "apiVersion: gpufrac.io/v1alpha1\nkind: Queue\n"
            f"metadata: {{name: {queue}}}\nspec: {{resources: {{gpuMemory: {{limit: 20000}}}}}}\n"
        )
        assert "created" in await asyncio.to_thread(_kubectl, cluster, "apply", "-f", "-", stdin=manifest)
        await _wait_pod(cluster, names[0], _bound, "bound")  # the new queue wakes it
        await submit(names[1])
        second = await _wait_pod(cluster, names[1], lambda p: _bound(p) or _refused(p), "decided")
        assert not second.spec.nodeName
        assert f"queue {queue} would exceed its GPU-memory limit of 20000 MiB" in _refusal(second)

        # The scheduler writes the queue's status (every 5 s by default); kubectl shows the CRD's columns.
        deadline = asyncio.get_running_loop().time() + 30
        while True:
            header, *rows = (await asyncio.to_thread(_kubectl, cluster, "get", "queues")).splitlines()
            # NAME PARENT DESERVED(MIB) LIMIT(MIB) ALLOCATED(MIB) ...; a top-level queue's parent is blank.
            assert header.split()[:5] == ["NAME", "PARENT", "DESERVED(MIB)", "LIMIT(MIB)", "ALLOCATED(MIB)"]
            if [row.split()[:4] for row in rows] == [[queue, "0", "20000", "16384"]]:
                break
            assert asyncio.get_running_loop().time() < deadline, rows
            await asyncio.sleep(0.5)
    finally:
        for name in names:
            with contextlib.suppress(ApiError):
                await cluster.client.delete(Pod, name, namespace="default", grace_period=0)
        await asyncio.to_thread(_kubectl, cluster, "delete", "queue", queue, "--ignore-not-found")


async def test_fractions_say_their_limits_were_read_back_from_the_driver(
    cluster: LocalCluster, outcomes: dict[str, PodOutcome]
) -> None:
    """Each running fraction has GpuMemoryEnforced=True with the values the (SIMULATED) driver holds for
    its cgroup; a limit cleared behind the agent's back is set again and said with an Event."""
    assert cluster.client is not None
    notebook = outcomes["notebook"]
    pod = await cluster.client.get(Pod, "notebook", namespace="default")
    condition = await _wait_condition(cluster, "notebook")
    assert condition.status == "True" and condition.reason == keys.POD_REASON_LIMITS_READ_BACK
    soft, hard = notebook.request_mib, notebook.limit_mib or notebook.request_mib
    assert f"soft {soft} MiB, hard {hard} MiB read back" in condition.message

    driver_state = cluster.work_dir / "nodes" / notebook.node / "state" / "sim-memory-limits.json"
    held = json.loads(driver_state.read_text())["limits"]
    cgroups = {cg for per_gpu in held.values() for cg in per_gpu if pod.metadata.uid in cg}
    assert len(cgroups) == 1, held  # one container, its cgroup on each of its GPUs
    (cgroup,) = cgroups
    gpu = next(g for g, per_gpu in held.items() if cgroup in per_gpu)
    assert held[gpu][cgroup] == {"soft": soft * 2**20, "hard": hard * 2**20}

    del held[gpu][cgroup]  # the driver "forgot" the limit (an operator reset it)
    driver_state.write_text(json.dumps({"limits": held}))
    deadline = asyncio.get_running_loop().time() + 40
    while True:
        events = [e for e in await _events(cluster, "notebook") if e.reason == "GpuMemoryLimitReapplied"]
        if events:
            break
        assert asyncio.get_running_loop().time() < deadline, "the audit did not set the limit again"
        await asyncio.sleep(1)
    assert "the driver holds no limit" in events[0].message
    again = json.loads(driver_state.read_text())["limits"][gpu][cgroup]
    assert again == {"soft": soft * 2**20, "hard": hard * 2**20}


async def _wait_condition(cluster: LocalCluster, name: str):  # type: ignore[no-untyped-def]
    assert cluster.client is not None
    deadline = asyncio.get_running_loop().time() + 30
    while True:
        pod = await cluster.client.get(Pod, name, namespace="default")
        found = [c for c in pod.status.conditions or [] if c.type == keys.POD_MEMORY_ENFORCED_CONDITION]
        if found:
            return found[0]
        assert asyncio.get_running_loop().time() < deadline, pod.status.conditions
        await asyncio.sleep(0.5)


async def _events(cluster: LocalCluster, name: str):  # type: ignore[no-untyped-def]
    from lightkube.resources.core_v1 import Event

    assert cluster.client is not None
    return [
        e async for e in cluster.client.list(Event, namespace="default", fields={"involvedObject.name": name})
    ]


async def test_graceful_deletion_and_eviction_finish_as_on_a_node(cluster: LocalCluster) -> None:
    """Before, the simulated kubelet ignored a deletionTimestamp: `kubectl delete pod` hung and evicted or
    reclaimed victims stayed Terminating. Now it stops the containers and confirms the deletion."""
    from gpufrac.kube.eviction import evict_pod

    assert cluster.client is not None
    packed = (DEMO_PODS[0].parent / "demo" / "packed.yaml").read_text()  # 16Gi, time-slicing
    names = ("leaves-gracefully", "evicted")
    for name in names:
        (pod,) = load_all_yaml(packed)
        pod.metadata.name = name
        await cluster.client.create(pod, namespace="default")
    try:
        running = [
            await _wait_pod(cluster, n, lambda p: (p.status.phase or "") == "Running", "running")
            for n in names
        ]
        # kubectl's default: a 30 s grace period, and it waits until the pod is gone.
        out = await asyncio.to_thread(_kubectl, cluster, "delete", "pod", names[0], "--timeout=45s")
        assert f'pod "{names[0]}" deleted' in out
        await evict_pod(cluster.client, name=names[1], namespace="default", uid=running[1].metadata.uid)
        for pod in running:
            deadline = asyncio.get_running_loop().time() + 30
            while True:
                try:
                    await cluster.client.get(Pod, pod.metadata.name, namespace="default")
                except ApiError as gone:
                    assert gone.status.code == 404
                    break
                assert asyncio.get_running_loop().time() < deadline, f"{pod.metadata.name} stays Terminating"
                await asyncio.sleep(0.2)
            # its containers are gone from the node's runtime too (their cgroups removed)
            cgroups = cluster.work_dir / "nodes" / pod.spec.nodeName / "cgroupfs"
            assert cgroups.is_dir()
            pod_cgroup = cgroups / "kubepods" / f"pod{pod.metadata.uid}"
            assert not (pod_cgroup.is_dir() and list(pod_cgroup.iterdir())), pod_cgroup
    finally:
        for name in names:
            with contextlib.suppress(ApiError):
                await cluster.client.delete(Pod, name, namespace="default", grace_period=0)


DEPLOYMENT = """
apiVersion: apps/v1
kind: Deployment
metadata: {name: fractions, namespace: default}
spec:
  replicas: 2
  selector: {matchLabels: {app: fractions}}
  template:
    metadata:
      labels: {app: fractions}
      annotations: {nvidia.com/container.app.gpu-memory.request: "8Gi"}
    spec:
      schedulerName: gpufrac-scheduler
      containers: [{name: app, image: busybox, command: [sleep, infinity]}]
"""


async def test_a_deployment_gets_its_replicas_from_the_controller_manager(cluster: LocalCluster) -> None:
    """Before, no kube-controller-manager ran on `gpufrac up`: a Deployment stayed 0/2 with no ReplicaSet."""
    assert cluster.client is not None
    try:
        await asyncio.to_thread(_kubectl, cluster, "apply", "-f", "-", stdin=DEPLOYMENT)
        deadline = asyncio.get_running_loop().time() + 60
        while True:
            ready = await asyncio.to_thread(
                _kubectl, cluster, "get", "deployment", "fractions", "-o", "jsonpath={.status.readyReplicas}"
            )
            if ready == "2":
                break
            assert asyncio.get_running_loop().time() < deadline, f"readyReplicas {ready!r}"
            await asyncio.sleep(0.5)
        pods = [p async for p in cluster.client.list(Pod, namespace="default", labels={"app": "fractions"})]
        assert len(pods) == 2 and all(p.spec.nodeName for p in pods)
        assert all(p.metadata.ownerReferences[0].kind == "ReplicaSet" for p in pods)
        # Deleting the Deployment removes its pods (the garbage collector, then graceful deletion).
        await asyncio.to_thread(_kubectl, cluster, "delete", "deployment", "fractions", "--wait=true")
        deadline = asyncio.get_running_loop().time() + 60
        while [p async for p in cluster.client.list(Pod, namespace="default", labels={"app": "fractions"})]:
            assert asyncio.get_running_loop().time() < deadline, "the Deployment's pods stayed"
            await asyncio.sleep(0.5)
    finally:
        await asyncio.to_thread(
            _kubectl, cluster, "delete", "deployment", "fractions", "--ignore-not-found", "--wait=false"
        )


async def test_an_isolation_pod_gets_a_slice_the_scheduler_had_an_idle_gpu_partitioned_for(
    cluster: LocalCluster, outcomes: dict[str, PodOutcome]
) -> None:
    """examples/isolated-mig.yaml on `gpufrac up`: no GPU is in MIG mode, so the scheduler writes a layout
    for an idle GPU on its node, that node's agent makes the slice and republishes, and the pod is bound
    to the new slice and created with exactly that MIG device (no fraction variables)."""
    assert cluster.client is not None
    client = cluster.client
    (pod,) = load_all_yaml((REPO_ROOT / "examples" / "isolated-mig.yaml").read_text())
    await client.create(pod, namespace="default")
    try:
        deadline = asyncio.get_running_loop().time() + 60
        while True:
            got = await client.get(Pod, "isolated", namespace="default")
            if (got.metadata.annotations or {}).get(CONTAINERS_ANNOTATION):
                break
            assert asyncio.get_running_loop().time() < deadline, [
                c.message for c in (got.status.conditions or []) if c.type == "PodScheduled"
            ]
            await asyncio.sleep(0.2)
        (slice_uuid,) = got.metadata.annotations[keys.devices_key("app")].split(",")
        assert slice_uuid.startswith("MIG-")
        node = await client.get(Node, got.spec.nodeName)
        gpus = json.loads(node.metadata.annotations[keys.NODE_GPUS_ANNOTATION])
        (parent,) = [g for g in gpus if any(s["uuid"] == slice_uuid for s in g.get("mig", []))]
        got_slice = next(s for s in parent["mig"] if s["uuid"] == slice_uuid)
        assert parent["mode"] == "mig" and got_slice["profile"] == "1g.20gb"  # the smallest that fits
        # None of the demo's fractions was on the GPU that was re-partitioned.
        assert not any(
            d.startswith(f"{node.metadata.name}/gpu{parent['index']}")
            for o in outcomes.values()
            for d in o.devices
        )
        status = json.loads(node.metadata.annotations[keys.NODE_GPU_LAYOUT_STATUS_ANNOTATION])
        assert status["gpus"][parent["uuid"]]["state"] == "Applied"
        env = json.loads(got.metadata.annotations[CONTAINERS_ANNOTATION])["app"]["env"]
        assert env["NVIDIA_VISIBLE_DEVICES"] == slice_uuid
        assert "NVIDIA_GPU_MEMORY_LIMIT" not in env and "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" not in env
    finally:
        await client.delete(Pod, "isolated", namespace="default", grace_period=0)
