"""API tests for clusters, cluster links and pools: CRUD, filters, validation (400) and roles."""

import pytest

from apps.fleet.models import Cluster, ClusterLink, Pool

pytestmark = pytest.mark.django_db

LOCAL = {"kind": "local", "agent_url": "http://127.0.0.1:9300"}


def test_cluster_create_list_filter_update_delete(admin_api):
    r = admin_api.post("/api/v1/clusters/", {"name": "dc-a", "datacenter": "eu", **LOCAL}, format="json")
    assert r.status_code == 201, r.json()
    assert r.json()["status"] == "unknown"
    k8s = {"name": "dc-b", "kind": "kubernetes", "datacenter": "us", "kubeconfig_secret": "dc-b-kubeconfig",
           "context": "prod", "namespace": "ferry", "labels": {"tier": "gpu"}}
    assert admin_api.post("/api/v1/clusters/", k8s, format="json").status_code == 201
    assert [c["name"] for c in admin_api.get("/api/v1/clusters/").json()["results"]] == ["dc-a", "dc-b"]
    assert [c["name"] for c in admin_api.get("/api/v1/clusters/?kind=kubernetes").json()["results"]] == ["dc-b"]
    assert [c["name"] for c in admin_api.get("/api/v1/clusters/?ordering=-name").json()["results"]] == ["dc-b", "dc-a"]
    cid = r.json()["id"]
    r = admin_api.patch(f"/api/v1/clusters/{cid}/", {"datacenter": "eu-west"}, format="json")
    assert r.status_code == 200 and r.json()["datacenter"] == "eu-west"
    assert admin_api.delete(f"/api/v1/clusters/{cid}/").status_code == 204
    assert list(Cluster.objects.values_list("name", flat=True)) == ["dc-b"]
    assert admin_api.get(f"/api/v1/clusters/{cid}/").status_code == 404


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"name": "x", "kind": "local"}, "agent_url"),
        ({"name": "x", "kind": "kubernetes", "namespace": "ferry"}, "kubeconfig_path"),
        ({"name": "x", "kind": "kubernetes", "in_cluster": True, "kubeconfig_path": "/k", "namespace": "f"},
         "kubeconfig_path"),
        ({"name": "x", "kind": "kubernetes", "in_cluster": True}, "namespace"),
        ({"name": "x", "kind": "local", "agent_url": "http://127.0.0.1:1", "namespace": "ferry"}, "namespace"),
        ({"name": "Bad_Name", **LOCAL}, "name"),
        ({"name": "x", "kind": "mesos"}, "kind"),
        ({"name": "x", "labels": {"bad key!": "v"}, **LOCAL}, "labels"),
    ],
)
def test_cluster_validation_per_kind_returns_400_with_field(admin_api, body, field):
    r = admin_api.post("/api/v1/clusters/", body, format="json")
    assert r.status_code == 400
    assert field in r.json()


def test_cluster_with_pools_cannot_be_deleted(admin_api, pool):
    r = admin_api.delete(f"/api/v1/clusters/{pool.cluster_id}/")
    assert r.status_code == 409
    assert "still in use by pool" in r.json()["detail"]


