"""The router as a real process in front of real upstream processes (small uvicorn echo servers).

Checks what reaches the upstream (decision headers, prefill endpoint), SSE passthrough, retries on a
killed or draining replica, 401/429, /v1/models, and table reloads (file and control-plane ETag pull).
"""

import hashlib
import http.server
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import httpx
import pytest

from inference_worker import http_headers

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]
REPO_ROOT = Path(__file__).resolve().parents[2]

ECHO_APP = textwrap.dedent('''
    import json, os, sys
    import uvicorn
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

    name, port, mode, cached_header = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
    app = FastAPI()

    @app.post("/v1/completions")
    @app.post("/v1/chat/completions")
    async def complete(request: Request):
        if mode == "draining":
            return JSONResponse({"error": {"message": "draining"}}, 503)
        if mode == "slow":
            import asyncio
            await asyncio.sleep(30)
        body = await request.json()
        seen = {k: v for k, v in request.headers.items() if k.startswith("x-")}
        # a token-id prompt answers as if its whole 16-token blocks were cached; a text prompt sends no header
        prompt = body.get("prompt")
        cached = {cached_header: str(len(prompt) // 16 * 16)} if isinstance(prompt, list) else {}
        if body.get("stream"):
            async def events():
                for i in range(3):
                    yield f"data: {json.dumps({'replica': name, 'i': i})}\\n\\n".encode()
                yield b"data: [DONE]\\n\\n"
            return StreamingResponse(events(), media_type="text/event-stream", headers=cached)
        return JSONResponse({"replica": name, "headers": seen, "path": request.url.path, "body": body}, headers=cached)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "echo", "object": "model", "owned_by": name}]}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse("# TYPE ferry_num_requests_waiting gauge\\nferry_num_requests_waiting 0.0\\n")

    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")
''')


def free_port():
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_http(url, proc, timeout_s=60):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args} exited with {proc.returncode}")
        try:
            if httpx.get(url, timeout=1).status_code < 500:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{url} not up after {timeout_s}s")


class Fleet:
    """Echo upstreams + one router process, cleaned up at the end."""

    def __init__(self, tmp):
        self.tmp, self.procs, self.upstreams, self.modes = tmp, [], {}, {}
        (tmp / "echo.py").write_text(ECHO_APP)

    def upstream(self, name, mode="ok"):
        port = free_port()
        proc = subprocess.Popen([sys.executable, str(self.tmp / "echo.py"), name, str(port), mode,
                                 http_headers.CACHED_TOKENS])
        self.procs.append(proc)
        self.upstreams[name] = (proc, f"http://127.0.0.1:{port}")
        self.modes[name] = mode
        wait_http(f"http://127.0.0.1:{port}/v1/models", proc)
        return self.upstreams[name][1]

    def router(self, table_location, *extra):
        self.port = free_port()
        env = {**os.environ, "FERRY_SERVICE_TOKEN": "service-token-123"}
        proc = subprocess.Popen([sys.executable, "-m", "inference_worker", "router", "--port", str(self.port),
                                 "--routing-table",
                                 table_location, "--api-keys", str(self.tmp / "keys.json"), "--table-interval", "0.2",
                                 "--scrape-interval", "0.5", "--log-level", "warning", *extra], env=env, cwd=REPO_ROOT)
        self.procs.append(proc)
        self.url = f"http://127.0.0.1:{self.port}"
        wait_http(self.url + "/health", proc)
        return self.url

    def close(self):
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        # A "slow" upstream still sleeps through a request the router gave up on; uvicorn's graceful shutdown
        # would wait for it until the 10 s limit below.
        for name, (proc, _) in self.upstreams.items():
            if self.modes[name] == "slow" and proc.poll() is None:
                proc.kill()
        for proc in self.procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()


def routing_table(urls, version=1, threshold=100, canary_weight=10):
    def pool(name, role, dc, members):
        return {"name": name, "role": role, "datacenter": dc,
                "replicas": [{"name": n, "url": urls[n], "track": t} for n, t in members]}

    return {"version": version,
            "tracks": [{"name": "stable", "model_version": "v1", "weight": 100 - canary_weight},
                       {"name": "canary", "model_version": "v2", "weight": canary_weight}],
            "pools": [pool("decode-dc1", "decode", "dc1", [("d0", "stable"), ("d1", "stable"), ("d2", "canary")]),
                      pool("prefill-dc2", "prefill", "dc2", [("p0", "stable")])],
            "length_routing": {"threshold_tokens": threshold}}


