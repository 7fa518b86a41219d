"""``kubectl gpufrac report`` end to end over HTTP: a Prometheus stand-in serves the hand-worked history
of test_report_figures.py as range-query answers (the wire format Prometheus answers with), and the
command prints, serializes and plots the same figures; one agent scrape gives a snapshot report."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlparse

import pytest
from test_report_figures import GIB, HISTORY, QUEUES, WHOLE
from typer.testing import CliRunner

from gpufrac.kubectl.command import app
from gpufrac.kubectl.report import History, build, by_namespace, density, memory
from gpufrac.kubectl.report_plot import write as write_plot
from gpufrac.kubectl.report_sources import (
    FRACTION_FIELDS,
    history_from_agents,
    history_from_matrices,
    step_for,
)
from gpufrac.node import metrics
from gpufrac.node.top import parse_agent


def as_matrices(history) -> dict[str, list[dict]]:
    """The history as Prometheus would answer a range query per metric (values as strings)."""
    series: dict[tuple, dict] = {}
    for at, samples in history.instants:
        for s in samples:
            labels = {
                "node": s.node,
                "namespace": s.namespace,
                "pod": s.pod,
                "container": s.container,
                "gpu_uuid": s.gpu_uuid,
                "gpu_index": "0",
                "mode": s.mode,
            }
            for name, field in FRACTION_FIELDS.items():
                key = (name, *labels.values())
                series.setdefault(key, {"metric": {"__name__": name, **labels}, "values": []})
                series[key]["values"].append([at, str(getattr(s, field))])
            gpu = {"node": s.node, "gpu_uuid": s.gpu_uuid, "gpu_index": "0"}
            key = (metrics.GPU_MEMORY_TOTAL, s.node, s.gpu_uuid)
            series.setdefault(key, {"metric": {"__name__": metrics.GPU_MEMORY_TOTAL, **gpu}, "values": []})
            if [at, str(s.gpu_memory_bytes)] not in series[key]["values"]:
                series[key]["values"].append([at, str(s.gpu_memory_bytes)])
    found: dict[str, list[dict]] = {}
    for (name, *_), one in series.items():
        found.setdefault(name, []).append(one)
    return found


def test_range_query_answers_join_into_the_history_the_figures_were_worked_out_on() -> None:
    history, notes = history_from_matrices(as_matrices(HISTORY), step_s=60)
    assert notes == []
    assert [len(s) for _, s in history.instants] == [5, 3]
    assert density(history) == density(HISTORY)
    assert (
        build(history, source="x", queues=QUEUES, gpu_hour_price=3).as_dict()
        == build(HISTORY, source="x", queues=QUEUES, gpu_hour_price=3).as_dict()
    )


def test_a_sample_that_missed_a_series_is_kept_and_said() -> None:
    matrices = as_matrices(HISTORY)
    matrices[metrics.FRACTION_MEMORY_USED] = matrices[metrics.FRACTION_MEMORY_USED][1:]
    history, notes = history_from_matrices(matrices, step_s=60)
    assert [len(s) for _, s in history.instants] == [5, 3]
    assert notes == ["2 sample(s) missed a series at their instant (read as 0)"]


def test_used_memory_is_the_drivers_count_for_the_cgroup_where_the_agent_exports_it() -> None:
    matrices = as_matrices(HISTORY)
    labels = {"node": "n1", "namespace": "a", "pod": "p1", "container": "c", "gpu_uuid": "G1"}
    matrices[metrics.FRACTION_CGROUP_USED] = [{"metric": labels, "values": [[0.0, str(12 * GIB)]]}]
    history, _ = history_from_matrices(matrices, step_s=60)
    a = next(r for r in memory(history, by_namespace) if r.group == "a")
    # p1 at 0 s: 12 GiB by the driver (10 by NVML); at 60 s no cgroup series: NVML's 30. p2: 20 both times.
    assert (a.used_bytes, a.idle_booked_bytes) == ((12 + 20 + 30 + 20) / 2 * GIB, (20 - 12) / 2 * GIB)


def test_the_step_keeps_a_range_query_under_prometheus_point_limit() -> None:
    assert step_for(24 * 3600) == 60
    assert step_for(7 * 24 * 3600) == 420


@pytest.fixture
def prometheus() -> Iterator[tuple[str, list[dict]]]:
    matrices = as_matrices(HISTORY)
    asked: list[dict] = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            url = urlparse(self.path)
            params = {k: v[0] for k, v in parse_qs(url.query).items()}
            asked.append({"path": url.path, **params})
            body = {
                "status": "success",
                "data": {"resultType": "matrix", "result": matrices.get(params["query"], [])},
            }
            data = json.dumps(body).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", asked
    finally:
        server.shutdown()
        server.server_close()


def test_the_command_reads_prometheus_over_the_window_and_prints_tables_json_and_a_plot(
    prometheus: tuple[str, list[dict]], tmp_path: Path
) -> None:
    url, asked = prometheus
    env = {"KUBECONFIG": str(tmp_path / "none")}  # no API server: queues are unknown, and said
    runner = CliRunner()
    args = ["report", "--prometheus", url, "--since", "2m", "--step", "1m", "--gpu-hour-price", "3"]
    shown = runner.invoke(app, args, env=env)
    assert shown.exit_code == 0, shown.output
    text = shown.output
    assert (
        "Density:  3.0 fractions on 1.5 GPUs (2.00 per GPU); "
        "whole GPUs would need 3.0: 1.5 GPUs saved (50.0%)" in text
    )
    assert "a/p2/c" in text.split("Interference by tenant")[1].splitlines()[2]  # ranked first
    assert "note: queues unknown: no API server to ask" in text
    assert "cannot be measured" in text
    assert {a["query"] for a in asked} == {
        *FRACTION_FIELDS,
        metrics.FRACTION_CGROUP_USED,
        metrics.GPU_MEMORY_TOTAL,
    }
    assert {(float(a["end"]) - float(a["start"]), float(a["step"])) for a in asked} == {(120.0, 60.0)}

    plot = tmp_path / "report.png"
    dumped = runner.invoke(app, [*args, "-o", "json", "--plot", str(plot)], env=env)
    assert dumped.exit_code == 0, dumped.output
    data = json.loads(dumped.stdout)
    assert data["density"]["gpusSaved"] == 1.5
    assert data["memory"]["byNamespace"][0] == {
        "group": "b",
        "bookedBytes": 110 * GIB,
        "limitBytes": 110 * GIB,
        "usedBytes": 60 * GIB,
        "idleBookedBytes": 50 * GIB,
        "idleShare": pytest.approx(50 / 110),
    }
    assert [q["queue"] for q in data["cost"]["byQueue"]] == ["<unknown>"]  # nobody to name queues
    assert data["cost"]["byQueue"][0]["wholeGpuCost"] == pytest.approx(6 * 3 / 60)
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and plot.stat().st_size > 20_000


def test_the_what_if_without_an_api_server_says_it_needs_the_clusters_nodes(
    prometheus: tuple[str, list[dict]], tmp_path: Path
) -> None:
    url, _ = prometheus
    args = ["report", "--prometheus", url, "--since", "2m", "--what-if-whole-gpu"]
    done = CliRunner().invoke(app, args, env={"KUBECONFIG": str(tmp_path / "none")})
    assert done.exit_code == 2
    assert (
        "--what-if-whole-gpu places the pods on the cluster's GPU nodes: it needs the API server"
        in done.output
    )


def test_a_window_with_no_fractions_still_plots_and_says_the_panels_are_empty(tmp_path: Path) -> None:
    empty = build(History([], 60), source="x", queues={}, gpu_hour_price=None)
    assert (empty.density.fractions, empty.density.saved_share, empty.cost) == (0, 0, [])
    write_plot(empty, tmp_path / "empty.png")
    assert (tmp_path / "empty.png").read_bytes()[:4] == b"\x89PNG"


def test_a_prometheus_that_does_not_answer_is_an_error_that_names_it(tmp_path: Path) -> None:
    done = CliRunner().invoke(
        app,
        ["report", "--prometheus", "http://127.0.0.1:9", "--since", "1h"],
        env={"KUBECONFIG": str(tmp_path)},
    )
    assert done.exit_code == 1
    assert "error: prometheus: http://127.0.0.1:9: ConnectError" in done.output


def test_a_bad_window_is_a_usage_error() -> None:
    done = CliRunner().invoke(app, ["report", "--since", "1d", "--prometheus", "http://x"])
    assert done.exit_code == 2
    assert '--since: \'1d\' is not a duration such as "5m", "1h30m" or "90s"' in done.output


def _fraction(pod: str) -> str:
    gpu = 'gpu_uuid="G1",gpu_index="0",mode="time-slicing"'
    return f'{{node="n1",namespace="a",pod="{pod}",container="c",{gpu}}}'


#: One agent's exposition: two time-slicing fractions of 20 GiB on one 80 GiB GPU, both busy.
SCRAPE = "\n".join(
    [
        'gpufrac_agent_info{node="n1"} 1',
        'gpufrac_gpu_memory_total_bytes{node="n1",gpu_uuid="G1",gpu_index="0"} 85899345920',
        *(f"gpufrac_fraction_memory_request_bytes{_fraction(p)} 21474836480" for p in ("p1", "p2")),
        f"gpufrac_fraction_memory_used_bytes{_fraction('p1')} 10737418240",
        f"gpufrac_fraction_memory_used_bytes{_fraction('p2')} 0",
        f"gpufrac_fraction_sm_utilization_ratio{_fraction('p1')} 0.6",
        f"gpufrac_fraction_sm_utilization_ratio{_fraction('p2')} 0.2",
        f"gpufrac_fraction_compute_received_ratio{_fraction('p1')} 0.75",
        f"gpufrac_fraction_compute_received_ratio{_fraction('p2')} 0.25",
    ]
)


def test_one_agent_scrape_is_a_snapshot_that_stands_for_an_hour() -> None:
    history, notes = history_from_agents([parse_agent(url="http://n1:9400/metrics", text=SCRAPE)], at=0.0)
    assert notes == [] and history.step_s == 3600
    report = build(history, source="snapshot", queues={("a", "p1"): "q"}, gpu_hour_price=2.0)
    assert (report.density.fractions, report.density.gpus_holding_fractions) == (2, 1)
    assert report.memory_by_namespace[0].idle_booked_bytes == 30 * GIB  # 20-10 + 20-0
    assert [t.pod for t in report.tenants] == ["p2", "p1"]
    q = next(r for r in report.cost if r.queue == "q")
    assert (q.booked_gpu_hours, q.whole_gpu_hours, q.whole_gpu_cost) == (0.25, 1.0, 2.0)
    assert WHOLE.fractional is False
