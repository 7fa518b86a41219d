"""``kubectl-gpufrac``: ``kubectl gpufrac nodes | explain POD | queues | top | report``, as kubectl does.

Flags as kubectl spells them: ``--kubeconfig``, ``--context``, ``-n/--namespace`` (default: the
context's namespace), ``-o/--output`` ``wide|json|yaml`` (default: a plain column table, upper-case
headers, as kubectl prints). Read-only: it lists and gets, never writes, except ``resize``, which writes
a resize request (``gpufrac.kubectl.resize``). Exit codes: 0 shown, 1 the API server said no (the message
names what), 2 bad usage.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

import httpx2
import typer
import yaml
from lightkube import ApiError, Client, KubeConfig
from lightkube.config import client_adapter
from lightkube.config.kubeconfig import SingleConfig
from lightkube.core.exceptions import ConfigError
from lightkube.resources.core_v1 import ConfigMap, Event, Namespace, Node, Pod
from lightkube.resources.resource_v1 import ResourceClaim
from lightkube.types import PatchType
from rich.console import Console
from rich.live import Live
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

from gpufrac.contract.keys import (
    LOCAL_NODE_AGENTS_CONFIGMAP,
    LOCAL_NODE_AGENTS_NAMESPACE,
    POD_MEMORY_ENFORCED_CONDITION,
)
from gpufrac.kubectl import report as report_figures
from gpufrac.kubectl import report_plot, report_sources, report_text, report_whatif
from gpufrac.kubectl import resize as resizing
from gpufrac.kubectl.snapshot import MILLI, ClusterTrace, cluster_trace
from gpufrac.kubectl.view import (
    UNKNOWN,
    Explanation,
    GpuRow,
    NodeEnforcement,
    QueueRow,
    explain,
    gpu_rows,
    node_enforcement,
    queue_rows,
    queue_share,
)
from gpufrac.node.top import AgentView, parse_agent, render
from gpufrac.node.top import scrape as top_scrape
from gpufrac.node.top import top as top_by_address
from gpufrac.operator.render import APP_NAME, METRICS_PORT_NAME
from gpufrac.placement.queue_access import parse_duration
from gpufrac.scheduler.queues import CRD_NAME as QUEUE_CRD_NAME
from gpufrac.scheduler.queues import GpufracQueue
from gpufrac.sim.experiment import by_policy, mean, parse_policies, parse_seeds, run_experiment
from gpufrac.sim.replay import RunResult
from gpufrac.sim.report import as_json, table
from gpufrac.sim.trace import export_snapshot

OUTPUTS = ("table", "wide", "json", "yaml")

app = typer.Typer(
    name="kubectl-gpufrac",
    help="GPU fractions from kubectl: `kubectl gpufrac nodes | explain POD | queues | top | report`.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


class _Globals:
    kubeconfig: Path | None = None
    context: str | None = None
    namespace: str | None = None


_globals = _Globals()


# kubectl accepts its global flags before or after the subcommand; so does the plugin (the callback takes
# them first, a subcommand's own copy overrides).
KUBECONFIG = typer.Option(None, "--kubeconfig", help="Path to the kubeconfig file to use.")
CONTEXT = typer.Option(None, "--context", help="The kubeconfig context to use.")
NAMESPACE = typer.Option(None, "-n", "--namespace", help="Namespace (default: the context's).")
OUTPUT = typer.Option("table", "-o", "--output", help="wide, json or yaml.")


def _set(kubeconfig: Path | None, context: str | None, namespace: str | None) -> None:
    _globals.kubeconfig = kubeconfig or _globals.kubeconfig
    _globals.context = context or _globals.context
    _globals.namespace = namespace or _globals.namespace


@app.callback()
def _root(
    kubeconfig: Path | None = KUBECONFIG, context: str | None = CONTEXT, namespace: str | None = NAMESPACE
) -> None:
    _set(kubeconfig, context, namespace)


def _config() -> SingleConfig:
    """kubectl's order: --kubeconfig, else $KUBECONFIG / ~/.kube/config / in-cluster; --context picks one."""
    try:
        base = KubeConfig.from_file(_globals.kubeconfig) if _globals.kubeconfig else KubeConfig.from_env()
        return base.get(context_name=_globals.context)
    except (ConfigError, OSError, KeyError, ValueError) as error:
        _fail(f"kubeconfig: {error}", code=2)


def _client() -> Client:
    return Client(config=_config(), field_manager="kubectl-gpufrac")


