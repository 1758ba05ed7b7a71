"""Rollout test helpers: a fake observer that makes backend replicas match desired tracks, a driver
that ticks a rollout until it settles, and a small HTTP server standing in for a worker's OpenAI API
and a router's ``/ready``."""

from __future__ import annotations

import json
import threading
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from django.utils import timezone

from apps.fleet.models import Pool, PoolTrack, Replica
from apps.fleet.selectors import routing_table_current
from apps.rollouts.controller import rollout_tick
from apps.rollouts.models import RolloutPlan


def observe(pool: Pool, *, tracks: tuple[str, ...] | None = None, endpoint: str = "") -> None:
    """Make ready ``Replica`` rows match each desired track (what reconcile reports once the backend
    converged): ``<pool>-<track>-<i>`` for i < replicas, with the track's model version."""
    now = timezone.now()
    keep = []
    for track in PoolTrack.objects.filter(pool=pool).select_related("model_version"):
        if tracks is not None and track.name not in tracks:
            keep += list(Replica.objects.filter(pool=pool, track=track.name).values_list("name", flat=True))
            continue
        for i in range(track.replicas):
            name = f"{pool.name}-{track.name}-{i}"
            Replica.objects.update_or_create(pool=pool, name=name, defaults={
                "track": track.name, "endpoint": endpoint or f"http://127.0.0.1:1/{name}", "ready": True,
                "alive": True, "version": track.model_version.version, "last_seen": now})
            keep.append(name)
    Replica.objects.filter(pool=pool).exclude(name__in=keep).delete()


def due_now(plan: RolloutPlan):
    plan.refresh_from_db()
    return max(timezone.now(), plan.next_step_at or timezone.now())


def drive(plan: RolloutPlan, *, until: tuple[str, ...] = ("promoted",), max_ticks: int = 40,
          sync: bool = True, endpoint: str = "") -> list[str]:
    """Tick ``plan`` (observing replicas before each tick) until its state is in ``until``; outcomes."""
    outcomes = []
    for _ in range(max_ticks):
        plan.refresh_from_db()
        if plan.state in until:
            return outcomes
        if sync:
            for pool in plan.pools.all():
                observe(pool, endpoint=endpoint)
        outcomes.append(rollout_tick(rollout_id=plan.pk, now=due_now(plan) + timedelta(milliseconds=1)))
    plan.refresh_from_db()
    raise AssertionError(f"{plan.name} still {plan.state} after {max_ticks} ticks: {outcomes} ({plan.message})")


def table_weights() -> dict[str, tuple[str, int]]:
    """The published routing table's tracks: name -> (model version, weight)."""
    table = routing_table_current()
    return {t["name"]: (t["model_version"], t["weight"]) for t in table.content["tracks"]}


def table_version() -> int:
    table = routing_table_current()
    return table.version if table else 0


class FakeHTTP:
    """A loopback HTTP server: ``/v1/models`` + ``/v1/completions`` (a worker) and ``/ready`` (a router)."""

    def __init__(self) -> None:
        self.router_version = -1
        self.completions = 0
        self.fail_completions = False
        self.authorizations: list[str | None] = []
        """The ``Authorization`` header of every worker call (``/v1/models``, ``/v1/completions``)."""
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:  # noqa: ANN002 - quiet
                pass

            def _send(self, code: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                if self.path == "/ready":
                    self._send(200, {"status": "ready", "routing_table_version": outer.router_version})
                elif self.path == "/v1/models":
                    outer.authorizations.append(self.headers.get("Authorization"))
                    self._send(200, {"object": "list", "data": [{"id": "gemma-like", "object": "model"}]})
                else:
                    self._send(404, {})

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                outer.authorizations.append(self.headers.get("Authorization"))
                outer.completions += 1
                if outer.fail_completions or body.get("model") != "gemma-like":
                    self._send(500, {"error": {"message": "boom"}})
                    return
                self._send(200, {"choices": [{"index": 0, "text": " Paris", "finish_reason": "length"}],
                                 "usage": {"prompt_tokens": 6, "completion_tokens": 4, "total_tokens": 10}})

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def fake_http():
    server = FakeHTTP()
    yield server
    server.close()


@pytest.fixture
def v2(make_model_version):
    return make_model_version("v2")


@pytest.fixture
def quick_agent(cluster, fake_http):
    """The cluster's agent URL answers 404 at once, so a track Action run by a test (its backend call fails and
    is left to a retry) does not spend the local backend's retry backoff against a closed port."""
    cluster.agent_url = fake_http.url
    cluster.save(update_fields=["agent_url"])
