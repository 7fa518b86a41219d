"""CreateContainer latency through NRI's real adaptation, with gpufrac's plugin and against baselines.

The runtime side is testenv's gpufrac-nriruntime (containerd's NRI adaptation library); the time taken
is the adaptation's own ``CreateContainer`` call measured in Go -- what the runtime waits for and what
its 2 s per-plugin timeout bounds. Four phases, same runtime, same pods:

1. ``no_plugin``: nothing registered (the adaptation's floor);
2. ``noop_plugin``: a Python plugin on gpufrac's NRI transport (mux, ttrpc, protobuf) whose handler
   adjusts nothing -- the cost of being a Python plugin at all;
3. ``gpufrac``: ``gpufrac node-agent --backend simulated --no-publish`` as its own process: contract
   parse, injection plan, adjustment, MPS leaf directory, mapping record written with fsync;
4. ``gpufrac_with_validator``: the same agent with ``gpufrac node-agent-validator`` beside it, as in the
   DaemonSet: the adaptation then asks the validator about every container after the agent answered.

Plugins run as separate processes, as on a node. The pods cycle through the contract's forms:
per-container time-slicing, sm-sharing with a portion, two devices, KAI's pod-level fraction, a
whole-GPU container and a container without GPU annotations. Each container is removed after its
create (not timed), so the runtime's state stays small.

Usage: .venv/bin/python bench/nri_create_latency.py [--creates 2000] [--state-dir /dev/shm/...]
Prints a one-line JSON summary last. Target: gpufrac p99 < 20 ms.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NODE = "bench-node"
#: The simulated node's GPUs (filled in by main once gpufrac is importable): the agent refuses others.
GPUS: list[str] = []
TARGET_P99_MS = 20.0


def pod_forms(i: int) -> tuple[dict[str, str], str]:
    """(annotations, container name) cycling through the contract's forms."""
    gpu, other = GPUS[i % 8], GPUS[(i + 1) % 8]
    forms: list[tuple[dict[str, str], str]] = [
        (
            {
                "nvidia.com/container.main.gpu-memory.request": "10Gi",
                "nvidia.com/container.main.gpu-memory.limit": "20Gi",
                "nvidia.com/container.main.gpus.devices": gpu,
            },
            "main",
        ),
        (
            {
                "nvidia.com/container.infer.gpu-memory.request": "20000Mi",
                "nvidia.com/container.infer.gpu-compute.mode": "sm-sharing",
                "nvidia.com/container.infer.gpu-compute.portion": "0.25",
                "nvidia.com/container.infer.gpus.devices": gpu,
            },
            "infer",
        ),
        (
            {
                "gpu-fraction-num-devices": "2",
                "nvidia.com/container.train.gpu-memory.request": "30Gi",
                "nvidia.com/container.train.gpus.devices": f"{gpu},{other}",
            },
            "train",
        ),
        (
            {
                "gpu-fraction": "0.5",
                "nvidia.com/container.nb.gpu-memory.request": "40779Mi",
                "nvidia.com/container.nb.gpus.devices": gpu,
            },
            "nb",
        ),
        ({"gpufrac.io/container.big.gpus": "1", "nvidia.com/container.big.gpus.devices": gpu}, "big"),
        ({"prometheus.io/scrape": "true"}, "web"),
    ]
    annotations, name = forms[i % len(forms)]
    return {**annotations, "app.kubernetes.io/name": "bench", "kubectl.kubernetes.io/restartedAt": "x"}, name


def summary(samples_ns: list[int]) -> dict[str, float]:
    ms = sorted(s / 1e6 for s in samples_ns)

    def pct(p: float) -> float:
        return round(ms[min(len(ms) - 1, int(p * len(ms)))], 3)

    return {
        "n": len(ms),
        "median_ms": round(statistics.median(ms), 3),
        "p95_ms": pct(0.95),
        "p99_ms": pct(0.99),
        "max_ms": round(ms[-1], 3),
    }


async def phase(runtime, *, creates: int, warmup: int, tag: str) -> tuple[list[int], list[int]]:  # type: ignore[no-untyped-def]
    adaptation: list[int] = []
    round_trip: list[int] = []
    for i in range(warmup + creates):
        annotations, name = pod_forms(i)
        pod_id = f"{tag}-pod-{i}"
        await runtime.run_pod(
            id=pod_id, name=f"bench-{i}", namespace="bench", uid=f"uid-{tag}-{i}", annotations=annotations
        )
        start = time.perf_counter_ns()
        created = await runtime.create_container(
            id=f"{tag}-ctr-{i:06d}", pod_id=pod_id, name=name, env={"PATH": "/usr/bin", "HOME": "/root"}
        )
        elapsed = time.perf_counter_ns() - start
        if i >= warmup:
            adaptation.append(created.elapsed_ns)
            round_trip.append(elapsed)
        await runtime.remove_container(created.id)
        await runtime.remove_pod(pod_id)
    return adaptation, round_trip


