#!/usr/bin/env bash
# promtool (Prometheus' rule checker and rule unit-test runner) for the chart's alert tests
# (tests/deploy/test_dashboards_alerts.py). A no-op when promtool is already on PATH; otherwise Debian's
# `prometheus` package provides /usr/bin/promtool (installed with apt as root, as CI runs; elsewhere
# the script says what to run). The package's daemon is not started in a container without an init.
set -euo pipefail
if command -v promtool >/dev/null 2>&1; then
    echo "testenv: promtool is present ($(command -v promtool))"
    exit 0
fi
if [[ $(id -u) -ne 0 ]] || ! command -v apt-get >/dev/null 2>&1; then
    echo "testenv: promtool missing; install it (Debian/Ubuntu: sudo apt-get install prometheus)" >&2
    exit 1
fi
echo "testenv: installing promtool (Debian package prometheus)"
export DEBIAN_FRONTEND=noninteractive
apt-get install -y --no-install-recommends prometheus >/dev/null \
    || { apt-get update >/dev/null && apt-get install -y --no-install-recommends prometheus >/dev/null; }
echo "testenv: promtool ready ($(command -v promtool))"
