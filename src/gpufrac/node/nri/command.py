"""``gpufrac node-agent-validator``: the node agent's validating NRI plugin as a process of its own.

It runs beside ``gpufrac node-agent`` (a second container of the agent's DaemonSet pod, a second process
of the embedded cluster's node and of the real-node harness) and refuses GPU containers whose final NRI
adjustment lacks the agent's injection (``gpufrac.node.nri.validator`` says why it must be a separate
process). It serves /healthz (its event loop answering) and /readyz (registered and synchronized with
the runtime) for the kubelet's probes. SIGTERM and SIGINT end it with 0.
"""

from __future__ import annotations

import asyncio
import logging

import typer

from gpufrac.contract import keys
from gpufrac.node.inject import CONTAINER_PIPE_DIR
from gpufrac.node.nri.plugin import DEFAULT_SOCKET

log = logging.getLogger("gpufrac.node.validator")

#: The validator's /healthz and /readyz port (the agent's are 8082 and 9400).
DEFAULT_HEALTH_PORT = 8083


def node_agent_validator(
    nri_socket: str = typer.Option(DEFAULT_SOCKET, "--nri-socket", help="The runtime's NRI socket."),
    agent_plugin: str = typer.Option(
        keys.NRI_PLUGIN_NAME,
        "--agent-plugin",
        help="The node agent's NRI plugin name (its plugin_name setting; what the webhook requires).",
    ),
    container_pipe_dir: str = typer.Option(
        CONTAINER_PIPE_DIR, "--container-pipe-dir", help="The agent's container_pipe_dir setting."
    ),
    fail_open: bool = typer.Option(
        False,
        "--fail-open/--fail-closed",
        help="Follow the agent's --fail-open: log what would be refused, refuse nothing. Default: closed.",
    ),
    health_host: str = typer.Option("0.0.0.0", "--health-host", help="Address of /healthz and /readyz."),
    health_port: int = typer.Option(
        DEFAULT_HEALTH_PORT, "--health-port", help="Port of /healthz and /readyz (0: any, logged)."
    ),
    log_level: str = typer.Option("info", "--log-level"),
    log_format: str = typer.Option("json", "--log-format", help="json or text."),
) -> None:
    """Refuse GPU containers whose NRI adjustment lacks the node agent's injection (docs/node-agent.md)."""
    from gpufrac.process.logs import configure_logging

    configure_logging(component="gpufrac-node-agent-validator", level=log_level, fmt=log_format)
    raise typer.Exit(
        code=asyncio.run(
            serve(
                nri_socket=nri_socket,
                agent_plugin=agent_plugin,
                container_pipe_dir=container_pipe_dir,
                fail_open=fail_open,
                health_host=health_host,
                health_port=health_port,
            )
        )
    )


async def serve(
    *,
    nri_socket: str,
    agent_plugin: str,
    container_pipe_dir: str,
    fail_open: bool,
    health_host: str,
    health_port: int,
) -> int:
    """Run until SIGTERM/SIGINT (0) or a failure to start (1)."""
    from prometheus_client import CollectorRegistry

    from gpufrac.node.nri.plugin import NriPlugin
    from gpufrac.node.nri.validator import VALIDATOR_IDENTITY, InjectionValidator
    from gpufrac.process.probes import ProbeServer
    from gpufrac.process.signals import run_until_signal

    handler = InjectionValidator(
        agent_plugin=agent_plugin, container_pipe_dir=container_pipe_dir, fail_open=fail_open
    )
    plugin = NriPlugin(handler=handler, socket_path=nri_socket, identity=VALIDATOR_IDENTITY)

    def ready() -> tuple[bool, str]:
        if plugin.synchronized.is_set():
            return True, "registered and synchronized with the runtime"
        return False, f"not in the runtime's path ({plugin.last_error or 'connecting'})"

    probes = ProbeServer(
        host=health_host,
        port=health_port,
        registry=CollectorRegistry(),
        healthy=lambda: (True, "event loop answering"),
        ready=ready,
    )
    try:
        await probes.start()
    except OSError as error:
        log.error("node agent validator cannot start: %s", error)
        return 1
    log.info(
        "node agent validator: validating for plugin %s",
        agent_plugin,
        extra={"socket": nri_socket, "health_port": probes.port, "fail_open": fail_open},
    )
    try:
        return await run_until_signal(plugin.run(), name="node agent validator")
    finally:
        await probes.stop()
