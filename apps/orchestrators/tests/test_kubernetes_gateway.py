"""Per-pool NetworkPolicies and Gateway API traffic splitting, against the Kubernetes emulator.

The emulator runs no Gateway controller: ``kube_mock.FakeGateway`` plays one through the official client,
setting the HTTPRoute's ``status.parents[].conditions`` (``Accepted``) for the generation it saw.
HTTPRoute has no core schema in ``kubernetes-validate``: the fields the backend writes (``backendRefs``:
group, kind, name, port, weight) are checked structurally against Gateway API v1's HTTPBackendRef rules
(:func:`check_backend_refs`).
"""

import re

import pytest
from kubernetes import client

from apps.orchestrators.base import InvalidSpec, ModelRef, NotFound, PoolRef, PoolTrackSpec
from apps.orchestrators.kubernetes_backend import KubernetesBackend
from apps.orchestrators.kubernetes_manifests import (
    GATEWAY_API_GROUP,
    HTTPROUTES,
    RouterSpec,
    router_deployment_manifest,
    track_router,
)
from apps.orchestrators.tests.kube_mock import HTTPROUTES as ROUTES
from apps.orchestrators.tests.kube_mock import NETWORK_POLICIES, FakeGateway, KubeMock, api_client
from inference_worker.tests.support.agent import wait_for

NS = "ferry"
ROUTE = "chat"
ROUTER = RouterSpec(namespace=NS, image="ferry:1", routing_table_url="http://ferry-web:8000/api/v1/routing-table/",
                    token_secret_name="ferry-service-token", port=8080)
MODEL = ModelRef(name="gemma-3-270m", version="v1", image="worker:v1")
DNS_1035 = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"


@pytest.fixture
def mock():
    with KubeMock() as m:
        yield m


@pytest.fixture
def backend(mock):
    return KubernetesBackend(api_client(mock.url), backoff_s=0.01, max_attempts=3, sleep=lambda s: None)


def test_decode_track_gets_a_network_policy_opening_http_to_routers_and_kv_to_peer_clusters(mock, backend):
    pool = PoolRef(pool_id=3, pool_name="decode-a", namespace=NS)
    backend.apply_pool_track(PoolTrackSpec(pool=pool, role="decode", track="stable", replicas=1, model=MODEL,
                                           kv_port=8001, kv_peer_cidrs=("10.8.0.0/16", "fd00:8::/64")))
    policy = mock.obj(NETWORK_POLICIES, NS, "decode-a-stable")
    assert policy["spec"] == {
        "podSelector": {"matchLabels": {"ferry.io/pool": "decode-a", "ferry.io/track": "stable"}},
        "policyTypes": ["Ingress"],
        "ingress": [
            {"from": [
                {"namespaceSelector": {}, "podSelector": {"matchLabels": {
                    "app.kubernetes.io/component": "router", "app.kubernetes.io/managed-by": "ferry"}}},
                {"namespaceSelector": {}, "podSelector": {"matchLabels": {"app.kubernetes.io/part-of": "ferry"}}},
                {"namespaceSelector": {}, "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}}},
            ], "ports": [{"protocol": "TCP", "port": 8000}]},
            {"from": [
                {"podSelector": {"matchLabels": {"ferry.io/role": "prefill",
                                                 "app.kubernetes.io/component": "inference-worker"}}},
                {"ipBlock": {"cidr": "10.8.0.0/16"}},
                {"ipBlock": {"cidr": "fd00:8::/64"}},
            ], "ports": [{"protocol": "TCP", "port": 8001}]},
        ],
    }
    container = backend.apps.read_namespaced_deployment("decode-a-stable", NS).spec.template.spec.containers[0]
    assert container.args[-2:] == ["--kv-port", "8001"]
    assert [(p.name, p.container_port) for p in container.ports] == [("http", 8000), ("kv", 8001)]
    backend.delete_track(pool, "stable")
    assert mock.obj(NETWORK_POLICIES, NS, "decode-a-stable") is None


def test_prefill_track_opens_http_to_decode_workers_and_peer_clusters_and_has_no_kv_rule(mock, backend):
    pool = PoolRef(pool_id=4, pool_name="prefill-b", namespace=NS)
    backend.apply_pool_track(PoolTrackSpec(pool=pool, role="prefill", track="canary", replicas=0, model=MODEL,
                                           kv_peer_cidrs=("10.9.0.0/16",)))
    ingress = mock.obj(NETWORK_POLICIES, NS, "prefill-b-canary")["spec"]["ingress"]
    assert len(ingress) == 1 and ingress[0]["ports"] == [{"protocol": "TCP", "port": 8000}]
    assert ingress[0]["from"][3:] == [
        {"podSelector": {"matchLabels": {"ferry.io/role": "decode", "app.kubernetes.io/component": "inference-worker"}}},
        {"ipBlock": {"cidr": "10.9.0.0/16"}}]


@pytest.mark.parametrize(("fields", "message"), [
    ({"kv_peer_cidrs": ("10.8.0.1/16",)}, "not a CIDR"),
    ({"kv_peer_cidrs": ("everywhere",)}, "not a CIDR"),
    ({"kv_port": 8000}, "differ from port 8000"),
    ({"kv_port": 70000}, "kv_port must be in 1..65535"),
])
def test_bad_kv_port_or_peer_cidr_is_invalid_spec(fields, message):
    with pytest.raises(InvalidSpec, match=message):
        PoolTrackSpec(pool=PoolRef(pool_id=1, pool_name="p", namespace=NS), role="decode", track="stable",
                      replicas=1, model=MODEL, **fields)


def test_track_router_is_pinned_to_its_track_behind_its_own_service():
    canary = router_deployment_manifest(track_router(ROUTER, "canary"))
    assert canary["metadata"]["name"] == "ferry-router-canary"
    assert canary["metadata"]["labels"]["ferry.io/track"] == "canary"
    args = canary["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--track") + 1] == "canary"


