"""The router under hostile input, as a real process: malformed bodies are 400s, oversized ones 413, in-flight
seats per key (429) and overall (503) carry ``Retry-After``, and a client that leaves has its upstream request
cancelled (seen by the upstream as a disconnect) and its seat given back.

The upstream here holds every completion until its caller hangs up and logs the request id when that
happens, so "the router cancelled the upstream request" is observed where it matters.
"""

import json
import subprocess
import sys
import textwrap
import time

import httpx
import pytest

from inference_worker.tests.support.agent import wait_for
from inference_worker.tests.support.router import send_and_hold
from inference_worker.tests.test_request_limits import BAD_BODIES
from inference_worker.tests.test_router_proxy import Fleet, free_port, metric, wait_http

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

HOLD_APP = textwrap.dedent('''
    import sys
    import uvicorn

    port, log_path = int(sys.argv[1]), sys.argv[2]

    async def app(scope, receive, send):
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                await send({"type": message["type"] + ".complete"})
                if message["type"] == "lifespan.shutdown":
                    return
        if scope["method"] == "GET":
            status = 200 if scope["path"] == "/metrics" else 404
            await send({"type": "http.response.start", "status": status, "headers": []})
            await send({"type": "http.response.body", "body": b""})
            return
        request_id = dict(scope["headers"]).get(b"x-request-id", b"?").decode()
        while (await receive())["type"] != "http.disconnect":
            pass
        with open(log_path, "a") as log:
            log.write(request_id + "\\n")

    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")
''')
KEYS = {"a": "key-a-0123456789", "b": "key-b-0123456789", "c": "key-c-0123456789"}


@pytest.fixture(scope="module")
def router(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("router-limits")
    (tmp / "keys.json").write_text(json.dumps({"keys": [{"name": n, "key": k} for n, k in KEYS.items()]}))
    (tmp / "hold.py").write_text(HOLD_APP)
    fleet = Fleet(tmp)
    port = free_port()
    hold = subprocess.Popen([sys.executable, str(tmp / "hold.py"), str(port), str(tmp / "hung_up.log")])
    fleet.procs.append(hold)
    wait_http(f"http://127.0.0.1:{port}/metrics", hold)
    (tmp / "table.json").write_text(json.dumps({
        "version": 1, "tracks": [{"name": "stable", "model_version": "v1", "weight": 100}],
        "pools": [{"name": "decode", "role": "decode", "datacenter": "dc1",
                   "replicas": [{"name": "h0", "url": f"http://127.0.0.1:{port}", "track": "stable"}]}]}))
    fleet.router(str(tmp / "table.json"), "--max-in-flight", "3", "--max-in-flight-per-key", "2")
    fleet.hung_up = tmp / "hung_up.log"
    yield fleet
    hold.kill()
    fleet.close()


def auth(name):
    return {"Authorization": f"Bearer {KEYS[name]}"}


@pytest.mark.parametrize("case", sorted(BAD_BODIES))
def test_router_answers_400_for_every_malformed_body(router, case):
    raw, _ = BAD_BODIES[case]
    r = httpx.post(router.url + "/v1/completions", content=raw, headers={**auth("a"), "content-type": "application/json"})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["type"] == "invalid_request_error"


def test_router_refuses_a_6_mb_prompt_with_413_with_or_without_content_length(router):
    body = json.dumps({"model": "m", "prompt": "x" * 6_000_000}).encode()
    r = httpx.post(router.url + "/v1/completions", content=body, headers=auth("a"))
    assert r.status_code == 413
    assert r.json()["error"] == {"message": "request body too large: this route accepts at most 1114112 bytes",
                                 "type": "invalid_request_error", "param": None, "code": "request_too_large"}
    r = httpx.post(router.url + "/v1/completions", content=iter([body[i:i + 65536] for i in range(0, len(body), 65536)]),
                   headers=auth("a"))
    assert r.status_code == 413
    assert httpx.get(router.url + "/health").status_code == 200


def hold(router, name, request_id):
    """A completion left open (the upstream holds it until we hang up)."""
    return send_and_hold(router.url, "/v1/completions", {"prompt": "hi", "max_tokens": 4},
                         {"Authorization": f"Bearer {KEYS[name]}", "X-Request-Id": request_id})


def in_flight(router):
    return metric(router.url, "ferry_router_requests_in_flight")


def test_in_flight_seats_per_key_and_overall_and_a_leaving_client_cancels_its_upstream_request(router):
    held = [hold(router, "a", "a-1"), hold(router, "a", "a-2")]
    assert wait_for(lambda: in_flight(router) == 2, 10, 0.05)
    r = httpx.post(router.url + "/v1/completions", json={"prompt": "hi"}, headers=auth("a"), timeout=10)
    assert (r.status_code, r.headers["retry-after"], r.json()["error"]["type"]) == (429, "1", "rate_limit_error")
    held.append(hold(router, "b", "b-1"))
    assert wait_for(lambda: in_flight(router) == 3, 10, 0.05)
    r = httpx.post(router.url + "/v1/completions", json={"prompt": "hi"}, headers=auth("c"), timeout=10)
    assert (r.status_code, r.headers["retry-after"]) == (503, "1")
    assert metric(router.url, "ferry_router_admission_refused_total", {"reason": "per_key"}) == 1
    assert metric(router.url, "ferry_router_admission_refused_total", {"reason": "overall"}) == 1
    for sock in held:
        sock.close()
    assert wait_for(lambda: in_flight(router) == 0, 10, 0.05)
    assert wait_for(lambda: router.hung_up.exists() and len(router.hung_up.read_text().split()) == 3, 10, 0.05)
    assert sorted(router.hung_up.read_text().split()) == ["a-1", "a-2", "b-1"]
    assert metric(router.url, "ferry_router_client_disconnects_total") == 3
    time.sleep(0.1)
    held = hold(router, "c", "c-1")  # the seats are free again
    assert wait_for(lambda: in_flight(router) == 1, 10, 0.05)
    held.close()
    assert wait_for(lambda: in_flight(router) == 0, 10, 0.05)
