"""Waits and waste removed from the path of ``POST /scale/`` to applied (issue 21, ``bench/scale_latency.py``).

* ``wait_ready`` polled every 0.5 s: a backend that converged in 50 ms still ended its Action up to half a second
  later. The pause now starts at 50 ms and doubles up to 0.5 s, and never runs past the deadline.
* Every local-agent backend session built a new TLS context (certifi's bundle: ~25 ms of CPU, 0.2-0.3 s on a
  loaded host) before its first call; the clients now share one.
* An Action log line was a locking read and a write of the whole log; it is one ``UPDATE ... log || line``.
"""

import pytest

from apps.operations import pool_actions
from apps.operations.handlers import ActionError
from apps.operations.models import Action
from apps.operations.services import action_log_append
from apps.orchestrators import local_backend
from apps.orchestrators.base import ObservedReplica, ObservedState, ObservedTrack, PoolRef
from apps.orchestrators.local_backend import LocalAgentBackend

REF = PoolRef(pool_id=1, pool_name="decode", namespace="default")


class Converging:
    """``observe`` shows ``ready`` of 1 replica ready from its ``after``-th call on."""

    def __init__(self, after: int) -> None:
        self.after, self.calls = after, 0

    def observe(self, ref):
        self.calls += 1
        ready = int(self.calls >= self.after)
        replica = ObservedReplica(name="decode-stable-0", track="stable", endpoint="http://127.0.0.1:9000",
                                  ready=bool(ready), alive=True, version="v1")
        return ObservedState(pool_name=ref.pool_name, tracks={"stable": ObservedTrack("stable", 1, ready, (replica,))})


@pytest.fixture
def clock(monkeypatch):
    """A fake monotonic clock that ``time.sleep`` in pool_actions advances; returns the pauses slept."""
    now, pauses = [1000.0], []

    def sleep(seconds):
        pauses.append(round(seconds, 6))
        now[0] += seconds

    monkeypatch.setattr(pool_actions.time, "monotonic", lambda: now[0])
    monkeypatch.setattr(pool_actions.time, "sleep", sleep)
    return pauses


def test_wait_ready_polls_after_50_ms_then_doubles_up_to_half_a_second(clock):
    backend = Converging(after=7)
    observed = pool_actions.wait_ready(backend, REF, {"stable": 1}, timeout_s=60)
    assert observed.tracks["stable"].ready_replicas == 1
    assert (backend.calls, clock) == (7, [0.05, 0.1, 0.2, 0.4, 0.5, 0.5])


def test_wait_ready_sleeps_no_further_than_its_deadline_and_then_fails_retryable(clock):
    backend = Converging(after=100)
    with pytest.raises(ActionError) as failed:
        pool_actions.wait_ready(backend, REF, {"stable": 1}, timeout_s=1.0)
    assert clock == [0.05, 0.1, 0.2, 0.4, 0.25]  # 0.95 s slept, then the 0.05 s left
    assert (backend.calls, failed.value.retryable) == (6, True)
    assert str(failed.value) == "not ready after 1s: stable: 0/1 ready (wanted {'stable': 1})"


def test_local_agent_clients_share_one_tls_context(monkeypatch):
    local_backend.tls_context.cache_clear()
    built = []
    real = local_backend.httpx.create_ssl_context
    monkeypatch.setattr(local_backend.httpx, "create_ssl_context", lambda: built.append(1) or real())
    backends = [LocalAgentBackend("https://127.0.0.1:9", "token") for _ in range(3)]
    for backend in backends:
        backend.close()
    assert built == [1]
    assert local_backend.tls_context() is local_backend.tls_context()
    local_backend.tls_context.cache_clear()


@pytest.mark.django_db
def test_log_lines_are_appended_in_one_statement_in_order(pool, django_assert_num_queries):
    action = Action.objects.create(kind="pool.scale", target_type="pool", target_id=str(pool.pk),
                                   log=[{"at": "2026-12-01T00:00:00+00:00", "message": "requested by ada"}])
    with django_assert_num_queries(1):
        action_log_append(action_id=action.pk, message="attempt 1 started")
    action_log_append(action_id=action.pk, message="desired replicas stable=3")
    action.refresh_from_db()
    assert [line["message"] for line in action.log] == ["requested by ada", "attempt 1 started",
                                                         "desired replicas stable=3"]
    assert all(isinstance(line["at"], str) and line["at"].startswith("20") for line in action.log)
    with pytest.raises(Action.DoesNotExist):
        action_log_append(action_id=action.pk + 1000, message="nobody")
