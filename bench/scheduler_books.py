"""The scheduler's books at 5,000 nodes x 8 GPUs and 40,000 placed pods, in one process, without an API
server: the Node and Pod objects its informers would hold, and the booking cache with its engine,
filled through the same calls the service makes (place, then finish_binding). CPU per pod and RSS.

    .venv/bin/python bench/scheduler_books.py                        # 5,000 nodes, 40,000 pods
    .venv/bin/python bench/scheduler_books.py --nodes 1000 --pods 5000
    .venv/bin/python bench/scheduler_books.py --unmanaged 5000         # and 5,000 CPU nodes

With ``--unmanaged N`` the cluster also has N nodes gpufrac does not manage (CPU nodes, with a kubelet's
status: conditions, addresses, 50 images), each with ``--pods-per-unmanaged`` pods of other schedulers:
the nodes are held as the scheduler's informer of every node holds them (``objects.NodeTopology``),
the pods as the pod informer holds them, and both are counted in the engine as topology through the
cache (``set_topology_node``, ``confirm``). For comparison, the same nodes are also decoded as full
Node objects (what a plain node informer would hold) and that memory is reported.

It is the memory figure of the 40,000-pod end-to-end run (``bench/scheduler_e2e.py --large``) without
the half hour that run takes on a shared machine; the Pods here carry no status or managed fields, so a
real informer's store is somewhat larger.
"""

from __future__ import annotations

import argparse
import gc
import json
import resource
import sys
import time
import tracemalloc
from pathlib import Path

import msgspec
from lightkube.core import decoders
from lightkube.resources.core_v1 import Node, Pod

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpufrac.contract import keys
from gpufrac.local.simnodes import NodeShape, sim_node
from gpufrac.placement.decision import Placement
from gpufrac.placement.model import ModePolicy
from gpufrac.scheduler.booking_cache import BookingCache
from gpufrac.scheduler.config import SchedulerConfig
from gpufrac.scheduler.objects import NodeTopology, gpu_request, node_spec, pending_pod, topology_node_spec
from gpufrac.scheduler.placement_engine import build_engine
from scheduler_e2e import pod_manifest

BATCH = 256


def rss_mib() -> float:
    return int(Path("/proc/self/status").read_text().split("VmRSS:")[1].split()[0]) / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=5000)
    parser.add_argument("--pods", type=int, default=40000)
    parser.add_argument("--unmanaged", type=int, default=0, help="nodes gpufrac does not manage")
    parser.add_argument("--pods-per-unmanaged", type=int, default=10)
    args = parser.parse_args()
    nodes_wanted, pods_wanted = args.nodes, args.pods
    base = rss_mib()
    cache = BookingCache(engine=build_engine(SchedulerConfig()), default_queue="default")
    nodes = [
        sim_node(name=f"n{i}", shape=NodeShape()) for i in range(nodes_wanted)
    ]  # as an informer holds them
    for node in nodes:
        cache.set_node(node_spec(node))
    pods = {}
    started = time.process_time()
    placed = 0
    for k in range(0, pods_wanted, BATCH):
        batch = [pod_manifest(i, namespace="b", scheduler="s") for i in range(k, min(k + BATCH, pods_wanted))]
        for pod in batch:
            pod.metadata.uid = f"u{pod.metadata.name}"
            pods[pod.metadata.uid] = pod
        pending = [
            pending_pod(
                p, gpu=gpu_request(p), arrival=k, default_queue="default", mode_policy=ModePolicy.REQUIRED
            )
            for p in batch
        ]
        for pod, decision in zip(batch, cache.place(pending, batch), strict=True):
            if isinstance(decision, Placement):
                placed += 1
                cache.finish_binding(pod.metadata.uid)
    cpu = time.process_time() - started
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(
        f"{nodes_wanted}x8 GPUs: placed {placed}/{pods_wanted}, {cpu:.1f} s CPU "
        f"({1000 * cpu / pods_wanted:.2f} ms/pod); "
        f"RSS {base:.0f} -> {rss_mib():.0f} MiB (peak {peak:.0f} MiB)"
    )
    if args.unmanaged:
        unmanaged(cache, args.unmanaged, args.pods_per_unmanaged)


