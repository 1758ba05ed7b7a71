"""Circuit breaking and client errors through a real router and real workers (issue 20: acceptance 4, the
client-error path).

Workers (Gemma 3 270M, CPU): ``healthy`` (decode role, recompute off, a 64 MiB KV cache: 1792 tokens), ``faulty`` (colocated,
``--fault-error-rate 0.5 --fault-seed 7``) and ``prefill`` (``--max-model-len 128``: a 200-token prompt is
over its limit but not over the decode worker's). Three routers read three tables:

- ``pair``: healthy + faulty in one track (round robin, breaker window 60 s, 10 requests, 5 in a row);
- ``pd``: healthy + prefill with a fixed threshold of 64 tokens (a 200-token prompt goes remote);
- ``local``: healthy alone (local prefill).

The injected faults are drawn from ``random.Random(7)`` once per valid request the faulty worker gets,
whatever the routing order, so the test computes the exact request at which the breaker must eject it.
"""

import json
import random

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from inference_worker import http_headers
from inference_worker.tests.support.router import RouterProcess
from inference_worker.tests.support.worker import WorkerProcess, start_together

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
MODEL = "gemma-3-270m"
SECRET = "ferry-test-link-secret-0123456789"
PD = ("--kv-link-secret", SECRET, "--model-version", "v1", "--max-num-seqs", "2")
# Each pool's worker token (issue 19), in the workers' environment: the routers send them from the tables, and the
# decode worker's remote prefill reaches the prefill worker with the link secret alone.
DECODE_TOKEN, PREFILL_TOKEN = "decode-pool-token-0123456789", "prefill-pool-token-0123456789"
FAULT_RATE, FAULT_SEED, MIN_REQUESTS, IN_A_ROW = 0.5, 7, 10, 5


def samples(url: str) -> dict:
    """``(sample name, frozenset(labels with a value)) -> value`` of a /metrics page."""
    out = {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=10).text):
        for s in family.samples:
            out[(s.name, frozenset((k, v) for k, v in s.labels.items() if v))] = s.value
    return out


def outcome(worker: WorkerProcess, name: str) -> float:
    return sum(v for (n, labels), v in samples(worker.base_url).items()
               if n == "ferry_requests_total" and ("outcome", name) in labels)


def router_total(url: str, name: str, **labels) -> float:
    want = set(labels.items())
    return sum(v for (n, got), v in samples(url).items() if n == name and want <= got)


@pytest.fixture(scope="module")
def workers():
    decode_env, prefill_env = {"FERRY_WORKER_TOKEN": DECODE_TOKEN}, {"FERRY_WORKER_TOKEN": PREFILL_TOKEN}
    healthy = WorkerProcess("--role", "decode", "--kv-recompute-on-failure", "false", "--kv-cache-memory", "64MiB",
                            "--replica", "healthy", *PD, env=decode_env)
    faulty = WorkerProcess("--role", "colocated", "--fault-error-rate", str(FAULT_RATE), "--fault-seed",
                           str(FAULT_SEED), "--replica", "faulty", "--max-num-seqs", "2", env=decode_env)
    prefill = WorkerProcess("--role", "prefill", "--max-model-len", "128", "--replica", "prefill", *PD,
                            env=prefill_env)
    start_together(healthy, faulty, prefill)
    try:
        yield {"healthy": healthy, "faulty": faulty, "prefill": prefill}
    finally:
        for w in (healthy, faulty, prefill):
            w.stop()


def start_router(tmp_path_factory, name, pools, *args, **table):
    """A router on a table of ``pools``, launched (not yet awaited: see ``routers``)."""
    path = tmp_path_factory.mktemp(f"router-{name}") / "table.json"
    path.write_text(json.dumps({"version": 1, "tracks": [{"name": "stable", "model_version": "v1", "weight": 100}],
                                "pools": pools, **table}))
    return RouterProcess(path, "--table-interval", "0.2", "--scrape-interval", "0", "--no-kv-index", *args, wait=False)


