"""``gpufrac scheduler``: the scheduler service as a process.

The configuration file is optional; flags override it. SIGTERM and SIGINT stop the service cleanly
(binds in flight finish, the lease is released) and the process exits 0. Losing the lease exits 1, as
kube-scheduler does: the Deployment restarts the replica, which comes back as a standby with ledgers
rebuilt from the API.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from gpufrac.placement.policies import DEFAULT_POLICY, POLICIES

if TYPE_CHECKING:
    from gpufrac.scheduler.config import SchedulerConfig

log = logging.getLogger("gpufrac.scheduler")


def scheduler(
    config: Path | None = typer.Option(None, "--config", help="Scheduler configuration file (YAML)."),
    kubeconfig: Path | None = typer.Option(
        None, "--kubeconfig", help="Kubeconfig (default: in-cluster, then $KUBECONFIG, then ~/.kube/config)."
    ),
    scheduler_name: str | None = typer.Option(None, "--scheduler-name", help="spec.schedulerName to serve."),
    policy: str | None = typer.Option(
        None,
        "--policy",
        help=f"Placement policy: {', '.join(POLICIES)} (default: the file's, else {DEFAULT_POLICY}).",
    ),
    http_port: int | None = typer.Option(None, "--http-port", help="Port of /healthz, /readyz, /metrics."),
    leader_elect: bool | None = typer.Option(
        None, "--leader-elect/--no-leader-elect", help="Take part in leader election (default: on)."
    ),
    lease_namespace: str | None = typer.Option(None, "--lease-namespace", help="Namespace of the Lease."),
    identity: str | None = typer.Option(None, "--identity", help="This replica's name in the Lease."),
    log_level: str = typer.Option("info", "--log-level"),
    log_format: str = typer.Option("json", "--log-format", help="json or text."),
) -> None:
    """Run the gpufrac scheduler service."""
    from gpufrac.process.logs import configure_logging
    from gpufrac.scheduler.config import load_config

    configure_logging(component="gpufrac-scheduler", level=log_level, fmt=log_format)
    try:
        settings = load_config(config, scheduler_name=scheduler_name, policy=policy, http_port=http_port)
    except (OSError, ValueError) as error:
        typer.echo(f"gpufrac scheduler: invalid configuration: {error}", err=True)
        raise typer.Exit(code=2) from error
    election = settings.leader_election.model_copy(
        update={
            k: v
            for k, v in {"enabled": leader_elect, "lease_namespace": lease_namespace}.items()
            if v is not None
        }
    )
    settings = settings.model_copy(update={"leader_election": election})
    raise typer.Exit(code=asyncio.run(serve(settings=settings, kubeconfig=kubeconfig, identity=identity)))


async def serve(*, settings: SchedulerConfig, kubeconfig: Path | None, identity: str | None) -> int:
    """Run until SIGTERM/SIGINT (exit code 0) or a failure such as a lost lease (1)."""
    from gpufrac.process import controller
    from gpufrac.scheduler.service import build_service

    return await controller.serve(
        name="scheduler",
        kubeconfig=kubeconfig,
        field_manager="gpufrac-scheduler",
        build=lambda client: build_service(client=client, config=settings, identity=identity),
    )
