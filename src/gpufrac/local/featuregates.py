"""The Kubernetes feature gates the embedded cluster's components run with: one setting, one home.

gpufrac's DRA driver publishes GPUs whose memory many claims consume (KEP-5075, consumable capacity:
``allowMultipleAllocations`` and ``capacity.requestPolicy``). On Kubernetes 1.34 and 1.35 that is the
alpha gate ``DRAConsumableCapacity`` (off by default; without it the API server drops the fields and the
scheduler hands a GPU to one claim only); from 1.36 it is beta and on by default
(``pkg/features/kube_features.go`` of k8s.io/kubernetes v1.34.4 and v1.37.2). Every component that
reads those fields -- kube-apiserver, kube-scheduler, kube-controller-manager, kubelet -- gets the same
flag from here, so moving the test environment to another Kubernetes release changes this dict only
(a gate that a release no longer knows makes its components refuse to start: drop it here then).
"""

from __future__ import annotations

#: Gate name -> enabled, for every component.
FEATURE_GATES: dict[str, bool] = {"DRAConsumableCapacity": True}


def feature_gates_flag(gates: dict[str, bool] | None = None) -> str:
    """The ``--feature-gates=`` flag every Kubernetes component accepts (empty string for no gates)."""
    chosen = FEATURE_GATES if gates is None else gates
    if not chosen:
        return ""
    return "--feature-gates=" + ",".join(f"{name}={str(on).lower()}" for name, on in sorted(chosen.items()))
