"""The import direction of docs/architecture.md, checked on the source: a layer never imports above it.

The pure layers matter most: the simulator's quality figures are the product's only while `placement`,
`contract` and `mig` stay free of I/O and of the components above them.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "gpufrac"

#: What each package may import of gpufrac (besides itself).
ALLOWED: dict[str, set[str]] = {
    "contract": {"mig"},
    # MIG profile tables and layout geometry: pure, below everything that judges a MIG layout.
    "mig": set(),
    "placement": {"contract", "mig"},
    "kube": set(),
    # The controller runner (process/controller.py) runs informers and a lease for the components.
    "process": {"kube"},
    "scheduler": {"contract", "mig", "placement", "kube", "process"},
    "admission": {"contract", "mig", "placement", "kube", "process"},
    "node": {"contract", "mig", "kube", "process", "_generated"},
    "sim": {"contract", "mig", "placement"},
    "operator": {"contract", "mig", "kube", "process"},
    "local": {"contract", "mig", "kube", "node", "scheduler"},
    # kubectl-gpufrac is an entry like the cli: it reads through the layers below so that what it shows
    # is what they count; nothing imports it.
    "kubectl": {"contract", "mig", "placement", "kube", "scheduler", "sim", "node", "operator"},
}

#: Where a layer may import only some modules of a layer below it (module prefixes).
ONLY: dict[str, dict[str, tuple[str, ...]]] = {
    # local starts the components as processes; of the node agent it uses only what describes a
    # simulated Node (label names, the simulated inventory's models, the MPS capability labels).
    # The soak (local/soak.py) judges the cluster with the scheduler's booking audit over the API objects,
    # the same oracle the scheduler's own tests use.
    "local": {
        "node": ("gpufrac.node.labels", "gpufrac.node.inventory.simulated", "gpufrac.node.mps.mode"),
        "scheduler": ("gpufrac.scheduler.booking_audit",),
    },
    # kubectl's `top` reuses the node agent's view of its metrics, its `report` the names of the metrics
    # the agent exports, and it finds the agents' pods by the names the operator renders them with.
    "kubectl": {
        "node": ("gpufrac.node.top", "gpufrac.node.metrics"),
        "operator": ("gpufrac.operator.render",),
    },
    # The webhook judges a pod's queue by the scheduler's own rule (which queues a namespace may use).
    "admission": {"placement": ("gpufrac.placement.queue_access", "gpufrac.placement.model")},
}

#: The ``gpufrac`` command: a table of contents that registers each component's command.
CLI_MAY_IMPORT = ("command", "validate_command", "top")

#: Modules a pure layer must not import: they would give it I/O.
IO_MODULES = {"lightkube", "httpx", "httpx2", "socket", "subprocess", "asyncio", "grpc", "pynvml"}


def _is_module(name: str) -> bool:
    parts = name.split(".")
    where = SRC.joinpath(*parts[1:])
    return parts[0] == "gpufrac" and (where.is_dir() or where.with_suffix(".py").is_file())


def _imports(path: Path) -> set[str]:
    """Modules ``path`` imports; ``from gpufrac.x import y`` counts as ``gpufrac.x.y`` when y is a module."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                submodule = f"{node.module}.{alias.name}"
                names.add(submodule if _is_module(submodule) else node.module)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return names


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_a_package_imports_only_the_layers_below_it(package: str) -> None:
    wrong = []
    for path in sorted((SRC / package).rglob("*.py")):
        for name in _imports(path):
            parts = name.split(".")
            if parts[0] != "gpufrac" or len(parts) < 2 or parts[1] == package:
                continue
            limited = ONLY.get(package, {}).get(parts[1])
            if parts[1] not in ALLOWED[package] or (limited is not None and not name.startswith(limited)):
                wrong.append(f"{path.relative_to(SRC)} imports {name}")
    assert not wrong, "imports against docs/architecture.md:\n" + "\n".join(wrong)


@pytest.mark.parametrize("package", ["contract", "mig", "placement"])
def test_the_pure_layers_do_no_io(package: str) -> None:
    wrong = [
        f"{path.relative_to(SRC)} imports {name}"
        for path in sorted((SRC / package).rglob("*.py"))
        for name in _imports(path)
        if name.split(".")[0] in IO_MODULES
    ]
    assert not wrong, "\n".join(wrong)


def test_every_layer_is_checked() -> None:
    layers = {p.name for p in SRC.iterdir() if p.is_dir() and not p.name.startswith("_")}
    layers.discard("__pycache__")
    assert layers == set(ALLOWED), "give every package under src/gpufrac its rule in ALLOWED"


def test_the_cli_imports_only_command_modules() -> None:
    wrong = [
        name
        for name in _imports(SRC / "cli.py")
        if name.startswith("gpufrac.") and name.split(".")[-1] not in CLI_MAY_IMPORT
    ]
    assert not wrong, f"cli.py imports more than command modules: {wrong}"
    assert _imports(SRC / "__main__.py") == {"gpufrac.cli"}


def _module_name(path: Path) -> str:
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _top_level_imports(path: Path) -> set[str]:
    """The gpufrac modules ``path`` imports when it is loaded or type-checked: imports at module level,
    inside ``if`` (``TYPE_CHECKING`` too) and ``try``; an import inside a function is not counted."""
    package = _module_name(path) if path.name == "__init__.py" else _module_name(path).rpartition(".")[0]
    names: set[str] = set()

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, ast.If):
                visit(node.body)
                visit(node.orelse)
            elif isinstance(node, ast.Try):
                visit(node.body)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*anchor, *([node.module] if node.module else [])])
                for alias in node.names:
                    submodule = f"{base}.{alias.name}"
                    names.add(submodule if _is_module(submodule) else base)
            elif isinstance(node, ast.Import):
                names.update(alias.name for alias in node.names)

    visit(ast.parse(path.read_text(), filename=str(path)).body)
    return {n for n in names if n.startswith("gpufrac.")}


def _circles(package: str) -> list[list[str]]:
    graph = {
        _module_name(path): {n for n in _top_level_imports(path) if n.startswith(f"gpufrac.{package}.")}
        for path in sorted((SRC / package).rglob("*.py"))
        if path.name != "__init__.py"  # a package's __init__ re-exports its modules; it is not a circle
    }
    found: set[tuple[str, ...]] = set()

    def walk(module: str, path: list[str]) -> None:
        for target in sorted(graph.get(module, ())):
            if target in path:
                circle = path[path.index(target) :]
                start = circle.index(min(circle))
                found.add(tuple(circle[start:] + circle[:start]))
            else:
                walk(target, [*path, target])

    for module in graph:
        walk(module, [module])
    return [list(c) for c in sorted(found)]


@pytest.mark.parametrize("package", ["contract", "mig", "placement"])
def test_no_import_circle_closes_inside_a_pure_layer(package: str) -> None:
    """Not even one a ``TYPE_CHECKING`` guard hides: such a pair is one module in two files, and the
    next change to either breaks the other at import time."""
    assert not _circles(package), f"import circles in gpufrac.{package}: {_circles(package)}"
