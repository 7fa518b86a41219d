"""The GPUs this node serves whole: the one GPU mode no driver records, so the node agent does.

``whole`` (docs/mig.md) is a promise to the scheduler, not a hardware state: NVML cannot tell a GPU that
serves whole-GPU pods only from one that serves fractions. The layout executor records it here, in the
agent's state directory (a tmpfs under /run: it outlives an agent restart, not a reboot, as containers
do), written atomically, so a restarted agent publishes the mode before it has read the layout again.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from pathlib import Path

log = logging.getLogger(__name__)


class WholeGpus:
    def __init__(self, *, path: Path) -> None:
        self._path = path
        self._lock = threading.Lock()
        self._uuids: frozenset[str] = frozenset()
        try:
            data = json.loads(path.read_text())
            self._uuids = frozenset(str(u) for u in data.get("whole", []))
        except FileNotFoundError:
            pass
        except (OSError, ValueError, AttributeError) as exc:
            log.warning("mig: %s unreadable (%s); no GPU is served whole until the layout says so", path, exc)

    def __call__(self) -> frozenset[str]:
        return self._uuids

    def set(self, uuid: str, whole: bool) -> None:
        with self._lock:
            uuids = self._uuids | {uuid} if whole else self._uuids - {uuid}
            if uuids == self._uuids:
                return
            self._path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self._path.with_name(f".{self._path.name}.tmp")
            tmp.write_text(json.dumps({"whole": sorted(uuids)}))
            os.replace(tmp, self._path)
            self._uuids = uuids