DECODE = {"worker_token": DECODE_TOKEN}


def replica(name, worker):
    return {"name": name, "url": worker.base_url, "track": "stable", "model_version": "v1"}


@pytest.fixture(scope="module")
def routers(workers, tmp_path_factory):
    """The three routers of the module docstring, started together (their start-ups overlap on two cores)."""
    started = {
        "pair": start_router(tmp_path_factory, "pair", [{"name": "decode", "role": "decode", **DECODE, "replicas": [
            replica("healthy", workers["healthy"]), replica("faulty", workers["faulty"])]}],
            "--policy", "round_robin", "--breaker-window", "60", "--breaker-min-requests", str(MIN_REQUESTS),
            "--breaker-consecutive", str(IN_A_ROW), "--breaker-cooldown", "600", "--breaker-max-cooldown", "600"),
        "pd": start_router(tmp_path_factory, "pd", [
            {"name": "decode", "role": "decode", **DECODE, "replicas": [replica("healthy", workers["healthy"])]},
            {"name": "prefill", "role": "prefill", "worker_token": PREFILL_TOKEN,
             "replicas": [replica("prefill", workers["prefill"])]}],
            length_routing={"threshold_tokens": 64}),
        "local": start_router(tmp_path_factory, "local", [{"name": "decode", "role": "decode", **DECODE, "replicas": [
            replica("healthy", workers["healthy"])]}]),
    }
    try:
        for router in started.values():
            router.wait_ready()
        yield {name: router.url for name, router in started.items()}
    finally:
        for router in started.values():
            router.stop()


@pytest.fixture(scope="module")
def pair(routers):
    return routers["pair"]


@pytest.fixture(scope="module")
def pd(routers):
    return routers["pd"]


@pytest.fixture(scope="module")
def local(routers):
    return routers["local"]


def expected_ejection():
    """(requests the faulty worker gets, failures among them, reason): the breaker's rule on the fault RNG."""
    rng, fails, run = random.Random(FAULT_SEED), 0, 0
    for n in range(1, 1000):
        failed = rng.random() < FAULT_RATE
        fails, run = fails + failed, run + 1 if failed else 0
        if run >= IN_A_ROW:
            return n, fails, "consecutive_failures"
        if n >= MIN_REQUESTS and fails / n > 0.05:
            return n, fails, "error_rate"
    raise AssertionError("never ejected")


def test_a_replica_failing_half_its_requests_is_ejected_and_traffic_goes_to_the_healthy_one(workers, pair):
    to_faulty, failures, reason = expected_ejection()
    healthy_before = outcome(workers["healthy"], "success")
    answered_by = []
    for i in range(3 * to_faulty):
        r = httpx.post(pair + "/v1/completions", timeout=120,
                       json={"model": MODEL, "prompt": f"Ferry request {i}:", "max_tokens": 1, "temperature": 0})
        assert r.status_code == 200, r.text  # each injected 500 was retried on the healthy replica
        answered_by.append(r.headers[http_headers.REPLICA])
    faulty = workers["faulty"]
    assert (outcome(faulty, "success"), outcome(faulty, "server_error")) == (to_faulty - failures, failures)
    assert answered_by.count("faulty") == to_faulty - failures
    assert outcome(workers["healthy"], "success") - healthy_before == 3 * to_faulty - (to_faulty - failures)
    assert router_total(pair, "ferry_router_ejections_total", replica="faulty") == 1
    assert router_total(pair, "ferry_router_ejections_total", replica="faulty", reason=reason) == 1
    assert router_total(pair, "ferry_router_replica_ejected", replica="faulty") == 1
    assert router_total(pair, "ferry_router_ejections_total", replica="healthy") == 0
    assert router_total(pair, "ferry_router_upstream_errors_total", replica="faulty", kind="status") == failures
    assert router_total(pair, "ferry_router_retries_total") == failures
    # after the ejection every request is answered by the healthy replica
    last_faulty = max(i for i, name in enumerate(answered_by) if name == "faulty")
    assert answered_by[last_faulty + 1:] == ["healthy"] * (len(answered_by) - last_faulty - 1)
    assert len(answered_by) - last_faulty - 1 >= to_faulty


