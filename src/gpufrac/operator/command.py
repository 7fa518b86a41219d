"""``gpufrac operator``: the GpuFractioningConfig reconciler as a process.

Configured by flags and the Downward API's environment (``POD_NAMESPACE`` for the Lease, ``POD_NAME`` as
the replica's identity). SIGTERM and SIGINT stop it cleanly (the reconcile in progress is cancelled, the
lease is released) and the process exits 0; losing the lease exits 1 so the Deployment restarts the
replica as a standby.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import TYPE_CHECKING

import typer

if TYPE_CHECKING:
    from gpufrac.operator.reconciler import OperatorSettings

log = logging.getLogger("gpufrac.operator")


def operator(
    kubeconfig: Path | None = typer.Option(
        None, "--kubeconfig", help="Kubeconfig (default: in-cluster, then $KUBECONFIG, then ~/.kube/config)."
    ),
    http_port: int = typer.Option(8080, "--http-port", help="Port of /healthz, /readyz, /metrics."),
    leader_elect: bool = typer.Option(
        True, "--leader-elect/--no-leader-elect", help="Take part in leader election (two replicas)."
    ),
    lease_namespace: str = typer.Option(
        "gpufrac-system", "--lease-namespace", envvar="POD_NAMESPACE", help="Namespace of the Lease."
    ),
    lease_name: str = typer.Option("gpufrac-operator", "--lease-name", help="Name of the Lease."),
    identity: str | None = typer.Option(None, "--identity", help="This replica's name in the Lease."),
    log_level: str = typer.Option("info", "--log-level"),
    log_format: str = typer.Option("json", "--log-format", help="json or text."),
) -> None:
    """Run the cluster operator: GpuFractioningConfig -> node-agent DaemonSet and readiness status."""
    from gpufrac.operator.reconciler import OperatorSettings
    from gpufrac.process.logs import configure_logging

    configure_logging(component="gpufrac-operator", level=log_level, fmt=log_format)
    if not 0 <= http_port <= 65535:
        typer.echo(f"gpufrac operator: --http-port {http_port} is not a port", err=True)
        raise typer.Exit(code=2)
    settings = OperatorSettings(
        http_port=http_port, leader_elect=leader_elect, lease_name=lease_name, lease_namespace=lease_namespace
    )
    raise typer.Exit(code=asyncio.run(serve(settings=settings, kubeconfig=kubeconfig, identity=identity)))


async def serve(*, settings: OperatorSettings, kubeconfig: Path | None, identity: str | None) -> int:
    """Run until SIGTERM/SIGINT (exit code 0) or a failure such as a lost lease (1)."""
    from gpufrac.operator.reconciler import FIELD_MANAGER, Operator
    from gpufrac.process import controller

    return await controller.serve(
        name="operator",
        kubeconfig=kubeconfig,
        field_manager=FIELD_MANAGER,
        build=lambda client: Operator(client=client, settings=settings, identity=identity),
    )
