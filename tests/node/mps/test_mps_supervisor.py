"""The real supervisor against the STAND-IN control daemon (a separate process): start, restart, stop."""

from __future__ import annotations

import asyncio
import os
import re
import signal
from pathlib import Path

from mps_harness import STANDIN, RecordingSink, processes_of, started, until

from gpufrac.contract.request import ComputeMode
from gpufrac.node.mps.events import REASON_RESTARTED, REASON_START_FAILED
from gpufrac.node.mps.supervisor import SupervisorState


async def test_v3_daemon_starts_ready_with_capped_default_namespace(make_supervisor, mps_env) -> None:
    supervisor = await started(make_supervisor(driver="615.20.01"))

    cmdline = Path(f"/proc/{supervisor.daemon_pid}/cmdline").read_bytes().split(b"\0")
    at = cmdline.index(str(STANDIN).encode())  # the wrapper execs python .../mps_standin.py
    assert cmdline[at + 1 : at + 6] == [b"-p", b"3", b"-m", b"-f", b"-a"]
    assert (mps_env.root / "pipe" / "control").exists()
    assert await supervisor.control.list_namespaces(server="shared") == ["default"]
    default = await supervisor.control.namespace_field(
        server="shared", name="default", field="active_thread_percentage"
    )
    assert default == "1"
    assert supervisor.capability().enforceable == {ComputeMode.TIME_SLICING, ComputeMode.SM_SHARING}
    assert supervisor.capability().labels()["gpufrac.io/mps"] == "v3"


async def test_crash_is_restarted_with_growing_backoff_and_an_event_each_time(
    make_supervisor, mps_env
) -> None:
    sink = RecordingSink()
    supervisor = await started(make_supervisor(sink=sink))
    first = supervisor.daemon_pid

    os.kill(first, signal.SIGKILL)
    await until(lambda: supervisor.restarts == 1 and supervisor.state is SupervisorState.READY)
    assert supervisor.daemon_pid != first
    assert sink.reasons() == [REASON_RESTARTED]
    assert "exited with status -9" in sink.events[0][2]
    assert len([p for p in processes_of(mps_env.root / "pipe")]) == 2  # the new daemon and its one server

    # A daemon that keeps crashing: delays double up to the maximum, one Event per restart.
    mps_env.arm(*["crash-after=0.1"] * 5)  # for the next five starts
    os.kill(supervisor.daemon_pid, signal.SIGKILL)
    await until(lambda: supervisor.restarts >= 7, timeout_s=40)
    delays = [float(re.search(r"in ([\d.]+)s", m).group(1)) for _, _, m in sink.events]
    assert delays == [0.05, 0.1, 0.2, 0.4, 0.4, 0.4, 0.4]
    await until(lambda: supervisor.state is SupervisorState.READY, timeout_s=20)


async def test_backoff_starts_over_after_a_stable_period(make_supervisor, mps_env) -> None:
    sink = RecordingSink()
    supervisor = await started(
        make_supervisor(sink=sink, backoff={"initial_s": 0.05, "max_s": 5, "stable_s": 1.0})
    )
    for n in (1, 2):  # crashes right after becoming ready: a crash loop, delays grow
        os.kill(supervisor.daemon_pid, signal.SIGKILL)
        await until(lambda n=n: supervisor.restarts == n and supervisor.state is SupervisorState.READY)
    await asyncio.sleep(1.2)  # READY for longer than stable_s: the next crash is a new incident
    os.kill(supervisor.daemon_pid, signal.SIGKILL)
    await until(lambda: supervisor.restarts == 3)
    delays = [m.rsplit(" in ", 1)[1] for _, _, m in sink.events]
    assert delays == ["0.05s", "0.10s", "0.05s"]


async def test_repeated_failed_starts_withdraw_sm_sharing_until_ready_again(make_supervisor, mps_env) -> None:
    sink = RecordingSink()
    # Each slow start outlasts the ready timeout by far; the timeout itself leaves a normal start (about
    # 1.7 s on a loaded 2-core machine) room, so the fourth start is judged on its merits.
    mps_env.arm(*["slow-start=60"] * 3)
    supervisor = make_supervisor(sink=sink, ready_timeout_s=5.0)
    await supervisor.start()
    await until(lambda: supervisor.backoff.consecutive >= 3, timeout_s=60)
    assert ComputeMode.SM_SHARING not in supervisor.capability().enforceable
    assert ComputeMode.TIME_SLICING in supervisor.capability().enforceable
    assert sink.reasons()[:3] == [REASON_START_FAILED] * 3
    assert "not ready within 5.0s" in sink.events[0][2]
    await until(lambda: supervisor.state is SupervisorState.READY, timeout_s=60)
    assert ComputeMode.SM_SHARING in supervisor.capability().enforceable


async def test_graceful_stop_leaves_no_process_even_when_quit_is_ignored(
    make_supervisor, mps_env, monkeypatch
) -> None:
    monkeypatch.setenv("GPUFRAC_STANDIN_FAULTS", "ignore-quit,leave-servers")
    supervisor = await started(make_supervisor())
    assert processes_of(mps_env.root / "pipe")  # daemon + server

    await supervisor.stop()

    assert processes_of(mps_env.root / "pipe") == []
    assert supervisor.state is SupervisorState.STOPPED
    assert ComputeMode.SM_SHARING not in supervisor.capability().enforceable


async def test_graceful_stop_uses_quit_when_the_daemon_obeys(make_supervisor, mps_env) -> None:
    labels: list[str] = []  # what the inventory publisher would write on each poke
    supervisor = make_supervisor(
        on_change=lambda: labels.append(
            supervisor.capability().labels()["gpufrac.io/compute-mode.sm-sharing"]
        )
    )
    await started(supervisor)
    await supervisor.stop()
    assert labels[-1] == "false" and "true" in labels
    assert processes_of(mps_env.root / "pipe") == []
    assert not (mps_env.root / "pipe" / "control").exists()  # removed by the daemon itself on quit
    log = (mps_env.root / "log" / "control.log").read_text()
    assert "command (stdin): quit" in log and "stopped" in log
    # `quit` went to the daemon's stdin, as a foreground r615 daemon takes it; the binary never ran it.
    assert not [c for c in mps_env.commands() if c.endswith("quit")]


async def test_a_foreground_daemon_whose_stdin_closes_quits(mps_env) -> None:
    """The stand-in behaves as the 615 daemon does: -f reads commands on stdin and exits at its end
    (why the supervisor holds the daemon's stdin open: a daemon given /dev/null never serves)."""
    env = {
        **os.environ,
        "CUDA_MPS_PIPE_DIRECTORY": str(mps_env.root / "pipe"),
        "CUDA_MPS_LOG_DIRECTORY": str(mps_env.root / "log"),
    }
    daemon = await asyncio.create_subprocess_exec(
        str(mps_env.bin), "-p", "3", "-f", env=env, stdin=asyncio.subprocess.DEVNULL
    )
    assert await asyncio.wait_for(daemon.wait(), 30) == 0
    assert "stdin closed: quitting" in (mps_env.root / "log" / "control.log").read_text()


async def test_stop_during_backoff_leaves_nothing(make_supervisor, mps_env) -> None:
    supervisor = await started(make_supervisor(backoff={"initial_s": 30.0, "max_s": 30.0}))
    os.kill(supervisor.daemon_pid, signal.SIGKILL)
    await until(lambda: supervisor.state is SupervisorState.BACKOFF)
    await supervisor.stop()
    assert processes_of(mps_env.root / "pipe") == []
