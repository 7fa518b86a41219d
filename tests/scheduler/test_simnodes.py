"""Simulated GPU nodes on the real API server: what ``gpufrac up`` and the demo create."""

from __future__ import annotations

import uuid

import pytest
from lightkube import Client
from lightkube.resources.core_v1 import Node

from gpufrac.contract import keys
from gpufrac.local.simnodes import NodeShape, create_sim_nodes_sync
from gpufrac.scheduler.objects import node_spec

pytestmark = pytest.mark.kube


def test_simulated_nodes_are_ready_managed_gpu_nodes_and_creating_again_is_harmless(kube: Client) -> None:
    prefix = f"sim-{uuid.uuid4().hex[:6]}-"
    shape = NodeShape(gpus=4, model="A100-40GB")
    names = create_sim_nodes_sync(kube, count=2, shape=shape, prefix=prefix)
    assert create_sim_nodes_sync(kube, count=2, shape=shape, prefix=prefix) == names
    try:
        for name in names:
            node = kube.get(Node, name)
            # The API server's NodeTaint admission added node.kubernetes.io/not-ready; it is gone again.
            assert [(t.key, t.effect) for t in node.spec.taints] == [(keys.MANAGED_TAINT_KEY, "NoSchedule")]
            spec = node_spec(node)
            assert spec.ready and len(spec.gpus) == 4 and {g.memory_mib for g in spec.gpus} == {40960}
            assert node.metadata.labels[keys.MANAGED_LABEL] == "true"
    finally:
        for name in names:
            kube.delete(Node, name)
