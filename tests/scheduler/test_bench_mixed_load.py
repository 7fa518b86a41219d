"""bench/mixed_load.py end to end at a tiny size (issue #39): queues, priorities and a preemption burst
interleaved with a stream of creates, through a real API server and ``gpufrac scheduler`` as deployed.
What a user of the bench relies on: every high-priority pod bound, only lower-priority fill pods
evicted, each exactly once with its Event, the bookings clean throughout, the scheduler's own decision
counter agreeing with the binds the API shows, and the figures the bench reports present."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench" / "mixed_load.py"


def run_bench(*args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(BENCH), *args], capture_output=True, text=True, timeout=timeout
    )


@pytest.mark.kube
def test_a_tiny_mixed_load_binds_the_burst_by_preempting_fill_pods_once_each() -> None:
    # 4 nodes x 2 GPUs; the fill asks 1.05x the cluster, so it ends full and part of it waits.
    done = run_bench(
        *("--nodes", "4", "--gpus", "2", "--burst", "4", "--concurrency", "4"),
        *("--settle", "1", "--audit-every", "0.5", "--timeout", "90"),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["pass"], got
    # Every high-priority pod is bound, and at least one of them had to evict to get there.
    assert got["burst_bound_at_end"] == got["burst_pods"] == 4
    assert got["classes"]["burst"]["bound"] == 4 and got["classes"]["burst"]["p99_ms"] > 0
    assert got["burst_preempting"] >= 1
    # Victims are fill pods (lower priority), each evicted exactly once, each with its one Event.
    assert got["victims"] >= 1 and set(got["victims_by_class"]) <= {"fill-low", "fill-mid"}
    assert got["victims_evicted_twice"] == 0 and got["evicted_not_gone"] == []
    assert got["victims_with_event"] == got["victims_checked"] == got["victims"] == got["victim_events"]
    # The cluster ends mostly booked (victims leave room only for their preemptors), and what still
    # waits, if anything, is fill, never a burst pod.
    assert got["booked_at_end"] > 0.75 and "burst" not in got["pending_by_class"]
    # The bookings were audited during the run and at the end, and held.
    assert got["audit_ok"] and got["audits_during"] >= 1 and got["audit_problems"] == []
    # The scheduler's own counter of scheduled attempts is the pods the watch saw bound.
    assert got["attempts"]["scheduled"] == got["pods_bound"] > got["burst_pods"]
    assert got["decisions_per_s"] > 0 and got["scheduler_peak_rss_mib"] > 0
    assert got["scheduler_cpu_ms_per_pod"] > 0 and got["pods_per_s"] > 0


def test_a_share_out_of_range_is_refused_naming_the_flag_and_the_rule() -> None:
    done = run_bench("--burst-at", "3")
    assert done.returncode == 2
    assert "--burst-at 3.0 must be above 0 and at most 2" in done.stderr
