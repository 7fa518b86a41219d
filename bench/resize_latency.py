"""Resize latency: from the user's write of a resize request to the binding showing the new amounts.

A real control plane (testenv), simulated GPU nodes, and the gpufrac scheduler running in this process
(``SchedulerService``, leader election on, as ``gpufrac up`` starts it). Pods of 8 GiB are placed first,
spread one per GPU so that every grow fits;
then each resize is timed from the start of the user's merge patch of
``gpufrac.io/container.app.resize.gpu-memory.request`` to the moment a watch sees the pod with the new
``nvidia.com/container.app.gpu-memory.request`` and the request removed (what the node agent watches for).
Resizes alternate grow (8 -> 10 GiB) and shrink (10 -> 8 GiB) on the same pod, so both orders of
books-and-patch are measured. ``--sequential`` resizes go one at a time (no queueing); then ``--burst``
pods are asked to resize at once (the scheduler decides them in one pass, writing one patch each).

Baseline, in the same run on the same control plane: the user's write of a plain annotation to the watch
seeing it (the API server's own write-to-watch floor): the resize's cost over it is the scheduler's
decision and its one patch. The bookings are audited at the end (``booking_audit``: no GPU over its
capacity, and the scheduler's books equal to the pods' annotations).

    .venv/bin/python bench/resize_latency.py                     # 4 nodes x 8 GPUs, 32 pods, 200 + 32
    .venv/bin/python bench/resize_latency.py --sequential 50 --burst 16   # quick look

The last line is a one-line JSON summary.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from lightkube import AsyncClient
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.core_v1 import Namespace, Node, Pod
from lightkube.types import PatchType

from gpufrac.contract import keys
from gpufrac.local.controlplane import ControlPlane
from gpufrac.local.simnodes import NodeShape, create_sim_nodes
from gpufrac.scheduler.booking_audit import audit, books_disagree
from gpufrac.scheduler.config import SchedulerConfig
from gpufrac.scheduler.service import build_service

NAMESPACE = "resize-bench"
SCHEDULER = "gpufrac-scheduler"
REQ = keys.memory_request_key("app")
RESIZE = keys.resize_key("app", keys.RESIZE_MEMORY_REQUEST)
MARK = "example.com/bench-mark"


def pod(name: str) -> Pod:
    return Pod.from_dict(
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name, "namespace": NAMESPACE, "annotations": {REQ: "8Gi"}},
            "spec": {
                "schedulerName": SCHEDULER,
                "tolerations": [keys.managed_toleration()],
                "containers": [{"name": "app", "image": "busybox"}],
            },
        }
    )


class Watch:
    """One watch of the namespace's pods: waiters are woken when a pod shows what they wait for."""

    def __init__(self, client: AsyncClient) -> None:
        self._client = client
        self._waiters: list[tuple[str, Any, asyncio.Future[float]]] = []
        self.latest: dict[str, Pod] = {}

    async def run(self) -> None:
        async for _, obj in self._client.watch(Pod, namespace=NAMESPACE):
            now = time.perf_counter()
            self.latest[obj.metadata.name] = obj
            keep = []
            for name, check, future in self._waiters:
                if name == obj.metadata.name and not future.done() and check(obj):
                    future.set_result(now)
                else:
                    keep.append((name, check, future))
            self._waiters = keep

    def until(self, name: str, check: Any) -> asyncio.Future[float]:
        future: asyncio.Future[float] = asyncio.get_running_loop().create_future()
        self._waiters.append((name, check, future))
        return future


def _annotations(obj: Pod) -> dict[str, str]:
    return dict(obj.metadata.annotations or {})


async def timed(client: AsyncClient, watch: Watch, name: str, body: dict[str, Any], check: Any) -> float:
    """Seconds from the start of the user's patch to the watch seeing ``check`` hold on the pod."""
    seen = watch.until(name, check)
    started = time.perf_counter()
    await client.patch(
        Pod, name, {"metadata": {"annotations": body}}, namespace=NAMESPACE, patch_type=PatchType.MERGE
    )
    return await asyncio.wait_for(seen, timeout=60) - started


def resized_to(mib: int) -> Any:
    return lambda obj: _annotations(obj).get(REQ) == f"{mib}Mi" and RESIZE not in _annotations(obj)


