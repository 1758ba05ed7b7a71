"""``python -m apps.setup.run`` on the fresh-machine defaults: no DATABASE_URL (embedded PostgreSQL with its data
in a temp var dir), no REDIS_URL (embedded Redis; a Redis on 127.0.0.1:6379 is not used). It must come up (web /healthz 200, "Ferry is ready") and one
Ctrl-C (SIGINT to its process group, as a terminal sends it) must stop every process it started and leave
nothing listening. ``--no-workers`` keeps it cheap (demo pools at 0 replicas: no model is loaded); the
model-worker flow is covered by apps/operations' local end-to-end test and was verified by hand.
"""

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest

from apps.setup.embedded_redis import free_tcp_port
from apps.setup.procfile import BASE_DIR

pytestmark = pytest.mark.slow

READY_TIMEOUT_S = 240
STOP_TIMEOUT_S = 90


def _listening(port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(1)
        return sock.connect_ex(("127.0.0.1", port)) == 0


def _processes_with_var_dir(var_dir: Path) -> list[int]:
    marker = f"FERRY_VAR_DIR={var_dir}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if marker in (entry / "environ").read_bytes().split(b"\0"):
                found.append(int(entry.name))
        except OSError:
            continue
    return found


def _web_server_processes(supervisor: int) -> list[int]:
    """The uvicorn worker processes of the web supervisor (children running ``multiprocessing.spawn``)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes()
        except (OSError, NotADirectoryError):
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == supervisor and b"multiprocessing.spawn" in cmdline:
            found.append(int(entry.name))
    return found


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def _wait(predicate, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.5)
    return predicate()


@pytest.fixture
def var_dir():
    """A var dir under the system temp dir: pytest's tmp_path is closed (0700) to the user an embedded
    PostgreSQL started by root runs as."""
    top = Path(tempfile.mkdtemp(prefix="ferry-launcher-")).resolve()
    top.chmod(0o711)
    yield top / "var"
    shutil.rmtree(top, ignore_errors=True)


def test_launcher_comes_up_on_embedded_redis_and_postgres_and_one_ctrl_c_stops_everything(tmp_path, var_dir):
    ports = {"web": free_tcp_port(), "router": free_tcp_port(), "agent": free_tcp_port()}
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "REDIS_URL", "FERRY_AGENT_TOKEN",
                                                                     "FERRY_SERVICE_TOKEN")}
    env.update(FERRY_VAR_DIR=str(var_dir), PYTHONUNBUFFERED="1", FERRY_WEB_WORKERS="2")
    log_path = tmp_path / "launcher.log"
    with log_path.open("wb") as log:
        launcher = subprocess.Popen(
            [sys.executable, "-m", "apps.setup.run", "--no-workers", "--port", str(ports["web"]),
             "--router-port", str(ports["router"]), "--agent-port", str(ports["agent"])],
            cwd=BASE_DIR, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        assert _wait(lambda: "Ferry is ready" in log_path.read_text() or launcher.poll() is not None,
                     READY_TIMEOUT_S), log_path.read_text()[-4000:]
        output = log_path.read_text()
        assert launcher.poll() is None, output[-4000:]
        assert httpx.get(f"http://127.0.0.1:{ports['web']}/healthz", timeout=10).status_code == 200
        assert httpx.get(f"http://127.0.0.1:{ports['router']}/ready", timeout=10).status_code == 200
        redis_port = int(re.search(r"started embedded redis-server at redis://127\.0\.0\.1:(\d+)/0", output).group(1))
        postgres_port = int(re.search(r"started embedded PostgreSQL 18\.\d+ at postgres://postgres@127\.0\.0\.1:(\d+)/ferry",
                                      output).group(1))
        assert (var_dir / "postgres" / "PG_VERSION").read_text() == "18\n"
        assert oct((var_dir / "postgres").stat().st_mode & 0o777) == "0o700"
        assert (var_dir / "ready").is_file()  # the marker LOAD=1's generator waits for
        pids = {name: int(pid) for name, pid in re.findall(r"system\s+\| (\w+) started \(pid=(\d+)\)", output)}
        assert set(pids) == {"web", "worker", "ticks", "beat", "telemetry", "agent", "router"}
        assert all(_listening(p) for p in (*ports.values(), redis_port, postgres_port))
        # web is a supervisor with FERRY_WEB_WORKERS server processes: they must stop with it
        web_workers = _web_server_processes(pids["web"])
        assert len(web_workers) == 2, web_workers

        os.killpg(launcher.pid, signal.SIGINT)  # Ctrl-C: the terminal signals the foreground process group
        assert launcher.wait(STOP_TIMEOUT_S) == 0, log_path.read_text()[-4000:]
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait(10)
    output = log_path.read_text()
    assert "embedded Redis stopped" in output and "embedded PostgreSQL stopped" in output
    assert not (var_dir / "ready").exists()
    assert "killed leftovers" not in output  # every process stopped on SIGTERM, nothing needed SIGKILL
    assert "Traceback" not in output  # a clean stop prints no traceback (e.g. web's aborted requests)
    assert [name for name, pgid in pids.items() if _group_alive(pgid)] == []
    assert [pid for pid in web_workers if Path(f"/proc/{pid}").exists()] == []
    assert [port for port in (*ports.values(), redis_port, postgres_port) if _listening(port)] == []
    assert _processes_with_var_dir(var_dir) == []