def check_backend_refs(refs: list[dict]) -> None:
    """Gateway API v1 HTTPBackendRef as the backend writes it: core Service refs (group "", kind Service),
    an RFC 1035 name, a port 1..65535, a weight 0..1000000; at most 16 refs per rule."""
    assert 1 <= len(refs) <= 16
    for ref in refs:
        assert set(ref) == {"group", "kind", "name", "port", "weight"}
        assert (ref["group"], ref["kind"]) == ("", "Service")
        assert re.match(DNS_1035, ref["name"]) and len(ref["name"]) <= 63
        assert 1 <= ref["port"] <= 65535 and 0 <= ref["weight"] <= 1_000_000


def test_canary_steps_move_the_httproute_weights_and_abort_moves_them_back(mock, backend):
    custom = client.CustomObjectsApi(api_client(mock.url))
    custom.create_namespaced_custom_object(GATEWAY_API_GROUP, "v1", NS, HTTPROUTES, {
        "apiVersion": "gateway.networking.k8s.io/v1", "kind": "HTTPRoute",
        "metadata": {"name": ROUTE, "namespace": NS},
        "spec": {"parentRefs": [{"name": "public"}],
                 "rules": [{"matches": [{"path": {"type": "PathPrefix", "value": "/v1"}}],
                            "backendRefs": [{"name": "ferry-router", "port": 8080}]}]}})
    gateway = FakeGateway(mock.url, NS, ROUTE)
    gateway.start()
    assert wait_for(lambda: gateway.accepted == [[1]], timeout_s=10, interval_s=0.05)  # generation 1 (default weight)
    try:
        applied = []
        for canary in (10, 50, 100, 0):  # three steps, then an abort back to stable
            generation = backend.set_route_weights(NS, ROUTE, ROUTER.name, ROUTER.port,
                                                   {"stable": 100 - canary, "canary": canary})
            assert backend.route_accepted(NS, ROUTE, generation) is False  # the controller has not seen it yet
            assert wait_for(lambda g=generation: backend.route_accepted(NS, ROUTE, g), timeout_s=10, interval_s=0.05)
            route = mock.obj(ROUTES, NS, ROUTE)
            refs = route["spec"]["rules"][0]["backendRefs"]
            check_backend_refs(refs)
            applied.append([(r["name"], r["weight"]) for r in refs])
            assert route["spec"]["rules"][0]["matches"] == [{"path": {"type": "PathPrefix", "value": "/v1"}}]
    finally:
        gateway.stop()
    assert applied == [
        [("ferry-router-stable", 90), ("ferry-router-canary", 10)],
        [("ferry-router-stable", 50), ("ferry-router-canary", 50)],
        [("ferry-router-stable", 0), ("ferry-router-canary", 100)],
        [("ferry-router-stable", 100), ("ferry-router-canary", 0)],
    ]
    assert gateway.accepted == [[1], [90, 10], [50, 50], [0, 100], [100, 0]]  # each step accepted once, in order
    assert mock.obj(ROUTES, NS, ROUTE)["metadata"]["generation"] == 5


def test_route_weights_reject_bad_splits_and_missing_routes(backend):
    with pytest.raises(InvalidSpec):
        backend.set_route_weights(NS, ROUTE, "ferry-router", 8080, {"stable": 80, "canary": 10})
    with pytest.raises(NotFound):
        backend.set_route_weights(NS, "missing", "ferry-router", 8080, {"stable": 100})
