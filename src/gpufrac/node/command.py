"""``gpufrac node-agent``: the node agent as a process (a privileged DaemonSet pod on each GPU node).

Flags override the optional configuration file (``gpufrac.node.config``). SIGTERM and SIGINT stop the
agent cleanly (the Node is marked not ready, the NRI connection closes) and the process exits 0.
On a machine without GPUs: ``--backend simulated --sim-gpus 4xH100-80GB``.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from pathlib import Path

import typer

log = logging.getLogger("gpufrac.node")


def node_agent(
    node_name: str | None = typer.Option(
        None, "--node-name", envvar="NODE_NAME", help="This node's name (the DaemonSet passes spec.nodeName)."
    ),
    config: Path | None = typer.Option(None, "--config", help="Node agent configuration file (YAML)."),
    kubeconfig: Path | None = typer.Option(
        None, "--kubeconfig", help="Kubeconfig (default: in-cluster, then $KUBECONFIG, then ~/.kube/config)."
    ),
    publish: bool | None = typer.Option(
        None,
        "--publish/--no-publish",
        help="Write the GPU inventory and readiness on the Node (default: on).",
    ),
    nri_socket: str | None = typer.Option(None, "--nri-socket", help="The runtime's NRI socket."),
    backend: str | None = typer.Option(None, "--backend", help="GPU inventory: nvml or simulated."),
    sim_gpus: str | None = typer.Option(
        None,
        "--sim-gpus",
        help="Simulated GPUs: COUNTxMODEL[:MIB|:mig],... e.g. 8xH100-80GB or 2xA100-80GB:mig.",
    ),
    sim_config: Path | None = typer.Option(
        None, "--sim-config", help="YAML file of simulated GPUs (re-read when it changes)."
    ),
    sim_driver: str | None = typer.Option(None, "--sim-driver", help="Simulated NVIDIA driver version."),
    mps_running: bool | None = typer.Option(
        None,
        "--mps-running/--no-mps-running",
        help="Advertise sm-sharing (MPS serving). Default: yes when simulated, no with NVML.",
    ),
    mps: bool | None = typer.Option(
        None, "--mps/--no-mps", help="Run and supervise the MPS control daemon (docs/mps.md). Default: off."
    ),
    mps_control_bin: str | None = typer.Option(
        None, "--mps-control-bin", help="The MPS control binary (default: nvidia-cuda-mps-control)."
    ),
    mps_time_slicing_clients: bool | None = typer.Option(
        None,
        "--mps-time-slicing-clients/--no-mps-time-slicing-clients",
        help="Time-slicing containers as MPS clients of the default server (docs/mps.md). Default: off.",
    ),
    gpu_toolkit_version: str | None = typer.Option(
        None,
        "--gpu-toolkit-version",
        help="The NVIDIA container toolkit's version, where no GPU Operator says it.",
    ),
    gpu_device_plugin_version: str | None = typer.Option(
        None,
        "--gpu-device-plugin-version",
        help="The NVIDIA device plugin's version, where no GPU Operator says it.",
    ),
    allow_unsupported_gpu_stack: bool | None = typer.Option(
        None,
        "--allow-unsupported-gpu-stack/--gate-gpu-stack",
        help="Escape hatch: Ready although the GPU stack gate fails (the Node says so). Default: gate.",
    ),
    mps_handover: bool | None = typer.Option(
        None,
        "--mps-handover/--no-mps-handover",
        help="Leave MPS serving when the agent stops and adopt it on start (default: on; docs/mps.md).",
    ),
    state_dir: Path | None = typer.Option(
        None, "--state-dir", help="Mapping store and MPS leaf directories."
    ),
    taint: bool | None = typer.Option(
        None,
        "--taint/--no-taint",
        help="Taint the node gpufrac.io/managed (default); --no-taint when KAI Scheduler places GPU pods.",
    ),
    kubelet_dir: Path | None = typer.Option(
        None,
        "--kubelet-dir",
        help="The kubelet's root, for the DRA plugin's sockets (default /var/lib/kubelet).",
    ),
    cdi_dir: Path | None = typer.Option(
        None, "--cdi-dir", help="Where the DRA plugin writes claims' CDI specs (default /var/run/cdi)."
    ),
    dra: bool | None = typer.Option(
        None,
        "--dra/--no-dra",
        help="Be the DRA driver: ResourceSlice and kubelet plugin (docs/dra.md). Default: off.",
    ),
    fail_open: bool | None = typer.Option(
        None,
        "--fail-open/--fail-closed",
        help="Create containers whose GPU annotations are invalid (unenforced).",
    ),
    health_port: int | None = typer.Option(
        None, "--health-port", help="Port of /healthz and /readyz (0: any)."
    ),
    metrics_port: int | None = typer.Option(
        None, "--metrics-port", help="Port of the usage metrics endpoint /metrics (default 9400; 0: any)."
    ),
    usage_backend: str | None = typer.Option(
        None,
        "--usage-backend",
        help="What reads GPU processes: nvml or simulated (default: the same kind as --backend).",
    ),
    sim_usage: Path | None = typer.Option(
        None,
        "--sim-usage",
        help="JSON table of simulated GPU processes, re-read every sample (absent: every GPU idle).",
    ),
    proc_root: Path | None = typer.Option(
        None, "--proc-root", help="The host's /proc, for PID to container attribution (default: /proc)."
    ),
    memory_limits: str | None = typer.Option(
        None,
        "--memory-limits",
        help="driver: set and read back each fraction's GPU memory limit through the driver's per-cgroup "
        "API before it starts (default); verify: only read back what the toolkit's hook set; off: the "
        "toolkit's variables only.",
    ),
    cgroup_root: Path | None = typer.Option(
        None,
        "--cgroup-root",
        help="The host's cgroup filesystem (default /sys/fs/cgroup; simulated: <state-dir>/cgroupfs).",
    ),
    audit: bool | None = typer.Option(
        None,
        "--audit/--no-audit",
        help="Audit enforcement through CRI after every collection (default: on when the CRI socket exists).",
    ),
    cri_endpoint: str | None = typer.Option(
        None, "--cri-endpoint", help="The runtime's CRI endpoint (default: containerd's socket)."
    ),
    log_level: str = typer.Option("info", "--log-level"),
    log_format: str = typer.Option("json", "--log-format", help="json or text."),
) -> None:
    """Run the node agent: NRI plugin, GPU inventory, usage metrics and the audit."""
    from gpufrac.node.config import load_settings
    from gpufrac.process.logs import configure_logging

    configure_logging(component="gpufrac-node-agent", level=log_level, fmt=log_format)
    try:
        settings = load_settings(
            config,
            node_name=node_name,
            kubeconfig=kubeconfig,
            publish=publish,
            taint=taint,
            dra=dra,
            kubelet_dir=kubelet_dir,
            cdi_dir=cdi_dir,
            nri_socket=nri_socket,
            backend=backend,
            sim_gpus=sim_gpus,
            sim_config=sim_config,
            sim_driver=sim_driver,
            mps_running=mps_running,
            mps=mps,
            mps_control_bin=mps_control_bin,
            mps_time_slicing_clients=mps_time_slicing_clients,
            gpu_stack={
                "toolkit_version": gpu_toolkit_version,
                "device_plugin_version": gpu_device_plugin_version,
                "allow_unsupported": allow_unsupported_gpu_stack,
            },
            mps_handover=mps_handover,
            state_dir=state_dir,
            fail_open=fail_open,
            health_port=health_port,
            usage_backend=usage_backend,
            sim_usage=sim_usage,
            memory_limits=memory_limits,
            cgroup_root=cgroup_root,
            usage={
                "metrics_port": metrics_port,
                "proc_root": proc_root,
                "audit": audit,
                "cri_endpoint": cri_endpoint,
            },
        )
    except (OSError, ValueError) as error:
        typer.echo(f"gpufrac node-agent: invalid configuration: {error}", err=True)
        raise typer.Exit(code=2) from error
    raise typer.Exit(code=asyncio.run(serve(settings)))


async def serve(settings) -> int:  # type: ignore[no-untyped-def]
    """Run until SIGTERM/SIGINT (0) or a failure to start (1)."""
    from gpufrac.kube.client import connect
    from gpufrac.node.agent import NodeAgent
    from gpufrac.node.inventory.backend import InventoryUnavailable

    client = (
        connect(kubeconfig=settings.kubeconfig, field_manager="gpufrac-node-agent")
        if settings.publish
        else None
    )
    try:
        agent = NodeAgent(settings=settings, client=client)
    except (InventoryUnavailable, OSError) as error:
        log.error("node agent cannot start: %s", error)
        return 1
    task = asyncio.create_task(agent.run(), name="node-agent")
    loop = asyncio.get_running_loop()

    def stop() -> None:
        log.info("signal received, stopping")
        task.cancel()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop)
    try:
        await task
    except asyncio.CancelledError:
        pass
    except Exception:
        log.exception("node agent failed")
        return 1
    finally:
        if client is not None:
            await client.close()
    return 0