def summary(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    pick = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000  # noqa: E731
    return {
        "n": len(ordered),
        "p50_ms": round(pick(0.50), 1),
        "p99_ms": round(pick(0.99), 1),
        "max_ms": round(ordered[-1] * 1000, 1),
        "mean_ms": round(statistics.fmean(ordered) * 1000, 1),
    }


async def run(args: argparse.Namespace) -> dict[str, Any]:
    workdir = Path(tempfile.mkdtemp(prefix="gpufrac-resize-bench-"))
    with ControlPlane(data_dir=workdir / "cp") as cp:
        client = cp.async_client(timeout=30)
        await create_sim_nodes(client, count=args.nodes, shape=NodeShape(gpus=args.gpus), prefix="rb-")
        await client.create(Namespace(metadata=ObjectMeta(name=NAMESPACE)))
        config = SchedulerConfig.model_validate(
            {
                "scheduler_name": SCHEDULER,
                # One pod per GPU: every grow fits, so every resize measured is carried out (a deferred
                # one waits for room, which is not latency).
                "policy": "spread",
                "http_host": "127.0.0.1",
                "http_port": 0,
                "node_heartbeat_expiry_s": None,
                "leader_election": {"lease_name": "resize-bench", "lease_namespace": "default"},
            }
        )
        service = build_service(client=client, config=config, identity="bench")
        scheduler = asyncio.create_task(service.run())
        watch = Watch(client)
        watcher = asyncio.create_task(watch.run())
        try:
            await service.wait_scheduling(timeout=60)
            names = [f"p{i}" for i in range(args.pods)]
            bound = [watch.until(n, lambda obj: bool(obj.spec.nodeName)) for n in names]
            for name in names:
                await client.create(pod(name))
            await asyncio.wait_for(asyncio.gather(*bound), timeout=120)

            floor, sequential = [], []
            for i in range(args.sequential):
                name = names[i % len(names)]
                floor.append(
                    await timed(
                        client,
                        watch,
                        name,
                        {MARK: str(i)},
                        lambda o, i=i: _annotations(o).get(MARK) == str(i),
                    )
                )
                grow = (i // len(names)) % 2 == 0
                mib = 10240 if grow else 8192
                sequential.append(await timed(client, watch, name, {RESIZE: f"{mib}Mi"}, resized_to(mib)))

            burst_names = names[: args.burst]
            current = {n: _annotations(watch.latest[n]).get(REQ) for n in burst_names}
            targets = {n: 8192 if current[n] == "10240Mi" else 10240 for n in burst_names}
            started = time.perf_counter()
            seen = [watch.until(n, resized_to(targets[n])) for n in burst_names]
            await asyncio.gather(
                *(
                    client.patch(
                        Pod,
                        n,
                        {"metadata": {"annotations": {RESIZE: f"{targets[n]}Mi"}}},
                        namespace=NAMESPACE,
                        patch_type=PatchType.MERGE,
                    )
                    for n in burst_names
                )
            )
            burst = [t - started for t in await asyncio.wait_for(asyncio.gather(*seen), timeout=120)]

            nodes = [n async for n in client.list(Node)]
            pods = [p async for p in client.list(Pod, namespace=NAMESPACE)]
            report = audit(nodes=nodes, pods=pods)
            ledgers = [g for node in service.cache.nodes for g in service.cache.engine.ledger(node)]
            disagree = books_disagree(report, ledgers)
        finally:
            for task in (scheduler, watcher):
                task.cancel()
            await asyncio.gather(scheduler, watcher, return_exceptions=True)
    seq, base = summary(sequential), summary(floor)
    return {
        "bench": "resize_latency",
        "nodes": args.nodes,
        "gpus_per_node": args.gpus,
        "pods": args.pods,
        "sequential": seq,
        "burst": {**summary(burst), "pods": len(burst)},
        "baseline_write_to_watch": base,
        "p50_over_baseline_ms": round(seq["p50_ms"] - base["p50_ms"], 1),
        "audit_ok": report.ok and not disagree,
        "audit_problems": report.problems + disagree,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--pods", type=int, default=32)
    parser.add_argument("--sequential", type=int, default=200, help="resizes timed one at a time")
    parser.add_argument("--burst", type=int, default=32, help="pods asked to resize at once")
    args = parser.parse_args()
    result = asyncio.run(run(args))
    print(json.dumps(result, separators=(",", ":")))
    if not result["audit_ok"]:
        sys.exit(1)


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
