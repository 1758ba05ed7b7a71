"""Every Kubernetes API call gives up within its configured bound against a stalled API server, and
a watch that keeps answering 410 Gone re-lists with backoff instead of spinning.

The stalled server is real HTTP: it accepts each connection, reads the request and never answers
(or, for list requests in the watch case, answers an empty list and stalls only the watch). The
official client takes ``_request_timeout`` only as an int or a ``(connect, read)`` tuple; a float is
dropped without a word, which is why these calls used to hang (kubernetes_backend's docstring).
"""

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from apps.orchestrators.base import BackendUnavailable, ModelRef, PoolRef, PoolTrackSpec
from apps.orchestrators.kubernetes_backend import KubernetesBackend
from apps.orchestrators.kubernetes_manifests import RouterSpec
from apps.orchestrators.tests.kube_mock import DEPLOYMENTS, FakeController, KubeMock, api_client

NS = "ferry"
POOL = PoolRef(pool_id=3, pool_name="decode-a", namespace=NS)
TIMEOUT_S = 0.25
SPEC = PoolTrackSpec(pool=POOL, role="decode", track="stable", replicas=1,
                     model=ModelRef(name="gemma-3-270m", version="v1", image="worker:v1"))


class StalledApiServer:
    """Accepts requests and never answers them; with ``answer_lists`` a plain list GET gets an empty
    ``DeploymentList`` and only ``watch=true`` requests stall. ``requests``: request lines seen."""

    def __init__(self, *, answer_lists: bool = False):
        self.release = threading.Event()
        self.requests: list[str] = []
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _stall_or_answer(self):
                server.requests.append(f"{self.command} {self.path}")
                length = int(self.headers.get("Content-Length") or 0)
                if length:
                    self.rfile.read(length)
                if answer_lists and self.command == "GET" and "watch=" not in self.path:
                    body = json.dumps({"kind": "DeploymentList", "apiVersion": "apps/v1",
                                       "metadata": {"resourceVersion": "7"}, "items": []}).encode()
                    self.send_response(200)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                    return
                server.release.wait(60)  # hold the connection open, say nothing
                self.close_connection = True  # then hang up without an answer

            do_GET = do_POST = do_PATCH = do_PUT = do_DELETE = _stall_or_answer

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.release.set()
        self.httpd.shutdown()
        self.httpd.server_close()


def _backend(url, **kw):
    return KubernetesBackend(KubernetesBackend.configure(api_client(url).configuration), max_attempts=2,
                             backoff_s=0.01, request_timeout_s=TIMEOUT_S, **kw)


def _timed(fn, guard_s):
    """``(seconds, exception)`` of ``fn()`` run in a thread; fails instead of hanging past ``guard_s``."""
    with ThreadPoolExecutor(1) as pool:
        started = time.monotonic()
        future = pool.submit(fn)
        try:
            future.result(timeout=guard_s)
            error = None
        except FutureTimeout:
            pytest.fail(f"the call was still waiting after {guard_s} s: no client timeout in force")
        except Exception as exc:  # noqa: BLE001 - the exception is what the test inspects
            error = exc
        return time.monotonic() - started, error


VERBS = {
    "observe (list)": lambda b: b.observe(POOL),
    "scale_track (read scale)": lambda b: b.scale_track(POOL, "stable", 2),
    "apply_pool_track (create)": lambda b: b.apply_pool_track(SPEC),
    "apply_router (create)": lambda b: b.apply_router(RouterSpec(
        namespace=NS, image="router:v1", routing_table_url="http://web:8000/api/v1/routing-table/",
        token_secret_name="router-token")),
    "switch_active (read)": lambda b: b.switch_active(POOL, "blue"),
    "delete_track (delete)": lambda b: b.delete_track(POOL, "canary"),
    "restart_replica (read pod)": lambda b: b.restart_replica(POOL, "decode-a-stable-0"),
    "logs (read log)": lambda b: b.logs(POOL, "decode-a-stable-0", tail=10),
    "wait_track_ready (list)": lambda b: b.wait_track_ready(POOL, "stable", 1, timeout_s=30),
}


