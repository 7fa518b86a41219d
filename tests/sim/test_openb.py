"""``gpufrac simulate --trace default`` for an installed package: fetched once, checked, or a clear error.

The network is never used: the trace source is a local directory (``file://``) or a closed localhost port
(what "offline" looks like to the fetcher). ``checkout_data_dir`` is patched to None so the CLI behaves as
it does installed from a wheel, where no ``shared/data`` lies beside the package (tests/test_wheel.py
checks that on a real installed package).
"""

from __future__ import annotations

import hashlib
import shutil
import socket
from pathlib import Path

import pytest
from typer.testing import CliRunner

from gpufrac.cli import app
from gpufrac.sim import openb
from gpufrac.sim import trace as trace_module
from gpufrac.sim.trace import TraceNode, TracePod, save_nodes, save_pods

POD_FILE = "openb_pod_list_default.csv"
NODE_FILE = trace_module.GPU_NODE_FILE
#: The repository's copy of the published files, when this checkout has one (looked up before any patching).
CHECKOUT_DATA = trace_module.checkout_data_dir()


@pytest.fixture
def installed(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """An installed package's view: no checkout data, the cache under tmp_path; returns the cache dir."""
    monkeypatch.setattr(trace_module, "checkout_data_dir", lambda: None)
    monkeypatch.delenv("GPUFRAC_DATA_DIR", raising=False)
    monkeypatch.setenv("GPUFRAC_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _small_trace(directory: Path) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    save_nodes(directory / NODE_FILE, [TraceNode(f"n{i}", 96000, 400000, 8, "T4") for i in range(4)])
    save_pods(directory / POD_FILE, [TracePod(f"p{i}", 1000, 1024, 1, 500) for i in range(20)])


def _checksums(directory: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in directory.glob("*.csv")}


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again on exit: connecting is refused, as offline


def test_fetch_keeps_a_checked_copy_and_reuses_it(tmp_path: Path) -> None:
    source, cache = tmp_path / "mirror", tmp_path / "cache"
    _small_trace(source)
    sums = _checksums(source)
    fetched = openb.fetch([POD_FILE, NODE_FILE], into=cache, base_url=source.as_uri(), checksums=sums)
    assert fetched == [cache / POD_FILE, cache / NODE_FILE]
    assert _checksums(cache) == sums
    shutil.rmtree(source)  # the second use needs no source at all
    assert openb.fetch([POD_FILE], into=cache, base_url=source.as_uri(), checksums=sums) == [cache / POD_FILE]


def test_a_file_that_does_not_match_its_pinned_checksum_is_refused_and_not_kept(
    installed: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    source = tmp_path / "mirror"
    _small_trace(source)  # not the published files: their checksums differ from the pinned ones
    monkeypatch.setenv("GPUFRAC_TRACE_SOURCE", source.as_uri())
    result = CliRunner().invoke(app, ["simulate", "--trace", "default", "--seeds", "42", "--no-plot"])
    assert result.exit_code == 2
    assert POD_FILE in result.output
    assert openb.CHECKSUMS[POD_FILE] in result.output
    assert not (installed / POD_FILE).exists()


def test_offline_says_where_to_get_the_files_and_about_data_dir(
    installed: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GPUFRAC_TRACE_SOURCE", f"http://127.0.0.1:{_closed_port()}/csv")
    result = CliRunner().invoke(app, ["simulate", "--trace", "default", "--seeds", "42", "--no-plot"])
    assert result.exit_code == 2
    assert "could not download openb_pod_list_default.csv" in result.output
    assert "--data-dir" in result.output
    assert openb.SOURCE in result.output


def test_data_dir_needs_no_download(installed: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUFRAC_TRACE_SOURCE", f"http://127.0.0.1:{_closed_port()}/csv")
    _small_trace(tmp_path / "mine")
    result = CliRunner().invoke(
        app,
        [
            *("simulate", "--trace", "default", "--data-dir", str(tmp_path / "mine"), "--seeds", "42"),
            *("--policy", "binpack", "--no-plot", "--json", "--workers", "1"),
        ],
    )
    assert result.exit_code == 0, result.output
    assert not installed.exists()


def test_the_pinned_checksums_are_the_published_files() -> None:
    shared = CHECKOUT_DATA
    if shared is None:
        pytest.skip("no shared/data/openb beside this checkout to compare the pins with")
    assert _checksums(shared) == openb.CHECKSUMS


def test_an_unknown_trace_name_lists_the_known_ones(installed: Path) -> None:
    result = CliRunner().invoke(app, ["simulate", "--trace", "nope", "--seeds", "42", "--no-plot"])
    assert result.exit_code == 2
    assert "openb_pod_list_nope.csv: not a published openb file" in result.output
    assert POD_FILE in result.output


def test_first_use_fetches_the_published_files_then_simulates(
    installed: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    shared = CHECKOUT_DATA
    if shared is None:
        pytest.skip("no shared/data/openb beside this checkout to serve as the published source")
    monkeypatch.setenv("GPUFRAC_TRACE_SOURCE", shared.as_uri())
    args = ["simulate", "--trace", "default", "--seeds", "42", "--policy", "binpack", "--no-plot", "--json"]
    result = CliRunner().invoke(app, [*args, "--workers", "1"])
    assert result.exit_code == 0, result.output
    assert _checksums(installed) == {name: openb.CHECKSUMS[name] for name in (POD_FILE, NODE_FILE)}
