"""The scheduler's books at 5,000 nodes x 8 GPUs and 40,000 placed pods, in one process, without an API
server: the Node and Pod objects its informers would hold, and the booking cache with its engine,
filled through the same calls the service makes (place, then finish_binding). CPU per pod and RSS.

    .venv/bin/python bench/scheduler_books.py                        # 5,000 nodes, 40,000 pods
    .venv/bin/python bench/scheduler_books.py --nodes 1000 --pods 5000

It is the memory figure of the 40,000-pod end-to-end run (``bench/scheduler_e2e.py --large``) without
the half hour that run takes on a shared machine; the Pods here carry no status or managed fields, so a
real informer's store is somewhat larger.
"""

from __future__ import annotations

import argparse
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpufrac.local.simnodes import NodeShape, sim_node
from gpufrac.placement.decision import Placement
from gpufrac.placement.model import ModePolicy
from gpufrac.scheduler.booking_cache import BookingCache
from gpufrac.scheduler.config import SchedulerConfig
from gpufrac.scheduler.objects import gpu_request, node_spec, pending_pod
from gpufrac.scheduler.placement_engine import build_engine
from scheduler_e2e import pod_manifest

BATCH = 256


def rss_mib() -> float:
    return int(Path("/proc/self/status").read_text().split("VmRSS:")[1].split()[0]) / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=5000)
    parser.add_argument("--pods", type=int, default=40000)
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


if __name__ == "__main__":
    main()
