"""What setting and reading back the driver's GPU memory limit adds to a container start.

The node agent sets soft = request and hard = limit for a fractional container's cgroup at NRI's
StartContainer and reads them back before the workload runs (gpufrac.node.memlimit); the runtime waits
for that answer, under NRI's 2 s per-plugin timeout. Two parts, each against a baseline in the same run:

1. **NRI adaptation** (testenv's gpufrac-nriruntime: containerd's NRI library, cgroup directories made as
   runc makes them, SIMULATED): the adaptation's StartContainer time for the same fractional
   containers with ``gpufrac node-agent --memory-limits off`` (the plugin is not called at start) and
   ``--memory-limits driver`` (set + read back through the simulated driver on every GPU of the
   container). ``--starts`` containers per phase after a warm-up; p50/p99 and the difference.
2. **The audit's cost per 100 containers**: ``LimitEnforcer.audit`` re-reading 100 booked containers
   (each on one GPU), through the simulated driver (a JSON state file under a lock: its cost is mostly
   that file) and through an in-memory driver (the enforcer's own cost, what NVML's two calls would add
   to on a GPU). Median of ``--audits`` passes.

The real node's pod start with and without the limit is in bench/realnode_start.py (``--limits``).
No GPU here: the NVML calls' own cost on hardware is not measured (scripts/gpu-check runs them).

Usage: .venv/bin/python bench/memory_limit_start.py [--starts 1000] [--audits 50]
Prints a one-line JSON summary last.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

from nri_create_latency import summary  # noqa: E402  (bench/ is on the path when run as a script)

NODE = "bench-node"
NRI_TIMEOUT_MS = 2000.0


def fraction(i: int, gpus: list[str]) -> dict[str, str]:
    """Fractional pods on one or two GPUs, time-slicing and sm-sharing."""
    two = i % 3 == 0
    devices = f"{gpus[i % 8]},{gpus[(i + 1) % 8]}" if two else gpus[i % 8]
    return {
        "nvidia.com/container.app.gpu-memory.request": "10Gi",
        "nvidia.com/container.app.gpu-memory.limit": "20Gi",
        "nvidia.com/container.app.gpus.devices": devices,
        **({"gpu-fraction-num-devices": "2"} if two else {}),
    }


async def start_phase(runtime, *, gpus: list[str], starts: int, warmup: int, tag: str) -> list[int]:  # type: ignore[no-untyped-def]
    samples: list[int] = []
    for i in range(warmup + starts):
        pod_id = f"{tag}-pod-{i}"
        await runtime.run_pod(
            id=pod_id,
            name=f"bench-{i}",
            namespace="bench",
            uid=f"uid-{tag}-{i}",
            annotations=fraction(i, gpus),
        )
        created = await runtime.create_container(id=f"{tag}-ctr-{i:06d}", pod_id=pod_id, name="app")
        elapsed = await runtime.start_container(created.id)
        if i >= warmup:
            samples.append(elapsed)
        await runtime.stop_container(created.id)
        await runtime.remove_container(created.id)
        await runtime.remove_pod(pod_id)
    return samples


async def agent(socket: Path, state: Path, cgroup_root: Path, limits: str) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        sys.executable, "-m", "gpufrac", "node-agent",
        "--node-name", NODE, "--no-publish",
        "--backend", "simulated", "--sim-gpus", "8xH100-80GB",
        "--nri-socket", str(socket), "--state-dir", str(state),
        "--cgroup-root", str(cgroup_root), "--memory-limits", limits,
        "--health-port", "0", "--metrics-port", "0", "--no-audit", "--log-level", "warning",
    )  # fmt: skip


async def nri_part(args: argparse.Namespace) -> dict[str, object]:
    from gpufrac.local.nriruntime import NriRuntime
    from gpufrac.node.inventory.simulated import simulated_uuid

    gpus = [simulated_uuid(NODE, i) for i in range(8)]
    root = Path(tempfile.mkdtemp(prefix="mlbench", dir="/tmp"))
    runtime = NriRuntime(socket_path=root / "nri.sock", cgroup_root=root / "cgroupfs")
    await runtime.start()
    out: dict[str, object] = {}
    try:
        for limits in ("off", "driver"):
            proc = await agent(root / "nri.sock", root / f"state-{limits}", runtime.cgroup_root, limits)  # type: ignore[arg-type]
            try:
                await runtime.wait_plugins(1, timeout_s=30)
                samples = await start_phase(
                    runtime, gpus=gpus, starts=args.starts, warmup=args.warmup, tag=limits
                )
                out[f"start_limits_{limits}"] = summary(samples)
            finally:
                proc.terminate()
                await proc.wait()
                await runtime.restart()  # forget the plugin at once
    finally:
        await runtime.stop()
        shutil.rmtree(root, ignore_errors=True)
    on, off = out["start_limits_driver"], out["start_limits_off"]
    assert isinstance(on, dict) and isinstance(off, dict)
    out["added_median_ms"] = round(on["median_ms"] - off["median_ms"], 3)
    out["added_p99_ms"] = round(on["p99_ms"] - off["p99_ms"], 3)
    out["share_of_nri_timeout_p99"] = round(on["p99_ms"] / NRI_TIMEOUT_MS, 5)
    return out


class InMemoryDriver:
    """The driver's two calls on a dict: the enforcer's own cost, without the simulated driver's file."""

    def __init__(self) -> None:
        self.held: dict[tuple[str, str], tuple[int, int]] = {}

    def set_limits(self, *, gpu: str, cgroup: str, soft: int, hard: int) -> None:
        self.held[(gpu, cgroup)] = (soft, hard)

    def get_limits(self, *, gpu: str, cgroup: str):  # type: ignore[no-untyped-def]
        from gpufrac.node.memlimit.driver import LIMIT_MAX, MemoryLimits

        soft, hard = self.held.get((gpu, cgroup), (0, LIMIT_MAX))
        return MemoryLimits(soft=soft, hard=hard)


