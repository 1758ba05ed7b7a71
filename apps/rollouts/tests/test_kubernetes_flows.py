"""Canary and blue-green against the Kubernetes API emulator (kmock) with the fake controller: reconcile
and pool Actions converge the Deployments to the tracks the rollout writes; the Deployments, Services
and routing table end in the expected shape after promote and after abort.

The fake controller's pods answer on loopback (a stand-in worker serving ``/v1/completions``) so the
blue-green smoke test makes a real HTTP completion through the preview replica's endpoint.
"""

from __future__ import annotations

import time

import pytest
from kubernetes import client

from apps.fleet.services import cluster_create, pool_create
from apps.operations.models import Action
from apps.operations.reconcile import reconcile_all
from apps.operations.tasks import execute_action
from apps.orchestrators.kubernetes_manifests import GATEWAY_API_GROUP, HTTPROUTES
from apps.orchestrators.tests.kube_mock import (
    DEPLOYMENTS,
    SERVICES,
    FakeController,
    FakeGateway,
    KubeMock,
    api_client,
)
from apps.orchestrators.tests.kube_mock import HTTPROUTES as HTTPROUTES_RESOURCE
from apps.rollouts import services
from apps.rollouts.controller import rollout_tick
from apps.rollouts.models import RolloutPlan
from apps.rollouts.tests.conftest import due_now, table_weights
from inference_worker.tests.support.agent import wait_for

pytestmark = pytest.mark.django_db
NS = "ferry"


class LoopbackController(FakeController):
    """The fake controller, with pods that listen on the stand-in worker (127.0.0.1:<port>)."""

    def __init__(self, url: str, namespace: str, port: int) -> None:
        super().__init__(url, namespace, ready_delay_s=0.1, period_s=0.2)
        self.port = port

    def _create_pod(self, dep):  # noqa: ANN001, ANN202 - the client's Deployment model
        n = next(self._ids)
        name = f"{dep.metadata.name}-{n:05d}"
        template = dep.spec.template
        spec = self.apps.api_client.sanitize_for_serialization(template.spec)
        spec["containers"][0]["ports"] = [{"name": "http", "containerPort": self.port}]
        body = {"apiVersion": "v1", "kind": "Pod",
                "metadata": {"name": name, "namespace": self.namespace, "labels": dict(template.metadata.labels)},
                "spec": spec,
                "status": {"phase": "Running", "podIP": "127.0.0.1",
                           "conditions": [{"type": "Ready", "status": "False"}]}}
        self._created_at[name] = time.monotonic()
        return self.core.create_namespaced_pod(self.namespace, body)


@pytest.fixture
def world(tmp_path, make_model_version, fake_http, settings):
    settings.FERRY_ACTION_READY_TIMEOUT_S = 30
    with KubeMock() as kube:
        controller = LoopbackController(kube.url, NS, int(fake_http.url.rsplit(":", 1)[1]))
        controller.start()
        cluster = cluster_create(name="k8s-a", kind="kubernetes", datacenter="dc-k", namespace=NS, context="mock",
                                 kubeconfig_path=kube.kubeconfig(str(tmp_path / "kubeconfig.json")))
        pool = pool_create(name="chat", cluster=cluster, role="colocated", model_version=make_model_version("v1"),
                           replicas=2, drain_timeout_s=1)
        converge()
        yield kube, pool, make_model_version("v2")
        controller.stop()
        assert controller.errors == []


def converge() -> None:
    """One reconcile tick, the Actions it requested run to completion, and a second tick to observe."""
    reconcile_all()
    for action in Action.objects.filter(status="pending", kind__startswith="pool."):
        outcome = execute_action.apply(args=[action.pk]).get()
        assert outcome == "succeeded", [line["message"] for line in Action.objects.get(pk=action.pk).log]
    reconcile_all()


def run_until(plan: RolloutPlan, done, max_rounds: int = 30) -> None:  # noqa: ANN001 - predicate
    for _ in range(max_rounds):
        plan.refresh_from_db()
        if done(plan):
            return
        converge()
        rollout_tick(rollout_id=plan.pk, now=due_now(plan))
    raise AssertionError(f"{plan.state}/{plan.phase}: {plan.message}")


def deployments(kube) -> dict[str, tuple[int, str]]:
    out = {}
    for track in ("stable", "canary", "blue", "green"):
        dep = kube.obj(DEPLOYMENTS, NS, f"chat-{track}")
        if dep is not None:
            labels = dep["spec"]["template"]["metadata"]["labels"]
            out[track] = (dep["spec"]["replicas"], labels["ferry.io/model-version"])
    return out


def _canary(pool, v2):
    plan = services.rollout_plan_create(pools=[pool], target_model_version=v2, name="k8s canary", strategy="canary",
                                        steps=[{"set_weight": 50}, {"pause": {}}])
    services.rollout_start(plan=plan)
    run_until(plan, lambda p: p.state == "paused")
    converge()
    return plan


