"""The STAND-IN daemon as a program: the flags and errors the supervisor relies on behave like the real."""

from __future__ import annotations

import os
import subprocess
import time

from mps_harness import MpsEnv, processes_of
from mps_standin import STANDIN_DEVICE

from gpufrac.node.mps.control import parse_client_list, parse_namespace_list, parse_pipe_directory


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

    v3 = ("-p", "3")
    assert parse_namespace_list(run(mps_env, *v3, "namespace", "list", "--server=shared").stdout) == [
        "default",
        "fast",
    ]
    got = run(mps_env, *v3, "namespace", "get", "fast", "shared", "active_thread_percentage")
    assert got.stdout == "60\n"
    assert run(mps_env, *v3, "namespace", "create", "slow", "--server=shared").returncode == 0
    refused = run(mps_env, *v3, "namespace", "set", "slow", "--server=shared", "--active-thread-percentage=0")
    assert refused.returncode == 1 and "not an integer in [1, 100]" in refused.stderr

    assert run(mps_env, "-p", "3", "-q").returncode == 0
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
        stdin=subprocess.PIPE,  # held open: a foreground daemon quits at the end of its stdin
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


def test_the_r615_grammar_and_output_shapes(mps_env: MpsEnv) -> None:
    """Each v3 command as driver 615 takes it (docs/mps.md, "Commands"), refused as 615 refuses it."""
    config = mps_env.root / "mps.toml"
    config.write_text('schema_version = "1.0"\n[servers.shared]\n')
    daemon = subprocess.Popen(
        [str(mps_env.bin), "-p", "3", "-m", "-f", "-a", str(config)],
        stdin=subprocess.PIPE,
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
        v3 = ("-p", "3")

        # A name outside [a-z0-9_]+ is refused (the seed's `ctr-<id>` names were).
        refused = run(mps_env, *v3, "namespace", "create", "ctr-1a2b", "--server=shared")
        assert refused.returncode == 1 and "[a-z0-9_]+" in refused.stderr
        # The server is a flag; the old positional form is a usage error.
        assert run(mps_env, *v3, "namespace", "create", "shared", "ns_a").returncode == 1
        # Without -p 3 a command does not reach the v3 daemon.
        assert run(mps_env, "namespace", "list", "--server=shared").returncode == 1

        assert run(mps_env, *v3, "namespace", "create", "ns_a", "--server=shared").returncode == 0
        assert (
            run(
                mps_env,
                *v3,
                "namespace",
                "set",
                "ns_a",
                "--server=shared",
                "--active-thread-percentage=25",
                "--pinned-memory-limit=3000M",
            ).returncode
            == 0
        )
        table = run(mps_env, *v3, "namespace", "list", "--server=shared").stdout
        assert table.splitlines()[0].split()[0] == "NAME"  # a table, header first
        assert parse_namespace_list(table) == ["default", "ns_a"]
        answer = run(mps_env, *v3, "namespace", "get", "ns_a", "shared", "pipe_directory").stdout
        assert parse_pipe_directory(answer) == mps_env.root / "pipe" / "shared" / "ns_a"

        client = subprocess.Popen(
            [str(mps_env.bin), "--mps-client"],
            env={**os.environ, "CUDA_MPS_PIPE_DIRECTORY": str(mps_env.root / "pipe" / "shared" / "ns_a")},
            stdout=subprocess.PIPE,
        )
        assert client.stdout is not None and client.stdout.readline().startswith(b"connected shared ns_a 25")
        csv = run(mps_env, *v3, "client", "list", "--format=csv,noheader").stdout
        # The 615 CSV shape: pid, server, device, <server>/<namespace> (<id>), command.
        assert csv.strip().split(",")[:4] == [str(client.pid), "shared", STANDIN_DEVICE, "shared/ns_a (1)"]
        assert [(c.pid, c.server, c.namespace) for c in parse_client_list(csv)] == [
            (client.pid, "shared", "ns_a")
        ]
        table = run(mps_env, *v3, "client", "list").stdout
        assert table.startswith("PID") and parse_client_list(table) == []  # the table is never read
        # A namespace with a client attached cannot be changed or deleted (as on 615).
        busy = run(
            mps_env, *v3, "namespace", "set", "ns_a", "--server=shared", "--active-thread-percentage=90"
        )
        assert busy.returncode == 1 and "active clients" in busy.stderr
        assert run(mps_env, *v3, "namespace", "delete", "ns_a", "--server=shared").returncode == 1
        assert run(mps_env, *v3, "client", "terminate", str(client.pid)).returncode == 0
        assert client.wait(timeout=15) == 3
        assert run(mps_env, *v3, "namespace", "delete", "ns_a", "--server=shared").returncode == 0
        assert not (mps_env.root / "pipe" / "shared" / "ns_a").exists()
    finally:
        assert daemon.stdin is not None
        daemon.stdin.write(b"quit\n")
        daemon.stdin.flush()
        assert daemon.wait(timeout=15) == 0
