"""``gpufrac simulate``: replay a GPU-sharing trace through the placement engine and report.

Examples::

    gpufrac simulate --trace default --policy fgd --seeds 42-51
    gpufrac simulate --trace gpushare60 --policy all --workers 2 --json
    gpufrac simulate --trace my_pods.csv --nodes my_nodes.csv --policy binpack,fgd-align
    gpufrac simulate --trace default --policy all --scenario mixed     # both compute modes
    gpufrac simulate --trace default --policy fgd-plus,kube-dra --scenario claims  # as DRA claims, vs stock
    gpufrac simulate --trace default --policy fgd --seeds 42 --churn   # departures, queues, reclaim
    gpufrac simulate --trace default --churn --consolidation --churn-cluster 0.01  # and moves
    gpufrac simulate --trace default --churn --churn-reclaim deserved,fair-share  # reclaim before/after #36
    gpufrac simulate --trace cpu2x --policy fgd,fgd-align --offline-bound   # a CPU-heavier variant
    gpufrac simulate --trace default --policy fgd-align --window 16    # bursts of 16 received pods
    gpufrac simulate --from-cluster --policy all --export snap/        # your own cluster (kubeconfig)
    gpufrac simulate --trace default --scenario mig --seeds 42-44      # MIG static/dynamic vs fractions
    gpufrac simulate --trace default --scenario mig --churn --churn-load 3 --churn-cluster 0.01  # per hour

Prints a table (or JSON with ``--json``) and writes a PNG of the allocation and fragmentation curves of
every policy run (``--plot``, default out/simulate-<trace>.png).

``--from-cluster`` replays a snapshot of a live cluster (its GPU nodes and GPU pods, read through a
kubeconfig) instead of a trace file. The simulator itself never talks to Kubernetes (it stays pure and
fast): the entry point (``gpufrac.cli``) hands it the snapshot source (``set_cluster_source``), which is
``kubectl gpufrac whatif``'s.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict
from functools import partial
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from gpufrac.placement.policies import DEFAULT_POLICY, POLICIES

from .churn import DESERVED_RULE, FAIR_SHARE_RULE, RECLAIM_RULES, ChurnResult, churn_replay
from .experiment import DEFAULT_POLICIES, parse_policies, parse_seeds, run_experiment
from .mig_churn import MigChurnRun, mig_churn_replay
from .mig_replay import MIG_VARIANTS, MigRun, run_mig
from .mig_workload import DEFAULT_MIG_SHARE, MIG_GPU_MIB, MIG_MODEL
from .openb import TraceUnavailable
from .replay import RunResult
from .report import as_json, plot, plot_churn, table
from .scenarios import SCENARIOS
from .trace import TraceNode, TracePod, export_snapshot, load_nodes, load_pods, resolve
from .variants import BASE, VARIANTS, variant

#: Reads a live cluster as a trace: (kubeconfig, context) -> (nodes, pods); set by the entry point.
ClusterSource = Callable[[Path | None, str | None], tuple[list[TraceNode], list[TracePod]]]
_cluster_source: ClusterSource | None = None


def set_cluster_source(source: ClusterSource) -> None:
    """Where ``--from-cluster`` reads the cluster from (the entry point wires kubectl's snapshot in)."""
    global _cluster_source
    _cluster_source = source


def simulate(
    trace: Annotated[
        str,
        typer.Option(
            help="Trace name (default, gpushare60, ...), a CPU-heavier variant of default "
            f"({', '.join(VARIANTS)}), or a pod CSV path."
        ),
    ] = "default",
    policy: Annotated[
        str,
        typer.Option(
            help=f"Policy ({', '.join(POLICIES)}), a comma list of them, or 'all' "
            f"({', '.join(DEFAULT_POLICIES)}); default: the scheduler's default, {DEFAULT_POLICY}."
        ),
    ] = DEFAULT_POLICY,
    seeds: Annotated[str, typer.Option(help="Seeds: 42-51, 42,43 or 42.")] = "42-51",
    nodes: Annotated[str | None, typer.Option(help="Node CSV (default: the openb GPU nodes).")] = None,
    data_dir: Annotated[
        Path | None,
        typer.Option(
            help="Where named traces live (default $GPUFRAC_DATA_DIR, else downloaded once into "
            "~/.cache/gpufrac/openb and checked; docs/placement.md)."
        ),
    ] = None,
    scenario: Annotated[str, typer.Option(help=f"Workload variant: {', '.join(SCENARIOS)}.")] = "plain",
    online: Annotated[
        bool, typer.Option(help="FGD learns typical pods online instead of from the trace (as in service).")
    ] = False,
    offline_bound: Annotated[
        bool,
        typer.Option(
            "--offline-bound",
            help="Add the offline reference per seed: the same workload known in advance, placed largest "
            "first with FGD. A reference to read the policies against, not a policy and not a ceiling "
            "(@130% only; docs/placement.md).",
        ),
    ] = False,
    window: Annotated[
        int,
        typer.Option(
            min=1,
            help="Pods handed to the scheduler at once: a burst of pods already received (never future "
            "ones). 1 is the published protocol.",
        ),
    ] = 1,
    workers: Annotated[int, typer.Option(help="Worker processes (replays are independent).")] = min(
        2, os.cpu_count() or 1
    ),
    json_output: Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")] = False,
    plot_path: Annotated[Path | None, typer.Option("--plot", help="PNG path for the curves.")] = None,
    no_plot: Annotated[bool, typer.Option("--no-plot", help="Do not write the PNG.")] = False,
    churn: Annotated[
        bool,
        typer.Option(
            "--churn",
            help="Replay arrivals and departures (creation/deletion times) with QoS classes as queues; "
            "report pending time and preemptions per queue with and without reclaim (first policy and seed).",
        ),
    ] = False,
    churn_load: Annotated[
        float, typer.Option(help="With --churn: arrivals this many times faster (durations unchanged).")
    ] = 1.0,
    churn_cluster: Annotated[
        float, typer.Option(help="With --churn: keep this fraction of the nodes (a seeded sample).")
    ] = 1.0,
    churn_reclaim: Annotated[
        str,
        typer.Option(
            help="With --churn: the runs, a comma list of off (no reclaim), deserved (reclaim against "
            "deserved quotas alone, before #36), fair-share (against fair shares, then deserved quotas) and "
            "fair-share+time (fair shares that are time-based: k 0.5, half-life 6 h of trace time, use "
            "above the deserved quota counted) and fair-share+time-all (the same counting all use, as KAI).",
        ),
    ] = f"off,{DESERVED_RULE},{FAIR_SHARE_RULE}",
    consolidation: Annotated[
        bool,
        typer.Option(
            "--consolidation",
            help="With --churn: also run with consolidation (moves of movable pods), reclaim off and on.",
        ),
    ] = False,
    churn_movable: Annotated[
        float,
        typer.Option(help="With --consolidation: the share of pods that are movable (seeded draw per pod)."),
    ] = 0.5,
    max_moves_per_minute: Annotated[
        int, typer.Option(min=1, help="With --consolidation: the bound on moves per minute of trace time.")
    ] = 4,
    mig_share: Annotated[
        float,
        typer.Option(
            help="With --scenario mig: the share of GPU-sharing pods that ask for hardware isolation (a MIG "
            "slice; a seeded draw per trace row).",
        ),
    ] = DEFAULT_MIG_SHARE,
    mig_static_share: Annotated[
        float | None,
        typer.Option(
            help="With --scenario mig: the share of GPU nodes the static variant partitions (all-balanced); "
            "default: the isolation pods' share of the requested GPU.",
        ),
    ] = None,
    from_cluster: Annotated[
        bool,
        typer.Option(
            "--from-cluster",
            help="Replay a snapshot of your cluster's GPU nodes and GPU pods instead of a trace.",
        ),
    ] = False,
    kubeconfig: Annotated[
        Path | None, typer.Option(help="With --from-cluster: kubeconfig (default: kubectl's rules).")
    ] = None,
    context: Annotated[str | None, typer.Option(help="With --from-cluster: kubeconfig context.")] = None,
    export: Annotated[
        Path | None,
        typer.Option(help="With --from-cluster: also write the snapshot as openb CSVs in this directory."),
    ] = None,
) -> None:
    """Replay a trace (the paper's protocol) through the placement engine; table, JSON and curves."""
    err = Console(stderr=True)
    try:
        policies = parse_policies(policy)
        seed_list = parse_seeds(seeds)
    except ValueError as error:
        err.print(f"gpufrac simulate: {error}")
        raise typer.Exit(code=2) from error
    if scenario not in SCENARIOS:
        err.print(f"gpufrac simulate: unknown scenario {scenario!r}; known: {', '.join(SCENARIOS)}")
        raise typer.Exit(code=2)
    rules = [r.strip() for r in churn_reclaim.split(",") if r.strip()]
    unknown = [r for r in rules if r not in ("off", *RECLAIM_RULES)]
    if unknown or not rules:
        err.print(
            f"gpufrac simulate: --churn-reclaim {churn_reclaim!r}: "
            f"a comma list of off, {', '.join(RECLAIM_RULES)}",
            soft_wrap=True,
            markup=False,
        )
        raise typer.Exit(code=2)
    if consolidation and not churn:
        err.print("gpufrac simulate: --consolidation goes with --churn")
        raise typer.Exit(code=2)
    if (kubeconfig or context or export) and not from_cluster:
        err.print("gpufrac simulate: --kubeconfig, --context and --export go with --from-cluster")
        raise typer.Exit(code=2)
    if from_cluster:
        if _cluster_source is None:
            err.print("gpufrac simulate: --from-cluster needs the gpufrac command (no cluster reader set)")
            raise typer.Exit(code=2)
        name = "cluster"
        node_list, pod_list = _cluster_source(kubeconfig, context)
        if export is not None:
            written = export_snapshot(export, node_list, pod_list)
            err.print(f"snapshot: {written[0]}, {written[1]}", markup=False)
    else:
        name, node_list, pod_list = _trace(trace, nodes, data_dir, err)
    if scenario == "mig":
        if offline_bound or window != 1 or consolidation:
            err.print(
                "gpufrac simulate: --scenario mig takes no --offline-bound, --window or --consolidation"
            )
            raise typer.Exit(code=2)
        if churn:
            _mig_churn(
                name,
                node_list,
                pod_list,
                policies[0],
                seed_list[0],
                share=mig_share,
                static_share=mig_static_share,
                load=churn_load,
                cluster=churn_cluster,
                workers=max(1, workers),
                json_output=json_output,
                err=err,
            )
            return
        _mig(
            name,
            node_list,
            pod_list,
            policies[0],
            seed_list,
            share=mig_share,
            static_share=mig_static_share,
            workers=max(1, workers),
            json_output=json_output,
            err=err,
        )
        return
    if churn:
        _churn(
            name,
            node_list,
            pod_list,
            policies[0],
            seed_list[0],
            json_output=json_output,
            err=err,
            load=churn_load,
            cluster=churn_cluster,
            consolidation=consolidation,
            rules=rules,
            movable_share=churn_movable,
            max_moves_per_minute=max_moves_per_minute,
            plot_path=None if no_plot else plot_path or Path("out") / f"churn-{name}.png",
        )
        return
    total = (len(policies) + offline_bound) * len(seed_list)
    with Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=err,
        transient=True,
    ) as progress:
        task = progress.add_task(f"replaying {name}", total=total)

        def advance(result: RunResult) -> None:
            progress.update(task, advance=1, description=f"{result.policy} seed {result.seed}")

        results = run_experiment(
            trace=name,
            nodes=node_list,
            pods=pod_list,
            policies=policies,
            seeds=seed_list,
            workers=max(1, workers),
            scenario=scenario,
            online=online,
            window=window,
            bound=offline_bound,
            progress=advance,
        )
    written = None
    if not no_plot:
        written = plot(name, results, plot_path or Path("out") / f"simulate-{name}.png")
    if json_output:
        out = as_json(name, scenario, results)
        out["plot"] = str(written) if written else None
        typer.echo(json.dumps(out))
    else:
        console = Console()
        console.print(table(name, results, scenario))
        if written:
            console.print(f"curves: {written}")


