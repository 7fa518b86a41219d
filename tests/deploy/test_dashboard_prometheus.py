"""A real Prometheus scrapes the embedded cluster's scheduler and node agents and answers the dashboard.

The name check (test_dashboards_alerts.py) proves every query names real metrics; this proves the
queries, as written, return data from the components as they run: the embedded cluster (real control
plane, scheduler process, node-agent processes with simulated GPUs) places the demo's pods, Prometheus
(Debian's package, installed with promtool by `make testenv`) scrapes every component each second, and
every dashboard panel must have at least one query that answers with a series. The GPU memory limit
panels must also show every demo fraction's limit read back from the (simulated) driver. Prometheus also
evaluates the report's recording rules (the dashboard's "Report" row reads them), and ``kubectl gpufrac
report --prometheus`` run against it agrees with them.
"""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import socket
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any
from urllib.parse import urlparse

import httpx
import pytest
import yaml
from helm_chart import CHART
from typer.testing import CliRunner

from gpufrac.kubectl.command import app as kubectl_app
from gpufrac.local.cluster import ClusterShape, LocalCluster
from gpufrac.local.demo import DEMO_PODS, submit_and_wait
from gpufrac.local.simnodes import NodeShape

pytestmark = pytest.mark.kube

DASHBOARD = CHART / "dashboards" / "gpufrac.json"
REPORT_RULES = CHART / "rules" / "report.yaml"
#: Grafana's variables, as a user with "All" nodes selected would have them.
VARIABLES = {"$node": ".*", "$__rate_interval": "30s"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _scheduler_port(cluster: LocalCluster) -> int:
    assert cluster.scheduler_url is not None, "the embedded cluster runs no scheduler"
    return int(cluster.scheduler_url.rsplit(":", 1)[1])


@pytest.fixture(scope="module")
async def cluster() -> AsyncIterator[LocalCluster]:
    local = LocalCluster(shape=ClusterShape(nodes=2, node=NodeShape(gpus=4, model="H100-80GB")))
    async with local:
        assert local.client is not None
        for manifest in DEMO_PODS:
            await submit_and_wait(local.client, manifest)
        yield local


@pytest.fixture(scope="module")
def prometheus(cluster: LocalCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.fail("prometheus is missing: `make testenv` installs it (testenv/promtool.sh)", pytrace=False)
    work = tmp_path_factory.mktemp("prometheus")
    agents = [urlparse(url).netloc for url in cluster.metrics_urls.values()]
    shutil.copy(REPORT_RULES, work / "report.yaml")
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": ["report.yaml"],
        "scrape_configs": [
            {
                "job_name": "gpufrac-scheduler",
                "static_configs": [{"targets": [f"127.0.0.1:{_scheduler_port(cluster)}"]}],
            },
            # The agents' per-fraction series carry the tenant's namespace/pod/container: keep them.
            {"job_name": "gpufrac-node-agent", "honor_labels": True, "static_configs": [{"targets": agents}]},
        ],
    }
    (work / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = _free_port()
    log = (work / "prometheus.log").open("wb")
    process = subprocess.Popen(
        [
            binary,
            f"--config.file={work / 'prometheus.yml'}",
            f"--storage.tsdb.path={work / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        _wait(lambda: httpx.get(f"{url}/-/ready", timeout=2).status_code == 200, what="prometheus ready")
        targets = 1 + len(agents)
        # Every target up, with enough samples for rate() and increase() over the dashboard's windows.
        _wait(
            lambda: _value(url, "count(count_over_time(up[1m]) >= 5 and up == 1)") == targets,
            what=f"{targets} targets scraped 5 times",
        )
        yield url
    finally:
        process.terminate()
        process.wait(timeout=20)
        log.close()


def _wait(check, *, what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if check():
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout_s:.0f}s")
        time.sleep(0.5)


def _query(url: str, expr: str) -> list[dict[str, Any]]:
    answer = httpx.get(f"{url}/api/v1/query", params={"query": expr}, timeout=10).json()
    assert answer["status"] == "success", (expr, answer)
    return answer["data"]["result"]


def _value(url: str, expr: str) -> float | None:
    result = _query(url, expr)
    return float(result[0]["value"][1]) if result else None


def _substitute(expr: str) -> str:
    return re.sub(r"\$\w+", lambda m: VARIABLES[m.group(0)], expr)


async def test_every_dashboard_panel_answers_with_data(prometheus: str) -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    empty = []
    for panel in (p for p in dashboard["panels"] if p["type"] != "row"):
        answers = [
            await asyncio.to_thread(_query, prometheus, _substitute(t["expr"])) for t in panel["targets"]
        ]
        if not any(answers):
            empty.append(f"{panel['title']}: {[t['expr'] for t in panel['targets']]}")
    assert not empty, "panels with no data:\n" + "\n".join(empty)

    # And the numbers are the cluster's: the demo's pods hold GPU memory, the versions are one.
    allocated = await asyncio.to_thread(
        _value, prometheus, _substitute(dashboard["panels"][0]["targets"][0]["expr"])
    )
    assert allocated is not None and 0 < allocated < 1
    versions = await asyncio.to_thread(
        _query, prometheus, "count by (component, version) (gpufrac_build_info)"
    )
    assert {v["metric"]["component"] for v in versions} == {"scheduler", "node-agent"}
    # The GPU memory limit panels say what the (simulated) driver holds: every demo fraction read back.
    verified_panel, table = (
        next(p for p in dashboard["panels"] if p["title"].startswith(title))
        for title in ("Fractions with GPU memory limit verified", "Per fraction: GPU memory limit read back")
    )

    def per_node(expr: str) -> dict[str, float]:
        return {r["metric"]["node"]: float(r["value"][1]) for r in _query(prometheus, _substitute(expr))}

    def all_read_back() -> bool:
        verified, running = (per_node(t["expr"]) for t in verified_panel["targets"])
        return verified == running and sum(running.values()) > 0

    await asyncio.to_thread(_wait, all_read_back, what="every running fraction's limit verified")
    read_back = await asyncio.to_thread(_query, prometheus, _substitute(table["targets"][0]["expr"]))
    assert read_back and {r["value"][1] for r in read_back} == {"1"}
    variable = dashboard["templating"]["list"][1]["query"]["query"]
    metric, label = re.fullmatch(r"label_values\((\w+), (\w+)\)", variable).groups()
    nodes = await asyncio.to_thread(_query, prometheus, f"count by ({label}) ({metric})")
    assert len(nodes) == 2


async def test_the_report_from_prometheus_agrees_with_the_recorded_rules(
    prometheus: str, cluster: LocalCluster
) -> None:
    needed = "cluster:gpufrac_fraction_memory_request_bytes:whole_gpus_needed"
    holding = "cluster:gpufrac_fraction_memory_request_bytes:gpus_holding_fractions"
    # A window in which every agent was scraped throughout: the fractions counted did not change in it.
    window = f"{needed}[20s]"
    steady = f"count_over_time({window}) >= 18 and min_over_time({window}) == max_over_time({window})"
    await asyncio.to_thread(_wait, lambda: _value(prometheus, steady), what="the report's rules recorded")
    fractions = await asyncio.to_thread(
        _value,
        prometheus,
        "count(gpufrac_fraction_memory_request_bytes < on(node, gpu_uuid) group_left() "
        "gpufrac_gpu_memory_total_bytes)",
    )
    assert fractions and await asyncio.to_thread(_value, prometheus, needed) == fractions
    args = ["report", "--prometheus", prometheus, "--since", "8s", "--step", "1s", "-o", "json"]
    args += ["--what-if-whole-gpu", "--policy", "binpack"]
    done = await asyncio.to_thread(
        CliRunner().invoke, kubectl_app, args, env={"KUBECONFIG": str(cluster.kubeconfig)}
    )
    assert done.exit_code == 0, done.output
    report = json.loads(done.stdout)
    # The demo's pods do not change: every instant of the window holds the same fractions on the same GPUs.
    assert report["density"]["fractions"] == fractions
    assert report["density"]["gpusHoldingFractions"] == await asyncio.to_thread(_value, prometheus, holding)
    assert report["windowSeconds"] >= 7
    # Queues come from the cluster's pods (the API server answers): no fraction is left unnamed.
    assert "<unknown>" not in {q["group"] for q in report["memory"]["byQueue"]}
    # The demo's pods placed again on the cluster's 8 GPUs: as booked, all fit; whole GPUs take more.
    booked, whole = report["whatIfWholeGpu"]
    assert (booked["allocation"], booked["leftOut"], booked["gpus"]) == ("fractions", 0, 8)
    assert whole["allocation"] == "whole-gpus" and whole["gpusUsed"] > booked["gpusUsed"]
    # Without --prometheus: one scrape of `gpufrac up`'s agents (as `top` reads them), said to be a snapshot.
    args = ["report", "-o", "json", "--gpu-hour-price", "2"]
    done = await asyncio.to_thread(
        CliRunner().invoke, kubectl_app, args, env={"KUBECONFIG": str(cluster.kubeconfig)}
    )
    assert done.exit_code == 0, done.output
    snapshot = json.loads(done.stdout)
    assert snapshot["source"].startswith("snapshot") and snapshot["windowSeconds"] == 3600
    assert snapshot["density"]["fractions"] == fractions
