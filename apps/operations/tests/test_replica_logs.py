"""``GET /api/v1/replicas/{id}/logs/``: a replica's last log lines, read through the real local agent.

The replica is a real process the agent owns (a router, which loads no model, so the test is cheap).
"""

import json

import pytest
from django.utils import timezone

from apps.fleet.models import Replica
from inference_worker.tests.support.agent import AgentProcess, wait_for


@pytest.fixture
def agent(tmp_path):
    agent = AgentProcess(tmp_path / "state").start()
    yield agent
    agent.terminate()


@pytest.fixture
def logged_replica(agent, make_cluster, make_model_version, tmp_path, settings):
    settings.FERRY_AGENT_TOKEN = agent.token
    table = tmp_path / "table.json"
    table.write_text(json.dumps({"version": 1, "tracks": [], "pools": []}))
    with agent.client() as client:
        created = client.post("/v1/processes", json={
            "name": "decode-stable-0", "args": ["router", "--routing-table", str(table), "--scrape-interval", "0"],
            "env": {"OMP_NUM_THREADS": "1"}, "labels": {"pool": "decode"}, "drain_timeout_s": 5})
        assert created.status_code == 201, created.text
        assert wait_for(lambda: len(client.get("/v1/processes/decode-stable-0/logs",
                                               params={"tail": 5}).text.splitlines()) >= 3, 60)
    cluster = make_cluster("dc-logs", agent_url=agent.base_url)
    from apps.fleet.services import pool_create

    pool = pool_create(name="decode", role="decode", replicas=1, cluster=cluster, model_version=make_model_version())
    return Replica.objects.create(pool=pool, track="stable", name="decode-stable-0", last_seen=timezone.now())


def test_logs_return_the_agents_last_lines(viewer_api, logged_replica, agent):
    response = viewer_api.get(f"/api/v1/replicas/{logged_replica.pk}/logs/?tail=3")
    assert response.status_code == 200, response.content
    body = response.json()
    assert body["replica"] == "decode-stable-0"
    assert len(body["lines"]) == 3
    # the log keeps growing (the agent polls /ready): the 3 lines are a contiguous run of the full log
    with agent.client() as client:
        full = client.get("/v1/processes/decode-stable-0/logs", params={"tail": 10000}).text.splitlines()
    runs = [full[i:i + 3] for i in range(len(full) - 2)]
    assert body["lines"] in runs
    assert full[0].startswith("--- ferry agent: starting decode-stable-0")


@pytest.mark.parametrize("tail", ["0", "-1", "abc", "5001"])
def test_bad_tail_is_a_400_naming_the_range(viewer_api, logged_replica, tail):
    response = viewer_api.get(f"/api/v1/replicas/{logged_replica.pk}/logs/?tail={tail}")
    assert response.status_code == 400
    assert "1 to 5000" in response.json()["tail"][0]


def test_replica_the_backend_lost_is_a_404_and_unknown_id_too(viewer_api, logged_replica):
    Replica.objects.filter(pk=logged_replica.pk).update(name="decode-stable-9")
    assert viewer_api.get(f"/api/v1/replicas/{logged_replica.pk}/logs/").status_code == 404
    assert viewer_api.get("/api/v1/replicas/999999/logs/").status_code == 404


def test_unreachable_agent_is_a_503_with_the_reason(viewer_api, logged_replica, agent):
    agent.terminate()
    response = viewer_api.get(f"/api/v1/replicas/{logged_replica.pk}/logs/")
    assert response.status_code == 503
    assert "decode-stable-0" in response.json()["detail"]
