"""One usage collection cycle on a big node: 64 GPUs, 500 GPU processes, 250 fractional containers.

Measures what the node agent does every 5 s: read the processes of every GPU, map each PID through
/proc/<pid>/cgroup (real files in a temp dir) to its container and through the allocation records to
its fraction, compute entitlement and received compute. Baselines in the same run: the raw backend read
without attribution, from memory and from the simulated backend's JSON file (a read that parses all
500 processes, closer to what a real backend returns). Also reported: rendering the Prometheus
exposition of that snapshot (a scrape). The backend is the simulated one, so NVML's own cost (three
NVML queries per GPU) is not in these numbers; it has not been measured yet (no GPU machine).

Target: a cycle under 100 ms. Usage: .venv/bin/python bench/usage_collect.py [--rounds N]
The last line printed is a one-line JSON summary.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

from prometheus_client import generate_latest

from gpufrac.node.mapping import AllocationRecord, MappingStore
from gpufrac.node.metrics import EnforcementCounters, UsageExporter, registry_for
from gpufrac.node.usage.collect import UsageCollector
from gpufrac.node.usage.simulated import SimulatedUsage, SimulatedUsageFile

GPUS, PROCESSES, CONTAINERS, STRAYS = 64, 500, 250, 10
TARGET_MS = 100.0
GIB = 1024**3


def build(proc: Path, *, state: Path, seed: int = 7) -> tuple[SimulatedUsage, MappingStore]:
    rng = random.Random(seed)
    uuids = [f"GPU-{i:08x}-0000-4000-8000-{i:012x}" for i in range(GPUS)]
    gpus = SimulatedUsage()
    for i, uuid in enumerate(uuids):
        gpus.add_gpu(uuid=uuid, index=i, memory_total_bytes=80 * GIB)
    records = []
    for n in range(CONTAINERS):
        gpu = n % GPUS
        devices = (uuids[gpu],) if n % 10 else (uuids[gpu], uuids[(gpu + 1) % GPUS])  # every 10th has two
        mode = "sm-sharing" if gpu % 4 == 0 else "time-slicing"
        records.append(
            AllocationRecord(
                container_id=f"{n:064x}",
                pod_namespace=f"team-{n % 7}",
                pod_name=f"pod-{n}",
                container_name="main",
                devices=devices,
                request_mib=4096,
                limit_mib=8192,
                mode=mode,
                portion=0.25 if mode == "sm-sharing" else None,
                pod_uid=f"uid-{n}",
            )
        )
    pid = 10_000
    for p in range(PROCESSES - STRAYS):
        record = records[p % CONTAINERS]
        _write(proc, pid=pid, cgroup=_containerd(record.container_id, record.pod_uid))
        gpus.set_process(
            gpu=record.devices[p % len(record.devices)],
            pid=pid,
            used_bytes=rng.randrange(1, 4) * GIB,
            sm_ratio=rng.choice((0.0, 0.1, 0.35, 0.8)),
        )
        pid += 1
    for s in range(STRAYS):
        _write(proc, pid=pid, cgroup="0::/user.slice/user-1000.slice/session-2.scope\n")
        gpus.set_process(gpu=uuids[s], pid=pid, used_bytes=GIB, sm_ratio=0.05)
        pid += 1
    store = MappingStore(directory=state)
    for record in records:
        store.put(record)
    return gpus, store


def timed(fn: Callable[[], object], *, rounds: int) -> list[float]:
    fn()  # warm: imports, first file opens
    samples = []
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1000)
    return samples


def summary(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    return {
        "median_ms": round(statistics.median(ordered), 3),
        "p95_ms": round(ordered[max(0, int(len(ordered) * 0.95) - 1)], 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=50)
    rounds = parser.parse_args().rounds
    with tempfile.TemporaryDirectory() as tmp:
        proc = Path(tmp) / "proc"
        proc.mkdir()
        gpus, store = build(proc, state=Path(tmp) / "state")
        collector = UsageCollector(backend=gpus, allocations=store, proc_root=proc)
        exporter = UsageExporter(node="bench-node", counters=EnforcementCounters())
        registry = registry_for(exporter)
        snapshot = collector.collect()
        exporter.update(snapshot, duration_seconds=0.0)

        table = proc / "gpus.json"
        table.write_text(json.dumps({"gpus": [asdict(g) for g in gpus.sample()]}))
        baseline = summary(timed(gpus.sample, rounds=rounds))
        baseline_file = summary(timed(SimulatedUsageFile(path=table).sample, rounds=rounds))
        collect = summary(timed(collector.collect, rounds=rounds))
        scrape = summary(timed(lambda: generate_latest(registry), rounds=rounds))

    attributed = sum(len(f.pids) for f in snapshot.fractions)
    result = {
        "bench": "usage_collect",
        "gpus": GPUS,
        "processes": PROCESSES,
        "containers": CONTAINERS,
        "attributed_processes": attributed,
        "strays": len(snapshot.strays),
        "fraction_series": len(snapshot.fractions),
        "baseline_raw_read": baseline,
        "baseline_raw_read_file": baseline_file,
        "collect_cycle": collect,
        "scrape_render": scrape,
        "attribution_overhead_ms": round(collect["median_ms"] - baseline["median_ms"], 3),
        "target_ms": TARGET_MS,
        "pass": collect["p95_ms"] < TARGET_MS,
    }
    print(
        f"raw backend read (baseline): median {baseline['median_ms']} ms in memory, "
        f"{baseline_file['median_ms']} ms from the JSON file\n"
        f"collection cycle ({GPUS} GPUs, {PROCESSES} processes, {attributed} attributed, "
        f"{len(snapshot.strays)} strays): median {collect['median_ms']} ms, p95 {collect['p95_ms']} ms "
        f"(target < {TARGET_MS:.0f} ms)\n"
        f"scrape render ({len(snapshot.fractions)} fraction series): median {scrape['median_ms']} ms"
    )
    print(json.dumps(result, separators=(",", ":")))


def _containerd(container_id: str, pod_uid: str) -> str:
    pod = pod_uid.replace("-", "_")
    return (
        "0::/kubepods.slice/kubepods-burstable.slice/"
        f"kubepods-burstable-pod{pod}.slice/cri-containerd-{container_id}.scope\n"
    )


def _write(proc: Path, *, pid: int, cgroup: str) -> None:
    d = proc / str(pid)
    d.mkdir()
    (d / "cgroup").write_text(cgroup)
    (d / "comm").write_text("python3\n")


if __name__ == "__main__":
    main()
