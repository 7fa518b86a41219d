"""The chart's Grafana dashboard and alerts ask only for what gpufrac exports, and the alerts fire right.

A dashboard panel that names a metric nobody exports shows "No data" forever and nobody notices; an alert
on a misspelt label never fires. Every query (panel targets, template variables, alert expressions) is
checked against the metric names and labels collected from the components' real registries
(metric_catalog.py). The alerts also pass ``promtool check rules`` and the promtool unit tests in
alerts_test.yaml, rendered with the chart's default thresholds.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from helm_chart import CHART, helm, kinds, one, render
from metric_catalog import exposed

HERE = Path(__file__).resolve().parent
DASHBOARD = CHART / "dashboards" / "gpufrac.json"

METRIC = re.compile(r"\b(gpufrac_[A-Za-z0-9_]+)\b")
SELECTOR = re.compile(r"\{([^{}]*)\}")
MATCHER = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)\s*(?:=~|!~|!=|=)\s*\"")
GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)")
LABEL_VALUES = re.compile(r"label_values\(\s*[A-Za-z_:][\w:]*\s*,\s*(\w+)\s*\)")


def query_problems(expr: str, catalog: dict[str, set[str]]) -> list[str]:
    """What in ``expr`` names a metric not exported, or a label none of its metrics carries."""
    metrics = set(METRIC.findall(expr))
    problems = [f"{expr!r}: metric {m} is not exported" for m in sorted(metrics - catalog.keys())]
    if not metrics:
        problems.append(f"{expr!r}: names no gpufrac metric")
    carried = set().union(*(catalog.get(m, set()) for m in metrics))
    labels = {label for body in SELECTOR.findall(expr) for label in MATCHER.findall(body)}
    labels |= {x.strip() for group in GROUPING.findall(expr) for x in group.split(",") if x.strip()}
    labels |= set(LABEL_VALUES.findall(expr))
    problems += [f"{expr!r}: label {x} is on none of {sorted(metrics)}" for x in sorted(labels - carried)]
    return problems


def panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    """The dashboard's panels that show something (a "row" only groups the panels below it)."""
    return [panel for panel in dashboard["panels"] if panel["type"] != "row"]


def dashboard_queries(dashboard: dict[str, Any]) -> list[str]:
    queries = [t["expr"] for panel in panels(dashboard) for t in panel.get("targets", [])]
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            query = variable["query"]
            queries.append(query["query"] if isinstance(query, dict) else query)
    return queries


def rendered_rules(tmp_path: Path, name: str = "gpufrac", **values: Any) -> dict[str, Any]:
    objects = render({"prometheusRule": {"enabled": True, **values}}, tmp_path=tmp_path)
    return one(objects, "PrometheusRule", name)["spec"]


@pytest.fixture(scope="module")
def catalog() -> dict[str, set[str]]:
    return exposed()


@pytest.fixture(scope="module")
def promtool() -> str:
    found = shutil.which("promtool")
    if found is None:
        pytest.fail("promtool is missing: `make testenv` installs it (testenv/promtool.sh)", pytrace=False)
    return found


def test_the_checker_catches_a_wrong_metric_and_a_wrong_label(catalog: dict[str, set[str]]) -> None:
    assert query_problems('sum by (node) (gpufrac_gpu_memory_used_bytes{gpu_index="0"})', catalog) == []
    assert query_problems("gpufrac_gpu_memory_use_bytes", catalog) == [
        "'gpufrac_gpu_memory_use_bytes': metric gpufrac_gpu_memory_use_bytes is not exported"
    ]
    [wrong_label] = query_problems('gpufrac_scheduler_pending_pods{node="a"}', catalog)
    assert wrong_label.endswith("label node is on none of ['gpufrac_scheduler_pending_pods']")
    assert query_problems("sum by (gpu) (gpufrac_gpu_memory_used_bytes)", catalog)  # gpu_uuid, not gpu
    assert query_problems("label_values(gpufrac_agent_info, pod)", catalog)


def test_the_dashboard_ships_as_a_sidecar_configmap(tmp_path: Path) -> None:
    config_map = one(render(tmp_path=tmp_path), "ConfigMap", "gpufrac-dashboard")
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(config_map["data"]["gpufrac.json"]) == json.loads(DASHBOARD.read_text())
    off = render({"grafanaDashboard": {"enabled": False}}, tmp_path=tmp_path)
    assert ("ConfigMap", "gpufrac-dashboard") not in kinds(off)


def test_every_dashboard_query_names_only_exported_metrics_and_labels(catalog: dict[str, set[str]]) -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    assert all(panel.get("targets") for panel in panels(dashboard)), "a panel without a query"
    problems = [p for query in dashboard_queries(dashboard) for p in query_problems(query, catalog)]
    assert not problems, "\n".join(problems)