def test_canary_on_kubernetes_after_promote(world):
    kube, pool, v2 = world
    plan = _canary(pool, v2)
    assert deployments(kube) == {"stable": (1, "v1"), "canary": (1, "v2")}
    assert table_weights() == {"canary": ("v2", 50), "stable": ("v1", 50)}
    services.rollout_promote(plan=plan)
    run_until(plan, lambda p: p.state == "promoted")
    converge()
    assert deployments(kube) == {"stable": (2, "v2")}
    assert table_weights() == {"stable": ("v2", 100)}


def test_canary_on_kubernetes_after_abort(world):
    kube, pool, v2 = world
    plan = _canary(pool, v2)
    services.rollout_abort(plan=plan)
    assert table_weights() == {"canary": ("v2", 0), "stable": ("v1", 100)}
    run_until(plan, lambda p: not p.progress.get("cleanup"))
    converge()
    assert deployments(kube) == {"stable": (2, "v1")}
    assert table_weights() == {"stable": ("v1", 100)}


def _blue_green(pool, v2):
    plan = services.rollout_plan_create(pools=[pool], target_model_version=v2, name="k8s bg",
                                        strategy="blue_green", steps=[], scale_down_delay_s=3600)
    services.rollout_start(plan=plan)
    run_until(plan, lambda p: p.progress.get("switched_at") is not None)
    converge()
    return plan


def _service_track(kube) -> str:
    return kube.obj(SERVICES, NS, "chat")["spec"]["selector"]["ferry.io/track"]


def test_blue_green_on_kubernetes_after_promote(world, fake_http):
    kube, pool, v2 = world
    plan = _blue_green(pool, v2)
    assert fake_http.completions == 1  # the smoke test went through a preview pod's endpoint
    assert deployments(kube) == {"stable": (2, "v1"), "green": (2, "v2")}
    assert _service_track(kube) == "green"
    assert table_weights() == {"green": ("v2", 100), "stable": ("v1", 0)}
    RolloutPlan.objects.filter(pk=plan.pk).update(next_step_at=None)  # the scale-down delay is over
    run_until(plan, lambda p: p.state == "promoted")
    converge()
    assert deployments(kube) == {"green": (2, "v2")}
    assert _service_track(kube) == "green"
    assert table_weights() == {"green": ("v2", 100)}


def test_blue_green_on_kubernetes_after_abort_switches_back(world):
    kube, pool, v2 = world
    plan = _blue_green(pool, v2)
    stable_pods = kube.obj(DEPLOYMENTS, NS, "chat-stable")["metadata"].get("generation")
    services.rollout_abort(plan=plan)
    assert table_weights() == {"green": ("v2", 0), "stable": ("v1", 100)}
    run_until(plan, lambda p: not p.progress.get("cleanup"))
    converge()
    assert deployments(kube) == {"stable": (2, "v1")}
    assert kube.obj(DEPLOYMENTS, NS, "chat-stable")["metadata"].get("generation") == stable_pods
    assert _service_track(kube) == "stable"
    assert table_weights() == {"stable": ("v1", 100)}


def test_canary_with_gateway_api_moves_the_httproute_weights_step_by_step_and_back_on_abort(world):
    kube, pool, v2 = world
    cluster = pool.cluster
    cluster.gateway_httproute = "chat"
    cluster.save(update_fields=["gateway_httproute"])
    custom = client.CustomObjectsApi(api_client(kube.url))
    custom.create_namespaced_custom_object(GATEWAY_API_GROUP, "v1", NS, HTTPROUTES, {
        "apiVersion": "gateway.networking.k8s.io/v1", "kind": "HTTPRoute", "metadata": {"name": "chat", "namespace": NS},
        "spec": {"parentRefs": [{"name": "public"}], "rules": [{"backendRefs": [{"name": "ferry-router", "port": 8080}]}]}})
    gateway = FakeGateway(kube.url, NS, "chat", delay_s=0.05)
    gateway.start()
    try:
        assert wait_for(lambda: gateway.accepted == [[1]], 10, 0.05)
        plan = services.rollout_plan_create(pools=[pool], target_model_version=v2, name="gw canary", strategy="canary",
                                            steps=[{"set_weight": 25}, {"set_weight": 50}, {"pause": {}}])
        services.rollout_start(plan=plan)
        run_until(plan, lambda p: p.state == "paused")
        assert table_weights() == {"canary": ("v2", 50), "stable": ("v1", 50)}, gateway.accepted
        services.rollout_abort(plan=plan)
        assert wait_for(lambda: gateway.accepted[-1] == [100, 0], 10, 0.05), gateway.accepted
        run_until(plan, lambda p: not p.progress.get("cleanup"))
    finally:
        gateway.stop()
    refs = kube.obj(HTTPROUTES_RESOURCE, NS, "chat")["spec"]["rules"][0]["backendRefs"]
    assert [(ref["name"], ref["weight"]) for ref in refs] == [("ferry-router-stable", 100), ("ferry-router-canary", 0)]
    # generation 1 as created, then each weight the controller applied, in order, each accepted once
    assert gateway.accepted == [[1], [100, 0], [75, 25], [50, 50], [100, 0]]
