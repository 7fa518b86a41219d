"""Pod start latency on the real node (containerd + runc + kubelet), with and without our NRI plugin.

Same run, same node, same pods: plain busybox pods bound directly to the node (``spec.nodeName``), so
neither scheduler is in the path, started one at a time, first with the node agent connected to
containerd's NRI socket (containerd calls our plugin at RunPodSandbox, CreateContainer and the rest),
then with the agent stopped (no external plugin; containerd's built-in validator only). Two figures per
pod: ``process`` is the time from the Pod's creation to the start of the container's process (its start
time in ``/proc/<pid>/stat``, 10 ms ticks, on the boot clock), which is the kubelet's sandbox and
container creation through containerd, NRI and runc; ``running`` is the time until the API server shows
the container running, which adds the kubelet's PLEG period (1 s relist) and status write.
A third phase times fractional pods through our scheduler with the plugin injecting (scheduling
included, so not comparable one to one), and a fourth the same pods with the agent restarted with
``--memory-limits off``: the difference is what setting and reading back the driver's per-cgroup memory
limit at StartContainer adds to a fractional pod's start on the real node (the limit is SIMULATED, keyed
by the container's real cgroup; bench/memory_limit_start.py times the NRI call itself, to the
microsecond). Pods are deleted between starts (not timed).

Needs root and cgroups (see gpufrac.local.realnode). Usage:
    .venv/bin/python bench/realnode_start.py [--pods 10]
Prints a one-line JSON summary last.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path

from lightkube.models.core_v1 import Container, PodSpec, Toleration
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.core_v1 import Pod

from gpufrac.contract import keys
from gpufrac.local import ociimage
from gpufrac.local.cluster import ClusterShape, LocalCluster
from gpufrac.local.realnode import SLEEP_COMMAND, missing_requirements
from gpufrac.local.simnodes import NodeShape

FRACTION = {"gpu-fraction": "0.25"}


def _pod(name: str, *, node: str | None) -> Pod:
    spec = PodSpec(
        containers=[
            Container(
                name="app",
                image=ociimage.WORKLOAD.ref,
                imagePullPolicy="Never",
                command=list(SLEEP_COMMAND),
            )
        ],
        hostNetwork=True,
        automountServiceAccountToken=False,
        terminationGracePeriodSeconds=0,
    )
    annotations: dict[str, str] = {}
    if node is not None:
        spec.nodeName = node
        spec.tolerations = [Toleration(**keys.managed_toleration())]
    else:
        spec.schedulerName = keys.DEFAULT_SCHEDULER_NAME
        annotations = FRACTION
    return Pod(metadata=ObjectMeta(name=name, annotations=annotations), spec=spec)


def _process_start_boottime(pid: int) -> float:
    """When process ``pid`` started, in seconds on the boot clock (field 22 of /proc/<pid>/stat)."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    fields = stat[stat.rindex(")") + 2 :].split()
    return int(fields[19]) / os.sysconf("SC_CLK_TCK")


async def _start_ms(cluster: LocalCluster, pod: Pod) -> tuple[float, float]:
    """(creation to container process start, creation to Running seen on the API server), in ms."""
    client = cluster.client
    assert client is not None and cluster.real_node is not None
    assert pod.metadata is not None and pod.metadata.name
    name = pod.metadata.name
    created_boot = time.clock_gettime(time.CLOCK_BOOTTIME)
    started = time.perf_counter()
    await client.create(pod, namespace="default")
    while True:
        got = await client.get(Pod, name, namespace="default")
        statuses = (got.status.containerStatuses or []) if got.status else []
        if statuses and all(s.state is not None and s.state.running is not None for s in statuses):
            running_ms = (time.perf_counter() - started) * 1000
            container_id = statuses[0].containerID or ""
            break
        if time.perf_counter() - started > 60:
            raise RuntimeError(f"pod {name} did not start within 60 s: {got.status}")
        await asyncio.sleep(0.02)
    pid = cluster.real_node.container_pid(container_id)
    process_ms = (_process_start_boottime(pid) - created_boot) * 1000
    await client.delete(Pod, name, namespace="default", grace_period=0)
    return process_ms, running_ms


