"""What the README, the docs and ``--help`` say of defaults and versions is what the code does.

A newcomer follows the README and the docs literally: a default policy that is ``fgd-room`` in one page
and ``fgd`` in another, or a Go version the test environment cannot build with, costs an afternoon.
"""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import yaml
from typer.testing import CliRunner

from gpufrac.cli import app
from gpufrac.placement.policies import DEFAULT_POLICY, POLICIES
from gpufrac.scheduler.config import MigConfig
from gpufrac.sim.command import simulate

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def _go_directives() -> list[tuple[int, int]]:
    found = []
    for go_mod in (ROOT / "testenv").rglob("go.mod"):
        match = re.search(r"^go (\d+)\.(\d+)", go_mod.read_text(), re.MULTILINE)
        if match:
            found.append((int(match[1]), int(match[2])))
    return found


def test_the_go_version_the_readme_asks_for_builds_every_test_environment_module() -> None:
    needed = max(_go_directives())
    stated = [(int(major), int(minor)) for major, minor in re.findall(r"Go (?:>= ?)?(\d+)\.(\d+)\+?", README)]
    assert stated, "the README names no Go version"
    assert set(stated) == {needed}, f"README says Go {stated}; testenv's go.mod files need {needed}"


def test_the_readme_and_the_development_guide_give_one_cold_build_time() -> None:
    development = (ROOT / "docs" / "development.md").read_text()
    (guide,) = set(re.findall(r"about (\d+) min on a quiet 2-core machine", development))
    (readme,) = set(re.findall(r"about (\d+) min on a quiet\s+2-core machine", README))
    assert readme == guide


def test_every_page_that_names_the_default_policy_names_the_codes() -> None:
    values = yaml.safe_load((ROOT / "deploy" / "helm" / "gpufrac" / "values.yaml").read_text())
    assert values["scheduler"]["config"]["policy"] == DEFAULT_POLICY
    assert f"default policy, `{DEFAULT_POLICY}`" in README
    deploy = (ROOT / "docs" / "deploy.md").read_text()
    (row,) = [line for line in deploy.splitlines() if line.startswith("| `scheduler.config` |")]
    assert f"policy `{DEFAULT_POLICY}`" in row
    scheduler_doc = (ROOT / "docs" / "scheduler.md").read_text()
    (line,) = re.findall(r"^policy: .*\n.*\n.*$", scheduler_doc, re.MULTILINE)
    assert line.split()[1] == DEFAULT_POLICY
    listed = set(re.findall(r"[a-z][a-z-]+", line.partition("#")[2].partition(";")[0]))
    assert listed | {"kube-dra"} == set(POLICIES) and "(kube-dra models the stock scheduler" in line


def test_simulate_defaults_to_the_schedulers_policy_and_help_lists_every_policy() -> None:
    assert inspect.signature(simulate).parameters["policy"].default == DEFAULT_POLICY
    runner = CliRunner()
    for command in ("scheduler", "simulate"):
        result = runner.invoke(app, [command, "--help"], env={"COLUMNS": "400", "TERM": "dumb"})
        assert result.exit_code == 0, result.output
        for name in POLICIES:
            assert name in result.output, f"{command} --help does not list {name}"


def test_the_scheduler_page_gives_the_mig_settings_the_code_defaults_to() -> None:
    scheduler_doc = (ROOT / "docs" / "scheduler.md").read_text()
    (block,) = re.findall(r"^mig: .*\n((?:  \S.*\n)+)", scheduler_doc, re.MULTILINE)
    documented = yaml.safe_load("\n".join(line[2:] for line in block.splitlines()))
    assert documented == MigConfig().model_dump()
