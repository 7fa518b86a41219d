"""Container images for the real test node, made without a registry or a builder daemon.

No registry is reachable from the machines the tests run on, and the real node (``gpufrac.local.realnode``)
needs two images: the pod sandbox ("pause") image containerd starts every pod with, and a small workload
image for test pods. Both are one static binary, Debian's ``busybox-static`` (installed by
testenv/packages.sh), in a single layer, so writing the OCI image layout ourselves is simpler and faster
than building a Go image tool: an OCI archive is a tar of ``oci-layout``, ``index.json`` and
content-addressed blobs (a layer tar, a config and a manifest), which ``ctr images import`` reads.

The archive is deterministic (fixed mtimes and owners), so the same busybox gives the same image ID.
"""

from __future__ import annotations

import hashlib
import io
import json
import platform
import tarfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

#: Where Debian's busybox-static puts its binary.
BUSYBOX = Path("/bin/busybox")

#: The applets the workload image links to busybox (what tests run inside containers).
APPLETS = ("sh", "sleep", "cat", "env", "ls", "true", "echo")

MEDIA_INDEX = "application/vnd.oci.image.index.v1+json"
MEDIA_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
MEDIA_CONFIG = "application/vnd.oci.image.config.v1+json"
MEDIA_LAYER = "application/vnd.oci.image.layer.v1.tar"

_GOARCH = {"x86_64": "amd64", "aarch64": "arm64", "arm64": "arm64"}


@dataclass(frozen=True, slots=True)
class ImageSpec:
    """One image: its full reference and what its container runs by default."""

    ref: str
    entrypoint: tuple[str, ...]


#: The pod sandbox image (containerd's ``pinned_images.sandbox``): a process that only waits. The CRI
#: stops a sandbox with SIGKILL, so ``sleep`` as PID 1 (which ignores SIGTERM) is enough.
PAUSE = ImageSpec(ref="gpufrac.local/pause:testenv", entrypoint=("/bin/busybox", "sleep", "2147483647"))
#: The workload image of test pods: busybox's shell and applets under /bin.
WORKLOAD = ImageSpec(ref="gpufrac.local/busybox:testenv", entrypoint=("/bin/sh",))


class ImageError(RuntimeError):
    """An image could not be made (the message says what is missing)."""


def goarch() -> str:
    machine = platform.machine()
    try:
        return _GOARCH[machine]
    except KeyError:
        raise ImageError(f"no OCI architecture known for machine {machine!r}") from None


def _layer(busybox: bytes, applets: Sequence[str]) -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for directory in ("bin", "tmp", "proc", "sys", "dev", "etc"):
            info = tarfile.TarInfo(directory)
            info.type = tarfile.DIRTYPE
            info.mode = 0o1777 if directory == "tmp" else 0o755
            tar.addfile(info)
        info = tarfile.TarInfo("bin/busybox")
        info.size = len(busybox)
        info.mode = 0o755
        tar.addfile(info, io.BytesIO(busybox))
        for applet in applets:
            link = tarfile.TarInfo(f"bin/{applet}")
            link.type = tarfile.SYMTYPE
            link.linkname = "busybox"
            link.mode = 0o777
            tar.addfile(link)
    return out.getvalue()


def _descriptor(media_type: str, blob: bytes) -> dict[str, object]:
    return {
        "mediaType": media_type,
        "digest": f"sha256:{hashlib.sha256(blob).hexdigest()}",
        "size": len(blob),
    }


def _json(obj: object) -> bytes:
    return json.dumps(obj, separators=(",", ":"), sort_keys=True).encode()


def write_archive(spec: ImageSpec, path: Path, *, busybox: Path = BUSYBOX) -> Path:
    """Write ``spec`` as an OCI image-layout tar at ``path`` (for ``ctr images import``); returns it."""
    try:
        binary = busybox.read_bytes()
    except OSError as error:
        raise ImageError(
            f"cannot read {busybox} ({error.strerror}): install Debian's busybox-static "
            "(bash testenv/packages.sh)"
        ) from None
    arch = goarch()
    layer = _layer(binary, APPLETS)
    config = _json(
        {
            "architecture": arch,
            "os": "linux",
            "config": {"Entrypoint": list(spec.entrypoint), "Env": ["PATH=/bin"], "WorkingDir": "/"},
            "rootfs": {"type": "layers", "diff_ids": [f"sha256:{hashlib.sha256(layer).hexdigest()}"]},
        }
    )
    manifest = _json(
        {
            "schemaVersion": 2,
            "mediaType": MEDIA_MANIFEST,
            "config": _descriptor(MEDIA_CONFIG, config),
            "layers": [_descriptor(MEDIA_LAYER, layer)],
        }
    )
    tag = spec.ref.rpartition(":")[2]
    index = _json(
        {
            "schemaVersion": 2,
            "mediaType": MEDIA_INDEX,
            "manifests": [
                {
                    **_descriptor(MEDIA_MANIFEST, manifest),
                    "platform": {"architecture": arch, "os": "linux"},
                    "annotations": {
                        "io.containerd.image.name": spec.ref,
                        "org.opencontainers.image.ref.name": tag,
                    },
                }
            ],
        }
    )
    files: list[tuple[str, bytes]] = [("oci-layout", _json({"imageLayoutVersion": "1.0.0"}))]
    files += [(f"blobs/sha256/{hashlib.sha256(b).hexdigest()}", b) for b in (layer, config, manifest)]
    files.append(("index.json", index))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with tarfile.open(tmp, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for directory in ("blobs", "blobs/sha256"):
            info = tarfile.TarInfo(directory)
            info.type = tarfile.DIRTYPE
            info.mode = 0o755
            tar.addfile(info)
        for name, data in files:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            info.mode = 0o644
            tar.addfile(info, io.BytesIO(data))
    tmp.replace(path)
    return path