def audit_part(args: argparse.Namespace) -> dict[str, object]:
    from gpufrac.node.inventory.backend import GpuInfo
    from gpufrac.node.mapping import AllocationRecord
    from gpufrac.node.memlimit.enforcer import LimitEnforcer
    from gpufrac.node.memlimit.simulated import SimulatedMemoryLimits

    root = Path(tempfile.mkdtemp(prefix="mlaudit", dir="/tmp"))
    (root / "cgroup.controllers").touch()
    gpus = tuple(GpuInfo(uuid=f"GPU-{i}", index=i, minor=i, model="H100", mib=81559) for i in range(8))
    out: dict[str, object] = {}
    try:
        drivers = {
            "simulated_driver": SimulatedMemoryLimits(
                path=root / "limits.json",
                gpus=lambda: gpus,
                driver_version=lambda: "615.20.01",
                cgroup_root=root,
            ),
            "in_memory_driver": InMemoryDriver(),
        }
        for name, driver in drivers.items():
            enforcer = LimitEnforcer(driver=driver, gpu_uuid=lambda d: d, cgroup_root=root)
            for i in range(100):
                (root / "kubepods" / f"c{i}").mkdir(parents=True, exist_ok=True)
                record = AllocationRecord(
                    container_id=f"c{i}", pod_namespace="bench", pod_name=f"p{i}", pod_uid=f"u{i}",
                    container_name="app", devices=(gpus[i % 8].uuid,), request_mib=10240, limit_mib=20480,
                    mode="time-slicing", portion=None,
                )  # fmt: skip
                assert enforcer.enforce(record=record, pid=0, cgroups_path=f"/kubepods/c{i}").in_force
            samples = []
            for _ in range(args.audits):
                began = time.perf_counter_ns()
                changed = enforcer.audit()
                samples.append(time.perf_counter_ns() - began)
                assert changed == []
            out[f"audit_100_containers_{name}"] = summary(samples)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return out


async def main(args: argparse.Namespace) -> dict[str, object]:
    results: dict[str, object] = {"bench": "memory_limit_start", "starts": args.starts}
    results.update(await nri_part(args))
    results.update(audit_part(args))
    on = results["start_limits_driver"]
    assert isinstance(on, dict)
    results["pass"] = on["p99_ms"] < NRI_TIMEOUT_MS / 100  # far inside: under 1% of the timeout
    return results


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--starts", type=int, default=1000)
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--audits", type=int, default=50)
    out = asyncio.run(main(parser.parse_args()))
    for key, value in out.items():
        print(f"{key:40s} {value}", file=sys.stderr)
    print(json.dumps(out, separators=(",", ":")))
