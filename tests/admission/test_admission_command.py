"""``gpufrac admission`` as a process: it serves, writes its configurations, and stops cleanly on SIGTERM."""

from __future__ import annotations

import json
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
