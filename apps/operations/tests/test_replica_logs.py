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
            "name": "decode-stable-0", "args": ["router", "--routing-table", str(table), "--scrape-interval", "0", "--no-auth"],
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


class _NotAnAgent:
    """An HTTP server at a cluster's agent_url that is not an agent: answers every GET with ``body``."""

    def __init__(self, body: bytes, content_type: str, status: int = 200):
        import http.server
        import threading

        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 - http.server's name
                outer.requests.append(self.headers.get("Authorization"))
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.requests: list[str | None] = []
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self):
        self.server.shutdown()
        self.server.server_close()


SECRET_PAGE = b'{"detail": "internal-metadata: aws_secret_access_key=AKIA-LEAKED"}'


@pytest.mark.parametrize(("body", "content_type", "status", "expected"), [
    (SECRET_PAGE, "application/json", 200, 503),  # a JSON/HTML page is not a log: refused, not echoed
    (SECRET_PAGE, "application/json", 500, 503),  # nor is an error body
    (b"x" * (4 * 2**20 + 10), "text/plain", 200, 503),  # more than 4 MiB
    (b"line one\x1b[31m red\x00\nline two\xff\n", "text/plain; charset=utf-8", 200, 200),
])
def test_logs_are_capped_text_never_a_remote_body_echoed(viewer_api, make_cluster, make_model_version, settings,
                                                         body, content_type, status, expected):
    from apps.fleet.services import pool_create

    settings.FERRY_AGENT_TOKEN = "agent-token-not-for-strangers"
    fake = _NotAnAgent(body, content_type, status)
    try:
        cluster = make_cluster("dc-fake", agent_url=fake.url)
        pool = pool_create(name="decode", role="decode", replicas=1, cluster=cluster,
                           model_version=make_model_version())
        replica = Replica.objects.create(pool=pool, track="stable", name="decode-stable-0", last_seen=timezone.now())
        response = viewer_api.get(f"/api/v1/replicas/{replica.pk}/logs/?tail=10")
    finally:
        fake.close()
    assert response.status_code == expected
    assert b"AKIA" not in response.content and len(response.content) < 4096
    if expected == 200:
        assert response.json()["lines"] == ["line one[31m red", "line two\ufffd"]