GOOD = {"Authorization": "Bearer good-key"}


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("router")
    (tmp / "keys.json").write_text(json.dumps({"keys": [
        {"name": "good", "key_sha256": hashlib.sha256(b"good-key").hexdigest(), "rate_per_s": 1000, "burst": 1000},
        {"name": "slow", "key": "slow-key", "rate_per_s": 0.01, "burst": 2}]}))
    f = Fleet(tmp)
    urls = {n: f.upstream(n) for n in ("d0", "d1", "d2", "p0")}
    f.table_path = tmp / "table.json"
    f.table_path.write_text(json.dumps(routing_table(urls)))
    f.urls = urls
    f.router(str(f.table_path))
    yield f
    f.close()


def stable_id(prefix="s"):
    return next(f"{prefix}{i}" for i in range(1000)
                if int(hashlib.sha256(f"{prefix}{i}".encode()).hexdigest()[:16], 16) % 10000 < 9000)


def test_prompts_one_below_and_one_above_the_threshold(fleet):
    rid = stable_id()
    below = httpx.post(fleet.url + "/v1/completions", headers={**GOOD, "X-Request-Id": rid},
                       json={"prompt": list(range(99)), "max_tokens": 4}).json()
    assert below["headers"][http_headers.DECISION] == "local_prefill"
    assert http_headers.PREFILL_ENDPOINT not in below["headers"]
    assert below["replica"] in ("d0", "d1") and below["headers"]["x-request-id"] == rid
    above = httpx.post(fleet.url + "/v1/completions", headers={**GOOD, "X-Request-Id": rid},
                       json={"prompt": list(range(101)), "max_tokens": 4}).json()
    assert above["headers"][http_headers.DECISION] == "remote_prefill"
    assert above["headers"][http_headers.PREFILL_ENDPOINT] == fleet.urls["p0"]
    assert above["replica"] in ("d0", "d1") and above["headers"][http_headers.MODEL_VERSION] == "v1"
    assert above["body"]["prompt"] == list(range(101))


def test_split_is_deterministic_per_request_id(fleet):
    ids = [f"split-{i}" for i in range(100)]
    expected = {rid: "canary" if int(hashlib.sha256(rid.encode()).hexdigest()[:16], 16) % 10000 >= 9000 else "stable"
                for rid in ids}
    before = {t: metric(fleet.url, "ferry_router_decisions_total", {"track": t}) for t in ("stable", "canary")}
    with httpx.Client(headers=GOOD) as client:
        for rid in ids + ids[:20]:
            r = client.post(fleet.url + "/v1/completions", headers={"X-Request-Id": rid}, json={"prompt": "hi"})
            assert r.headers[http_headers.TRACK] == expected[rid]
            assert (r.json()["replica"] == "d2") == (expected[rid] == "canary")
    # the decision counter is labelled by track: its increase per track is exactly the split above
    sent = [expected[rid] for rid in ids + ids[:20]]
    after = {t: metric(fleet.url, "ferry_router_decisions_total", {"track": t}) for t in ("stable", "canary")}
    assert {t: after[t] - before[t] for t in after} == {t: float(sent.count(t)) for t in after}
    assert metric(fleet.url, "ferry_router_decisions_total", {"track": "canary", "pool": "decode-dc1",
                                                              "decision": "local_prefill"}) >= sent.count("canary") > 0


