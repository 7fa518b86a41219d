"""The STAND-IN daemon as a program: the flags and errors the supervisor relies on behave like the real."""

from __future__ import annotations

import os
import subprocess
import time

from mps_harness import MpsEnv, processes_of


def run(env: MpsEnv, *args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(env.bin), *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=30,
        env={
            **os.environ,
            "CUDA_MPS_PIPE_DIRECTORY": str(env.root / "pipe"),
            "CUDA_MPS_LOG_DIRECTORY": str(env.root / "log"),
        },
    )


def test_background_daemon_with_a_config_answers_and_quits_with_q(mps_env: MpsEnv) -> None:
    config = mps_env.root / "mps.toml"
    config.write_text(
        'schema_version = "1.0"\n[servers.shared]\n[servers.shared.namespaces.fast]\n'
        'active_thread_percentage = "60"\n'
    )
    assert run(mps_env, "-d", "-p", "3", "-m", "-a", str(config)).returncode == 0  # returns at once
    deadline = time.monotonic() + 15
    while not (mps_env.root / "pipe" / "control").exists():
        assert time.monotonic() < deadline, "the background daemon never opened its control socket"
        time.sleep(0.05)

    assert run(mps_env, "namespace", "list", "shared").stdout.split() == ["default", "fast"]
    assert run(mps_env, "namespace", "get", "shared", "fast").stdout == "active_thread_percentage=60\n"
    refused = run(mps_env, "namespace", "create", "shared", "x", "active_thread_percentage=0")
    assert refused.returncode == 1 and "not an integer in [1, 100]" in refused.stderr

    assert run(mps_env, "-q").returncode == 0
    deadline = time.monotonic() + 15
    while processes_of(mps_env.root / "pipe"):
        assert time.monotonic() < deadline, "the daemon and its server did not exit after -q"
        time.sleep(0.05)
    assert not (mps_env.root / "pipe" / "control").exists()


def test_configuration_errors_and_a_second_daemon_are_refused(mps_env: MpsEnv) -> None:
    bad = mps_env.root / "bad.toml"
    bad.write_text('schema_version = "1.0"\n[servers.shared]\nthreads = 5\n')
    refused = run(mps_env, "-f", "-p", "3", "-a", str(bad))
    assert refused.returncode != 0 and "unknown keys ['threads']" in refused.stderr
    classic_with_config = run(mps_env, "-f", "-a", str(bad))
    assert classic_with_config.returncode != 0 and "needs protocol 3" in classic_with_config.stderr

    first = subprocess.Popen(
        [str(mps_env.bin), "-f"],
        env={
            **os.environ,
            "CUDA_MPS_PIPE_DIRECTORY": str(mps_env.root / "pipe"),
            "CUDA_MPS_LOG_DIRECTORY": str(mps_env.root / "log"),
        },
    )
    try:
        deadline = time.monotonic() + 15
        while not (mps_env.root / "pipe" / "control").exists():
            assert time.monotonic() < deadline
            time.sleep(0.05)
        second = run(mps_env, "-f")
        assert second.returncode == 1 and "already running" in second.stderr
        assert run(mps_env, stdin="get_server_list\n").stdout == ""  # classic: servers start on demand
        assert run(mps_env, stdin="quit\n").returncode == 0
        assert first.wait(timeout=15) == 0
    finally:
        if first.poll() is None:
            first.kill()
