"""The import direction of docs/architecture.md, checked on the source: a layer never imports above it.

The pure layers matter most: the simulator's quality figures are the product's only while `placement`
and `contract` stay free of I/O and of the components above them.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "gpufrac"

#: What each package may import of gpufrac (besides itself).
ALLOWED: dict[str, set[str]] = {
    "contract": set(),
    "placement": {"contract"},
    "kube": set(),
    "process": set(),
    "scheduler": {"contract", "placement", "kube", "process"},
    "admission": {"contract", "kube", "process"},
    "node": {"contract", "kube", "process", "_generated"},
    "sim": {"contract", "placement"},
    "operator": {"contract", "kube", "process"},
}

#: Modules a pure layer must not import: they would give it I/O.
IO_MODULES = {"lightkube", "httpx", "httpx2", "socket", "subprocess", "asyncio", "grpc", "pynvml"}


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return names


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_a_package_imports_only_the_layers_below_it(package: str) -> None:
    wrong = []
    for path in sorted((SRC / package).rglob("*.py")):
        for name in _imports(path):
            parts = name.split(".")
            above = parts[0] == "gpufrac" and len(parts) > 1 and parts[1] not in {package, *ALLOWED[package]}
            if above:
                wrong.append(f"{path.relative_to(SRC)} imports {name}")
    assert not wrong, "imports against docs/architecture.md:\n" + "\n".join(wrong)


@pytest.mark.parametrize("package", ["contract", "placement"])
def test_the_pure_layers_do_no_io(package: str) -> None:
    wrong = [
        f"{path.relative_to(SRC)} imports {name}"
        for path in sorted((SRC / package).rglob("*.py"))
        for name in _imports(path)
        if name.split(".")[0] in IO_MODULES
    ]
    assert not wrong, "\n".join(wrong)
