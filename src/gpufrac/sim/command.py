"""``gpufrac simulate``: replay a GPU-sharing trace through the placement engine and report.

Examples::

    gpufrac simulate --trace default --policy fgd --seeds 42-51
    gpufrac simulate --trace gpushare60 --policy all --workers 2 --json
    gpufrac simulate --trace my_pods.csv --nodes my_nodes.csv --policy binpack,fgd-align
    gpufrac simulate --trace default --policy all --scenario mixed     # both compute modes
    gpufrac simulate --trace cpu2x --policy fgd,fgd-align --offline-bound   # a CPU-heavier variant
    gpufrac simulate --trace default --policy fgd-align --window 16    # bursts of 16 received pods

Prints a table (or JSON with ``--json``) and writes a PNG of the allocation and fragmentation curves of
every policy run (``--plot``, default out/simulate-<trace>.png).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from .experiment import parse_policies, parse_seeds, run_experiment
from .openb import TraceUnavailable
from .replay import RunResult
from .report import as_json, plot, table
from .scenarios import SCENARIOS
from .trace import load_nodes, load_pods, resolve
from .variants import BASE, VARIANTS, variant


def simulate(
    trace: Annotated[
        str,
        typer.Option(
            help="Trace name (default, gpushare60, ...), a CPU-heavier variant of default "
            f"({', '.join(VARIANTS)}), or a pod CSV path."
        ),
    ] = "default",
    policy: Annotated[str, typer.Option(help="Policy, comma list, or 'all'.")] = "fgd",
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
    try:
        pods_path, nodes_path = resolve(BASE if trace in VARIANTS else trace, nodes, data_dir)
    except TraceUnavailable as error:
        err.print(f"gpufrac simulate: {error}", soft_wrap=True, markup=False)
        raise typer.Exit(code=2) from error
    for path in (pods_path, nodes_path):
        if not path.is_file():
            err.print(f"gpufrac simulate: {path} not found (set --data-dir or GPUFRAC_DATA_DIR)")
            raise typer.Exit(code=2)
    name = Path(trace).stem if pods_path == Path(trace) else trace
    node_list, pod_list = load_nodes(nodes_path), load_pods(pods_path)
    if trace in VARIANTS:
        pod_list = variant(trace, pod_list)
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
