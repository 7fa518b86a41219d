"""``gpufrac up`` and ``gpufrac demo``: the embedded local cluster, on a laptop with no GPU.

Both start the same entry points a real cluster runs, as local processes, around a real
kube-apiserver (testenv/): see ``gpufrac.local.cluster``. ``demo`` is the README's first command: it must
work on a fresh machine and stop cleanly on its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer
from rich.console import Console

from gpufrac.local.simnodes import GPU_MODELS, NodeShape

if TYPE_CHECKING:
    from gpufrac.local.cluster import ClusterShape, LocalCluster


def _shape(
    nodes: int, gpus: int, model: str, policy: str | None, runtime: str = "simulated", dra: bool = False
) -> ClusterShape:
    from gpufrac.local.cluster import RUNTIMES, ClusterShape

    if model not in GPU_MODELS:
        raise typer.BadParameter(f"--gpu-model {model!r} is not one of {', '.join(GPU_MODELS)}")
    if runtime not in RUNTIMES:
        raise typer.BadParameter(f"--runtime {runtime!r} is not one of {', '.join(RUNTIMES)}")
    if runtime == "containerd" and nodes != 1:
        raise typer.BadParameter(
            f"--nodes {nodes} with --runtime containerd: the real node is one per machine"
        )
    if dra and runtime != "containerd":
        raise typer.BadParameter(
            f"--dra with --runtime {runtime}: claims are prepared by a real kubelet, so --dra needs "
            "--runtime containerd"
        )
    return ClusterShape(
        nodes=nodes, node=NodeShape(gpus=gpus, model=model), policy=policy, runtime=runtime, dra=dra
    )


def banner_console(file: Any = None) -> Console:
    """``gpufrac up``'s console: piped or redirected, rich would wrap at 80 columns and break the banner's
    copy-paste commands (``export KUBECONFIG=…``, ``gpufrac top <urls>``), so lines are never wrapped."""
    return Console(file=file, soft_wrap=True)


def kubectl_hint(bin_dir: Path | None = None) -> str:
    """How to get a kubectl of the server's version: ``make testenv`` builds one from the control plane's
    module graph (a distribution's kubectl may be many minors behind the v1.37 server)."""
    from gpufrac.local.realnode import TESTENV_BIN

    kubectl = (bin_dir or TESTENV_BIN) / "kubectl"
    if kubectl.exists():
        return f"kubectl of the server's version: export PATH={kubectl.parent}:$PATH"
    return "kubectl of the server's version: run `make testenv` (it builds testenv/bin/kubectl)"


def up(
    nodes: int | None = typer.Option(
        None, "--nodes", min=1, help="GPU nodes (default 2 simulated, 1 with --runtime containerd)."
    ),
    gpus: int = typer.Option(4, "--gpus", min=1, help="GPUs per node."),
    gpu_model: str = typer.Option(
        "H100-80GB", "--gpu-model", help=f"GPU model of every node: {', '.join(GPU_MODELS)}."
    ),
    policy: str | None = typer.Option(
        None, "--policy", help="Scheduler placement policy (default: the scheduler service's default)."
    ),
    work_dir: Path | None = typer.Option(
        None, "--work-dir", help="Keep the cluster's state and logs here (default: a temporary directory)."
    ),
    runtime: str = typer.Option(
        "simulated",
        "--runtime",
        help="simulated: NRI's runtime side and a simulated kubelet; containerd: one real node "
        "(containerd, runc, kubelet; needs root and cgroups).",
    ),
    dra: bool = typer.Option(
        False,
        "--dra",
        help="With --runtime containerd: gpufrac's DRA driver (the node agent's --dra, the chart's "
        "DeviceClasses), so pods can ask for a share with a ResourceClaim(Template) (docs/dra.md).",
    ),
) -> None:
    """Start the embedded cluster (control plane, webhook, scheduler, node agents) until Ctrl-C."""
    console = banner_console()
    count = nodes if nodes is not None else (1 if runtime == "containerd" else 2)
    asyncio.run(_up(console, _shape(count, gpus, gpu_model, policy, runtime, dra), work_dir))


async def _up(console: Console, shape: ClusterShape, work_dir: Path | None) -> None:
    from gpufrac.local.cluster import LocalCluster

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    cluster = LocalCluster(shape=shape, work_dir=work_dir, progress=lambda m: console.print(f"• {m}"))
    async with cluster:
        console.print(
            f"[bold green]gpufrac is up[/]: {shape.nodes} nodes x {shape.node.gpus} {shape.node.model}"
            f" ({shape.runtime} runtime)"
        )
        console.print(f"  export KUBECONFIG={cluster.kubeconfig}")
        console.print(f"  {kubectl_hint()}")
        console.print(f"  logs: {cluster.logs}")
        metrics = sorted(cluster.metrics_urls.items())
        for node, url in metrics:
            console.print(f"  metrics of {node}: {url}")
        urls = " ".join(url for _, url in metrics)
        console.print(f"  per-fraction usage: kubectl gpufrac top (or gpufrac top {urls})")
        if cluster.real_node is not None:
            from gpufrac.local import ociimage

            node = cluster.real_node
            console.print(f"  containerd: {' '.join(node.ctr_argv())} containers list")
            console.print(
                f"  pods run for real: image {ociimage.WORKLOAD.ref}, imagePullPolicy: Never, "
                "hostNetwork: true"
            )
        console.print("  submit pods with schedulerName: gpufrac-scheduler (see examples/); Ctrl-C stops")
        if shape.dra:
            from gpufrac.contract import keys
            from gpufrac.contract.request import ComputeMode

            classes = " or ".join(f"{mode.value}.{keys.DRA_DRIVER_NAME}" for mode in ComputeMode)
            console.print(
                f"  or with a ResourceClaim(Template) of {classes}, placed by kube-scheduler (docs/dra.md)"
            )
        console.print("  a component that exits is restarted with back-off, and said so here")
        code = await _until_stopped(cluster, stop)
        if code is not None:
            console.print(
                f"[red]the control plane exited with code {code}[/]; see {cluster.controlplane.log_path}"
            )
            raise typer.Exit(code=1)
        console.print("stopping…")
    console.print("stopped cleanly")


async def _until_stopped(cluster: LocalCluster, stop: asyncio.Event) -> int | None:
    """Wait for Ctrl-C (None) or the control plane's own exit (its code): nothing works without it."""
    while not stop.is_set():
        code = cluster.controlplane.exit_code()
        if code is not None:
            return code
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(1.0):
                await stop.wait()
    return None


def demo(
    keep: bool = typer.Option(False, "--keep", help="Leave the cluster running after the demo until Ctrl-C."),
    runtime: str = typer.Option(
        "simulated",
        "--runtime",
        help="simulated (two nodes, NRI's runtime side) or containerd (one real node with 8 GPUs: the pods "
        "really run and the environment is read from inside them; needs root and cgroups).",
    ),
) -> None:
    """Start the embedded cluster, submit the reference pods, show where they went, and stop."""
    console = Console(width=None if Console().is_terminal else 150)
    code = asyncio.run(_demo(console, keep=keep, runtime=runtime))
    raise typer.Exit(code=code)


async def _demo(console: Console, *, keep: bool, runtime: str = "simulated") -> int:
    from gpufrac.local.cluster import LocalCluster
    from gpufrac.local.demo import (
        DEMO_PODS,
        gpu_names,
        outcome,
        real_outcome,
        render,
        submit_and_wait,
        wait_enforced,
    )

    # One real node gets the two simulated nodes' eight GPUs, so the demo tells the same story.
    real = runtime == "containerd"
    shape = _shape(1, 8, "H100-80GB", "binpack", runtime) if real else _shape(2, 4, "H100-80GB", "binpack")
    started = time.monotonic()
    cluster = LocalCluster(shape=shape, progress=lambda m: console.print(f"• {m}"))
    async with cluster:
        console.print(f"[bold green]embedded cluster ready[/] in {time.monotonic() - started:.1f}s")
        client = cluster.client
        assert client is not None
        pods = []
        for manifest in DEMO_PODS:
            console.print(f"• submitting {manifest.relative_to(manifest.parents[1])}")
            pods.append(await submit_and_wait(client, manifest, real_node=cluster.real_node))
        names = await gpu_names(client)
        node = cluster.real_node
        outcomes = [real_outcome(p, names, node) if node else outcome(p, names) for p in pods]
        await wait_enforced(client, outcomes)
        render(console, outcomes, read_inside=node is not None)
        if keep:
            console.print(f"cluster kept: export KUBECONFIG={cluster.kubeconfig}; Ctrl-C stops")
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.Event().wait()
    console.print("stopped cleanly")
    expected = {"inference": "Running", "notebook": "Running", "packed": "Running"}
    wrong = [o.name for o in outcomes if expected.get(o.name, "Unschedulable") != o.state]
    wrong += [
        f"{o.name} (GPU memory limit not read back)"
        for o in outcomes
        if o.enforced and not o.enforced.startswith("True")
    ]
    if wrong:
        console.print(f"[red]unexpected outcome for {', '.join(wrong)}[/]")
        return 1
    return 0