def test_cluster_link_crud_and_validation(admin_api, make_cluster):
    a, b = make_cluster("dc-a"), make_cluster("dc-b")
    body = {"source": a.pk, "destination": b.pk, "bandwidth_gbps": 10.0, "rtt_ms": 35.5}
    r = admin_api.post("/api/v1/cluster-links/", body, format="json")
    assert r.status_code == 201, r.json()
    assert (r.json()["source_name"], r.json()["destination_name"]) == ("dc-a", "dc-b")
    assert admin_api.post("/api/v1/cluster-links/", body, format="json").status_code == 400  # duplicate pair
    self_link = admin_api.post("/api/v1/cluster-links/", {**body, "destination": a.pk}, format="json")
    assert self_link.status_code == 400 and "destination" in self_link.json()
    reverse = {"source": b.pk, "destination": a.pk}
    assert admin_api.post("/api/v1/cluster-links/", {**reverse, "bandwidth_gbps": 0, "rtt_ms": 1},
                          format="json").status_code == 400
    assert admin_api.post("/api/v1/cluster-links/", {**reverse, "bandwidth_gbps": 1, "rtt_ms": -1},
                          format="json").status_code == 400
    lid = r.json()["id"]
    assert admin_api.get(f"/api/v1/cluster-links/?source={b.pk}").json()["count"] == 0
    assert admin_api.get(f"/api/v1/cluster-links/?source={a.pk}").json()["count"] == 1
    r = admin_api.patch(f"/api/v1/cluster-links/{lid}/", {"rtt_ms": 80}, format="json")
    assert r.status_code == 200 and r.json()["rtt_ms"] == 80.0
    assert admin_api.delete(f"/api/v1/cluster-links/{lid}/").status_code == 204
    assert ClusterLink.objects.count() == 0


def _pool_body(cluster, model_version, **over):
    return {"name": "decode", "cluster": cluster.pk, "role": "decode", "model_version": model_version.pk,
            "replicas": 3, "cpu": "4", "memory": "16Gi", "node_selector": {"ferry.io/gpu": "h200"},
            "tolerations": [{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}],
            "autoscaling_enabled": True, "min_replicas": 1, "max_replicas": 8,
            "autoscaling_signal": "num_requests_waiting", "autoscaling_target": 4,
            "schedule_overrides": [{"start": "08:00", "end": "20:00", "replicas": 6, "days": ["mon", "tue"]}],
            "schedule_time_zone": "Europe/Paris", **over}


def test_pool_create_list_filter_update_delete(admin_api, cluster, model_version, make_model_version):
    r = admin_api.post("/api/v1/pools/", _pool_body(cluster, model_version), format="json")
    assert r.status_code == 201, r.json()
    body = r.json()
    assert body["replicas"] == 3
    assert body["tracks"] == [{"name": "stable", "model_version": model_version.pk, "replicas": 3, "weight": 100,
                               "active": True, "extra_args": ""}]
    admin_api.post("/api/v1/pools/", _pool_body(cluster, model_version, name="prefill", role="prefill"),
                   format="json")
    assert [p["name"] for p in admin_api.get("/api/v1/pools/?role=prefill").json()["results"]] == ["prefill"]
    assert admin_api.get(f"/api/v1/pools/?cluster_name={cluster.name}").json()["count"] == 2
    v2 = make_model_version("v2")
    r = admin_api.patch(f"/api/v1/pools/{body['id']}/", {"model_version": v2.pk, "drain_timeout_s": 60},
                        format="json")
    assert r.status_code == 200, r.json()
    assert r.json()["drain_timeout_s"] == 60
    assert r.json()["tracks"][0]["model_version"] == v2.pk  # the stable track follows the pool's version
    assert admin_api.delete(f"/api/v1/pools/{body['id']}/").status_code == 204
    assert list(Pool.objects.values_list("name", flat=True)) == ["prefill"]


@pytest.mark.parametrize(
    ("over", "field"),
    [
        ({"replicas": -1}, "replicas"),
        ({"role": "encoder"}, "role"),
        ({"min_replicas": 5, "max_replicas": 2}, "min_replicas"),
        ({"schedule_time_zone": "Mars/Olympus"}, "schedule_time_zone"),
        ({"schedule_overrides": [{"start": "25:00", "end": "01:00", "replicas": 1}]}, "schedule_overrides"),
        ({"tolerations": [{"key": "gpu", "operator": "Sometimes"}]}, "tolerations"),
        ({"memory": "lots"}, "memory"),
        ({"node_selector": ["not", "a", "dict"]}, "node_selector"),
    ],
)
def test_pool_invalid_input_returns_400_with_field(admin_api, cluster, model_version, over, field):
    r = admin_api.post("/api/v1/pools/", _pool_body(cluster, model_version, **over), format="json")
    assert r.status_code == 400
    assert field in r.json(), r.json()


