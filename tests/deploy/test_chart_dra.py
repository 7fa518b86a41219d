"""The chart's DRA DeviceClasses: one per compute mode, spelled with the node agent's own names, and
accepted by a real API server."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from helm_chart import one, render
from lightkube import AsyncClient
from lightkube.resources.resource_v1 import DeviceClass

from gpufrac.contract import keys
from gpufrac.contract.request import ComputeMode
from gpufrac.node.dra.slices import MODE_ATTRIBUTES

SERVES_DRA = ("--api-versions", "resource.k8s.io/v1/DeviceClass")


def classes(objects: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [o for o in objects if o["kind"] == "DeviceClass"]


def test_auto_renders_the_classes_only_where_the_cluster_serves_resource_v1(tmp_path: Path) -> None:
    assert classes(render(tmp_path=tmp_path)) == []  # a 1.30-1.33 cluster has no resource.k8s.io/v1
    assert len(classes(render(tmp_path=tmp_path, extra=SERVES_DRA))) == len(ComputeMode)
    assert classes(render({"dra": {"enabled": False}}, tmp_path=tmp_path, extra=SERVES_DRA)) == []
    assert len(classes(render({"dra": {"enabled": True}}, tmp_path=tmp_path))) == len(ComputeMode)


def test_each_mode_class_selects_our_devices_that_can_enforce_it(tmp_path: Path) -> None:
    objects = render(tmp_path=tmp_path, extra=SERVES_DRA)
    for mode in ComputeMode:
        spec = one(objects, "DeviceClass", f"{mode.value}.{keys.DRA_DRIVER_NAME}")["spec"]
        driver = keys.DRA_DRIVER_NAME
        assert spec["selectors"] == [
            {
                "cel": {
                    "expression": f'device.driver == "{driver}" && '
                    f'device.attributes["{driver}"].{MODE_ATTRIBUTES[mode]}'
                }
            }
        ]
        assert spec["config"] == [
            {
                "opaque": {
                    "driver": driver,
                    "parameters": {
                        "apiVersion": keys.DRA_CONFIG_API_VERSION,
                        "kind": keys.DRA_CONFIG_KIND,
                        "computeMode": mode.value,
                    },
                }
            }
        ]


def test_the_node_agent_may_write_resourceslices_and_read_claims(tmp_path: Path) -> None:
    role = one(render(tmp_path=tmp_path), "ClusterRole", "gpufrac-gpufrac-node-agent")
    assert {
        "apiGroups": ["resource.k8s.io"],
        "resources": ["resourceslices"],
        "verbs": ["get", "create", "patch"],
    } in role["rules"]
    assert {"apiGroups": ["resource.k8s.io"], "resources": ["resourceclaims"], "verbs": ["get"]} in role[
        "rules"
    ]


def test_the_node_agent_reads_pods_with_or_without_dra_and_writes_none(tmp_path: Path) -> None:
    """The agent watches the pods bound to its node (live resizes; with DRA also the over-commit check at
    prepare) whether DRA is on or not; it never gets a pod write (its conditions go through pods/status)."""
    pods = {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}

    def rules(objects: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return list(one(objects, "ClusterRole", "gpufrac-gpufrac-node-agent")["rules"])

    for rendered in (
        render(tmp_path=tmp_path, extra=SERVES_DRA),
        render(tmp_path=tmp_path),  # a cluster that does not serve resource.k8s.io/v1
        render({"dra": {"enabled": False}}, tmp_path=tmp_path, extra=SERVES_DRA),
    ):
        assert [r for r in rules(rendered) if "pods" in r["resources"]] == [pods]


async def test_the_api_server_accepts_the_classes(tmp_path: Path, akube: AsyncClient) -> None:
    for obj in classes(render(tmp_path=tmp_path, extra=SERVES_DRA)):
        created = await akube.create(DeviceClass.from_dict(obj))
        try:
            assert created.spec is not None and created.spec.selectors is not None
        finally:
            assert created.metadata is not None and created.metadata.name is not None
            await akube.delete(DeviceClass, created.metadata.name)


def test_the_scheduler_may_allocate_claims_only_where_dra_is_on(tmp_path: Path) -> None:
    """The scheduler's configuration and ClusterRole follow dra.enabled as the DeviceClasses do: on a
    cluster without resource.k8s.io/v1 its claim informers would never sync."""
    name = "gpufrac-gpufrac-scheduler"
    claim_rules = [
        {
            "apiGroups": ["resource.k8s.io"],
            "resources": ["resourceclaims"],
            "verbs": ["get", "list", "watch", "patch"],
        },
        {
            "apiGroups": ["resource.k8s.io"],
            "resources": ["resourceclaims/status"],
            "verbs": ["update", "patch"],
        },
        {
            "apiGroups": ["resource.k8s.io"],
            "resources": ["deviceclasses", "resourceslices"],
            "verbs": ["get", "list", "watch"],
        },
    ]
    for extra, values, on in (
        (SERVES_DRA, None, True),
        ((), None, False),
        (SERVES_DRA, {"dra": {"enabled": False}}, False),
        ((), {"dra": {"enabled": True}}, True),
    ):
        objects = render(values, tmp_path=tmp_path, extra=extra)
        rules = one(objects, "ClusterRole", name)["rules"]
        assert all((rule in rules) is on for rule in claim_rules), (extra, values)
        config = yaml.safe_load(one(objects, "ConfigMap", "gpufrac-scheduler")["data"]["scheduler.yaml"])
        assert config["dra"] is on
