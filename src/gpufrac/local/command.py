"""``gpufrac up`` and ``gpufrac demo``: the embedded local cluster, on a laptop with no GPU.

Both start the same entry points a real cluster runs, as local processes, around a real
kube-apiserver (testenv/). ``demo`` is the README's first command: it must work on a fresh machine and
stop cleanly on its own.
"""

from __future__ import annotations

import time
from pathlib import Path

import typer
from rich.console import Console


def up(
    data_dir: Path | None = typer.Option(
        None, "--data-dir", help="Keep the cluster's state here (default: a temporary directory)."
    ),
) -> None:
    """Start the embedded cluster and keep it running until Ctrl-C."""
    from gpufrac.local.controlplane import ControlPlane

    console = Console()
    with ControlPlane(data_dir=data_dir) as cp:
        console.print(f"[bold green]control plane ready[/] at {cp.server}")
        console.print(f"  export KUBECONFIG={cp.kubeconfig}")
        console.print("  press Ctrl-C to stop")
        try:
            while cp.running:
                time.sleep(1)
        except KeyboardInterrupt:
            console.print("stopping…")


def demo() -> None:
    """Start the embedded cluster, show it working, and stop."""
    from lightkube.resources.core_v1 import Namespace

    from gpufrac.local.controlplane import ControlPlane

    console = Console()
    started = time.monotonic()
    with ControlPlane() as cp:
        console.print(
            f"[bold green]control plane ready[/] in {time.monotonic() - started:.1f}s at {cp.server}"
        )
        client = cp.client()
        names = sorted(ns.metadata.name for ns in client.list(Namespace))
        console.print(f"namespaces served by the API server: {', '.join(names)}")
    console.print("stopped cleanly")
