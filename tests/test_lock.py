"""requirements.lock is the install `make venv` and CI use: it must still satisfy pyproject's ranges.

A range changed in pyproject.toml without `make lock` would leave CI testing versions a user's
``pip install gpufrac`` can no longer get (or the lock missing a new dependency entirely). And what the
package imports is declared: a module that arrives only through another dependency's requirements can go
with that dependency's next release.
"""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from importlib.metadata import packages_distributions
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
DECLARED = [
    Requirement(text)
    for text in [
        *PYPROJECT["project"]["dependencies"],
        *PYPROJECT["project"]["optional-dependencies"]["test"],
    ]
]


def _locked() -> dict[str, str]:
    pins = re.findall(r"^([A-Za-z0-9_.\-]+)==([^\s;]+)", (ROOT / "requirements.lock").read_text(), re.M)
    return {canonicalize_name(name): version for name, version in pins}


def test_the_lock_pins_exact_versions_only() -> None:
    lines = [
        line
        for line in (ROOT / "requirements.lock").read_text().splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    ]
    assert lines and all("==" in line for line in lines), [line for line in lines if "==" not in line]


@pytest.mark.parametrize("requirement", DECLARED, ids=str)
def test_every_declared_dependency_is_locked_inside_its_range(requirement: Requirement) -> None:
    locked = _locked()
    name = canonicalize_name(requirement.name)
    assert name in locked, f"{requirement} is in pyproject.toml but not in requirements.lock: run `make lock`"
    assert requirement.specifier.contains(locked[name], prereleases=True), (
        f"requirements.lock pins {name}=={locked[name]}, outside pyproject's {requirement}: run `make lock`"
    )


def _imported_top_level_modules() -> set[str]:
    names: set[str] = set()
    for path in (ROOT / "src" / "gpufrac").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                names.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names.add(node.module.split(".")[0])
    return names - set(sys.stdlib_module_names) - {"gpufrac"}


def test_every_module_the_package_imports_is_a_declared_dependency() -> None:
    runtime = {canonicalize_name(Requirement(text).name) for text in PYPROJECT["project"]["dependencies"]}
    installed = packages_distributions()
    undeclared = sorted(
        f"{module} (from {', '.join(installed.get(module, ['no installed distribution']))})"
        for module in _imported_top_level_modules()
        if not runtime & {canonicalize_name(d) for d in installed.get(module, [])}
    )
    assert not undeclared, f"src/gpufrac imports modules pyproject.toml does not declare: {undeclared}"