@pytest.mark.parametrize("verb", VERBS)
def test_every_call_gives_up_within_its_bound_against_a_stalled_server(verb):
    with StalledApiServer() as server:
        backend = _backend(server.url)
        bound = backend.call_bound_s  # 2 attempts x (connect + read) + one backoff = 1.01 s
        elapsed, error = _timed(lambda: VERBS[verb](backend), guard_s=bound + 10)
    assert isinstance(error, BackendUnavailable), (verb, error)
    assert "failed 2 times" in str(error) and "timed out" in str(error), str(error)
    assert len(server.requests) == 2  # both attempts reached the server and each waited its read timeout
    assert 2 * TIMEOUT_S <= elapsed <= bound + 0.5, (verb, elapsed, bound)


def test_a_stalled_watch_gives_up_at_the_deadline_plus_grace():
    with StalledApiServer(answer_lists=True) as server:
        backend = _backend(server.url)
        elapsed, error = _timed(lambda: backend.wait_track_ready(POOL, "stable", 1, timeout_s=1.0), guard_s=15)
    assert error is None  # not ready within the deadline: False, as with a quiet cluster
    assert [r.split("?")[0] for r in server.requests] == ["GET /apis/apps/v1/namespaces/ferry/deployments"] * 2
    assert "watch=True" in server.requests[1] and "timeoutSeconds=1" in server.requests[1]
    assert 1.0 <= elapsed <= 1.0 + TIMEOUT_S + 0.75, elapsed  # deadline + grace (min(1, request timeout))


def test_the_client_honours_only_int_or_tuple_timeouts():
    """The fact the backend is built on: a float ``_request_timeout`` is dropped by the client."""
    with StalledApiServer() as server:
        core = KubernetesBackend.configure(api_client(server.url).configuration)
        from kubernetes import client

        api = client.CoreV1Api(core)
        elapsed, error = _timed(lambda: api.read_namespaced_pod("p", NS, _request_timeout=(TIMEOUT_S, TIMEOUT_S)),
                                guard_s=10)
        assert "timed out" in str(error) and elapsed < 5
        with ThreadPoolExecutor(1) as pool:
            future = pool.submit(api.read_namespaced_pod, "p", NS, _request_timeout=TIMEOUT_S)
            with pytest.raises(FutureTimeout):
                future.result(timeout=TIMEOUT_S * 6)  # still waiting long after the float "timeout"
            server.release.set()  # let it go; the stalled handler closes without an answer


def test_repeated_410_on_a_watch_re_lists_with_capped_exponential_backoff():
    sleeps: list[float] = []

    def sleep(seconds):
        sleeps.append(seconds)
        time.sleep(seconds)

    with KubeMock() as mock:
        controller = FakeController(mock.url, NS, ready_delay_s=30)  # never ready within the test
        controller.start()
        try:
            backend = KubernetesBackend(KubernetesBackend.configure(api_client(mock.url).configuration),
                                        backoff_s=0.05, max_backoff_s=0.2, sleep=sleep)
            backend.apply_pool_track(SPEC)
            event = {"type": "ERROR", "object": {"kind": "Status", "apiVersion": "v1", "status": "Failure",
                                                 "code": 410, "reason": "Expired", "message": "too old"}}
            mock.k[{"watch": "True"}, DEPLOYMENTS] << (lambda: (json.dumps(event).encode() + b"\n",))
            assert backend.wait_track_ready(POOL, "stable", 1, timeout_s=1.5) is False
        finally:
            controller.stop()
        selector = "ferry.io/pool=decode-a,ferry.io/track=stable"
        lists = [r for r in mock.requests("GET", "/namespaces/ferry/deployments", labelSelector=selector)
                 if "watch" not in r.params]
        watches = mock.requests("GET", "/namespaces/ferry/deployments", labelSelector=selector, watch="True")
    # Every watch answered 410 -> a backoff of 0.05, 0.1, 0.2, 0.2, ... s (the last one cut at the
    # deadline, or none when the deadline already passed) -> a re-list, instead of hundreds of
    # list/watch round trips. Each list is followed by a watch unless the deadline passed in between.
    assert len(watches) - 1 <= len(sleeps) <= len(watches) <= len(lists) <= len(watches) + 1
    full = [min(0.05 * 2**n, 0.2) for n in range(len(sleeps))]
    assert sleeps[:-1] == full[:-1] and 0 < sleeps[-1] <= full[-1]
    assert 6 <= len(sleeps) <= 10, sleeps  # 1.5 s / (0.05+0.1+0.2+0.2...) plus the round trips
