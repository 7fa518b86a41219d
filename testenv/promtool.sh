#!/usr/bin/env bash
# promtool (Prometheus' rule checker and rule unit-test runner) and prometheus itself for the chart's
# dashboard and alert tests (tests/deploy/test_dashboards_alerts.py, test_dashboard_prometheus.py). A
# no-op when both are on PATH; otherwise Debian's `prometheus` package provides them (installed with apt
# as root, as CI runs; elsewhere the script says what to run). The tests start their own Prometheus; the
# package's service is not started in a container without an init.
set -euo pipefail
if command -v promtool >/dev/null 2>&1 && command -v prometheus >/dev/null 2>&1; then
    echo "testenv: promtool and prometheus are present ($(command -v promtool))"
    exit 0
fi
if [[ $(id -u) -ne 0 ]] || ! command -v apt-get >/dev/null 2>&1; then
    echo "testenv: promtool/prometheus missing; install them (Debian/Ubuntu: sudo apt-get install prometheus)" >&2
    exit 1
fi
echo "testenv: installing promtool (Debian package prometheus)"
export DEBIAN_FRONTEND=noninteractive
apt-get install -y --no-install-recommends prometheus >/dev/null \
    || { apt-get update >/dev/null && apt-get install -y --no-install-recommends prometheus >/dev/null; }
echo "testenv: promtool ready ($(command -v promtool))"
