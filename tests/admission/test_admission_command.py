"""``gpufrac admission`` as a process: it serves, writes its configurations, and stops cleanly on SIGTERM."""

from __future__ import annotations

import json
import os
import signal
import ssl
import subprocess
import sys
import time
from pathlib import Path

import httpx
import yaml


def test_serves_until_sigterm_then_exits_cleanly(tmp_path: Path) -> None:
    tls_dir, configuration = tmp_path / "tls", tmp_path / "webhooks.yaml"
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "gpufrac.cli",
            "admission",
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--tls-dir",
            str(tls_dir),
            "--write-configuration",
            str(configuration),
        ],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert process.stderr is not None
        address = None
        deadline = time.monotonic() + 30
        while address is None and time.monotonic() < deadline:
            line = process.stderr.readline()
            if line.startswith("{") and json.loads(line)["msg"] == "admission webhook serving":
                address = json.loads(line)["address"]
        assert address is not None, "the server never said it was serving"

        context = ssl.create_default_context(cafile=str(tls_dir / "ca.crt"))
        assert httpx.get(f"https://{address}/readyz", verify=context).text == "ok"
        mutating, validating = yaml.safe_load_all(configuration.read_text())
        assert validating["webhooks"][0]["clientConfig"]["url"] == f"https://{address}/validate"
        assert mutating["webhooks"][0]["failurePolicy"] == "Fail"

        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=15) == 0
        assert '"msg": "stopped"' in process.stderr.read()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


#: Run the CLI in a process whose Python finds no usable temporary directory: TMPDIR names a file (root
#: may write anywhere, so "not writable" is emulated) and ``tempfile.gettempdir`` raises as it does when
#: every candidate, /tmp included, is unwritable -- a read-only root filesystem without a /tmp volume.
_NO_TEMPORARY_DIRECTORY = """
import sys, tempfile

def _none(*_args, **_kwargs):
    raise FileNotFoundError("No usable temporary directory found")

tempfile.gettempdir = tempfile.gettempdirb = tempfile.mkdtemp = tempfile.mkstemp = _none
tempfile.tempdir = None
from gpufrac.cli import app

app(sys.argv[1:])
"""


def test_the_cli_loads_and_answers_help_without_a_writable_temporary_directory(tmp_path: Path) -> None:
    """Only the subcommand that needs a temporary directory may ask for one, when it runs: the node
    agent's validator runs on a read-only root filesystem and loads every subcommand at start."""
    not_a_directory = tmp_path / "not-a-directory"
    not_a_directory.write_text("")
    for args in (["--help"], ["admission", "--help"], ["node-agent-validator", "--help"]):
        done = subprocess.run(
            [sys.executable, "-c", _NO_TEMPORARY_DIRECTORY, *args],
            capture_output=True,
            text=True,
            env={**os.environ, "TMPDIR": str(not_a_directory)},
            timeout=60,
        )
        assert done.returncode == 0, (args, done.stderr[-2000:])
        assert "Usage:" in done.stdout, (args, done.stdout)
    admission_help = subprocess.run(
        [sys.executable, "-c", _NO_TEMPORARY_DIRECTORY, "admission", "--help"],
        capture_output=True,
        text=True,
        env={**os.environ, "TMPDIR": str(not_a_directory), "COLUMNS": "200"},
        timeout=60,
    ).stdout
    assert "--tls-dir" in admission_help