def _fail(message: str, *, code: int = 1) -> NoReturn:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code=code)


def _check_output(output: str) -> str:
    if output not in OUTPUTS:
        _fail(
            f"--output {output!r}: allowed formats are {', '.join(o for o in OUTPUTS if o != 'table')}",
            code=2,
        )
    return output


def _print_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    cells = [list(headers), *[[str(c) for c in r] for r in rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    for row in cells:
        typer.echo("   ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())


def _dump(data: Any, output: str) -> None:
    if output == "json":
        typer.echo(json.dumps(data, indent=2))
    else:
        typer.echo(yaml.safe_dump(data, sort_keys=False).rstrip())


def _api(call):
    """``call()``'s result, or exit 1 with what the API server said (or why it could not be reached)."""
    try:
        return call()
    except ApiError as error:
        _fail(f"{error.status.reason}: {error.status.message}")
    except httpx2.HTTPError as error:
        _fail(f"cannot reach the API server: {type(error).__name__}: {error}")


@app.command("nodes")
def nodes(
    output: str = OUTPUT,
    kubeconfig: Path | None = KUBECONFIG,
    context: str | None = CONTEXT,
    namespace: str | None = NAMESPACE,
) -> None:
    """Per GPU: model, usable/guaranteed/free MiB, mode, tenants, limits verified, health (all namespaces);
    then per node: fractions whose GPU memory limit the node agent verified, of those running."""
    _set(kubeconfig, context, namespace)
    _check_output(output)
    client = _client()
    node_list = _api(lambda: list(client.list(Node)))
    pods = _api(lambda: list(client.list(Pod, namespace="*")))
    rows, warnings = gpu_rows(node_list, pods, _claims(client))
    for warning in warnings:
        typer.echo(f"warning: {warning}", err=True)
    per_node = node_enforcement(rows)
    if output in ("json", "yaml"):
        _dump(
            {
                "kind": "GpuList",
                "items": [r.as_dict() for r in rows],
                "nodes": [n.as_dict() for n in per_node],
            },
            output,
        )
        return
    if not rows:
        typer.echo("No GPUs published (no node has a gpufrac.io/gpus annotation).", err=True)
        return
    _print_table(*_gpu_table(rows, wide=output == "wide"))
    typer.echo("")
    _print_table(*_node_table(per_node))


def _gpu_table(rows: list[GpuRow], *, wide: bool) -> tuple[list[str], list[list[Any]]]:
    headers = [
        "NODE",
        "GPU",
        "MODEL",
        "USABLE(MiB)",
        "GUARANTEED(MiB)",
        "FREE(MiB)",
        "MODE",
        "TENANTS",
        "ENFORCED",
        "HEALTH",
    ]
    if wide:
        headers[7:7] = ["LIMITS(MiB)"]
        headers.append("UUID")
    table = []
    for r in rows:
        tenants = (
            ",".join(f"{t.name}({t.request_mib})" for t in r.tenants)
            if wide
            else ",".join(t.pod for t in r.tenants)
        )
        row: list[Any] = [r.node, r.index, r.model or "-", r.usable_mib, r.guaranteed_mib, r.free_mib, r.mode]
        row += [r.limit_mib] if wide else []
        row += [tenants or "<none>", r.enforced, r.health]
        row += [r.uuid] if wide else []
        table.append(row)
    return headers, table


def _node_table(nodes: list[NodeEnforcement]) -> tuple[list[str], list[list[Any]]]:
    headers = ["NODE", "FRACTIONS", "LIMIT-VERIFIED", "UNVERIFIED"]
    rows = [[n.node, len(n.fractions), n.verified, ",".join(n.unverified) or "<none>"] for n in nodes]
    return headers, rows


@app.command("explain")
def explain_pod(
    pod: str = typer.Argument(..., help="The pod's name (its namespace: -n, else the context's)."),
    output: str = OUTPUT,
    kubeconfig: Path | None = KUBECONFIG,
    context: str | None = CONTEXT,
    namespace: str | None = NAMESPACE,
    default_queue: str = typer.Option(
        "default",
        "--default-queue",
        help="The scheduler's default_queue: the queue of a pod that names none, in a namespace without one.",
    ),
) -> None:
    """Where the pod went and why, or why it is pending: PodScheduled and the scheduler's Events; for a
    placed fractional pod, whether each container's GPU memory limit is in force (GpuMemoryEnforced); the
    pod's queue, how it got there and that queue's share (deserved, fair share, allocated)."""
    _set(kubeconfig, context, namespace)
    _check_output(output)
    client = _client()
    namespace = _globals.namespace or client.namespace
    found = _api(lambda: client.get(Pod, pod, namespace=namespace))
    node = None
    if found.spec and found.spec.nodeName:
        node = _api(lambda: client.get(Node, found.spec.nodeName))
    events = _api(
        lambda: list(
            client.list(
                Event,
                namespace=namespace,
                fields={"involvedObject.name": pod, "involvedObject.kind": "Pod"},
            )
        )
    )
    uid = found.metadata.uid
    events = [e for e in events if not e.involvedObject.uid or e.involvedObject.uid == uid]
    rows = None
    if node is None:  # waiting: what the cluster's GPUs have free says what would make it fit
        rows, _ = gpu_rows(
            _api(lambda: list(client.list(Node))), _api(lambda: list(client.list(Pod, namespace="*")))
        )
    claims = []
    if found.spec and found.spec.resourceClaims:  # DRA: the claims reserved for this pod
        claims = [
            c
            for c in _claims(client)
            if any(r.uid == uid for r in (c.status.reservedFor if c.status else None) or [])
        ]
    notes: list[str] = []
    namespace_labels = _namespace_labels(client, namespace)
    share = queue_share(
        found,
        queues=_queue_objects(client, notes),
        namespace_labels=namespace_labels,
        default_queue=default_queue,
        notes=notes,
    )
    result = explain(found, node=node, events=events, rows=rows, claims=claims, queue=share)
    if output in ("json", "yaml"):
        _dump(result.as_dict(), output)
        return
    _print_explanation(result, wide=output == "wide")


def _namespace_labels(client: Client, namespace: str) -> dict[str, str] | None:
    """The Namespace's labels (its default queue); None where they cannot be read (a tenant may not get
    Namespaces): ``queue_share`` says so when it matters."""
    try:
        got = client.get(Namespace, namespace)
    except ApiError as error:
        if error.status.code in (403, 404):
            return None
        _fail(f"{error.status.reason}: {error.status.message}")
    except httpx2.HTTPError as error:
        _fail(f"cannot reach the API server: {type(error).__name__}: {error}")
    return dict(got.metadata.labels or {})


def _queue_objects(client: Client, notes: list[str]) -> list[Any]:
    """Every ``Queue`` object; none, with a note, where the CRD is not installed or they may not be read."""
    try:
        return list(client.list(GpufracQueue))
    except ApiError as error:
        if error.status.code == 404:
            notes.append(f"the Queue resource is not installed (CRD {QUEUE_CRD_NAME})")
            return []
        if error.status.code == 403:
            notes.append(f"Queues could not be read: {error.status.message}")
            return []
        _fail(f"{error.status.reason}: {error.status.message}")
    except httpx2.HTTPStatusError as error:  # lightkube's list may raise the HTTP error itself
        if error.response.status_code in (403, 404):
            notes.append(f"Queues could not be read: the API server answered {error.response.status_code}")
            return []
        _fail(f"the API server answered {error.response.status_code}: {error}")
    except httpx2.HTTPError as error:
        _fail(f"cannot reach the API server: {type(error).__name__}: {error}")


def _print_explanation(e: Explanation, *, wide: bool) -> None:
    typer.echo(f"Pod:        {e.namespace}/{e.pod}")
    typer.echo(f"Scheduler:  {e.scheduler}")
    typer.echo(f"Phase:      {e.phase}")
    if e.request:
        typer.echo(f"GPU:        {e.request}")
    for label, text in e.queue.lines() if e.queue is not None else ():
        typer.echo(f"{label:<12}{text}")
    if e.node:
        typer.echo(f"Node:       {e.node}")
        if e.gpus:
            typer.echo("GPUs:")
            headers = ["CONTAINER", "GPU", "MODE", "REQUEST(MiB)", "LIMIT(MiB)"] + (["UUID"] if wide else [])
            rows = [
                [g["container"], g["gpu"], g["mode"], g["requestMiB"], g["limitMiB"]]
                + ([g["uuid"]] if wide else [])
                for g in e.gpus
            ]
            _print_table(headers, rows)
    else:
        typer.echo("Node:       <none> (not scheduled)")
    if e.scheduled is not None:
        s = e.scheduled
        typer.echo(f"PodScheduled: {s['status']} ({s['reason'] or '-'}): {s['message'] or ''}".rstrip(": "))
    if e.enforced is not None:
        m = e.enforced
        since = f" since {m.since}" if m.since else ""
        typer.echo(f"{POD_MEMORY_ENFORCED_CONDITION}: {m.status or UNKNOWN} ({m.reason or '-'}){since}")
        _print_table(
            ["CONTAINER", "ENFORCED", "REASON", "MESSAGE"],
            [[c.container, c.status, c.reason or "-", c.message] for c in m.containers],
        )
    if e.resize is not None:
        asked = ", ".join(f"{k}={v}" for k, v in e.resize.requested.items())
        typer.echo(f"Resize:     {asked or 'no request on the pod'}")
        for c in (e.resize.pending, e.resize.in_progress):
            if c is not None:
                since = f" since {c['since']}" if c["since"] else ""
                typer.echo(f"{c['type']}: {c['status']} ({c['reason'] or '-'}){since}: {c['message'] or ''}")
    for hint in e.fit:
        typer.echo(f"Fit now:    {hint}")
    typer.echo("Events:" if e.events else "Events:     <none>")
    if e.events:
        _print_table(
            ["TIME", "TYPE", "REASON", "COUNT", "MESSAGE"],
            [[v["time"], v["type"], v["reason"], v["count"], v["message"]] for v in e.events],
        )


@app.command("queues")
def queues(
    output: str = OUTPUT,
    kubeconfig: Path | None = KUBECONFIG,
    context: str | None = CONTEXT,
    namespace: str | None = NAMESPACE,
) -> None:
    """Queues as a tree: GPU memory allocated, fair share, deserved and limit; whole GPUs (docs/queues.md)."""
    _set(kubeconfig, context, namespace)
    _check_output(output)
    client = _client()
    try:
        found = list(client.list(GpufracQueue))
    except ApiError as error:
        if error.status.code == 404:
            _fail(
                f"the Queue resource is not installed (CRD {QUEUE_CRD_NAME}; the gpufrac chart installs it)"
            )
        _fail(f"{error.status.reason}: {error.status.message}")
    except httpx2.HTTPStatusError as error:  # lightkube's list may raise the HTTP error itself
        if error.response.status_code == 404:
            _fail(
                f"the Queue resource is not installed (CRD {QUEUE_CRD_NAME}; the gpufrac chart installs it)"
            )
        _fail(f"the API server answered {error.response.status_code}: {error}")
    except httpx2.HTTPError as error:
        _fail(f"cannot reach the API server: {type(error).__name__}: {error}")
    rows = queue_rows(found)
    if output in ("json", "yaml"):
        _dump({"kind": "QueueList", "items": [r.as_dict() for r in rows]}, output)
        return
    if not rows:
        typer.echo(
            "No queues (kubectl get queues.gpufrac.io); pods use the scheduler's configured ones.", err=True
        )
        return
    _print_table(*_queue_table(rows, wide=output == "wide"))


def _queue_table(rows: list[QueueRow], *, wide: bool) -> tuple[list[str], list[list[Any]]]:
    def shown(value: Any) -> str:
        return "-" if value is None else str(value)

    headers = [
        "QUEUE",
        "ALLOCATED(MiB)",
        "FAIR-SHARE(MiB)",
        "DESERVED(MiB)",
        "LIMIT(MiB)",
        "GPUS",
        "GPU-FAIR-SHARE",
    ]
    if wide:
        headers += [
            "REQUESTED(MiB)",
            "WEIGHT",
            "GPU-DESERVED",
            "GPU-LIMIT",
            "GPU-WEIGHT",
            "USED-SHARE",
            "DISPLAY-NAME",
        ]
    table = []
    for r in rows:
        row = [
            "  " * r.depth + r.name,
            shown(r.amount("allocated", "gpuMemory")),
            shown(r.amount("fairShare", "gpuMemory")),
            shown(r.term("gpuMemory", "deserved")),
            shown(r.term("gpuMemory", "limit")),
            shown(r.amount("allocated", "gpus")),
            shown(r.amount("fairShare", "gpus")),
        ]
        if wide:
            row += [
                shown(r.amount("requested", "gpuMemory")),
                shown(r.term("gpuMemory", "overQuotaWeight")),
                shown(r.term("gpus", "deserved")),
                shown(r.term("gpus", "limit")),
                shown(r.term("gpus", "overQuotaWeight")),
                shown(r.amount("historicalUsage", "gpuMemory")),
                shown(r.display_name),
            ]
        table.append(row)
    return headers, table


@app.command("top")
def top(
    addresses: list[str] | None = typer.Argument(
        None, help="Agents' host:port or metrics URLs; default: every node agent pod, via the API server."
    ),
    once: bool = typer.Option(False, "--once", help="Print one snapshot and exit."),
    interval: float = typer.Option(2.0, "--interval", min=0.2, help="Seconds between refreshes."),
    kubeconfig: Path | None = KUBECONFIG,
    context: str | None = CONTEXT,
    namespace: str | None = NAMESPACE,
) -> None:
    """Per node and GPU: the fractions with request, limit, used memory and SM%, live (`gpufrac top`).

    Without addresses, the node agents are the pods labelled app.kubernetes.io/name=gpufrac-node-agent
    (-n narrows the namespace), read through the API server's pod proxy on their "metrics" port, so it
    works from wherever kubectl does.
    """
    if addresses:
        top_by_address(urls=addresses, once=once, interval=interval)
        return
    _set(kubeconfig, context, namespace)
    config = _config()
    client = Client(config=config, field_manager="kubectl-gpufrac")
    agents = _agent_endpoints(client)
    if not agents:
        local = _local_agents(client)
        if local:  # `gpufrac up`: the agents are local processes, named in a ConfigMap
            top_by_address(urls=local, once=once, interval=interval)
            return
        _fail(
            f"no running node agent pods (label app.kubernetes.io/name={APP_NAME}) and no `gpufrac up` "
            f"agents (ConfigMap {LOCAL_NODE_AGENTS_NAMESPACE}/{LOCAL_NODE_AGENTS_CONFIGMAP}) to read; "
            "give the agents' host:port as arguments"
        )
    with client_adapter.Client(config, client_adapter.ConnectionParams()) as http:

        def snapshot() -> list[AgentView]:
            return [_scrape_through_proxy(http, path) for path in agents]

        if once:
            views = snapshot()
            Console(width=200).print(render(views))
            if all(v.error is not None for v in views):
                raise typer.Exit(code=1)
            return
        with Live(render(snapshot()), refresh_per_second=4, screen=False) as live:
            try:
                while True:
                    time.sleep(interval)
                    live.update(render(snapshot()))
            except KeyboardInterrupt:
                pass


def cluster_snapshot(
    *, kubeconfig: Path | None = None, context: str | None = None, export: Path | None = None
) -> ClusterTrace:
    """The cluster's GPU nodes and GPU pods as a trace (kubectl's kubeconfig rules), with what was left
    out said on stderr; ``export``: also write it as openb CSVs there. Exits 1 when there is nothing to
    replay. ``kubectl gpufrac whatif`` and ``gpufrac simulate --from-cluster`` both start here."""
    _set(kubeconfig, context, None)
    client = _client()
    trace = cluster_trace(
        _api(lambda: list(client.list(Node))), _api(lambda: list(client.list(Pod, namespace="*")))
    )
    for note in trace.left_out:
        typer.echo(f"warning: left out of the snapshot: {note}", err=True)
    if not trace.nodes or not trace.pods:
        _fail("nothing to replay: the cluster has no published GPU nodes or no GPU pods")
    if export is not None:
        written = export_snapshot(export, trace.nodes, trace.pods)
        typer.echo(f"snapshot: {written[0]}, {written[1]}", err=True)
    return trace


@app.command("whatif")
def whatif(
    policy: str = typer.Option("all", "--policy", help="Policy, comma list, or 'all' (as gpufrac simulate)."),
    seeds: str = typer.Option("42-46", "--seeds", help="Seeds: 42-46, 42,43 or 42."),
    workers: int = typer.Option(1, "--workers", min=1, help="Worker processes for the replays."),
    export: Path | None = typer.Option(None, "--export", help="Also write the snapshot as openb CSVs here."),
    output: str = OUTPUT,
    kubeconfig: Path | None = KUBECONFIG,
    context: str | None = CONTEXT,
) -> None:
    """Replay this cluster's GPU pods on its GPU nodes under each policy: what fits beyond today's placement.

    The snapshot (GPU nodes, GPU pods, bound or waiting) is replayed with the simulator's published
    protocol: the pods drawn until 130% of GPU capacity is offered, one seed per run.
    """
    _check_output(output)
    try:
        policies, seed_list = parse_policies(policy), parse_seeds(seeds)
    except ValueError as error:
        _fail(str(error), code=2)
    trace = cluster_snapshot(kubeconfig=kubeconfig, context=context, export=export)
    err = Console(stderr=True)
    with Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), console=err, transient=True
    ) as bar:
        task = bar.add_task("replaying the cluster", total=len(policies) * len(seed_list))

        def advance(result: RunResult) -> None:
            bar.update(task, advance=1, description=f"{result.policy} seed {result.seed}")

        results = run_experiment(
            trace="cluster",
            nodes=trace.nodes,
            pods=trace.pods,
            policies=policies,
            seeds=seed_list,
            workers=workers,
            progress=advance,
        )
    comparison = _against_today(trace, results)
    if output in ("json", "yaml"):
        _dump({**as_json("cluster", "plain", results), "today": comparison}, output)
        return
    Console(width=200).print(table("cluster", results))
    typer.echo(
        f"today: {comparison['allocatedGpus']:.2f} of {comparison['gpus']} GPUs' worth guaranteed "
        f"({comparison['allocatedPercent']:.1f}%)"
    )
    for row in comparison["policies"]:
        typer.echo(
            f"{row['policy']}: {row['gpusPlaced']:.2f} GPUs' worth of the same pods fit "
            f"({row['moreThanToday']:+.2f} than today)"
        )


def _placed_share(run: RunResult) -> float:
    """Percent of GPU capacity allocated once the whole 130% has been offered (no deletions: the maximum).

    Read from the curve, not ``alloc_130``: on a cluster of a few GPUs no arrival rounds to exactly 130%.
    """
    return max((v for v in run.curve if not math.isnan(v)), default=0.0)


def _against_today(trace: ClusterTrace, results: list[RunResult]) -> dict[str, Any]:
    """Today's guaranteed GPUs' worth against each policy's, the same pod mix offered up to 130%."""
    gpus = trace.capacity_milli // MILLI
    today = trace.allocated_milli / MILLI
    rows = []
    for policy, runs in by_policy(results).items():
        placed = mean([_placed_share(r) for r in runs]) / 100 * gpus
        rows.append(
            {"policy": policy, "gpusPlaced": round(placed, 2), "moreThanToday": round(placed - today, 2)}
        )
    return {
        "gpus": gpus,
        "allocatedGpus": round(today, 2),
        "allocatedPercent": round(100 * today / gpus, 2) if gpus else 0.0,
        "policies": rows,
    }


def _agent_endpoints(client: Client) -> list[str]:
    """The API server's proxy path to each running agent pod's metrics port."""
    paths = []
    pods = _api(
        lambda: list(
            client.list(Pod, namespace=_globals.namespace or "*", labels={"app.kubernetes.io/name": APP_NAME})
        )
    )
    for pod in pods:
        if not pod.status or pod.status.phase != "Running" or not pod.status.podIP:
            continue
        ports = [p for c in pod.spec.containers for p in c.ports or [] if p.name == METRICS_PORT_NAME]
        if ports:
            ns, name = pod.metadata.namespace, pod.metadata.name
            paths.append(f"/api/v1/namespaces/{ns}/pods/{name}:{ports[0].containerPort}/proxy/metrics")
    return sorted(paths)


def _claims(client: Client) -> list[ResourceClaim]:
    """Every ResourceClaim (DRA shares of our driver are GPU tenants too); none where the API server does
    not serve resource.k8s.io/v1 or the user may not list them."""
    try:
        return list(client.list(ResourceClaim, namespace="*"))
    except ApiError as error:
        if error.status.code in (403, 404):
            return []
        _fail(f"{error.status.reason}: {error.status.message}")
    except httpx2.HTTPError as error:
        _fail(f"cannot reach the API server: {type(error).__name__}: {error}")


def _local_agents(client: Client) -> list[str]:
    """The metrics URLs of ``gpufrac up``'s node agents (local processes), or none outside it."""
    try:
        config_map = client.get(ConfigMap, LOCAL_NODE_AGENTS_CONFIGMAP, namespace=LOCAL_NODE_AGENTS_NAMESPACE)
    except ApiError as error:
        if error.status.code in (403, 404):
            return []
        _fail(f"the API server answered {error.status.code}: {error.status.message}")
    return [url for _, url in sorted((config_map.data or {}).items())]


def _scrape_through_proxy(http: httpx2.Client, path: str) -> AgentView:
    try:
        response = http.get(path)
        response.raise_for_status()
        return parse_agent(url=path, text=response.text)
    except (httpx2.HTTPError, ValueError) as error:
        return AgentView(
            url=path, node=path.split("/")[6].split(":")[0], error=f"{type(error).__name__}: {error}"
        )


@app.command("report")
def report(
    since: str = typer.Option("24h", "--since", help="The window, a Go duration (24h, 90m, 168h)."),
    prometheus: str | None = typer.Option(
        None, "--prometheus", help="Prometheus URL; without it, one live snapshot of the node agents."
    ),
    step: str | None = typer.Option(None, "--step", help="Range-query step (default: the window / 1440)."),
    gpu_hour_price: float | None = typer.Option(
        None, "--gpu-hour-price", min=0, help="Price of one GPU-hour: the cost section shows money."
    ),
    plot: Path | None = typer.Option(None, "--plot", help="Also draw the report as a PNG here."),
    default_queue: str = typer.Option("default", "--default-queue", help="The scheduler's default_queue."),
    what_if_whole_gpu: bool = typer.Option(
        False, "--what-if-whole-gpu", help="Also place the window's pods again with whole GPUs, per policy."
    ),
    policy: str = typer.Option("binpack,spread,kai,fgd", "--policy", help="Policies of --what-if-whole-gpu."),
    output: str = OUTPUT,
    kubeconfig: Path | None = KUBECONFIG,
    context: str | None = CONTEXT,
) -> None:
    """Density, memory, interference and cost of the GPU fractions over a window (docs/kubectl.md)."""
    _set(kubeconfig, context, None)
    _check_output(output)
    try:
        window_s = parse_duration(since, where="--since")
        step_s = parse_duration(step, where="--step") if step else report_sources.step_for(window_s)
        policies = parse_policies(policy)
    except ValueError as error:
        _fail(str(error), code=2)
    notes: list[str] = []
    config = None if prometheus else _config()
    client = Client(config=config, field_manager="kubectl-gpufrac") if config else _optional_client(notes)
    if what_if_whole_gpu and client is None:
        _fail(
            "--what-if-whole-gpu places the pods on the cluster's GPU nodes: it needs the API server", code=2
        )
    if prometheus:
        end = time.time()
        try:
            found = report_sources.query_range(prometheus, start=end - window_s, end=end, step_s=step_s)
        except report_sources.PrometheusError as error:
            _fail(f"prometheus: {error}")
        history, said = report_sources.history_from_matrices(found, step_s=step_s)
        source = f"prometheus {prometheus}, last {since} every {step_s:g}s"
    else:
        views = _agent_snapshot(client, config)
        history, said = report_sources.history_from_agents(views, at=time.time())
        source = "snapshot: the node agents now (no --prometheus); GPU-hours are per hour at today's bookings"
    queues = _report_queues(client, default_queue, notes) if client is not None else {}
    what_if = _what_if(client, history, policies, notes) if what_if_whole_gpu else None
    result = report_figures.build(
        history, source=source, queues=queues, gpu_hour_price=gpu_hour_price, notes=[*said, *notes]
    )
    if plot is not None:
        report_plot.write(result, plot)
        typer.echo(f"plot: {plot}", err=True)
    if output in ("json", "yaml"):
        data = result.as_dict()
        if what_if is not None:
            data["whatIfWholeGpu"] = [r.as_dict() for r in what_if]
        _dump(data, output)
        return
    for line in report_text.header(result):
        typer.echo(line)
    sections = report_text.sections(result)
    if what_if is not None:
        sections.append(report_text.what_if_section(what_if))
    for section in sections:
        typer.echo(f"\n{section.title}:")
        if section.rows:
            _print_table(section.headers, section.rows)
        else:
            typer.echo("  <none>")
    for note in result.notes:
        typer.echo(f"\nnote: {note}")


def _what_if(
    client: Client, history: report_figures.History, policies: list[str], notes: list[str]
) -> list[report_whatif.WhatIfRow]:
    """The window's pods placed again on the cluster's GPU nodes, as booked and with whole GPUs."""
    nodes = cluster_trace(_api(lambda: list(client.list(Node))), []).nodes
    pods, left_out = report_whatif.window_pods(history)
    notes.append(report_whatif.UNSAID)
    notes.extend(f"what-if: left out {pod}" for pod in left_out)
    return report_whatif.what_if(nodes=nodes, pods=pods, policies=policies)


def _optional_client(notes: list[str]) -> Client | None:
    """The API server's client, or None with a note (the report then names no queues)."""
    try:
        base = KubeConfig.from_file(_globals.kubeconfig) if _globals.kubeconfig else KubeConfig.from_env()
        return Client(config=base.get(context_name=_globals.context), field_manager="kubectl-gpufrac")
    except (ConfigError, OSError, KeyError, ValueError) as error:
        notes.append(f"queues unknown: no API server to ask ({error})")
        return None


def _agent_snapshot(client: Client, config: SingleConfig) -> list[AgentView]:
    """What `top --once` reads: every node agent's metrics, through the API server or `gpufrac up`'s list."""
    agents = _agent_endpoints(client)
    if not agents:
        local = _local_agents(client)
        if not local:
            _fail("no node agents to read (as for `kubectl gpufrac top`); give --prometheus URL")
        return top_scrape(local)
    with client_adapter.Client(config, client_adapter.ConnectionParams()) as http:
        return [_scrape_through_proxy(http, path) for path in agents]


def _report_queues(client: Client, default_queue: str, notes: list[str]) -> dict[tuple[str, str], str]:
    try:
        pods = list(client.list(Pod, namespace="*"))
    except (ApiError, httpx2.HTTPError) as error:
        notes.append(f"queues unknown: pods could not be listed ({error})")
        return {}
    labels: dict[str, dict[str, str]] = {}
    try:
        labels = {n.metadata.name: dict(n.metadata.labels or {}) for n in client.list(Namespace)}
    except (ApiError, httpx2.HTTPError):
        notes.append("namespaces could not be read: their default queues are not applied")
    return report_sources.pod_queues(pods, namespace_labels=labels, fallback=default_queue)


@app.command("resize")
def resize(
    pod: str = typer.Argument(..., help="The pod's name (its namespace: -n, else the context's)."),
    container: str | None = typer.Option(None, "-c", "--container", help="Default: the pod's only fraction."),
    memory_request: str | None = typer.Option(None, "--memory-request", help="New request (8Gi)."),
    memory_limit: str | None = typer.Option(None, "--memory-limit", help="New limit (12Gi)."),
    fraction: str | None = typer.Option(None, "--fraction", help="New request, a portion of its GPU."),
    fraction_limit: str | None = typer.Option(None, "--fraction-limit", help="New limit, a portion."),
    compute: str | None = typer.Option(
        None, "--compute", help="New compute share of an sm-sharing container, in (0, 1]."
    ),
    wait: bool = typer.Option(True, "--wait/--no-wait", help="Wait for the scheduler's answer."),
    timeout: float = typer.Option(60.0, "--timeout", help="Seconds to wait for it."),
    kubeconfig: Path | None = KUBECONFIG,
    context: str | None = CONTEXT,
    namespace: str | None = NAMESPACE,
) -> None:
    """Resize a running fraction: write its resize request, then say what the scheduler made of it
    (resized, Deferred until room frees, or Infeasible: exit 1). docs/user-guide.md, "Resizing"."""
    _set(kubeconfig, context, namespace)
    client = _client()
    namespace = _globals.namespace or client.namespace
    found = _api(lambda: client.get(Pod, pod, namespace=namespace))
    if not (found.spec and found.spec.nodeName):
        _fail(f"pod {namespace}/{pod} is not placed yet: there is nothing to resize")
    fractions = resizing.fractional_containers(found)
    if container is None and len(fractions) != 1:
        _fail(
            f"pod {namespace}/{pod} has fractions in {fractions or 'no container'}: name one with -c", code=2
        )
    name = container or fractions[0]
    try:
        body = resizing.request_annotations(
            name,
            memory_request=memory_request,
            memory_limit=memory_limit,
            fraction=fraction,
            fraction_limit=fraction_limit,
            compute=compute,
        )
    except ValueError as error:
        _fail(str(error), code=2)
    before = resizing.pending_condition(found)
    patch = {"metadata": {"annotations": body}}
    _api(lambda: client.patch(Pod, pod, patch, namespace=namespace, patch_type=PatchType.MERGE))
    typer.echo(f"pod/{pod} resize requested: {', '.join(f'{k}={v}' for k, v in body.items() if v)}")
    if not wait:
        return
    deadline = time.monotonic() + timeout
    while (result := resizing.answer(client.get(Pod, pod, namespace=namespace), name, before=before)) is None:
        if time.monotonic() > deadline:
            _fail(f"the scheduler has not answered within {timeout:g}s; the request stays on the pod")
        time.sleep(0.2)
    typer.echo(f"{result.state}: {result.message}")
    raise typer.Exit(code=result.exit_code)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