def test_every_alert_names_only_exported_metrics_and_labels(
    tmp_path: Path, catalog: dict[str, set[str]]
) -> None:
    problems = []
    for group in rendered_rules(tmp_path)["groups"]:
        for rule in group["rules"]:
            problems += query_problems(rule["expr"], catalog)
            carried = set().union(*(catalog.get(m, set()) for m in METRIC.findall(rule["expr"])))
            used = {x for text in rule["annotations"].values() for x in re.findall(r"\$labels\.(\w+)", text)}
            problems += [f"{rule['alert']}: annotation label {x} is never there" for x in used - carried]
    assert not problems, "\n".join(problems)


def test_the_prometheus_rule_is_off_by_default_and_lints_when_on(tmp_path: Path) -> None:
    assert not [o for o in render(tmp_path=tmp_path) if o["kind"] == "PrometheusRule"]
    done = helm("lint", CHART, "--strict", "--set", "prometheusRule.enabled=true")
    assert "1 chart(s) linted, 0 chart(s) failed" in done.stdout


def _promtool(promtool: str, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([promtool, *args], capture_output=True, text=True, cwd=cwd, timeout=120)


def _write_rules(tmp_path: Path, **values: Any) -> Path:
    work = tmp_path / "promtool"
    work.mkdir(exist_ok=True)
    (work / "rules.yaml").write_text(yaml.safe_dump(rendered_rules(tmp_path, **values)))
    shutil.copy(HERE / "alerts_test.yaml", work / "alerts_test.yaml")
    return work


def test_the_alerts_pass_promtool_check_and_fire_in_their_unit_tests(tmp_path: Path, promtool: str) -> None:
    work = _write_rules(tmp_path)
    checked = _promtool(promtool, "check", "rules", "rules.yaml", cwd=work)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    rules = [r for group in rendered_rules(tmp_path)["groups"] for r in group["rules"]]
    assert f"SUCCESS: {len(rules)} rules found" in checked.stdout
    tested = _promtool(promtool, "test", "rules", "alerts_test.yaml", cwd=work)
    assert tested.returncode == 0, tested.stdout + tested.stderr


def test_every_alert_has_a_unit_test_that_fires_it(tmp_path: Path) -> None:
    alerts = {r["alert"] for group in rendered_rules(tmp_path)["groups"] for r in group["rules"]}
    cases = yaml.safe_load((HERE / "alerts_test.yaml").read_text())["tests"]
    fired = {check["alertname"] for case in cases for check in case["alert_rule_test"] if check["exp_alerts"]}
    assert alerts - fired == set(), "alerts no unit test expects to fire"


def test_the_unit_tests_notice_a_changed_threshold(tmp_path: Path, promtool: str) -> None:
    work = _write_rules(
        tmp_path, pendingMinutes=5
    )  # the pending alert now fires at 10m, which a test forbids
    tested = _promtool(promtool, "test", "rules", "alerts_test.yaml", cwd=work)
    assert tested.returncode != 0
    assert "GpufracGpuPodsPending" in tested.stdout + tested.stderr


REPORT_RULES = CHART / "rules" / "report.yaml"


def test_the_report_rules_ship_as_written_and_name_only_exported_metrics_and_labels(
    tmp_path: Path, catalog: dict[str, set[str]]
) -> None:
    spec = rendered_rules(tmp_path, "gpufrac-report")
    assert spec == yaml.safe_load(REPORT_RULES.read_text())  # a plain rule file, no templating
    rules = [r for group in spec["groups"] for r in group["rules"]]
    assert rules and all("record" in r for r in rules)
    problems = [p for r in rules for p in query_problems(r["expr"], catalog)]
    assert not problems, "\n".join(problems)


def test_the_report_rules_record_the_hand_worked_figures_in_promtool(tmp_path: Path, promtool: str) -> None:
    """report_rules_test.yaml feeds tests/kubectl/test_report_figures.py's history: same numbers."""
    work = tmp_path / "report"
    work.mkdir()
    (work / "report_rules.yaml").write_text(yaml.safe_dump(rendered_rules(tmp_path, "gpufrac-report")))
    shutil.copy(HERE / "report_rules_test.yaml", work / "report_rules_test.yaml")
    checked = _promtool(promtool, "check", "rules", "report_rules.yaml", cwd=work)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    tested = _promtool(promtool, "test", "rules", "report_rules_test.yaml", cwd=work)
    assert tested.returncode == 0, tested.stdout + tested.stderr
