"""Build hook: the wheel and sdist must carry the generated NRI/CRI/ttrpc messages, or the build fails.

``src/gpufrac/_generated`` is produced from the pinned Go modules' .proto files by
``scripts/gen-nri-protos`` and ``scripts/gen-cri-protos`` (``make testenv`` runs both; they need Go and
grpcio-tools) and is not tracked in git. Shipping them in the wheel is what lets ``pip install gpufrac``
run the node agent with no Go and no clone, so a build without them would be a broken package: it stops
here with the command that makes them. Everything else about the package is in pyproject.toml.

The generated code also names the protobuf runtime it needs (``ValidateProtobufRuntimeVersion``); the
build checks that pyproject's ``protobuf`` lower bound admits no older runtime, so an install never picks a
protobuf that the shipped messages refuse at import.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.command.sdist import sdist

ROOT = Path(__file__).resolve().parent
GENERATED = ROOT / "src" / "gpufrac" / "_generated"
#: The modules the node agent imports (gpufrac.node.nri, gpufrac.node.cri).
REQUIRED = ("nri/api_pb2.py", "ttrpc/request_pb2.py", "cri/api_pb2.py", "cri/api_pb2_grpc.py")
GENCODE_VERSION = re.compile(
    r"ValidateProtobufRuntimeVersion\(\s*_runtime_version\.Domain\.PUBLIC,\s*(\d+),\s*(\d+),\s*(\d+),"
)


def _version_tuple(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", text)[:3])


def check_generated() -> None:
    missing = [name for name in REQUIRED if not (GENERATED / name).is_file()]
    if missing:
        raise SystemExit(
            "gpufrac build: the generated protobuf messages are missing from src/gpufrac/_generated "
            f"({', '.join(missing)}); make them with `make testenv` or `python scripts/gen-nri-protos && "
            "python scripts/gen-cri-protos` (needs Go and grpcio-tools), then build again"
        )
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    bound = next(d for d in pyproject["project"]["dependencies"] if d.startswith("protobuf"))
    lower = _version_tuple(re.search(r">=\s*([\d.]+)", bound).group(1))
    for name in REQUIRED:
        found = GENCODE_VERSION.search((GENERATED / name).read_text())
        if found and tuple(map(int, found.groups())) > lower:
            raise SystemExit(
                f"gpufrac build: {name} was generated for protobuf {'.'.join(found.groups())} but "
                f"pyproject.toml allows {bound!r}; raise the lower bound (an older runtime refuses the "
                "messages at import) or regenerate with an older grpcio-tools"
            )


class BuildPy(build_py):
    def run(self) -> None:
        # An editable install (`make venv`) comes before `make testenv` generates the messages, and reads
        # them from src/ whenever they appear: only a real build must carry them.
        if not self.editable_mode:
            check_generated()
        super().run()


class Sdist(sdist):
    def run(self) -> None:
        check_generated()
        super().run()


setup(cmdclass={"build_py": BuildPy, "sdist": Sdist})
