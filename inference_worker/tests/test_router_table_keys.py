"""Client keys delivered in the routing table (issue 19: keys managed in the control plane): the router accepts
the table's ``client_keys`` besides its own file's, refuses a key once a table refresh no longer carries it,
rate-limits per key name (429), keeps a key to its models (403) and counts requests per key.

In-process router (FastAPI's TestClient) on a table file whose one pool has no replica: a request that gets past
the key checks is answered 503 "no replica", so every status here is decided by the router itself.
"""

import hashlib
import json

import pytest
from fastapi.testclient import TestClient
from prometheus_client import generate_latest

from inference_worker.router.app import Router, RouterConfig
from inference_worker.router.auth import ApiKeys, KeySpec
from inference_worker.router.table import RoutingTable, RoutingTableError

KEYS = {"team-a": "fck_team-a-secret", "team-b": "fck_team-b-secret", "file-key": "file-secret"}


def entry(name, **limits):
    return {"name": name, "key_sha256": hashlib.sha256(KEYS[name].encode()).hexdigest(), "rate_per_s": None,
            "burst": None, **limits}


def table(version, client_keys):
    data = {"version": version, "tracks": [{"name": "stable", "model_version": "v1", "weight": 100}],
            "pools": [{"name": "decode", "role": "decode", "datacenter": "dc1", "replicas": []}],
            "models": {"v1": {"layer_types": ["full_attention"], "sliding_window": 0, "num_kv_heads": 1,
                              "head_dim": 8, "dtype": "float16", "model": "gemma-3-270m"}}}
    if client_keys is not None:
        data["client_keys"] = client_keys
    return data


@pytest.fixture
def router(tmp_path):
    """(TestClient, Router, write(table dict)) with a router that has ``file-key`` in its own keys file."""
    path = tmp_path / "table.json"
    keys_file = tmp_path / "keys.json"
    keys_file.write_text(json.dumps({"keys": [{"name": "file-key", "key": KEYS["file-key"]}]}))

    def write(data):
        path.write_text(json.dumps(data))

    write(table(1, [entry("team-a"), entry("team-b", rate_per_s=0.01, burst=2)]))
    router = Router(RouterConfig(routing_table=str(path), api_keys=ApiKeys.from_file(keys_file),
                                 table_interval_s=3600, scrape_interval_s=0, kv_index=False))
    with TestClient(router.app) as client:
        yield client, router, write


def post(client, name=None, model="gemma-3-270m", key=None):
    headers = {} if name is None and key is None else {"Authorization": f"Bearer {key or KEYS[name]}"}
    return client.post("/v1/completions", json={"model": model, "prompt": "hi", "max_tokens": 1}, headers=headers)


def refresh(client, router):
    return client.portal.call(router.source.refresh)


def by_key(router, name):
    return router.metrics.registry.get_sample_value("ferry_router_requests_by_key_total", {"key": name})


def test_table_keys_and_file_keys_both_work_and_a_revoked_key_is_refused_after_the_next_refresh(router):
    client, r, write = router
    assert [post(client, n).status_code for n in ("team-a", "team-b", "file-key")] == [503, 503, 503]
    assert post(client, key="fck_unknown").status_code == 401 and post(client).status_code == 401
    write(table(2, [entry("team-b", rate_per_s=0.01, burst=2)]))  # team-a revoked in the control plane
    assert post(client, "team-a").status_code == 503  # the router has not polled yet
    assert refresh(client, r) is True
    refused = post(client, "team-a")
    assert (refused.status_code, refused.json()["error"]["type"]) == (401, "authentication_error")
    assert [post(client, n).status_code for n in ("team-b", "file-key")] == [503, 503]
    write(table(3, None))  # a table without client_keys: the router's own keys only
    assert refresh(client, r) is True
    assert [post(client, n).status_code for n in ("team-a", "team-b", "file-key")] == [401, 401, 503]
    assert (by_key(r, "team-a"), by_key(r, "team-b"), by_key(r, "file-key")) == (2.0, 2.0, 3.0)