def _trace(
    trace: str, nodes: str | None, data_dir: Path | None, err: Console
) -> tuple[str, list[TraceNode], list[TracePod]]:
    """A named trace, a variant of default, or a pod CSV (with ``nodes``), loaded; exits 2 if missing."""
    try:
        pods_path, nodes_path = resolve(BASE if trace in VARIANTS else trace, nodes, data_dir)
    except TraceUnavailable as error:
        err.print(f"gpufrac simulate: {error}", soft_wrap=True, markup=False)
        raise typer.Exit(code=2) from error
    for path in (pods_path, nodes_path):
        if not path.is_file():
            err.print(f"gpufrac simulate: {path} not found (set --data-dir or GPUFRAC_DATA_DIR)")
            raise typer.Exit(code=2)
    pod_list = load_pods(pods_path)
    if trace in VARIANTS:
        pod_list = variant(trace, pod_list)
    return Path(trace).stem if pods_path == Path(trace) else trace, load_nodes(nodes_path), pod_list


def _churn(
    name: str,
    nodes: list[TraceNode],
    pods: list[TracePod],
    policy: str,
    seed: int,
    *,
    json_output: bool,
    err: Console,
    load: float,
    cluster: float,
    consolidation: bool,
    rules: list[str],
    movable_share: float,
    max_moves_per_minute: int,
    plot_path: Path | None,
) -> None:
    try:
        runs = [
            churn_replay(
                nodes=nodes,
                pods=pods,
                policy=policy,
                seed=seed,
                reclaim=rule != "off",
                reclaim_rule=FAIR_SHARE_RULE if rule == "off" else rule,
                load=load,
                cluster=cluster,
                consolidation=consolidate,
                movable_share=movable_share,
                max_moves_per_minute=max_moves_per_minute,
            )
            for consolidate in ((False, True) if consolidation else (False,))
            for rule in rules
        ]
    except ValueError as error:
        err.print(f"gpufrac simulate: {error}")
        raise typer.Exit(code=2) from error
    written = plot_churn(name, runs, plot_path) if plot_path is not None else None
    if json_output:
        out = {"trace": name, "seed": seed, "runs": [asdict(r) for r in runs], "plot": str(written or "")}
        typer.echo(json.dumps(out))
        return
    title = f"{name}: churn replay, {policy}, seed {seed}, {runs[0].nodes} nodes, load x{load} (pending s)"
    if consolidation:
        title += f", {movable_share:.0%} of pods movable, at most {max_moves_per_minute} moves/min"
    out = Table(title=title)
    columns = [
        "queue",
        "share",
        "pods",
        "reclaim",
        "started",
        "pending p50",
        "pending p99",
        "preempted",
        "held/fair p10 mean p90",
        "starved h",
    ]
    if consolidation:
        columns[4:4] = ["consolidation"]
        columns.append("moved")
    for column in columns:
        out.add_column(column)
    for run in runs:
        rows = [
            (
                q.queue,
                f"{q.deserved_share:.3f}",
                f"{q.pods} (+{q.unfit} fit no node)" if q.unfit else str(q.pods),
                q.started,
                q.pending_p50_s,
                q.pending_p99_s,
                q.preempted,
                q.moved,
                f"{q.fair_ratio_p10:.2f} {q.fair_ratio_mean:.2f} {q.fair_ratio_p90:.2f}",
                f"{q.starved_s / 3600:.1f}",
            )
            for q in run.queues
        ]
        rows.append(
            (
                "all",
                "",
                f"{run.pods} (+{run.unfit} fit no node)" if run.unfit else str(run.pods),
                run.started,
                run.pending_p50_s,
                run.pending_p99_s,
                run.preemptions,
                run.moves,
                f"Jain {run.jain_index:.3f}",
                "",
            )
        )
        for queue, share, count, started, p50, p99, preempted, moved, fair, starved in rows:
            cells = [
                queue,
                share,
                count,
                run.reclaim_rule or "off",
                str(started),
                f"{p50:.0f}",
                f"{p99:.0f}",
                str(preempted),
                fair,
                starved,
            ]
            if consolidation:
                cells[4:4] = ["on" if run.consolidation else "off"]
                cells.insert(9, str(moved))
            out.add_row(*cells)
    Console().print(out)
    Console().print(_reclaim_table(runs, consolidation))
    if written:
        Console().print(f"allocation over time: {written}")


