"""ClusterShape and `gpufrac up` refuse a runtime they do not know, or a real node count they cannot run."""

from __future__ import annotations

import pytest
import typer

from gpufrac.local.cluster import ClusterShape
from gpufrac.local.command import _shape


def test_an_unknown_runtime_is_named_with_the_choices() -> None:
    with pytest.raises(ValueError, match=r"runtime 'docker': must be one of simulated, containerd"):
        ClusterShape(runtime="docker")
    with pytest.raises(typer.BadParameter, match=r"--runtime 'docker' is not one of simulated, containerd"):
        _shape(1, 4, "H100-80GB", "binpack", "docker")


def test_the_real_node_is_one_per_machine() -> None:
    with pytest.raises(ValueError, match=r"nodes=2 with runtime 'containerd'"):
        ClusterShape(nodes=2, runtime="containerd")
    assert _shape(1, 4, "H100-80GB", "binpack", "containerd").runtime == "containerd"
