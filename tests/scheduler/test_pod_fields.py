"""Pod fields beyond the contract, read from API objects: each honoured with kube's meaning or refused by
name (#19). No API server needed: these are the conversions the service runs on every pod."""

from __future__ import annotations

from typing import Any

import pytest
from lightkube.resources.core_v1 import PersistentVolume, PersistentVolumeClaim, Pod

from gpufrac.contract.request import PodGpuRequest
from gpufrac.placement.model import ModePolicy, NodeSelectorRequirement, SelectorOperator
from gpufrac.placement.pod_constraints import HostPort, InclusionPolicy, WhenUnsatisfiable
from gpufrac.scheduler.objects import pending_pod
from gpufrac.scheduler.pod_fields import (
    RefusedPod,
    and_terms,
    node_extras,
    node_resources,
    pod_constraints,
    refused_fields,
    volume_terms,
)

HOST = "kubernetes.io/hostname"


def pod(spec: dict[str, Any], *, labels: dict[str, str] | None = None, name: str = "p") -> Pod:
    base = {"containers": [{"name": "app", "image": "x"}]}
    return Pod.from_dict(
        {"metadata": {"name": name, "namespace": "team", "labels": labels or {}}, "spec": {**base, **spec}}
    )


def test_affinity_terms_default_to_the_pods_namespace_and_merge_label_keys() -> None:
    term = {
        "labelSelector": {"matchLabels": {"app": "infer"}},
        "topologyKey": HOST,
        "matchLabelKeys": ["rev"],
        "mismatchLabelKeys": ["tenant"],
    }
    p = pod(
        {"affinity": {"podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [term]}}},
        labels={"app": "infer", "rev": "7", "tenant": "x"},
    )
    (anti,) = pod_constraints(p).required_anti_affinity
    assert anti.namespaces == frozenset({"team"})
    assert anti.namespace_selector is None
    assert anti.selector is not None
    assert NodeSelectorRequirement("rev", SelectorOperator.IN, ("7",)) in anti.selector.match_expressions
    assert (
        NodeSelectorRequirement("tenant", SelectorOperator.NOT_IN, ("x",)) in anti.selector.match_expressions
    )
    assert anti.matches("team", {"app": "infer", "rev": "7", "tenant": "y"}, {})
    assert not anti.matches("team", {"app": "infer", "rev": "8", "tenant": "y"}, {})
    assert not anti.matches("team", {"app": "infer", "rev": "7", "tenant": "x"}, {})


def test_an_empty_namespace_selector_selects_every_namespace() -> None:
    term = {"labelSelector": {"matchLabels": {"app": "db"}}, "topologyKey": HOST, "namespaceSelector": {}}
    p = pod({"affinity": {"podAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [term]}}})
    (aff,) = pod_constraints(p).required_affinity
    assert aff.matches("anywhere", {"app": "db"}, {})


def test_spread_defaults_are_kubes() -> None:
    c = {"maxSkew": 2, "topologyKey": HOST, "whenUnsatisfiable": "ScheduleAnyway", "labelSelector": {}}
    (spread,) = pod_constraints(pod({"topologySpreadConstraints": [c]})).spread
    assert spread.when_unsatisfiable is WhenUnsatisfiable.SCHEDULE_ANYWAY
    assert (spread.min_domains, spread.node_affinity_policy, spread.node_taints_policy) == (
        1,
        InclusionPolicy.HONOR,
        InclusionPolicy.IGNORE,
    )


def test_a_bad_selector_operator_is_refused_with_the_field_named() -> None:
    term = {
        "labelSelector": {"matchExpressions": [{"key": "a", "operator": "Gt", "values": ["1"]}]},
        "topologyKey": HOST,
    }
    p = pod({"affinity": {"podAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [term]}}})
    with pytest.raises(RefusedPod, match=r"spec.affinity.podAffinity.required\[0\].labelSelector"):
        pod_constraints(p)


def test_extras_follow_kubes_request_arithmetic() -> None:
    p = pod(
        {
            "containers": [
                {
                    "name": "a",
                    "image": "x",
                    "ports": [{"containerPort": 80, "hostPort": 8080}, {"containerPort": 81}],
                    "resources": {"requests": {"ephemeral-storage": "1Gi", "example.com/fpga": "1"}},
                },
                {"name": "b", "image": "x", "resources": {"limits": {"example.com/fpga": "2"}}},
            ],
            "initContainers": [
                {"name": "i", "image": "x", "resources": {"requests": {"example.com/fpga": "5"}}}
            ],
            "overhead": {"ephemeral-storage": "1Mi"},
        }
    )
    extras = node_extras(p)
    assert extras.host_ports == (HostPort(8080),)
    assert extras.extended == (("example.com/fpga", 5),)  # max(1 + 2, 5)
    assert extras.ephemeral_bytes == (1 << 30) + (1 << 20)
    assert node_resources(
        {"cpu": "8", "nvidia.com/gpu": "8", "example.com/fpga": "4", "ephemeral-storage": "10Gi"}
    ) == (
        {"example.com/fpga": 4},
        10 << 30,
    )


def test_dra_claims_are_refused_by_name_only_when_the_scheduler_runs_without_dra() -> None:
    p = pod({"resourceClaims": [{"name": "gpu", "resourceClaimName": "c"}]})
    message = refused_fields(p, dra=False)
    assert message is not None and message.startswith("spec.resourceClaims (gpu)")
    assert "dra: false" in message
    assert refused_fields(p, dra=True) is None  # the claims module judges them (test_dra_claims.py)


def _claim(name: str, volume: str | None) -> PersistentVolumeClaim:
    return PersistentVolumeClaim.from_dict(
        {"metadata": {"name": name, "namespace": "team"}, "spec": {"volumeName": volume} if volume else {}}
    )


def test_volume_node_affinity_is_anded_with_the_pods_and_unbound_claims_are_refused() -> None:
    pv = PersistentVolume.from_dict(
        {
            "metadata": {"name": "pv"},
            "spec": {
                "nodeAffinity": {
                    "required": {
                        "nodeSelectorTerms": [
                            {"matchExpressions": [{"key": HOST, "operator": "In", "values": ["n1"]}]}
                        ]
                    }
                }
            },
        }
    )
    claims = {"data": _claim("data", "pv"), "later": _claim("later", None)}
    volumes = {"pv": pv}

    def lookup(spec: dict[str, Any]) -> Any:
        return volume_terms(pod(spec), claim=lambda ns, n: claims.get(n), volume=volumes.get)

    pinned = {
        "volumes": [{"name": "v", "persistentVolumeClaim": {"claimName": "data"}}],
        "affinity": {
            "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {
                    "nodeSelectorTerms": [{"matchExpressions": [{"key": "pool", "operator": "Exists"}]}]
                }
            }
        },
    }
    (terms,) = lookup(pinned)
    pending = pending_pod(
        pod(pinned),
        gpu=PodGpuRequest(),
        arrival=0,
        default_queue="default",
        mode_policy=ModePolicy.REQUIRED,
        volume_terms=[terms],
    )
    (term,) = pending.affinity
    assert term.matches({"pool": "a", HOST: "n1"})
    assert not term.matches({"pool": "a", HOST: "n2"})
    assert not term.matches({HOST: "n1"})
    with pytest.raises(RefusedPod, match=r"spec.volumes\[0\] \(PersistentVolumeClaim later\).*not bound"):
        lookup({"volumes": [{"name": "v", "persistentVolumeClaim": {"claimName": "later"}}]})
    with pytest.raises(RefusedPod, match="does not exist"):
        lookup({"volumes": [{"name": "v", "persistentVolumeClaim": {"claimName": "gone"}}]})
    with pytest.raises(RefusedPod, match=r"PersistentVolumeClaim p-scratch"):
        lookup({"volumes": [{"name": "scratch", "ephemeral": {"volumeClaimTemplate": {"spec": {}}}}]})


def test_anding_with_an_empty_term_matches_nothing() -> None:
    from gpufrac.placement.model import NodeSelectorTerm

    exists = NodeSelectorTerm((NodeSelectorRequirement("a", SelectorOperator.EXISTS),))
    (result,) = and_terms((NodeSelectorTerm(),), [(exists,)])
    assert not result.matches({"a": "1"})