def _limit_start_time(metrics_url: str) -> dict[str, object]:
    """The agent's own histogram of what StartContainer spent on the limit: mean, and the bucket that holds
    the median and the 99th percentile (an upper bound)."""
    import httpx2
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx2.get(metrics_url, timeout=10).text
    (family,) = [
        f for f in text_string_to_metric_families(text) if f.name == "gpufrac_memory_limit_start_seconds"
    ]
    buckets = sorted((float(s.labels["le"]), s.value) for s in family.samples if s.name.endswith("_bucket"))
    count = next(s.value for s in family.samples if s.name.endswith("_count"))
    total = next(s.value for s in family.samples if s.name.endswith("_sum"))

    def bound(q: float) -> float:
        return next(le for le, cumulative in buckets if cumulative >= q * count) * 1000

    return {
        "n": int(count),
        "mean_ms": round(total / count * 1000, 3) if count else None,
        "median_at_most_ms": bound(0.5) if count else None,
        "p99_at_most_ms": bound(0.99) if count else None,
    }


def _summary(samples: list[tuple[float, float]]) -> dict[str, object]:
    out: dict[str, object] = {"n": len(samples)}
    for index, figure in enumerate(("process", "running")):
        ordered = sorted(s[index] for s in samples)
        out[figure] = {
            "median_ms": round(statistics.median(ordered), 1),
            "min_ms": round(ordered[0], 1),
            "max_ms": round(ordered[-1], 1),
        }
    return out


async def main(pods: int) -> dict[str, object]:
    shape = ClusterShape(nodes=1, prefix="bench-gpu-", node=NodeShape(gpus=2), runtime="containerd")
    (node_name,) = shape.node_names
    async with LocalCluster(shape=shape, progress=lambda m: print(f"• {m}", file=sys.stderr)) as cluster:
        real = cluster.real_node
        assert real is not None
        await _start_ms(cluster, _pod("warmup", node=node_name))  # first start loads the image's snapshot
        with_plugin = [await _start_ms(cluster, _pod(f"with-{i}", node=node_name)) for i in range(pods)]
        fractional = [await _start_ms(cluster, _pod(f"frac-{i}", node=None)) for i in range(pods)]
        assert real.metrics_url is not None
        in_agent = _limit_start_time(real.metrics_url)
        await real.stop_agent()
        await real.start_agent(extra_args=["--memory-limits", "off"])
        unlimited = [await _start_ms(cluster, _pod(f"frac-off-{i}", node=None)) for i in range(pods)]
        await real.stop_agent()
        without_plugin = [await _start_ms(cluster, _pod(f"without-{i}", node=node_name)) for i in range(pods)]
    result: dict[str, object] = {
        "bench": "realnode_start",
        "plain_pod_with_plugin": _summary(with_plugin),
        "plain_pod_without_plugin": _summary(without_plugin),
        "fractional_pod_scheduled_and_injected": _summary(fractional),
        "fractional_pod_limits_off": _summary(unlimited),
        "memory_limit_in_start_container": in_agent,
    }
    result["memory_limit_overhead_process_median_ms"] = round(
        statistics.median(s[0] for s in fractional) - statistics.median(s[0] for s in unlimited), 1
    )
    result["plugin_overhead_process_median_ms"] = round(
        statistics.median(s[0] for s in with_plugin) - statistics.median(s[0] for s in without_plugin), 1
    )
    return result


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pods", type=int, default=10, help="pods per phase")
    args = parser.parse_args()
    missing = missing_requirements()
    if missing:
        sys.exit(f"realnode_start: this machine lacks {'; '.join(missing)}")
    print(json.dumps(asyncio.run(main(args.pods))))