def test_pool_replicas_change_only_through_scale(admin_api, pool):
    r = admin_api.patch(f"/api/v1/pools/{pool.pk}/", {"replicas": 9}, format="json")
    assert r.status_code == 400
    assert r.json() == {"replicas": ["Change replicas with POST /api/v1/pools/{id}/scale/."]}


def test_anonymous_gets_401_and_viewer_writes_get_403(client, viewer_api, operator_api, cluster, model_version):
    r = client.get("/api/v1/pools/")
    assert r.status_code == 401
    assert r.headers["WWW-Authenticate"] == 'Token'
    assert viewer_api.get("/api/v1/pools/").status_code == 200
    body = _pool_body(cluster, model_version)
    r = viewer_api.post("/api/v1/pools/", body, format="json")
    assert r.status_code == 403
    assert r.json()["detail"] == "This request needs the admin role; you have viewer."
    assert operator_api.post("/api/v1/pools/", body, format="json").status_code == 403
    assert operator_api.delete(f"/api/v1/clusters/{cluster.pk}/").status_code == 403


def test_unknown_id_is_404(admin_api):
    assert admin_api.get("/api/v1/pools/999999/").status_code == 404
    assert admin_api.post("/api/v1/pools/999999/scale/", {"replicas": 1}, format="json").status_code == 404


def test_link_source_cidrs_and_cluster_gateway_route_are_validated_with_400s(admin_api, make_cluster):
    local = make_cluster("dc-a")
    kube = make_cluster("k8s-b", kind="kubernetes", agent_url="", namespace="ferry", in_cluster=True)
    body = {"source": local.pk, "destination": kube.pk, "bandwidth_gbps": 10.0, "rtt_ms": 2,
            "source_cidrs": ["10.8.0.0/16", "fd00:8::/64"]}
    r = admin_api.post("/api/v1/cluster-links/", body, format="json")
    assert r.status_code == 201 and r.json()["source_cidrs"] == ["10.8.0.0/16", "fd00:8::/64"]
    link = f"/api/v1/cluster-links/{r.json()['id']}/"
    for bad, message in ((["10.8.0.1/16"], "'10.8.0.1/16' is not a CIDR"), ("10.8.0.0/16", "JSON list of CIDRs"),
                         ([8], "is not a string")):
        r = admin_api.patch(link, {"source_cidrs": bad}, format="json")
        assert r.status_code == 400 and message in r.json()["source_cidrs"][0], r.json()
    r = admin_api.patch(f"/api/v1/clusters/{kube.pk}/", {"gateway_httproute": "chat"}, format="json")
    assert r.status_code == 200 and r.json()["gateway_httproute"] == "chat"
    r = admin_api.patch(f"/api/v1/clusters/{local.pk}/", {"gateway_httproute": "chat"}, format="json")
    assert r.status_code == 400 and r.json()["gateway_httproute"] == ["Only Kubernetes clusters take this field."]
    assert admin_api.patch(f"/api/v1/clusters/{kube.pk}/", {"gateway_httproute": "Chat_Route"},
                           format="json").status_code == 400


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ({"tracks": [{"name": "canary", "replicas": 3}]},
         {"tracks": ["Tracks are read-only here: the rollout controller writes them (POST /api/v1/rollouts/), the "
                     "total replicas change with POST /api/v1/pools/{id}/scale/."]}),
        ({"created_at": "2026-01-01T00:00:00Z", "drain_timeout_s": 60}, {"created_at": ["This field is read-only."]}),
        ({"drain_timeout": 60}, {"drain_timeout": ["Unknown field: it is not part of this resource."]}),
    ],
)
def test_a_write_with_a_field_the_pool_api_does_not_write_is_400_and_changes_nothing(admin_api, pool, body, expected):
    """Regression (issue 20): PATCH with ``tracks`` answered 200 and changed nothing."""
    before = admin_api.get(f"/api/v1/pools/{pool.pk}/").json()
    r = admin_api.patch(f"/api/v1/pools/{pool.pk}/", body, format="json")
    assert (r.status_code, r.json()) == (400, expected)
    assert admin_api.get(f"/api/v1/pools/{pool.pk}/").json() == before