def test_per_key_rate_limit_429_with_retry_after_and_a_refresh_keeps_the_bucket(router):
    client, r, write = router
    assert [post(client, "team-b").status_code for _ in range(2)] == [503, 503]  # burst 2
    limited = post(client, "team-b")
    assert (limited.status_code, limited.headers["retry-after"]) == (429, "100")  # 1 request / 100 s
    assert limited.json()["error"] == {"message": "rate limit of key 'team-b' exceeded; retry in 100s",
                                       "type": "rate_limit_error", "code": 429}
    assert post(client, "team-a").status_code == 503  # other keys are not limited
    write(table(2, [entry("team-a"), entry("team-b", rate_per_s=0.01, burst=2), entry("file-key")]))
    assert refresh(client, r) is True
    assert post(client, "team-b").status_code == 429  # same limits: the bucket is not refilled by a new table
    write(table(3, [entry("team-a"), entry("team-b", rate_per_s=0.01, burst=3)]))
    assert refresh(client, r) is True
    assert post(client, "team-b").status_code == 503  # new limits: a new bucket
    assert r.metrics.registry.get_sample_value("ferry_router_rate_limited_total", {"key": "team-b"}) == 2.0
    assert by_key(r, "team-b") == 5.0
    assert b'ferry_router_requests_by_key_total{key="team-b"} 5.0' in generate_latest(r.metrics.registry)


def test_a_key_limited_to_some_models_gets_403_for_others_and_sees_only_its_models(router):
    client, r, write = router
    write(table(2, [entry("team-a", models=["gemma-3-270m"]), entry("team-b", models=["smollm2-135m"])]))
    assert refresh(client, r) is True
    assert post(client, "team-a").status_code == 503
    refused = post(client, "team-b")
    assert (refused.status_code, refused.json()["error"]) == (403, {
        "message": "API key 'team-b' may use only the models ['smollm2-135m']; name one in 'model'",
        "type": "permission_error", "code": 403})
    assert post(client, "team-b", model=None).status_code == 403
    models = client.get("/v1/models", headers={"Authorization": f"Bearer {KEYS['team-b']}"})
    assert (models.status_code, models.json()["data"]) == (200, [])
    models = client.get("/v1/models", headers={"Authorization": f"Bearer {KEYS['team-a']}"})
    assert [m["id"] for m in models.json()["data"]] == ["gemma-3-270m"]


def test_a_rotated_key_in_its_grace_period_has_two_secrets_sharing_one_bucket():
    old, new = "fck_old", "fck_new"
    specs = [KeySpec.from_entry({"name": "k", "key_sha256": hashlib.sha256(s.encode()).hexdigest(),
                                 "rate_per_s": 0.01, "burst": 1}) for s in (old, new)]
    keys = ApiKeys([]).with_table_keys(specs)
    a, b = keys.authenticate(f"Bearer {old}"), keys.authenticate(f"Bearer {new}")
    assert (a.name, b.name) == ("k", "k") and a.bucket is b.bucket
    assert (ApiKeys.retry_after_s(a), ApiKeys.retry_after_s(b)) == (0, 100)


@pytest.mark.parametrize("bad, message", [
    ({"client_keys": {"name": "x"}}, "client_keys must be a list"),
    ({"client_keys": [{"name": "x", "key_sha256": "abc"}]}, "key_sha256 must be 64 hex digits"),
    ({"client_keys": [{"name": "x", "key_sha256": "0" * 64, "rate_per_s": 0}]}, "rate_per_s must be a positive"),
    ({"client_keys": [{"name": "x", "key_sha256": "0" * 64, "rate_per_s": 1, "burst": 0.5}]}, "burst must be >= 1"),
    ({"client_keys": [{"key_sha256": "0" * 64}]}, "KeyError"),
])
def test_a_malformed_client_keys_entry_is_a_table_error(bad, message):
    with pytest.raises(RoutingTableError, match=message):
        RoutingTable.from_dict({**table(1, None), **bad})


def test_refused_clients_do_not_push_admitted_requests_out_of_the_slow_request_ring(router):
    """``/debug/slow-requests`` is open and the ring keeps the last 512 requests: a client without a key (401),
    over its rate (429) or with a body the router refuses must not evict the admitted requests' timelines (before:
    600 unauthenticated requests left only 401 records)."""
    client, r, _ = router
    assert post(client, "team-a", model="gemma-3-270m").status_code == 503  # admitted, then no replica
    for _ in range(r.slow.capacity + 10):
        assert post(client).status_code == 401
    assert [post(client, "team-b").status_code for _ in range(3)] == [503, 503, 429]
    records = client.get("/debug/slow-requests?limit=200").json()["requests"]
    assert sorted(rec["attributes"]["status"] for rec in records) == [503, 503, 503]

