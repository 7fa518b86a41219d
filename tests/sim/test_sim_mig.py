"""Scenario ``mig`` and ``gpufrac simulate --scenario mig``: the workload is a pure, seeded function of the
trace rows; isolation pods land on MIG slices only where MIG serves them; dynamic layouts change only
GPUs the engine has nothing booked on; fractions-only never uses MIG."""

from __future__ import annotations

import json
import re
from dataclasses import replace

import pytest
from typer.testing import CliRunner

from gpufrac.cli import app
from gpufrac.node.inventory.simulated import MODEL_MIB
from gpufrac.placement.decision import Placement
from gpufrac.placement.engine import Engine
from gpufrac.placement.mig_layouts import LayoutChange
from gpufrac.placement.model import GpuMode
from gpufrac.sim.mig_churn import mig_churn_replay
from gpufrac.sim.mig_replay import MIG_VARIANTS, mig_replay
from gpufrac.sim.mig_workload import (
    MIG_GPU_MIB,
    MIG_MODEL,
    isolated,
    mig_nodes,
    mig_workload,
    static_nodes,
)
from gpufrac.sim.synthetic import synthetic_trace
from gpufrac.sim.trace import TracePod, save_nodes, save_pods


def test_the_mig_model_has_the_simulated_inventorys_memory():
    assert MODEL_MIB[MIG_MODEL] == MIG_GPU_MIB


