"""One way to open an API client, so every component reads its kubeconfig the same way.

Without a path, lightkube's own order applies (in-cluster service account, ``$KUBECONFIG``,
``~/.kube/config``), which is what a Deployment and a developer's shell both expect.
"""

from __future__ import annotations

from pathlib import Path

import httpx2
from lightkube import AsyncClient, KubeConfig


def connect(
    *,
    kubeconfig: Path | None = None,
    context: str | None = None,
    field_manager: str = "gpufrac",
    timeout: float = 10.0,
) -> AsyncClient:
    config = KubeConfig.from_file(kubeconfig).get(context_name=context) if kubeconfig else None
    return AsyncClient(config=config, field_manager=field_manager, timeout=httpx2.Timeout(timeout))
