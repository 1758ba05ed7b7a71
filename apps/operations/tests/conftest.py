"""Fixtures for operations tests: a Kubernetes API emulator (kmock) with a fake controller, and a
Kubernetes cluster + pool in the database pointing at it through a kubeconfig file."""

from __future__ import annotations

import pytest

from apps.fleet.services import cluster_create, pool_create
from apps.orchestrators.tests.kube_mock import FakeController, KubeMock

NS = "ferry"


@pytest.fixture
def kube():
    with KubeMock() as mock:
        yield mock


@pytest.fixture
def kube_controller(kube):
    controller = FakeController(kube.url, NS, ready_delay_s=0.2)
    controller.start()
    yield controller
    controller.stop()


@pytest.fixture
def k8s_cluster(db, kube, tmp_path):
    path = kube.kubeconfig(str(tmp_path / "kubeconfig.json"))
    return cluster_create(name="k8s-a", kind="kubernetes", datacenter="dc-k", kubeconfig_path=path,
                          context="mock", namespace=NS)


@pytest.fixture
def k8s_pool(k8s_cluster, model_version):
    return pool_create(name="decode-a", cluster=k8s_cluster, role="decode", model_version=model_version,
                       replicas=1, drain_timeout_s=30)
