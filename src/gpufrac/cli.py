"""The ``gpufrac`` command: one entry point per component, plus the local tools.

Each component is one process started as ``gpufrac <component>``. A command's implementation lives in
its component's package (``<package>/command.py``) and is registered here with one line, so this module
stays a table of contents.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer

app = typer.Typer(
    name="gpufrac",
    help="Memory-enforced GPU sharing for Kubernetes.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _print_version(value: bool) -> None:
    if value:
        from gpufrac import __version__

        typer.echo(f"gpufrac {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(
        False, "--version", help="Print the version and exit.", is_eager=True, callback=_print_version
    ),
) -> None:
    """Memory-enforced GPU sharing for Kubernetes."""


def _register() -> None:
    from gpufrac.local.command import demo, up

    app.command(name="up")(up)
    app.command(name="demo")(demo)
    from gpufrac.node.top import top

    app.command(name="top")(top)

    from gpufrac.scheduler.command import scheduler

    app.command(name="scheduler")(scheduler)
    from gpufrac.node.command import node_agent

    app.command(name="node-agent")(node_agent)
    from gpufrac.node.nri.command import node_agent_validator

    app.command(name="node-agent-validator")(node_agent_validator)
    from gpufrac.admission.command import admission

    app.command(name="admission")(admission)
    from gpufrac.operator.command import operator

    app.command(name="operator")(operator)
    from gpufrac.sim.command import set_cluster_source, simulate

    app.command(name="simulate")(simulate)
    set_cluster_source(_cluster_snapshot)
    from gpufrac.admission.validate_command import validate

    app.command(name="validate")(validate)


def _cluster_snapshot(kubeconfig: Path | None, context: str | None) -> tuple[list[Any], list[Any]]:
    """``gpufrac simulate --from-cluster``'s reader: kubectl-gpufrac's snapshot (imported when used)."""
    from gpufrac.kubectl.command import cluster_snapshot

    trace = cluster_snapshot(kubeconfig=kubeconfig, context=context)
    return trace.nodes, trace.pods


_register()


def main() -> None:
    app()


if __name__ == "__main__":
    main()
