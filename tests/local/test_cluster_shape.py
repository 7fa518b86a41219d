"""ClusterShape and `gpufrac up`: unknown runtimes, real node counts it cannot run, and its policy."""

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


def test_gpufrac_up_runs_the_scheduler_services_default_policy() -> None:
    import inspect

    from gpufrac.local.cluster import Timings
    from gpufrac.local.command import up
    from gpufrac.scheduler.config import SchedulerConfig

    assert inspect.signature(up).parameters["policy"].default.default is None  # no --policy given
    shape = _shape(2, 4, "H100-80GB", None)
    written = Timings().scheduler_config(policy=shape.policy)
    assert "policy" not in written
    assert SchedulerConfig.model_validate(written).policy == "fgd-room"
    # A policy asked for is passed through.
    assert SchedulerConfig.model_validate(Timings().scheduler_config(policy="binpack")).policy == "binpack"


def test_dra_needs_the_real_node() -> None:
    """A claim is prepared by a real kubelet: `gpufrac up --dra` without `--runtime containerd` says so."""
    with pytest.raises(ValueError, match=r"dra=True with runtime 'simulated'.*needs runtime 'containerd'"):
        ClusterShape(dra=True)
    with pytest.raises(
        typer.BadParameter, match=r"--dra with --runtime simulated: .*needs --runtime containerd"
    ):
        _shape(2, 4, "H100-80GB", None, "simulated", True)
    assert _shape(1, 4, "H100-80GB", None, "containerd", True).dra is True