def kubelet_node(i: int) -> bytes:
    """The JSON of a CPU node as a kubelet keeps it: labels, conditions, addresses, 50 images."""
    name = f"cpu-{i}"
    condition = {
        "status": "False",
        "lastHeartbeatTime": "2026-12-01T20:00:00Z",
        "lastTransitionTime": "2026-12-01T19:00:00Z",
        "reason": "KubeletHasSufficientMemory",
        "message": "kubelet has sufficient memory available",
    }
    body = {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "uid": f"00000000-0000-0000-0000-{i:012d}",
            "resourceVersion": str(1000 + i),
            "labels": {
                "kubernetes.io/hostname": name,
                "kubernetes.io/os": "linux",
                "kubernetes.io/arch": "amd64",
                "node.kubernetes.io/instance-type": "m6i.4xlarge",
                keys.ZONE_LABEL: f"zone-{i % 3}",
                "topology.kubernetes.io/region": "region-1",
            },
            "annotations": {
                "node.alpha.kubernetes.io/ttl": "0",
                "volumes.kubernetes.io/controller-managed-attach-detach": "true",
            },
        },
        "spec": {"podCIDR": f"10.{i // 256 % 256}.{i % 256}.0/24", "providerID": f"aws:///zone/i-{i:017x}"},
        "status": {
            "capacity": {"cpu": "16", "memory": "65536Mi", "pods": "110", "ephemeral-storage": "100Gi"},
            "allocatable": {"cpu": "15890m", "memory": "63000Mi", "pods": "110", "ephemeral-storage": "92Gi"},
            "conditions": [
                {**condition, "type": t} for t in ("MemoryPressure", "DiskPressure", "PIDPressure")
            ]
            + [{**condition, "type": "Ready", "status": "True", "reason": "KubeletReady"}],
            "addresses": [
                {"type": "InternalIP", "address": f"10.0.{i // 256 % 256}.{i % 256}"},
                {"type": "Hostname", "address": name},
            ],
            "nodeInfo": {
                "machineID": "m" * 32,
                "systemUUID": "s" * 36,
                "bootID": "b" * 36,
                "kernelVersion": "6.8.0",
                "osImage": "Ubuntu 24.04",
                "containerRuntimeVersion": "containerd://2.1.0",
                "kubeletVersion": "v1.34.0",
                "kubeProxyVersion": "",
                "operatingSystem": "linux",
                "architecture": "amd64",
            },
            "images": [
                {
                    "names": [
                        f"registry.example.com/team/image-{k}@sha256:{k:064x}",
                        f"registry.example.com/team/image-{k}:v1.{k}",
                    ],
                    "sizeBytes": 100_000_000 + k,
                }
                for k in range(50)
            ],
        },
    }
    return json.dumps(body).encode()


def traced_mib(make):  # type: ignore[no-untyped-def]
    """(MiB that what ``make`` returns keeps allocated, as tracemalloc counts it; the result)."""
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        held = make()
        gc.collect()
        return (tracemalloc.get_traced_memory()[0] - before) / 2**20, held
    finally:
        tracemalloc.stop()


def unmanaged(cache: BookingCache, count: int, per_node: int) -> None:
    raw = [kubelet_node(i) for i in range(count)]
    full_mib, full = traced_mib(lambda: [decoders.decode_object(r, Node) for r in raw])
    del full
    narrow_mib, narrow = traced_mib(lambda: [msgspec.json.decode(r, type=NodeTopology) for r in raw])
    raw.clear()
    pods = [
        Pod.from_dict(
            {
                "metadata": {
                    "name": f"cpu-pod-{i}",
                    "namespace": "apps",
                    "uid": f"cpu-uid-{i}",
                    "labels": {"app": f"svc-{i % 300}", "tier": "backend"},
                },
                "spec": {
                    "nodeName": f"cpu-{i % count}",
                    "schedulerName": "default-scheduler",
                    "containers": [
                        {
                            "name": "app",
                            "image": "busybox",
                            "resources": {"requests": {"cpu": "100m", "memory": "256Mi"}},
                        }
                    ],
                },
            }
        )
        for i in range(count * per_node)
    ]  # the pod informer held these before this change too

    def count_all() -> None:
        for node in narrow:
            cache.set_topology_node(topology_node_spec(node))
        for pod in pods:
            cache.confirm(pod)

    started = time.process_time()
    counted_mib, _ = traced_mib(count_all)
    cpu = time.process_time() - started
    print(
        f"{count} unmanaged nodes held as NodeTopology: {narrow_mib:.1f} MiB (as full Node objects: "
        f"{full_mib:.1f} MiB); they and the {count * per_node} pods bound to them known to the cache and "
        f"counted in the engine: +{counted_mib:.1f} MiB, {cpu:.1f} s CPU (under tracemalloc); "
        f"RSS now {rss_mib():.0f} MiB"
    )


if __name__ == "__main__":
    main()
