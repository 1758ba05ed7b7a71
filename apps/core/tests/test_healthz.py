"""``GET /healthz``: 200 when database and Redis answer, 503 naming what is down."""

import socket

import pytest

pytestmark = pytest.mark.django_db


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_healthz_ok_without_authentication(client):
    r = client.get("/healthz")
    assert r.status_code == 200
    assert r.json() == {"database": "ok", "redis": "ok"}


def test_healthz_503_names_redis_when_it_is_down(client, settings):
    settings.REDIS_URL = f"redis://127.0.0.1:{_closed_port()}/0"
    r = client.get("/healthz")
    assert r.status_code == 503
    assert r.json() == {"database": "ok", "redis": "down: ConnectionError"}


def test_healthz_is_get_only(client):
    assert client.post("/healthz").status_code == 405
