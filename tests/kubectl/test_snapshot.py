"""``kubectl gpufrac whatif`` on a small cluster: every part of a pod the replay ignores is said, and a
share of capacity no arrival reaches shows as ``-`` with a caption, never ``nan``."""

from __future__ import annotations

from typing import Any

from lightkube.resources.core_v1 import Pod
from rich.console import Console

from gpufrac.contract import keys
from gpufrac.kubectl.snapshot import cluster_trace
from gpufrac.local.simnodes import NodeShape, sim_node
from gpufrac.sim.experiment import run_experiment
from gpufrac.sim.report import UNREACHED_NOTE, table


def gpu_pod(name: str, annotations: dict[str, str], **spec: Any) -> Pod:
    return Pod.from_dict(
        {
            "metadata": {"name": name, "namespace": "team-a", "uid": name, "annotations": annotations},
            "spec": {"containers": [{"name": "app"}], **spec},
        }
    )


def test_the_snapshot_says_it_left_out_a_pods_compute_mode_and_node_rules() -> None:
    nodes = [sim_node(name="n1", shape=NodeShape(gpus=2, model="H100-80GB"))]
    pods = [
        gpu_pod("plain", {"gpu-fraction": "0.5"}),
        gpu_pod("sm", {"gpu-fraction": "0.25", keys.compute_mode_key("app"): "sm-sharing"}),
        gpu_pod("pinned", {"gpu-fraction": "0.25"}, nodeSelector={"zone": "a"}),
    ]
    trace = cluster_trace(nodes, pods)
    assert [p.name for p in trace.pods] == ["team-a/plain", "team-a/sm", "team-a/pinned"]
    assert trace.left_out == [
        "pod team-a/sm: compute mode sm-sharing left out (replayed as time-slicing; "
        "gpufrac simulate --scenario varies the mode)",
        "pod team-a/pinned: node selector and node affinity left out (replayed on any GPU node)",
    ]


def test_a_replay_of_a_few_gpus_shows_unreached_shares_as_a_dash_with_a_caption() -> None:
    nodes = [sim_node(name="n1", shape=NodeShape(gpus=2, model="H100-80GB"))]
    pods = [gpu_pod(f"p{i}", {"gpu-fraction": "0.7"}) for i in range(3)]
    trace = cluster_trace(nodes, pods)
    results = run_experiment(
        trace="cluster", nodes=trace.nodes, pods=trace.pods, policies=["fgd-room"], seeds=[42]
    )
    console = Console(width=200, record=True)
    console.print(table("cluster", results))
    shown = console.export_text()
    assert "nan" not in shown
    assert " - " in shown and UNREACHED_NOTE.split(" (")[0] in " ".join(shown.split())


def test_the_snapshot_leaves_out_a_mig_pod_and_says_so() -> None:
    """The openb shape has no MIG slice: a MIG pod is named, not replayed as a whole GPU."""
    nodes = [sim_node(name="n1", shape=NodeShape(gpus=2, model="H100-80GB"))]
    pods = [
        gpu_pod("sliced", {keys.mig_key("app", keys.MIG_PROFILE): "3g.40gb"}),
        gpu_pod("plain", {"gpu-fraction": "0.5"}),
    ]
    trace = cluster_trace(nodes, pods)
    assert [p.name for p in trace.pods] == ["team-a/plain"]
    assert trace.left_out == ["pod team-a/sliced: asks for MIG slices, which the replay leaves out"]
