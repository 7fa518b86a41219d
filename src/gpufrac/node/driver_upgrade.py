"""Whether the GPU Operator is upgrading this node's driver, from the node's own label, as it changes.

The GPU Operator's upgrade controller says so on the Node (``gpufrac.contract.gpu_operator``). While it
does, the node agent must let go of the driver, or the unload fails with EBUSY and the driver DaemonSet
crash-loops (NVIDIA's GPU-fractioning operator recorded exactly that while its MPS daemon held the device
files). What letting go means is the agent's business (``NodeAgent._gpu_users``: MPS stopped, usage
reporting stopped, the inventory backend closed, the Node saying ``DriverUpgradeInProgress``); this
module only follows the label.

It watches the one Node (a field selector on its name, as the kubelet watches its own), so a label change
reaches the agent within a watch event, not a poll; the informer's relist after a dropped watch repairs
what was missed. ``changed`` is set on every change of the state.
"""

from __future__ import annotations

import asyncio
import logging

from lightkube import AsyncClient
from lightkube.resources.core_v1 import Node

from gpufrac.contract.gpu_operator import driver_upgrade_state
from gpufrac.kube.informer import Informer
from gpufrac.kube.stream import Selection

log = logging.getLogger(__name__)


class DriverUpgradeWatch:
    def __init__(self, *, client: AsyncClient, node_name: str) -> None:
        self._node = node_name
        self.informer: Informer[Node] = Informer(
            client=client,
            resource=Node,
            selection=Selection(fields=f"metadata.name={node_name}"),
            name="own-node",
        )
        self.informer.add_handler(self)
        #: The upgrade state while an upgrade is in progress; None otherwise.
        self.state: str | None = None
        self.changed = asyncio.Event()

    async def run(self) -> None:
        await self.informer.run()

    def _seen(self, node: Node | None) -> None:
        state = driver_upgrade_state(node.metadata.labels if node is not None else None)
        if state != self.state:
            log.info("driver upgrade on %s: %s", self._node, state or "none (done or never started)")
            self.state = state
            self.changed.set()

    # -- the informer's handler ---------------------------------------------------------------------------

    def on_add(self, obj: Node) -> None:
        self._seen(obj)

    def on_update(self, old: Node, new: Node) -> None:
        self._seen(new)

    def on_delete(self, obj: Node) -> None:
        self._seen(None)