def test_cluster_and_link_writes_refuse_read_only_and_unknown_fields(admin_api, make_cluster):
    a, b = make_cluster("dc-x"), make_cluster("dc-y")
    r = admin_api.patch(f"/api/v1/clusters/{a.pk}/", {"status": "ready"}, format="json")
    assert (r.status_code, r.json()) == (400, {"status": ["This field is read-only."]})
    r = admin_api.post("/api/v1/cluster-links/", {"source": a.pk, "destination": b.pk, "bandwidth_gbps": 10,
                                                   "rtt_ms": 1, "latency_ms": 1}, format="json")
    assert (r.status_code, r.json()) == (400, {"latency_ms": ["Unknown field: it is not part of this resource."]})


@pytest.mark.django_db
def test_a_vllm_or_sglang_pool_is_a_colocated_pool_on_kubernetes(admin_api, cluster, make_cluster, model_version):
    kube = make_cluster("k8s-e", kind="kubernetes", agent_url="", namespace="ferry", in_cluster=True)
    local = admin_api.post("/api/v1/pools/", _pool_body(cluster, model_version, name="chat", role="colocated",
                                                        engine="vllm"), format="json")
    assert local.status_code == 400
    assert local.json() == {"engine": ["engine 'vllm' runs on Kubernetes clusters only; the local agent runs Ferry "
                                       "workers (engine 'ferry')."]}
    decode = admin_api.post("/api/v1/pools/", _pool_body(kube, model_version, name="chat", engine="sglang"),
                            format="json")
    assert decode.status_code == 400
    assert "colocated pools only" in decode.json()["engine"][0]
    unknown = admin_api.post("/api/v1/pools/", _pool_body(kube, model_version, name="chat", role="colocated",
                                                          engine="tgi"), format="json")
    assert unknown.status_code == 400 and "engine" in unknown.json()
    ok = admin_api.post("/api/v1/pools/", _pool_body(kube, model_version, name="chat", role="colocated",
                                                     engine="vllm"), format="json")
    assert ok.status_code == 201, ok.json()
    assert ok.json()["engine"] == "vllm"
    switch = admin_api.patch(f"/api/v1/pools/{ok.json()['id']}/", {"role": "decode"}, format="json")
    assert switch.status_code == 400 and "colocated pools only" in switch.json()["engine"][0]
    assert Pool.objects.get(pk=ok.json()["id"]).role == "colocated"


def test_link_and_cluster_writes_publish_the_routing_table_at_once(admin_api, make_cluster):
    """Routers see a link or datacenter change at their next poll: the write republishes the table (before, only
    the next reconcile tick did, seconds later)."""
    from apps.fleet.models import RoutingTable

    a, b = make_cluster("dc-a"), make_cluster("dc-b")

    def table() -> tuple[int, list]:
        row = RoutingTable.objects.get(pk=1)
        return row.version, row.content["links"]

    r = admin_api.post("/api/v1/cluster-links/", {"source": a.pk, "destination": b.pk, "bandwidth_gbps": 10.0,
                                                  "rtt_ms": 35.5}, format="json")
    assert r.status_code == 201, r.json()
    version, links = table()
    assert [(link["bandwidth_gbps"], link["rtt_ms"]) for link in links] == [(10.0, 35.5)]
    assert admin_api.patch(f"/api/v1/cluster-links/{r.json()['id']}/", {"rtt_ms": 80}, format="json").status_code == 200
    assert table() == (version + 1, [{**links[0], "rtt_ms": 80.0}])
    assert admin_api.patch(f"/api/v1/clusters/{a.pk}/", {"datacenter": "eu-west"}, format="json").status_code == 200
    assert table() == (version + 2, [{**links[0], "rtt_ms": 80.0, "source": "eu-west"}])
    assert admin_api.delete(f"/api/v1/cluster-links/{r.json()['id']}/").status_code == 204
    assert table() == (version + 3, [])