def test_streaming_is_passed_through(fleet):
    with httpx.stream("POST", fleet.url + "/v1/chat/completions", headers={**GOOD, "X-Request-Id": stable_id()},
                      json={"messages": [{"role": "user", "content": "hi"}], "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        text = r.read().decode()
    replica = r.headers[http_headers.REPLICA]
    assert text == "".join(f"data: {json.dumps({'replica': replica, 'i': i})}\n\n" for i in range(3)) + \
        "data: [DONE]\n\n"


def test_cached_tokens_header_is_passed_through_streamed_and_not(fleet):
    # regression: the router dropped the worker's cached-tokens header (it passed only content-type and
    # cache-control); the echo upstream answers a token-id prompt with its whole 16-token blocks as cached
    rid = stable_id()
    r = httpx.post(fleet.url + "/v1/completions", headers={**GOOD, "X-Request-Id": rid},
                   json={"prompt": list(range(99)), "max_tokens": 4})
    assert r.status_code == 200 and r.headers[http_headers.CACHED_TOKENS] == "96"
    with httpx.stream("POST", fleet.url + "/v1/completions", headers={**GOOD, "X-Request-Id": rid},
                      json={"prompt": list(range(462)), "max_tokens": 4, "stream": True}) as r:
        assert r.status_code == 200 and r.headers[http_headers.CACHED_TOKENS] == "448"
        assert r.read().decode().endswith("data: [DONE]\n\n")
    assert r.headers[http_headers.DECISION] == "remote_prefill"
    # no header from the worker, none from the router
    r = httpx.post(fleet.url + "/v1/completions", headers={**GOOD, "X-Request-Id": rid}, json={"prompt": "hi"})
    assert r.status_code == 200 and http_headers.CACHED_TOKENS not in r.headers


def test_wrong_key_gets_401_and_a_key_over_its_rate_gets_429(fleet):
    body = {"prompt": "hi"}
    assert httpx.post(fleet.url + "/v1/completions", json=body).status_code == 401
    assert httpx.post(fleet.url + "/v1/completions", json=body, headers={"Authorization": "Bearer nope"}
                      ).status_code == 401
    slow = {"Authorization": "Bearer slow-key"}
    codes = [httpx.post(fleet.url + "/v1/completions", json=body, headers=slow) for _ in range(3)]
    assert [r.status_code for r in codes] == [200, 200, 429]
    assert int(codes[2].headers["retry-after"]) >= 1
    assert codes[2].json()["error"]["type"] == "rate_limit_error"


def test_models_are_proxied(fleet):
    r = httpx.get(fleet.url + "/v1/models", headers=GOOD)
    assert r.status_code == 200 and r.json()["data"][0]["id"] == "echo"


def metric(url, name, labels=None):
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url + "/metrics").text
    total = 0.0
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in (labels or {}).items()):
                total += s.value
    return total


def test_killed_and_draining_replicas_cause_retries_not_client_errors(tmp_path):
    f = Fleet(tmp_path)
    (tmp_path / "keys.json").write_text(json.dumps({"keys": [{"name": "good", "key": "good-key"}]}))
    try:
        urls = {"d0": f.upstream("d0"), "d1": f.upstream("d1", mode="draining"), "d2": f.upstream("d2"),
                "p0": f.upstream("p0")}
        table = routing_table(urls, canary_weight=0)
        table["pools"][0]["replicas"][2].update(track="stable")  # d0, d1, d2 all serve stable (v1)
        (tmp_path / "table.json").write_text(json.dumps(table))
        f.router(str(tmp_path / "table.json"), "--scrape-interval", "0")
        f.upstreams["d0"][0].send_signal(signal.SIGKILL)
        f.upstreams["d0"][0].wait()
        # d0 is dead and d1 answers 503 (draining): every request must still be served, by d2.
        with httpx.Client(headers=GOOD) as client:
            replies = [client.post(f.url + "/v1/completions", json={"prompt": "hi"}) for _ in range(12)]
        assert [r.status_code for r in replies] == [200] * 12
        assert {r.json()["replica"] for r in replies} == {"d2"}
        assert metric(f.url, "ferry_router_upstream_errors_total", {"replica": "d0", "kind": "connect"}) > 0
        assert metric(f.url, "ferry_router_upstream_errors_total", {"replica": "d1", "kind": "status"}) > 0
        assert metric(f.url, "ferry_router_retries_total") > 0
        assert metric(f.url, "ferry_router_decisions_total", {"decision": "local_prefill"}) == 12
    finally:
        f.close()


def test_ejection_of_a_tracks_only_replica_sends_its_traffic_to_the_other_track(tmp_path):
    """Canary d2 answers 503 to everything: each failed attempt is retried on the stable track, and after 2
    failures in a row the breaker ejects d2 so canary requests go to stable directly (all counted), with the
    stable track's headers upstream."""
    f = Fleet(tmp_path)
    (tmp_path / "keys.json").write_text(json.dumps({"keys": [{"name": "good", "key": "good-key"}]}))
    try:
        urls = {"d0": f.upstream("d0"), "d1": f.upstream("d1"), "d2": f.upstream("d2", mode="draining"),
                "p0": f.upstream("p0")}
        (tmp_path / "table.json").write_text(json.dumps(routing_table(urls, canary_weight=50)))
        f.router(str(tmp_path / "table.json"), "--scrape-interval", "0", "--breaker-consecutive", "2",
                 "--breaker-cooldown", "600", "--breaker-max-cooldown", "600")
        canary_ids = [f"c{i}" for i in range(1000)
                      if int(hashlib.sha256(f"c{i}".encode()).hexdigest()[:16], 16) % 10000 >= 5000][:5]
        with httpx.Client(headers=GOOD) as client:
            replies = [client.post(f.url + "/v1/completions", headers={"X-Request-Id": rid}, json={"prompt": "hi"})
                       for rid in canary_ids]
        # 1st: d2's 503; its track has no other replica, so the retry fails over to stable. 2nd: d2 fails again and
        # is ejected, the retry fails over to stable. 3rd-5th: straight to stable. No client sees an error.
        assert [r.status_code for r in replies] == [200] * 5
        assert {r.json()["replica"] for r in replies} <= {"d0", "d1"}
        assert [r.headers[http_headers.TRACK] for r in replies] == ["stable"] * 5
        assert {r.json()["headers"][http_headers.MODEL_VERSION] for r in replies} == {"v1"}
        assert metric(f.url, "ferry_router_track_failovers_total", {"from_track": "canary", "to_track": "stable"}) == 5
        assert metric(f.url, "ferry_router_ejections_total", {"replica": "d2", "track": "canary",
                                                               "reason": "consecutive_failures"}) == 1
        assert metric(f.url, "ferry_router_replica_ejected", {"replica": "d2"}) == 1
        assert metric(f.url, "ferry_router_replica_ejected", {"replica": "d0"}) == 0
        assert metric(f.url, "ferry_router_upstream_errors_total", {"replica": "d2"}) == 2
    finally:
        f.close()


