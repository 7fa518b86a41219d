"""``pip install gpufrac`` works for a user with no Go and no clone: the wheel carries the generated messages.

Builds the wheel and sdist with ``python -m build`` (no isolation: the project venv has setuptools, wheel
and build from the test extras), installs the wheel into a fresh venv whose process sees no Go on PATH and
runs outside the clone, then asks that venv's ``gpufrac`` for its version, validates an example pod, and
imports the node agent's NRI plugin (which imports the generated NRI and ttrpc messages), runs the
``kubectl-gpufrac`` plugin and checks named traces default to the user's cache. Dependencies
come from the package index as a user's would (pip's cache keeps a rerun quick).

Deselect with ``-m "not wheel"`` (it installs ~40 packages into a new venv).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import venv
from pathlib import Path

import pytest

import gpufrac

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "inference-sm-sharing.yaml"

pytestmark = pytest.mark.wheel


def _build(source: Path, outdir: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "build", "--no-isolation", "--outdir", str(outdir), str(source)],
        capture_output=True,
        text=True,
        timeout=300,
    )


def _no_go_env(bindir: Path) -> dict[str, str]:
    """An environment with the venv first and no Go, no PYTHONPATH, no clone."""
    path = [str(bindir), "/usr/bin", "/bin"]
    assert not any((Path(p) / "go").exists() for p in path), "Go is on the test venv's PATH"
    return {"PATH": os.pathsep.join(path), "HOME": str(bindir.parents[1] / "home"), "LANG": "C.UTF-8"}


def test_the_wheel_installs_and_runs_without_go_or_a_clone(tmp_path: Path) -> None:
    built = _build(ROOT, tmp_path / "dist")
    assert built.returncode == 0, built.stderr[-3000:]
    wheels = list((tmp_path / "dist").glob("gpufrac-*.whl"))
    assert [w.name for w in wheels] == [f"gpufrac-{gpufrac.__version__}-py3-none-any.whl"]
    assert list((tmp_path / "dist").glob(f"gpufrac-{gpufrac.__version__}.tar.gz"))

    venv.create(tmp_path / "venv", with_pip=True)
    bindir = tmp_path / "venv" / "bin"
    env = _no_go_env(bindir)
    user_dir = tmp_path / "elsewhere"  # the user's working directory: not the clone
    user_dir.mkdir()
    shutil.copy(EXAMPLE, user_dir / "pod.yaml")

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(args, capture_output=True, text=True, env=env, cwd=user_dir, timeout=600)

    started = time.monotonic()
    installed = run(str(bindir / "pip"), "install", "--quiet", "--disable-pip-version-check", str(wheels[0]))
    assert installed.returncode == 0, installed.stderr[-3000:]
    validated = run(str(bindir / "gpufrac"), "validate", "pod.yaml")
    elapsed = time.monotonic() - started
    assert validated.returncode == 0, validated.stderr
    assert "Pod inference: ok" in validated.stdout
    print(f"pip install to first `gpufrac validate` answer: {elapsed:.1f} s")

    version = run(str(bindir / "gpufrac"), "--version")
    assert version.stdout.strip() == f"gpufrac {gpufrac.__version__}", version.stderr

    plugin = run(
        str(bindir / "python"),
        "-c",
        "import gpufrac.node.nri.plugin as p, gpufrac._generated.cri.api_pb2 as c; print(p.__file__)",
    )
    assert plugin.returncode == 0, plugin.stderr
    assert Path(plugin.stdout.strip()).is_relative_to(tmp_path / "venv"), plugin.stdout

    # The kubectl plugin comes with the wheel, under the name kubectl looks for.
    plugin_help = run(str(bindir / "kubectl-gpufrac"), "--help")
    assert plugin_help.returncode == 0, plugin_help.stderr
    assert "explain" in plugin_help.stdout

    # No clone beside an installed package: named traces come from the user's cache, nowhere else.
    where = "from gpufrac.sim.trace import default_data_dir as d; print(d())"
    data = run(str(bindir / "python"), "-c", where)
    assert data.stdout.strip() == str(tmp_path / "home" / ".cache" / "gpufrac" / "openb"), data.stderr


def test_a_build_without_the_generated_messages_fails_and_says_how_to_make_them(tmp_path: Path) -> None:
    source = tmp_path / "src-copy"
    for name in ("pyproject.toml", "setup.py", "README.md"):
        (source / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / name, source / name)
    shutil.copytree(
        ROOT / "src" / "gpufrac",
        source / "src" / "gpufrac",
        ignore=shutil.ignore_patterns("_generated", "__pycache__"),
    )
    built = _build(source, tmp_path / "dist")
    assert built.returncode != 0
    assert "generated protobuf messages are missing" in built.stdout + built.stderr
    assert "make testenv" in built.stdout + built.stderr
    assert not list((tmp_path / "dist").glob("*.whl"))
