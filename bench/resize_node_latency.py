"""Node-side resize latency: from the scheduler's patch of a bound pod's amounts to the new limit read back
in force on the running container's cgroup (gpufrac.node.resize).

1. **Simulated driver, real API server** (always): a real kube-apiserver (testenv's control plane), pods
   bound to a node, each with a running container's record and its limits set through the SIMULATED
   per-cgroup driver on a directory cgroup tree; the node agent's ``PodResizeWatch`` runs as in the agent.
   Each sample is one admin merge patch of one pod's ``gpu-memory.request``/``.limit`` (alternately grow
   and shrink, the container using nothing, so no shrink waits); the clock stops when the driver's state
   holds the new soft and hard limit for that cgroup (polled from outside the agent, as a user would read
   it). **Baseline in the same run**: the time the same patch takes to reach a plain watch of the node's
   pods (a second handler on the same informer), i.e. what the API server and the watch cost before the
   node does anything; the difference is the node's own work (compare, record, set, read back).
2. **The real node** (``--realnode``, needs root and cgroups): the embedded cluster with a real kubelet,
   containerd and runc (``gpufrac.local.realnode``), one fractional pod running; each sample patches its
   amounts as the scheduler would and stops when the SIMULATED driver's state (keyed by the REAL cgroup
   of the container's process) holds the new limit.

No GPU here: NVML's own set/get cost on hardware is not in these numbers (scripts/gpu-check's resize
step runs those calls on a GPU).

Usage: .venv/bin/python bench/resize_node_latency.py [--resizes 200] [--pods 20]
                                                     [--realnode] [--realnode-resizes 50]
Prints a one-line JSON summary last.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

from lightkube.models.core_v1 import Container, PodSpec  # noqa: E402
from lightkube.models.meta_v1 import ObjectMeta  # noqa: E402
from lightkube.resources.core_v1 import Namespace, Pod  # noqa: E402
from lightkube.types import PatchType  # noqa: E402

from gpufrac.contract import keys  # noqa: E402
from gpufrac.contract.render import read_binding  # noqa: E402
from gpufrac.node.inventory.backend import GpuInfo  # noqa: E402
from gpufrac.node.mapping import AllocationRecord, MappingStore  # noqa: E402
from gpufrac.node.memlimit.driver import MIB, MemoryLimits  # noqa: E402
from gpufrac.node.memlimit.enforcer import LimitEnforcer  # noqa: E402
from gpufrac.node.memlimit.simulated import SimulatedMemoryLimits  # noqa: E402
from gpufrac.node.resize import PodResizeWatch, ResizeTracker  # noqa: E402

NODE = "bench-resize-node"
NAMESPACE = "bench-resize"
GPUS = tuple(GpuInfo(uuid=f"GPU-bench-{i}", index=i, minor=i, model="H100", mib=81559) for i in range(8))


def percentiles(samples_ms: list[float]) -> dict[str, float]:
    ordered = sorted(samples_ms)

    def at(q: float) -> float:
        return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 3)

    return {"p50_ms": at(0.50), "p99_ms": at(0.99), "max_ms": round(ordered[-1], 3), "n": len(ordered)}


def amounts(request: int, limit: int) -> dict[str, str]:
    return {keys.memory_request_key("app"): f"{request}Mi", keys.memory_limit_key("app"): f"{limit}Mi"}


class Arrivals:
    """The baseline: when each patched value reached the informer (a plain watch of the node's pods)."""

    def __init__(self) -> None:
        self.seen: dict[tuple[str, str], float] = {}

    @staticmethod
    def _limit(pod: Pod) -> str:
        assert pod.metadata is not None
        return (pod.metadata.annotations or {}).get(keys.memory_limit_key("app"), "")

    def on_add(self, obj: Pod) -> None:
        pass

    def on_update(self, old: Pod, new: Pod) -> None:
        if self._limit(old) != self._limit(new):  # the patch itself, not a later status write
            assert new.metadata is not None
            self.seen[(new.metadata.name or "", self._limit(new))] = time.perf_counter()

    def on_delete(self, obj: Pod) -> None:
        pass


async def simulated(*, resizes: int, pods: int) -> dict[str, Any]:
    from gpufrac.local.controlplane import ControlPlane

    with tempfile.TemporaryDirectory(prefix="resize-bench-") as tmp, ControlPlane() as controlplane:
        root = Path(tmp) / "cgroupfs"
        root.mkdir()
        (root / "cgroup.controllers").touch()
        driver = SimulatedMemoryLimits(
            path=Path(tmp) / "limits.json",
            gpus=lambda: GPUS,
            driver_version=lambda: "615.20.01",
            cgroup_root=root,
        )
        limits = LimitEnforcer(driver=driver, gpu_uuid={g.uuid: g.uuid for g in GPUS}.get, cgroup_root=root)
        store = MappingStore(directory=Path(tmp) / "state")
        client = controlplane.async_client()
        await client.create(Namespace(metadata=ObjectMeta(name=NAMESPACE)))
        cgroups: dict[str, str] = {}
        for i in range(pods):
            name, gpu = f"pod-{i}", GPUS[i % len(GPUS)].uuid
            annotations = {keys.devices_key("app"): gpu, **amounts(4096, 8192)}
            created = await client.create(
                Pod(
                    metadata=ObjectMeta(name=name, annotations=annotations),
                    spec=PodSpec(nodeName=NODE, containers=[Container(name="app", image="x")]),
                ),
                namespace=NAMESPACE,
            )
            assert created.metadata is not None and created.metadata.uid is not None
            (bound,) = read_binding(annotations)
            cid = f"{i:064x}"
            relative = f"/kubepods/pod{created.metadata.uid}/{cid}"
            (root / relative.lstrip("/")).mkdir(parents=True)
            record = AllocationRecord(
                container_id=cid,
                pod_namespace=NAMESPACE,
                pod_name=name,
                pod_uid=created.metadata.uid,
                container_name="app",
                devices=bound.devices,
                request_mib=4096,
                limit_mib=8192,
                mode="time-slicing",
                portion=None,
            )
            store.put(record)
            assert limits.enforce(record=replace(record), pid=0, cgroups_path=relative).in_force
            cgroups[name] = str(root / relative.lstrip("/"))
        watch = PodResizeWatch(
            client=client, node_name=NODE, tracker=ResizeTracker(store=store, limits=limits)
        )
        arrivals = Arrivals()
        watch.informer.add_handler(arrivals)
        running = asyncio.create_task(watch.run())
        try:
            await asyncio.wait_for(watch.informer.synced.wait(), 30)
            in_force_ms, watch_ms = [], []
            for n in range(resizes):
                name, gpu = f"pod-{n % pods}", GPUS[(n % pods) % len(GPUS)].uuid
                grow = (n // pods) % 2 == 0
                request, limit = (8192, 16384) if grow else (4096, 8192)
                wanted = MemoryLimits(soft=request * MIB, hard=limit * MIB)
                began = time.perf_counter()
                await client.patch(
                    Pod,
                    name,
                    {"metadata": {"annotations": amounts(request, limit)}},
                    namespace=NAMESPACE,
                    patch_type=PatchType.MERGE,
                )
                while driver.held().get(gpu, {}).get(cgroups[name]) != wanted:
                    await asyncio.sleep(0.0005)
                    assert time.perf_counter() - began < 30, f"resize {n} not in force"
                in_force_ms.append((time.perf_counter() - began) * 1000)
                arrived = arrivals.seen.pop((name, f"{limit}Mi"))
                watch_ms.append((arrived - began) * 1000)
            settled = time.perf_counter()  # the last one's Event may follow its read-back by a moment
            while watch.tracker.applied < resizes and time.perf_counter() - settled < 5:
                await asyncio.sleep(0.01)
        finally:
            running.cancel()
            await asyncio.gather(running, return_exceptions=True)
            await client.close()
            store.close()
    node = [a - b for a, b in zip(in_force_ms, watch_ms, strict=True)]
    return {
        "patch_to_in_force": percentiles(in_force_ms),
        "baseline_patch_to_watch": percentiles(watch_ms),
        "node_share_p50_ms": round(statistics.median(node), 3),
        "applied": watch.tracker.applied,
    }


def process_cgroup(pid: int) -> str:
    """The cgroup directory the process lives in, from the kernel (v2 unified, else the v1 memory one)."""
    unified = Path("/sys/fs/cgroup/cgroup.controllers").exists()
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if unified and not controllers:
            return f"/sys/fs/cgroup{path}"
        if not unified and "memory" in controllers.split(","):
            return f"/sys/fs/cgroup/memory{path}"
    raise RuntimeError(f"no cgroup for pid {pid}")


async def realnode(*, resizes: int) -> dict[str, Any]:
    from lightkube.models.core_v1 import Container as C

    from gpufrac.admission.review import DEFAULT_SCHEDULER_USER
    from gpufrac.local import ociimage
    from gpufrac.local.cluster import ClusterShape, LocalCluster
    from gpufrac.local.realnode import SLEEP_COMMAND
    from gpufrac.local.simnodes import NodeShape

    shape = ClusterShape(
        nodes=1, prefix="real-gpu-", node=NodeShape(gpus=8, model="H100-80GB"), runtime="containerd"
    )
    async with LocalCluster(shape=shape, progress=lambda m: print(f"• {m}", file=sys.stderr)) as cluster:
        assert cluster.client is not None and cluster.real_node is not None
        pod = Pod(
            metadata=ObjectMeta(
                name="resized", annotations={"gpu-fraction": "0.25", "gpu-fraction.limit": "0.5"}
            ),
            spec=PodSpec(
                schedulerName=keys.DEFAULT_SCHEDULER_NAME,
                hostNetwork=True,
                automountServiceAccountToken=False,
                terminationGracePeriodSeconds=1,
                containers=[
                    C(
                        name="app",
                        image=ociimage.WORKLOAD.ref,
                        imagePullPolicy="Never",
                        command=list(SLEEP_COMMAND),
                    )
                ],
            ),
        )
        await cluster.client.create(pod, namespace="default")
        deadline = time.monotonic() + 120
        while True:
            got = await cluster.client.get(Pod, "resized", namespace="default")
            statuses = (got.status.containerStatuses or []) if got.status else []
            if statuses and statuses[0].state is not None and statuses[0].state.running is not None:
                break
            assert time.monotonic() < deadline, "the pod did not run"
            await asyncio.sleep(0.2)
        assert got.metadata is not None and statuses[0].containerID
        (plan,) = read_binding(got.metadata.annotations or {})
        assert plan.request_mib is not None and plan.limit_mib is not None
        pid = cluster.real_node.container_pid(statuses[0].containerID)
        cgroup = process_cgroup(pid)
        driver = SimulatedMemoryLimits(
            path=cluster.real_node.root / "node-agent" / "sim-memory-limits.json",
            gpus=tuple,
            driver_version=lambda: "615.20.01",
        )
        scheduler = cluster.controlplane.async_client(impersonate=DEFAULT_SCHEDULER_USER)
        samples: list[float] = []
        patch_ms: list[float] = []
        try:
            for n in range(resizes):
                grow = n % 2 == 0
                request = plan.request_mib + (1024 if grow else 0)
                limit = plan.limit_mib + (4096 if grow else 0)
                wanted = MemoryLimits(soft=request * MIB, hard=limit * MIB)
                began = time.perf_counter()
                await scheduler.patch(
                    Pod,
                    "resized",
                    {"metadata": {"annotations": amounts(request, limit)}},
                    namespace="default",
                    patch_type=PatchType.MERGE,
                )
                patch_ms.append((time.perf_counter() - began) * 1000)  # the API server's answer (webhook)
                while any(
                    per.get(cgroup) != wanted for per in (driver.held().get(d, {}) for d in plan.devices)
                ):
                    await asyncio.sleep(0.001)
                    assert time.perf_counter() - began < 30, f"resize {n} not in force"
                samples.append((time.perf_counter() - began) * 1000)
        finally:
            await scheduler.close()
        return {
            "patch_to_in_force": percentiles(samples),
            "patch_answered": percentiles(patch_ms),
            "pid_unchanged": cluster.real_node.container_pid(statuses[0].containerID) == pid,
        }


async def main(args: argparse.Namespace) -> dict[str, Any]:
    result: dict[str, Any] = {
        "bench": "resize_node_latency",
        "simulated": await simulated(resizes=args.resizes, pods=args.pods),
    }
    if args.realnode:
        result["realnode"] = await realnode(resizes=args.realnode_resizes)
    return result


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--resizes", type=int, default=200)
    parser.add_argument("--pods", type=int, default=20)
    parser.add_argument("--realnode", action="store_true", help="also on the real node (root, cgroups)")
    parser.add_argument("--realnode-resizes", type=int, default=50)
    summary = asyncio.run(main(parser.parse_args()))
    print(json.dumps(summary))