def _reclaim_table(runs: list[ChurnResult], consolidation: bool) -> Table:
    """Per run: evictions per hour of trace time, the wasted ones, those below their queue's fair share,
    and Jain's index of held / fair share over queues (docs/benchmarks.md, "Reclaim before and after #36")."""
    out = Table(
        title="reclaim per run",
        caption="wasted: the pod they were evicted for did not start, or was evicted itself within 10 min; "
        "below share: their queue then held less than its fair share",
    )
    columns = ["reclaim", "hours", "evictions", "per hour", "wasted", "below share", "Jain"]
    if consolidation:
        columns[1:1] = ["consolidation"]
    for column in columns:
        out.add_column(column)
    for run in runs:
        cells = [
            run.reclaim_rule or "off",
            f"{run.hours:.1f}",
            str(run.preemptions),
            f"{run.evictions_per_hour:.3f}",
            str(run.wasted_evictions),
            str(run.below_share_evictions),
            f"{run.jain_index:.3f}",
        ]
        if consolidation:
            cells[1:1] = ["on" if run.consolidation else "off"]
        out.add_row(*cells)
    return out


def _mig(
    name: str,
    nodes: list[TraceNode],
    pods: list[TracePod],
    policy: str,
    seeds: list[int],
    *,
    share: float,
    static_share: float | None,
    workers: int,
    json_output: bool,
    err: Console,
) -> None:
    """``--scenario mig``: the three variants side by side, means over the seeds (docs/mig.md, "Measured")."""
    for key, value in (("--mig-share", share), ("--mig-static-share", static_share)):
        if value is not None and not 0 <= value <= 1:
            err.print(f"gpufrac simulate: {key} {value}: a share must be between 0 and 1")
            raise typer.Exit(code=2)
    with Progress(
        TextColumn("[bold]{task.description}"), MofNCompleteColumn(), console=err, transient=True
    ) as bar:
        task = bar.add_task(f"replaying {name} (mig)", total=len(MIG_VARIANTS) * len(seeds))
        runs = run_mig(
            nodes=nodes,
            pods=pods,
            policy=policy,
            seeds=seeds,
            share=share,
            static_share=static_share,
            workers=workers,
            progress=lambda r: bar.update(task, advance=1, description=f"{r.variant} seed {r.seed}"),
        )
    means = {v: _mig_means([r for r in runs if r.variant == v]) for v in MIG_VARIANTS}
    static = next(r for r in runs if r.variant == "static")
    if json_output:
        out = {
            "trace": name,
            "scenario": "mig",
            "policy": policy,
            "seeds": seeds,
            "model": MIG_MODEL,
            "gpu_mib": MIG_GPU_MIB,
            "mig_share": share,
            "static_mig_gpus": static.static_mig_gpus,
            "means": means,
            "runs": [r.summary() for r in runs],
        }
        typer.echo(json.dumps(out))
        return
    title = (
        f"{name}: MIG beside fractions, {policy}, seeds {','.join(map(str, seeds))}; every GPU node as "
        f"{MIG_MODEL} ({MIG_GPU_MIB} MiB), {share:.0%} of sharing pods isolated, static: "
        f"{static.static_mig_gpus} of {static.gpus} GPUs all-balanced (means over seeds)"
    )
    table = Table(
        title=title,
        caption="alloc: GPU asked by placed pods / capacity, at 100 % and 130 % arrival; re-partitions per "
        "1,000 submitted pods (the arrival replay has no trace time, so none per hour)",
    )
    columns = [
        "variant",
        "pods",
        "placed",
        "GPUs used",
        "MIG GPUs at end",
        "alloc@100",
        "alloc@130",
        "isolation placed",
        "isolation failed",
        "on MIG slices",
        "re-partitions (to MIG / back)",
        "per 1,000 pods",
    ]
    for column in columns:
        table.add_column(column)
    for kind, m in means.items():
        table.add_row(
            kind,
            f"{m['pods']:.0f}",
            f"{m['placed']:.0f}",
            f"{m['gpus_used']:.0f}",
            f"{m['mig_gpus_end']:.0f}",
            f"{m['alloc_100']:.2f}",
            f"{m['alloc_130']:.2f}",
            f"{m['isolation_placed']:.0f}",
            f"{m['isolation_failed']:.0f}",
            f"{m['isolation_on_slices']:.0f}",
            f"{m['repartitions']:.0f} ({m['to_mig']:.0f} / {m['to_fractions']:.0f})",
            f"{m['repartitions_per_1000_pods']:.1f}",
        )
    Console().print(table)


