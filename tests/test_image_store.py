"""The buildah store of ``testenv/image/build.sh`` keeps only what the next build can reuse.

vfs storage holds a full copy of every image and working container. Before the store was tidied, every
build of the gpufrac image left about 3 GB behind (the previous build's untagged chain and a working
container per ``FROM`` stage), and a day of CI runs filled the disk (54 GB). These tests make the litter
by hand in a store of their own and run the script's ``--tidy`` on it, the step it runs before and after
each build.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BUILD = ROOT / "testenv" / "image" / "build.sh"


def _buildah(store: Path, *args: str) -> str:
    where = ["--root", str(store / "root"), "--runroot", str(store / "run"), "--storage-driver=vfs"]
    done = subprocess.run(["buildah", *where, *args], check=True, capture_output=True, text=True, timeout=120)
    return done.stdout.strip()


def test_an_unknown_argument_is_refused_with_the_usage() -> None:
    done = subprocess.run(["bash", str(BUILD), "--prune"], capture_output=True, text=True, timeout=30)
    assert done.returncode == 2
    assert "unknown argument --prune" in done.stderr
    assert "--force | --tidy" in done.stderr


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("buildah") is None, reason="needs root and buildah")
def test_tidy_removes_left_over_containers_and_untagged_images_and_keeps_tagged_ones(tmp_path: Path) -> None:
    store = tmp_path / "store"
    kept = _buildah(store, "from", "scratch")
    _buildah(store, "config", "--label", "role=kept", kept)
    _buildah(store, "commit", "--quiet", "--rm", kept, "gpufrac.local/kept:1")
    untagged = _buildah(store, "from", "scratch")
    _buildah(store, "config", "--label", "role=previous-build", untagged)
    untagged_id = _buildah(store, "commit", "--quiet", "--rm", untagged)
    left_over = _buildah(store, "from", "scratch")
    assert _buildah(store, "containers", "--format", "{{.ContainerName}}") == left_over

    env = {**os.environ, "GPUFRAC_BUILDAH_STORE": str(store)}
    done = subprocess.run(
        ["bash", str(BUILD), "--tidy"], env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr
    assert f"tidied {store}" in done.stdout

    assert _buildah(store, "containers", "--format", "{{.ContainerName}}") == ""
    images = _buildah(store, "images", "--all", "--format", "{{.Name}}:{{.Tag}} {{.ID}}")
    assert "gpufrac.local/kept:1" in images
    assert untagged_id[:12] not in images
