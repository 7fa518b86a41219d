"""Settings of the MPS supervisor (REAL): where the binary and directories are, and how patient to be.

Every duration is a setting because production and tests want very different values: a node agent
backs off for minutes, a test for milliseconds. The binary is a setting (``--mps-control-bin``) so the
tests point the very same supervisor at the stand-in daemon.
"""

from __future__ import annotations

import sys
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from gpufrac.node.mps.hostcgroup import CGROUP_NAME


class BackoffSettings(BaseModel):
    model_config = ConfigDict(frozen=True)

    initial_s: float = Field(1.0, gt=0)
    factor: float = Field(2.0, ge=1)
    max_s: float = Field(300.0, gt=0)
    stable_s: float = Field(600.0, gt=0, description="a daemon READY this long resets the backoff")
    degraded_after: int = Field(
        3, ge=1, description="consecutive failed starts before sm-sharing is withdrawn"
    )


class MpsSettings(BaseModel):
    model_config = ConfigDict(frozen=True)

    control_bin: str = "nvidia-cuda-mps-control"
    server_marker: str = Field(
        "nvidia-cuda-mps-server", description="argv element (basename) that identifies an MPS server process"
    )
    pipe_dir: Path = Path("/run/nvidia/mps")
    log_dir: Path = Path("/var/log/nvidia-mps")
    state_dir: Path = Field(Path("/var/lib/gpufrac/mps"), description="where the v3 TOML is written")
    server_name: str = "shared"
    default_namespace_thread_percentage: int = Field(1, ge=1, le=100)
    default_namespace_pinned_limit: str = "1M"
    ready_timeout_s: float = Field(30.0, gt=0)
    command_timeout_s: float = Field(5.0, gt=0)
    create_wait_s: float = Field(
        1.0,
        ge=0,
        lt=2.0,
        description="CreateContainer's wait for a restarting daemon; under NRI's 2 s timeout",
    )
    drain_timeout_s: float = Field(
        1.5,
        gt=0,
        lt=2.0,
        description="how long StopContainer waits for its drain (under NRI's 2 s timeout); the drain "
        "itself goes on in the background",
    )
    terminate_timeout_s: float = Field(
        30.0,
        gt=0,
        description="a `client terminate` (which blocks while the client's GPU work drains) slower "
        "than this = the server is wedged",
    )
    recycle_when_idle: bool = Field(
        True, description="restart MPS when a drain leaves no client attached (clears a latent fault)"
    )
    time_slicing_clients: bool = Field(
        False,
        description="make time-slicing containers MPS clients of the default server (v3), each through a "
        "directory holding only a link to the default socket: memory accounting and the pinned-memory "
        "variable as a second guard where the toolkit's memory-limit hook is missing; opt-in because it "
        "exposes the control socket to those containers (docs/mps.md)",
    )
    probe_command: tuple[str, ...] = Field(
        default_factory=lambda: (sys.executable, "-m", "gpufrac.node.mps.cuda_probe"),
        min_length=1,
        description="the short-lived test client of the active probe (gpufrac.node.mps.probe)",
    )
    probe_interval_s: float | None = Field(
        30.0, gt=0, description="seconds between probes while MPS serves; None turns the probe off"
    )
    probe_timeout_s: float = Field(
        10.0, gt=0, description="a test client without an MPS context after this long = the server is wedged"
    )
    handover: bool = Field(
        False,
        description="run the daemon in the background (-d) so that it outlives the agent, and adopt a "
        "running one at start instead of replacing it (agent upgrades keep MPS clients running)",
    )
    own_cgroup: str | None = Field(
        None,
        pattern=CGROUP_NAME.pattern,
        description="with handover: move the daemon into this cgroup of its own in every host hierarchy "
        "once it runs, so that stopping the agent's container (a rolling update) does not kill it "
        "(gpufrac.node.mps.hostcgroup); None leaves it in the agent's cgroup",
    )
    exit_poll_s: float = Field(0.5, gt=0, description="how often a background daemon's pid is checked")
    quit_timeout_s: float = Field(5.0, gt=0)
    kill_timeout_s: float = Field(5.0, gt=0)
    backoff: BackoffSettings = BackoffSettings()