async def serve_noop(socket_path: str) -> None:
    """The no-op baseline plugin: gpufrac's NRI transport, a handler that adjusts nothing."""
    from gpufrac.node.nri.plugin import NriPlugin, PluginIdentity

    class Noop:
        def events(self):  # type: ignore[no-untyped-def]
            from gpufrac._generated.nri import api_pb2 as api

            return (api.CREATE_CONTAINER, api.STOP_CONTAINER, api.REMOVE_CONTAINER)

        async def configure(self, **_: object) -> None: ...
        async def synchronize(self, **_: object) -> None: ...
        async def create_container(self, **_: object) -> None:
            return None

        async def stop_container(self, **_: object) -> None: ...
        async def remove_container(self, **_: object) -> None: ...
        async def shutdown(self) -> None: ...

    await NriPlugin(
        handler=Noop(), socket_path=socket_path, identity=PluginIdentity(name="noop", index="10")
    ).run()


async def main(args: argparse.Namespace) -> dict[str, object]:
    sys.path.insert(0, str(ROOT / "src"))
    from gpufrac.local.nriruntime import NriRuntime
    from gpufrac.node.inventory.simulated import simulated_uuid

    GPUS[:] = [simulated_uuid(NODE, i) for i in range(8)]

    root = Path(tempfile.mkdtemp(prefix="nribench", dir="/tmp"))
    state_dir = (
        Path(args.state_dir)
        if args.state_dir
        else (
            Path(tempfile.mkdtemp(prefix="nribench", dir="/dev/shm"))
            if os.path.isdir("/dev/shm")
            else root / "state"
        )
    )
    socket_path = root / "nri.sock"
    results: dict[str, object] = {
        "bench": "nri_create_latency",
        "creates": args.creates,
        "state_dir": str(state_dir),
    }
    runtime = NriRuntime(socket_path=socket_path)
    await runtime.start()
    plugins: list[asyncio.subprocess.Process] = []
    try:
        adapt, trip = await phase(runtime, creates=args.creates, warmup=args.warmup, tag="none")
        results["no_plugin"] = summary(adapt)

        noop = await asyncio.create_subprocess_exec(
            sys.executable, __file__, "--serve-noop", str(socket_path)
        )
        plugins.append(noop)
        await runtime.wait_plugins(1, timeout_s=30)
        adapt, trip = await phase(runtime, creates=args.creates, warmup=args.warmup, tag="noop")
        results["noop_plugin"] = summary(adapt)
        noop.terminate()
        await noop.wait()
        await runtime.restart()  # forget the no-op plugin at once

        agent = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "gpufrac", "node-agent",
            "--node-name", NODE, "--no-publish",
            "--backend", "simulated", "--sim-gpus", "8xH100-80GB",
            "--nri-socket", str(socket_path),
            "--state-dir", str(state_dir),
            "--health-port", "0",
            "--log-level", "warning",
        )  # fmt: skip
        plugins.append(agent)
        await runtime.wait_plugins(1, timeout_s=30)
        adapt, trip = await phase(runtime, creates=args.creates, warmup=args.warmup, tag="gpufrac")
        results["gpufrac"] = summary(adapt)
        results["gpufrac_round_trip_from_test"] = summary(trip)

        validator = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "gpufrac", "node-agent-validator",
            "--nri-socket", str(socket_path),
            "--health-port", "0",
            "--log-level", "warning",
        )  # fmt: skip
        plugins.append(validator)
        await runtime.wait_plugins(2, timeout_s=30)
        adapt, trip = await phase(runtime, creates=args.creates, warmup=args.warmup, tag="validated")
        results["gpufrac_with_validator"] = summary(adapt)
    finally:
        for proc in plugins:
            if proc.returncode is None:
                proc.terminate()
                await proc.wait()
        await runtime.stop()
        shutil.rmtree(root, ignore_errors=True)
        if not args.state_dir:
            shutil.rmtree(state_dir, ignore_errors=True)
    gpufrac, noop = results["gpufrac"], results["noop_plugin"]
    assert isinstance(gpufrac, dict) and isinstance(noop, dict)
    results["gpufrac_over_noop_median_ms"] = round(gpufrac["median_ms"] - noop["median_ms"], 3)
    validated = results["gpufrac_with_validator"]
    assert isinstance(validated, dict)
    results["validator_adds_median_ms"] = round(validated["median_ms"] - gpufrac["median_ms"], 3)
    results["validator_adds_p99_ms"] = round(validated["p99_ms"] - gpufrac["p99_ms"], 3)
    results["target_p99_ms"] = TARGET_P99_MS
    results["pass"] = gpufrac["p99_ms"] < TARGET_P99_MS and validated["p99_ms"] < TARGET_P99_MS
    return results


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--creates", type=int, default=2000)
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--state-dir", default=None, help="mapping store (default: a fresh dir in /dev/shm)")
    parser.add_argument("--serve-noop", metavar="SOCKET", help=argparse.SUPPRESS)
    parsed = parser.parse_args()
    if parsed.serve_noop:
        sys.path.insert(0, str(ROOT / "src"))
        with contextlib.suppress(KeyboardInterrupt):
            asyncio.run(serve_noop(parsed.serve_noop))
        sys.exit(0)
    out = asyncio.run(main(parsed))
    for key in (
        "no_plugin",
        "noop_plugin",
        "gpufrac",
        "gpufrac_round_trip_from_test",
        "gpufrac_with_validator",
    ):
        print(f"{key:32s} {out[key]}", file=sys.stderr)
    print(json.dumps(out, separators=(",", ":")))
