"""``--policy`` help is generated from the policy table: a policy added to ``POLICIES`` is offered by every
command that takes one, and a name the help shows is one the table knows."""

from __future__ import annotations

import re

import pytest
import typer

from gpufrac.cli import app
from gpufrac.placement.policies import DEFAULT_POLICY, POLICIES


def _policy_help(command: str) -> str:
    found = typer.main.get_command(app).commands[command]  # type: ignore[attr-defined]
    (option,) = [p for p in found.params if "--policy" in p.opts]
    assert isinstance(option.help, str) and option.help
    return option.help


@pytest.mark.parametrize("command", ["scheduler", "simulate"])
def test_the_policy_help_lists_every_policy_of_the_table(command: str) -> None:
    text = _policy_help(command)
    named = set(re.findall(r"[a-z][a-z0-9]*(?:-[a-z0-9]+)*", text))
    assert set(POLICIES) <= named, f"gpufrac {command} --policy does not offer {set(POLICIES) - named}"


def test_the_scheduler_help_says_the_default_policy() -> None:
    assert f"else {DEFAULT_POLICY}" in _policy_help("scheduler")
