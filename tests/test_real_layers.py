"""The guard that keeps CI from going green with its real-node layers skipped (tests/real_layers.py)."""

from __future__ import annotations

import os
import re
import textwrap
from pathlib import Path

import pytest

from real_layers import (
    ONE_WORKER_GROUP,
    REAL_NODE_SKIP,
    RealLayerGuard,
    is_real_layer,
    machine_lacks,
    required,
    runs_the_machines_runtime,
)


def test_ci_requires_the_real_layers_unless_turned_off_explicitly() -> None:
    assert required({"GPUFRAC_REQUIRE_REAL_LAYERS": "1"})
    assert required({"CI": "true"})
    assert not required({"CI": "true", "GPUFRAC_REQUIRE_REAL_LAYERS": "0"})
    assert not required({})
    assert not required({"CI": "false"})


def test_a_machine_with_root_and_a_writable_v1_or_v2_hierarchy_can_run_the_real_layers(
    tmp_path: Path,
) -> None:
    v1 = tmp_path / "v1"
    (v1 / "memory").mkdir(parents=True)
    (v1 / "memory" / "cgroup.procs").write_text("")
    v2 = tmp_path / "v2"
    v2.mkdir()
    (v2 / "cgroup.controllers").write_text("cpu memory\n")
    assert machine_lacks(euid=0, cgroup_root=v1) == []
    assert machine_lacks(euid=0, cgroup_root=v2) == []
    lacks = machine_lacks(euid=1000, cgroup_root=tmp_path / "none")
    assert len(lacks) == 2
    assert "root" in lacks[0] and "cgroup" in lacks[1]


def test_only_real_layer_skips_count() -> None:
    assert is_real_layer("tests/install/test_helm_install.py", "anything")
    assert is_real_layer("tests/realnode/test_dra_up.py::test_x", "anything")
    assert is_real_layer("tests/node/mps/test_mps_handover_realnode.py", f"{REAL_NODE_SKIP}: it lacks root")
    assert not is_real_layer("tests/node/usage/test_usage_nvml.py::test_x", "NVML is available here")


def _project(root: Path) -> Path:
    """A small test tree: a real-node module that skips as ours do, an ordinary skip, a passing test.
    Its modules are named after ``root``: nested runs share one interpreter and its module cache."""
    tag = re.sub(r"\W", "_", root.name)
    (root / "tests" / "realnode").mkdir(parents=True)
    (root / "pytest.ini").write_text("[pytest]\nasyncio_default_fixture_loop_scope = function\n")
    (root / "tests" / "realnode" / f"test_guarded_node_{tag}.py").write_text(
        textwrap.dedent(
            f"""
            import pytest
            pytest.skip("{REAL_NODE_SKIP}: it lacks a cgroup v1 memory hierarchy", allow_module_level=True)

            def test_runs_a_pod():
                pass
            """
        )
    )
    (root / "tests" / f"test_guarded_plain_{tag}.py").write_text(
        textwrap.dedent(
            """
            import pytest

            def test_passes():
                pass

            def test_skips_for_another_reason():
                pytest.skip("NVML is available here")
            """
        )
    )
    return root


def _run(root: Path, guard: RealLayerGuard, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    cwd = os.getcwd()
    os.chdir(root)
    try:
        code = pytest.main(
            # importlib: the nested runs leave the outer session's sys.path as it was.
            [
                "-q",
                "-p",
                "no:cacheprovider",
                "--import-mode=importlib",
                "--rootdir",
                str(root),
                "-c",
                str(root / "pytest.ini"),
                "tests",
            ],
            plugins=[guard],
        )
    finally:
        os.chdir(cwd)
    return int(code), capsys.readouterr().out


def test_a_real_layer_skipped_on_a_capable_machine_fails_the_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out = _run(_project(tmp_path), RealLayerGuard(lacks=[]), capsys)
    assert code == pytest.ExitCode.TESTS_FAILED
    assert "FAILED tests/realnode/test_guarded_node_" in out
    assert ".py skipped (no real node on this machine: it lacks a cgroup v1 memory hierarchy)" in out
    assert "test_guarded_plain" not in out.split("real layers skipped")[1]


def test_a_real_layer_skipped_where_the_machine_lacks_root_is_only_reported(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out = _run(_project(tmp_path), RealLayerGuard(lacks=["root (running as uid 1000)"]), capsys)
    assert code == pytest.ExitCode.OK, out
    assert "1 real-layer test(s) skipped; allowed because this machine lacks root" in out


TESTS = Path(__file__).resolve().parent


def test_every_module_that_starts_the_machines_runtime_runs_in_the_one_worker_group() -> None:
    """`make test` runs two workers: a test module that starts a real node (its skip condition is
    ``missing_requirements``) or drives buildah, left out of the group, would run beside another real
    node and race it for the machine's iptables rules and cgroups."""
    starts_it = sorted(
        path.relative_to(TESTS.parent).as_posix()
        for path in TESTS.rglob("test_*.py")
        if path != Path(__file__).resolve()
        and re.search(r"missing_requirements|\bbuildah\b", path.read_text())
    )
    assert "tests/realnode/test_realnode.py" in starts_it and "tests/test_image_store.py" in starts_it
    assert [m for m in starts_it if not runs_the_machines_runtime(f"{m}::test_x")] == []
    assert not runs_the_machines_runtime("tests/local/test_soak.py::test_x")
    assert not runs_the_machines_runtime("tests/realnodes_elsewhere.py::test_x")


def test_the_scheduler_keeps_the_runtime_stack_in_one_unit_and_spreads_the_rest(
    pytestconfig: pytest.Config,
) -> None:
    """The scheduler tests/conftest.py gives pytest-xdist under ``--dist loadgroup``: one work unit for
    the runtime stack's tests, one per other test (a parametrized id holding an ``@`` included); under
    any other mode none, so xdist's own."""
    if not pytestconfig.pluginmanager.hasplugin("xdist"):
        pytest.skip("pytest-xdist is not loaded (-p no:xdist)")

    class Config:
        def __init__(self, dist: str) -> None:
            self.values = {"dist": dist, "tx": ["2*popen"]}

        def getvalue(self, name: str) -> object:
            return self.values[name]

    make = pytestconfig.hook.pytest_xdist_make_scheduler
    scheduler = make(config=Config("loadgroup"), log=None)
    ids = [
        "tests/realnode/test_realnode.py::test_a",
        "tests/install/test_helm_install.py::test_b",
        "tests/test_image_store.py::test_c",
        "tests/local/test_soak.py::test_d",
        "tests/contract/test_x.py::test_e[a@b]",
    ]
    assert [scheduler._split_scope(i) for i in ids] == [ONE_WORKER_GROUP] * 3 + ids[3:]
    assert make(config=Config("load"), log=None) is None  # xdist's own scheduler then (its controller's)