def _mig_means(runs: list[MigRun]) -> dict[str, float]:
    """Each numeric figure's mean over the runs (seeds) of one variant."""
    keys = [k for k, v in runs[0].summary().items() if isinstance(v, int | float) and k not in ("seed",)]
    return {k: round(sum(r.summary()[k] for r in runs) / len(runs), 2) for k in keys}


def _mig_churn(
    name: str,
    nodes: list[TraceNode],
    pods: list[TracePod],
    policy: str,
    seed: int,
    *,
    share: float,
    static_share: float | None,
    load: float,
    cluster: float,
    workers: int,
    json_output: bool,
    err: Console,
) -> None:
    """``--scenario mig --churn``: the three variants with departures; re-partitions per hour."""
    run = partial(
        mig_churn_replay,
        nodes=nodes,
        pods=pods,
        policy=policy,
        seed=seed,
        share=share,
        static_share=static_share,
        load=load,
        cluster=cluster,
    )
    try:
        if workers <= 1:
            runs: list[MigChurnRun] = [run(variant=v) for v in MIG_VARIANTS]
        else:
            with ProcessPoolExecutor(max_workers=workers) as pool:
                runs = list(pool.map(_churn_variant, [run] * len(MIG_VARIANTS), MIG_VARIANTS))
    except ValueError as error:
        err.print(f"gpufrac simulate: {error}", markup=False)
        raise typer.Exit(code=2) from error
    if json_output:
        out = {"trace": name, "scenario": "mig", "churn": True, "model": MIG_MODEL, "gpu_mib": MIG_GPU_MIB}
        out |= {"mig_share": share, "runs": [r.summary() for r in runs]}
        typer.echo(json.dumps(out))
        return
    first = runs[0]
    table = Table(
        title=f"{name}: MIG beside fractions with departures, {policy}, seed {seed}, {first.nodes} nodes as "
        f"{MIG_MODEL}, load x{load}, {share:.0%} of sharing pods isolated, static: {first.static_mig_gpus} "
        f"GPUs all-balanced, {first.hours:.0f} h of trace time",
        caption="unservable: isolation pods no slice of the variant can hold (not replayed); pending: "
        "start minus arrival, seconds",
    )
    columns = ["variant", "pods", "started", "isolation started", "unservable", "pending p50", "pending p99"]
    columns += ["re-partitions (to MIG / back)", "per hour", "MIG GPUs at end"]
    for column in columns:
        table.add_column(column)
    for r in runs:
        table.add_row(
            r.variant,
            str(r.pods),
            str(r.started),
            f"{r.isolation_started} of {r.isolation_pods}",
            str(r.isolation_unservable),
            f"{r.pending_p50_s:.0f}",
            f"{r.pending_p99_s:.0f}",
            f"{r.repartitions} ({r.to_mig} / {r.to_fractions})",
            f"{r.repartitions_per_hour:.3f}",
            str(r.mig_gpus_end),
        )
    Console().print(table)


def _churn_variant(run: Callable[..., MigChurnRun], variant: str) -> MigChurnRun:
    return run(variant=variant)
