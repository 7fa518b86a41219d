"""A replica's name in its Lease: both controllers take the pod's name (``POD_NAME``) when no
``--identity`` is given, and a unique name outside a pod."""

from __future__ import annotations

import pytest
from lightkube import AsyncClient
from lightkube.config.kubeconfig import KubeConfig
from lightkube.config.models import Cluster, User

from gpufrac.operator.reconciler import Operator
from gpufrac.process.controller import default_identity
from gpufrac.scheduler.config import SchedulerConfig
from gpufrac.scheduler.placement_engine import build_engine
from gpufrac.scheduler.service import SchedulerService


def _client() -> AsyncClient:
    config = KubeConfig.from_one(cluster=Cluster(server="http://127.0.0.1:9"), user=User())
    return AsyncClient(config)  # never dialled: nothing here runs


def _identities() -> tuple[str, str]:
    config = SchedulerConfig()
    scheduler = SchedulerService(client=_client(), config=config, engine=build_engine(config))
    return scheduler.identity, Operator(client=_client()).identity


def test_both_controllers_name_themselves_after_their_pod(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("POD_NAME", "gpufrac-scheduler-7d9c-x2k4q")
    assert _identities() == ("gpufrac-scheduler-7d9c-x2k4q", "gpufrac-scheduler-7d9c-x2k4q")


def test_an_explicit_identity_wins_over_the_pods_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("POD_NAME", "from-env")
    config = SchedulerConfig()
    service = SchedulerService(client=_client(), config=config, engine=build_engine(config), identity="given")
    assert (service.identity, Operator(client=_client(), identity="given").identity) == ("given", "given")


def test_outside_a_pod_every_replica_gets_a_name_of_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("POD_NAME", raising=False)
    names = {default_identity() for _ in range(20)} | set(_identities())
    assert len(names) == 22 and all(names)