def ask(url, *, stream, prompt, max_tokens=2):
    return httpx.post(url + "/v1/completions", timeout=120,
                      json={"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "stream": stream})


@pytest.mark.parametrize("stream", [False, True])
def test_a_prompt_over_the_prefill_workers_limit_is_a_400_not_retried_nor_counted_as_a_failure(workers, pd, stream):
    healthy, prefill = workers["healthy"], workers["prefill"]
    before = {w: (outcome(w, "client_error"), outcome(w, "server_error")) for w in (healthy, prefill)}
    r = ask(pd, stream=stream, prompt=[5] * 200)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["code"] == "context_length_exceeded" and error["type"] == "invalid_request_error"
    assert "prefill worker refused the prompt (400)" in error["message"] and "128" in error["message"]
    assert r.headers[http_headers.DECISION] == "remote_prefill" and r.headers[http_headers.REPLICA] == "healthy"
    for w in (healthy, prefill):
        assert (outcome(w, "client_error"), outcome(w, "server_error")) == (before[w][0] + 1, before[w][1])
    kv_failures = router_total(healthy.base_url, "ferry_kv_transfer_total", outcome="failure")
    assert kv_failures == 0
    assert router_total(pd, "ferry_router_retries_total") == 0
    assert router_total(pd, "ferry_router_upstream_errors_total") == 0
    assert router_total(pd, "ferry_router_ejections_total") == 0
    # a prompt within the prefill worker's limit goes remote and succeeds on the same workers
    ok = ask(pd, stream=stream, prompt=[5] * 100)
    assert ok.status_code == 200 and ok.headers[http_headers.DECISION] == "remote_prefill"


@pytest.mark.parametrize("stream", [False, True])
def test_a_prompt_over_the_decode_workers_cache_is_a_400_not_retried_nor_counted(workers, local, stream):
    healthy = workers["healthy"]
    before = (outcome(healthy, "client_error"), outcome(healthy, "server_error"))
    requests = router_total(local, "ferry_router_requests_total", status="400")
    for _ in range(IN_A_ROW + 1):  # more client errors in a row than the breaker's limit of failures
        r = ask(local, stream=stream, prompt=[5] * 5000)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["code"] == "context_length_exceeded"
        assert r.headers[http_headers.DECISION] == "local_prefill"
    assert (outcome(healthy, "client_error"), outcome(healthy, "server_error")) == (before[0] + IN_A_ROW + 1,
                                                                                    before[1])
    assert router_total(local, "ferry_router_requests_total", status="400") == requests + IN_A_ROW + 1
    assert router_total(local, "ferry_router_retries_total") == 0
    assert router_total(local, "ferry_router_upstream_errors_total") == 0
    assert router_total(local, "ferry_router_ejections_total") == 0
    assert ask(local, stream=stream, prompt="The ferry", max_tokens=1).status_code == 200  # not ejected


def test_a_client_calling_a_worker_directly_without_its_pools_token_is_refused(workers):
    base = workers["healthy"].base_url
    body = {"model": MODEL, "prompt": "bypass the router", "max_tokens": 1}
    assert httpx.post(base + "/v1/completions", json=body, timeout=30).json()["error"]["code"] == "invalid_worker_token"
    wrong = httpx.post(base + "/v1/completions", json=body, timeout=30, headers={"Authorization": f"Bearer {PREFILL_TOKEN}"})
    assert wrong.status_code == 401  # another pool's token is no good either
    assert httpx.get(base + "/health", timeout=30).json()["status"] == "ok"