def test_isolation_is_a_pure_seeded_function_of_the_row():
    _, pods = synthetic_trace(seed=3, nodes=4, pods=400)
    out = mig_workload(pods, 0.3)
    by_name = {p.name: p.isolation_mib for p in out}
    # The same rows in another order (a replay seed's shuffle) are isolated the same way.
    again = mig_workload(list(reversed(pods)), 0.3)
    assert {p.name: p.isolation_mib for p in again} == by_name
    chosen = [p for p in pods if by_name[p.name]]
    sharing = [p for p in pods if 0 < p.gpu_milli < 1000]
    assert chosen and set(chosen) <= set(sharing)
    assert 0.15 < len(chosen) / len(sharing) < 0.45
    # Each asks for its share of the H100's memory; nothing keeps a model constraint.
    assert all(by_name[p.name] == p.gpu_milli * MIG_GPU_MIB // 1000 for p in chosen)
    assert all(p.gpu_spec == () for p in out)
    # Another seed draws other rows; share 0 and 1 take none and every sharing pod.
    assert {p.name for p in sharing if isolated(p, 0.3, seed=7)} != {p.name for p in chosen}
    assert not any(p.isolation_mib for p in mig_workload(pods, 0.0))
    assert {p.name for p in mig_workload(pods, 1.0) if p.isolation_mib} == {p.name for p in sharing}
    # fractions-only: the same pods, as fractions of the same memory.
    assert not any(p.isolation_mib for p in mig_workload(pods, 0.3, as_mig=False))


def test_bad_shares_are_refused_naming_the_option():
    with pytest.raises(ValueError, match=re.escape("--mig-share 1.5: the share of sharing pods must be")):
        mig_workload([TracePod("p", 1000, 1024, 1, 500)], 1.5)


def test_static_partitions_whole_nodes_spread_over_the_cluster():
    nodes = mig_nodes(synthetic_trace(seed=5, nodes=20, pods=1)[0])
    assert all(n.model == MIG_MODEL for n in nodes if n.gpus)
    chosen = static_nodes(nodes, 0.25)
    assert len(chosen) == 5
    names = sorted(n.name for n in nodes)
    assert chosen == {names[i] for i in (2, 6, 10, 14, 18)}
    assert len(static_nodes(nodes, 0.01)) == 1 and static_nodes(nodes, 0.0) == set()


def _gpu_of(device_uuid: str, gpu_uuid: str) -> bool:
    return device_uuid == gpu_uuid or device_uuid.startswith(f"MIG-{gpu_uuid}-")


@pytest.mark.parametrize("variant", MIG_VARIANTS)
def test_isolation_pods_land_on_slices_only_where_mig_serves_them(variant):
    nodes, pods = synthetic_trace(seed=21, nodes=10, pods=160)
    placed: list[tuple[bool, Placement]] = []
    changes: list[LayoutChange] = []

    def on_pod(tp: TracePod, pod, decision) -> None:
        if isinstance(decision, Placement):
            placed.append((isolated(tp, 0.4), decision))

    def on_change(engine: Engine, change: LayoutChange) -> None:
        # Checked against the engine's own bookings: nothing bound on the GPU, nothing in its ledger.
        assert engine.gpu_idle(change.uuid)
        for uid in engine.bound_uids:
            placement = engine.placement_of(uid)
            assert placement is not None
            assert not any(_gpu_of(u, change.uuid) for c in placement.containers for u in c.uuids)
        (ledger,) = [g for g in engine.ledger(change.node) if g.uuid == change.uuid]
        assert not ledger.pods and not ledger.slices
        changes.append(change)

    run = mig_replay(
        nodes=nodes,
        pods=pods,
        variant=variant,
        policy="fgd-align",
        seed=4,
        share=0.4,
        static_share=0.3,
        on_change=on_change,
        on_pod=on_pod,
    )
    assert run.placed == len(placed) > 0 and run.isolation_pods > 0
    on_slices = [iso for iso, p in placed if any(c.mig for c in p.containers)]
    assert all(on_slices), "only isolation pods take MIG slices"
    if variant == "fractions-only":
        assert on_slices == [] and run.isolation_on_slices == 0 and run.mig_gpus_end == 0
        assert run.isolation_placed > 0 and run.repartitions == 0 and changes == []
        return
    # Every isolation pod placed holds MIG slices, and only them.
    assert all(all(c.mig for c in p.containers) for iso, p in placed if iso)
    assert run.isolation_on_slices == run.isolation_placed > 0
    if variant == "static":
        assert run.static_mig_gpus > 0 and run.repartitions == 0 and changes == []
        assert run.mig_gpus_end == run.static_mig_gpus
    else:
        assert run.static_mig_gpus == 0 and run.to_mig > 0
        assert run.repartitions == len(changes) == run.to_mig + run.to_fractions
        assert {c.mode for c in changes} <= {GpuMode.MIG, GpuMode.FRACTIONS}


def test_simulate_prints_the_three_variants_side_by_side(tmp_path):
    nodes, pods = synthetic_trace(seed=11, nodes=8, pods=100)
    save_nodes(tmp_path / "nodes.csv", nodes)
    save_pods(tmp_path / "pods.csv", pods)
    args = ["simulate", "--trace", str(tmp_path / "pods.csv"), "--nodes", str(tmp_path / "nodes.csv")]
    args += ["--seeds", "1,2", "--scenario", "mig", "--mig-share", "0.5", "--workers", "1", "--no-plot"]
    result = CliRunner().invoke(app, [*args, "--json"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out["model"] == MIG_MODEL and out["gpu_mib"] == MIG_GPU_MIB and out["mig_share"] == 0.5
    assert list(out["means"]) == list(MIG_VARIANTS)
    assert [(r["variant"], r["seed"]) for r in out["runs"]] == [(v, s) for v in MIG_VARIANTS for s in (1, 2)]
    assert out["means"]["fractions-only"]["mig_gpus_end"] == 0
    table = CliRunner().invoke(app, args, env={"COLUMNS": "300"})
    assert table.exit_code == 0, table.output
    assert all(v in table.stdout for v in MIG_VARIANTS) and "alloc@130" in table.stdout
    assert f"{MIG_MODEL} ({MIG_GPU_MIB} MiB)" in table.stdout
    bad = CliRunner().invoke(app, [*args, "--mig-share", "2"])
    assert bad.exit_code == 2 and "--mig-share 2.0: a share must be between 0 and 1" in bad.output


def _timed(pods: list[TracePod]) -> list[TracePod]:
    """Each pod created a minute after the last and running for one to three hours."""
    return [replace(p, created=60 * i, deleted=60 * i + 3600 * (1 + i % 3)) for i, p in enumerate(pods)]


def test_with_departures_dynamic_layouts_turn_gpus_both_ways_and_count_per_hour():
    nodes, pods = synthetic_trace(seed=8, nodes=4, pods=120)
    runs = {
        v: mig_churn_replay(nodes=nodes, pods=_timed(pods), variant=v, policy="fgd-room", seed=3, share=0.5)
        for v in MIG_VARIANTS
    }
    dynamic, only = runs["dynamic"], runs["fractions-only"]
    # Idle MIG GPUs went back to fractions for fraction pods that waited, and MIG again later.
    assert dynamic.to_mig > 0 and dynamic.to_fractions > 0
    assert dynamic.repartitions_per_hour == pytest.approx(dynamic.repartitions / dynamic.hours, abs=0.001)
    assert dynamic.isolation_started > 0 and dynamic.isolation_unservable == 0
    assert only.repartitions == 0 and only.mig_gpus_end == 0 and only.isolation_started == only.isolation_pods
    # The static layout has no 7g.80gb: isolation pods above 49.6 % of a GPU are never replayed there.
    big = sum(isolated(p, 0.5) and p.gpu_milli * MIG_GPU_MIB // 1000 > 40448 for p in pods)
    assert big and runs["static"].isolation_unservable == big and runs["static"].repartitions == 0


def test_simulate_churn_prints_the_three_variants_per_hour(tmp_path):
    nodes, pods = synthetic_trace(seed=8, nodes=4, pods=60)
    save_nodes(tmp_path / "nodes.csv", nodes)
    rows = ["name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec,qos,creation_time,deletion_time"]
    rows += [
        f"{p.name},{p.cpu_milli},{p.memory_mib},{p.num_gpu},{p.gpu_milli},,{p.qos},{p.created},{p.deleted}"
        for p in _timed(pods)
    ]
    (tmp_path / "pods.csv").write_text("\n".join(rows) + "\n")
    args = ["simulate", "--trace", str(tmp_path / "pods.csv"), "--nodes", str(tmp_path / "nodes.csv")]
    args += ["--seeds", "1", "--scenario", "mig", "--churn", "--workers", "1", "--no-plot"]
    table = CliRunner().invoke(app, args, env={"COLUMNS": "300"})
    assert table.exit_code == 0, table.output
    assert all(v in table.stdout for v in MIG_VARIANTS) and "per hour" in table.stdout
    out = json.loads(CliRunner().invoke(app, [*args, "--json"]).stdout.strip().splitlines()[-1])
    assert [r["variant"] for r in out["runs"]] == list(MIG_VARIANTS)


def test_dynamic_layouts_fill_the_gpu_so_one_re_partition_serves_several_isolation_pods():
    nodes, pods = synthetic_trace(seed=5, nodes=20, pods=300)
    run = {
        fill: mig_replay(
            nodes=nodes, pods=pods, variant="dynamic", policy="fgd-align", seed=4, share=0.5, fill=fill
        )
        for fill in (False, True)
    }
    # Without the fill each re-partition lays out the one waiting pod's slice: one pod per change.
    assert run[False].isolation_on_slices == run[False].to_mig > 0
    # With it later isolation pods land on the free slices of GPUs laid out before.
    assert run[True].isolation_on_slices > run[True].to_mig > 0
    assert run[True].isolation_on_slices >= run[False].isolation_on_slices
    # With departures too: fewer changes for the same isolation pods, all of them started.
    timed = _timed(synthetic_trace(seed=8, nodes=4, pods=120)[1])
    churn = {
        fill: mig_churn_replay(
            nodes=synthetic_trace(seed=8, nodes=4, pods=120)[0],
            pods=timed,
            variant="dynamic",
            policy="fgd-room",
            seed=3,
            share=0.5,
            fill=fill,
        )
        for fill in (False, True)
    }
    assert churn[True].isolation_started == churn[False].isolation_started == churn[True].isolation_pods
    assert churn[True].to_mig < churn[False].to_mig
