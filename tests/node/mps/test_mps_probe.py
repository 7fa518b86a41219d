"""The MPS wedge the control daemon does not report, found by the active probe (MPS STAND-IN).

NVIDIA (CUDA <= 13.5): a client killed with GPU work in flight orphans that work on its server; every
client that connects afterwards hangs in CUDA init, while ``server list`` and ``client list`` answer as
usual. The stand-in reproduces it (``wedge-on-kill``); the supervisor's probe -- a short-lived test
client with a timeout -- must find it, withhold sm-sharing, restart MPS, say so in an Event and a metric,
and trust the server again only once a test client gets a context.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

from mps_harness import MpsEnv, RecordingSink, started, until

from gpufrac.contract.request import ComputeMode
from gpufrac.node.metrics import CountingMpsEvents, EnforcementCounters
from gpufrac.node.mps.events import REASON_WEDGED
from gpufrac.node.mps.supervisor import MpsSupervisor, SupervisorState


async def connects(mps_env: MpsEnv, pipe: Path, *, within_s: float) -> bool:
    """Whether a new client gets its greeting (a CUDA context) within ``within_s``."""
    process = await asyncio.create_subprocess_exec(
        str(mps_env.bin),
        "--mps-client",
        "--once",
        env={**os.environ, "CUDA_MPS_PIPE_DIRECTORY": str(pipe)},
        stdout=asyncio.subprocess.DEVNULL,
    )
    try:
        return await asyncio.wait_for(process.wait(), timeout=within_s) == 0
    except TimeoutError:
        process.kill()
        await process.wait()
        return False


async def test_the_standin_reproduces_the_wedge_the_control_plane_does_not_see(
    mps_env: MpsEnv, make_supervisor: Callable[..., MpsSupervisor]
) -> None:
    mps_env.arm("wedge-on-kill")
    supervisor = await started(make_supervisor(probe_interval_s=None))
    server_pipe = supervisor.probe_pipe_dir
    assert await connects(mps_env, server_pipe, within_s=5)  # a client that exits normally: no harm

    victim, greeting = await mps_env.client(server_pipe)
    assert greeting.startswith("connected shared")
    victim.send_signal(signal.SIGKILL)  # killed with work in flight
    await victim.wait()

    assert not await connects(mps_env, server_pipe, within_s=1.5)  # hangs in "CUDA init"
    # ...while the control plane answers as if nothing happened, and the daemon runs on.
    assert "shared" in await supervisor.control.run("server", "list")
    assert supervisor.state is SupervisorState.READY


async def test_the_probe_finds_the_wedge_withholds_sm_sharing_recovers_and_counts_it(
    mps_env: MpsEnv, make_supervisor: Callable[..., MpsSupervisor]
) -> None:
    sink = RecordingSink()
    counters = EnforcementCounters()
    seen_withheld: list[bool] = []
    holder: list[MpsSupervisor] = []

    def on_change() -> None:  # what the inventory publisher would read at each poke
        if holder and holder[0].suspect is not None:
            seen_withheld.append(ComputeMode.SM_SHARING not in holder[0].capability().enforceable)

    supervisor = make_supervisor(
        sink=CountingMpsEvents(sink=sink, counters=counters),  # type: ignore[arg-type]
        on_change=on_change,
        probe_interval_s=0.3,
        probe_timeout_s=5.0,  # the stand-in client is a Python process: slow to start on a busy machine
    )
    holder.append(supervisor)
    await started(supervisor)
    assert ComputeMode.SM_SHARING in supervisor.capability().enforceable
    probes = supervisor.probes
    await until(lambda: supervisor.probes >= probes + 2)  # probes pass while the server is healthy
    assert sink.reasons() == []

    mps_env.arm("wedge-on-kill")
    victim, _ = await mps_env.client(supervisor.probe_pipe_dir)
    victim.send_signal(signal.SIGKILL)
    await victim.wait()
    killed = time.monotonic()

    await until(lambda: REASON_WEDGED in sink.reasons(), timeout_s=15)
    detected = time.monotonic() - killed
    (message,) = [m for _, r, m in sink.events if r == REASON_WEDGED]
    assert "clients hang in CUDA init" in message
    assert counters.read().mps_wedges == 1
    assert seen_withheld and all(seen_withheld)  # no sm-sharing advertised while suspect
    await until(
        lambda: supervisor.state is SupervisorState.READY and supervisor.suspect is None, timeout_s=15
    )
    recovered = time.monotonic() - killed
    print(f"MPS wedge: detected {detected:.2f}s after the kill, trusted again after {recovered:.2f}s")
    assert await connects(mps_env, supervisor.probe_pipe_dir, within_s=5)
    assert ComputeMode.SM_SHARING in supervisor.capability().enforceable
    assert supervisor.restarts == 1
