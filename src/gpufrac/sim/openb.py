"""The published openb trace for an installed package: fetched once into a cache, checked, never assumed.

A ``pip install gpufrac`` user has no clone and no ``shared/data`` beside it, so ``gpufrac simulate
--trace default`` downloads the two CSVs it needs (the pod list and the GPU node list) from the public
repository the trace was published in (alibaba/clusterdata, ``cluster-trace-gpu-v2023/csv``; Weng et al.,
ATC'23) into ``~/.cache/gpufrac/openb`` (``$XDG_CACHE_HOME`` and ``$GPUFRAC_CACHE_DIR`` move it). Every
file is checked against the SHA-256 pinned below before it is kept, so a changed upstream file or a
truncated download is an error naming the file, never a silently different experiment. A machine with no
internet gets a message saying where to put the files and how to point ``--data-dir`` at them.

``$GPUFRAC_TRACE_SOURCE`` replaces the base URL (an HTTP(S) or ``file://`` URL, e.g. a mirror); the tests
use it with a local directory, never the network.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import urllib.error
import urllib.request
from pathlib import Path

SOURCE = "https://raw.githubusercontent.com/alibaba/clusterdata/master/cluster-trace-gpu-v2023/csv"
"""Where the trace was published; the files there are the ones the checksums below were taken from."""

CHECKSUMS: dict[str, str] = {
    "openb_node_list_all_node.csv": "5a85c2af79c66a1efff8bbcbda430400aae56d8431370d738480967e1a9c6b15",
    "openb_node_list_gpu_node.csv": "2beca64b4d3dfa342036a34b56a495c6cef9225db836c81f541282cb1df320b5",
    "openb_pod_list_cpu050.csv": "747f43247bffc2b0bb081d7f61f0705ca8d390dafc0b647e642c92f3baf3ba1e",
    "openb_pod_list_cpu100.csv": "bec1c33fbdde61fd463877534ec79b393aec73e1cbb22d55fab9f166ac480982",
    "openb_pod_list_default.csv": "1ee7ed79c27a3b0861cda8ddba86a004c6aba904caafa329a76ae93ca63834a8",
    "openb_pod_list_gpushare100.csv": "12dbc07d6a49bf8641e2275a2ff5bf7be74b5df7d148d531e135b140b95f9a3d",
    "openb_pod_list_gpushare20.csv": "9be2d0efb52e242c32e23dd184cc5fcc1983478c6c9c02cbb6b4b62925c0ffcd",
    "openb_pod_list_gpushare60.csv": "d31809628128a1f24491086eda4af3e23882b9213d3ef57a56ee2d1af69492fe",
    "openb_pod_list_gpuspec10.csv": "2dc7e4cb9480484f08539720b433a9ec9ab5d76b396f3f7557c53a2ff78a7611",
    "openb_pod_list_gpuspec20.csv": "6b9b89ab8913c1c074e994e98f548cf1a872fc5f76f2442ca8cd514a478b00a9",
    "openb_pod_list_multigpu20.csv": "d9ec6f6c74fb980cc0b81239470c6353fceea077ea9abd610003b604c7cc2b01",
    "openb_pod_list_multigpu30.csv": "a5e479c6444b1d83eef848159cf00c3cfa13441b2d1e2c113c391b91f1cc5b11",
}
"""SHA-256 of every published CSV (taken from the copy in shared/data/openb, itself copied unchanged)."""

TIMEOUT_S = 60.0


class TraceUnavailable(Exception):
    """A named trace file could not be fetched or did not match its pinned checksum."""


def cache_dir() -> Path:
    """``$GPUFRAC_CACHE_DIR``, else ``$XDG_CACHE_HOME/gpufrac/openb``, else ``~/.cache/gpufrac/openb``."""
    explicit = os.environ.get("GPUFRAC_CACHE_DIR")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "gpufrac" / "openb"


def source() -> str:
    return os.environ.get("GPUFRAC_TRACE_SOURCE") or SOURCE


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def fetch(
    names: list[str], *, into: Path, base_url: str, checksums: dict[str, str] = CHECKSUMS
) -> list[Path]:
    """Each of ``names`` in ``into``: kept if present and matching its checksum, else downloaded and checked.

    A file is written (atomically) only once its checksum matched, so the cache never holds a bad copy.
    """
    paths = []
    for name in names:
        if name not in checksums:
            raise TraceUnavailable(
                f"{name}: not a published openb file; known: {', '.join(sorted(checksums))}"
            )
        path = into / name
        if path.is_file() and _sha256(path.read_bytes()) == checksums[name]:
            paths.append(path)
            continue
        url = f"{base_url.rstrip('/')}/{name}"
        try:
            with urllib.request.urlopen(url, timeout=TIMEOUT_S) as response:
                data = response.read()
        except (urllib.error.URLError, OSError, ValueError) as error:
            reason = getattr(error, "reason", error)
            raise TraceUnavailable(
                f"could not download {name} from {url} ({reason}). Offline? Fetch the openb CSVs from "
                f"{SOURCE} on a machine that can, copy them into a directory and pass --data-dir DIR "
                "(or set GPUFRAC_DATA_DIR)"
            ) from error
        got = _sha256(data)
        if got != checksums[name]:
            raise TraceUnavailable(
                f"{name} from {url} has SHA-256 {got}, expected {checksums[name]} (the published file "
                "gpufrac pins); not kept. A changed upstream file or a broken download: retry, or pass "
                "--data-dir with a verified copy"
            )
        into.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=into, prefix=f".{name}.", delete=False) as tmp:
            tmp.write(data)
        os.replace(tmp.name, path)
        paths.append(path)
    return paths
