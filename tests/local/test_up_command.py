"""``gpufrac up``'s command line: what a newcomer reads before the cluster starts."""

from __future__ import annotations

import io

from typer.testing import CliRunner

from gpufrac.cli import app
from gpufrac.local.command import banner_console, kubectl_hint
from gpufrac.local.simnodes import GPU_MODELS


def test_up_help_lists_the_gpu_models() -> None:
    result = CliRunner().invoke(app, ["up", "--help"], env={"COLUMNS": "300", "TERM": "dumb"})
    assert result.exit_code == 0
    for model in GPU_MODELS:
        assert model in result.output


def test_the_banner_does_not_wrap_its_commands_when_piped() -> None:
    piped = io.StringIO()
    command = "  per-fraction usage: gpufrac top " + " ".join(
        f"http://127.0.0.1:{40000 + i}/metrics" for i in range(4)
    )
    banner_console(piped).print(command)
    assert piped.getvalue() == command + "\n"


def test_the_banner_points_at_a_kubectl_of_the_servers_version(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import re
    import subprocess

    from gpufrac.local.realnode import TESTENV_BIN

    assert (
        kubectl_hint(tmp_path)
        == "kubectl of the server's version: run `make testenv` (it builds testenv/bin/kubectl)"
    )
    assert kubectl_hint() == f"kubectl of the server's version: export PATH={TESTENV_BIN}:$PATH"
    go_mod = (TESTENV_BIN.parent / "controlplane" / "go.mod").read_text()
    (server,) = re.findall(r"^\tk8s.io/kubernetes (v\S+)$", go_mod, re.MULTILINE)
    done = subprocess.run(
        [str(TESTENV_BIN / "kubectl"), "version", "--client"], capture_output=True, text=True, check=True
    )
    assert f"Client Version: {server}" in done.stdout