class TableHandler(http.server.BaseHTTPRequestHandler):
    table: dict = {}
    seen: list = []

    def do_GET(self):
        etag = f'"{self.table["version"]}"'
        type(self).seen.append((self.headers.get("Authorization"), self.headers.get("If-None-Match")))
        if self.headers.get("If-None-Match") == etag:
            self.send_response(304)
            self.end_headers()
            return
        body = json.dumps(self.table).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("ETag", etag)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def test_table_pulled_from_the_control_plane_with_token_and_etag(tmp_path):
    f = Fleet(tmp_path)
    (tmp_path / "keys.json").write_text(json.dumps({"keys": [{"name": "good", "key": "good-key"}]}))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), TableHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        urls = {n: f.upstream(n) for n in ("d0",)}
        urls.update(d1=urls["d0"], d2=urls["d0"], p0=urls["d0"])
        TableHandler.table = routing_table(urls, version=5)
        f.router(f"http://127.0.0.1:{server.server_port}/api/v1/routing-table/")
        assert httpx.get(f.url + "/ready").json()["routing_table_version"] == 5
        # a conditional pull of the version it holds (If-None-Match "5") before the table changes
        deadline = time.monotonic() + 10
        while ("Bearer service-token-123", '"5"') not in TableHandler.seen and time.monotonic() < deadline:
            time.sleep(0.05)
        TableHandler.table = routing_table(urls, version=6)
        deadline = time.monotonic() + 10
        while metric(f.url, "ferry_router_routing_table_version") != 6 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert metric(f.url, "ferry_router_routing_table_version") == 6
        assert all(auth == "Bearer service-token-123" for auth, _ in TableHandler.seen)
        assert TableHandler.seen[0][1] is None and ("Bearer service-token-123", '"5"') in TableHandler.seen
        assert metric(f.url, "ferry_router_routing_table_refresh_errors_total") == 0
    finally:
        server.shutdown()
        f.close()


def test_file_table_changes_are_applied_and_exported(fleet):
    assert metric(fleet.url, "ferry_router_routing_table_version") == 1
    fleet.table_path.write_text(json.dumps(routing_table(fleet.urls, version=2)))
    deadline = time.monotonic() + 10
    while metric(fleet.url, "ferry_router_routing_table_version") != 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert metric(fleet.url, "ferry_router_routing_table_version") == 2


def test_request_timeout_answers_504(tmp_path):
    f = Fleet(tmp_path)
    (tmp_path / "keys.json").write_text(json.dumps({"keys": [{"name": "good", "key": "good-key"}]}))
    try:
        urls = {n: f.upstream(n, mode="slow") for n in ("d0",)}
        urls.update(d1=urls["d0"], d2=urls["d0"], p0=urls["d0"])
        table = routing_table(urls, canary_weight=0)
        table["pools"][0]["replicas"] = table["pools"][0]["replicas"][:1]
        (tmp_path / "table.json").write_text(json.dumps(table))
        f.router(str(tmp_path / "table.json"), "--request-timeout", "0.5", "--scrape-interval", "0")
        started = time.monotonic()
        r = httpx.post(f.url + "/v1/completions", headers=GOOD, json={"prompt": "hi"}, timeout=20)
        assert r.status_code == 504 and r.json()["error"]["type"] == "timeout"
        assert time.monotonic() - started < 20
        assert metric(f.url, "ferry_router_upstream_errors_total", {"replica": "d0", "kind": "timeout"}) == 1
        assert metric(f.url, "ferry_router_requests_total", {"status": "504"}) == 1
    finally:
        f.close()
