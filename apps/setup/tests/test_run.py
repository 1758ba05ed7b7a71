"""Launcher pieces (apps.setup.run): the ready banner, the agent table reset, the leftover sweep, busy ports."""

import re
import socket
import subprocess
import threading
import time
from pathlib import Path

from apps.setup.procfile import LaunchConfig
from apps.setup.run import (
    ReadyTimings,
    agent_state_reset,
    parse_args,
    port_in_use,
    ready_banner,
    redis_choice,
    sweep,
)
from inference_worker.agent.processes import read_cmdline
from inference_worker.agent.state import AgentState, ProcessRecord, StateStore


def _record(name: str, pid: int, cmdline: list[str]) -> ProcessRecord:
    return ProcessRecord(name=name, args=["serve"], env={}, labels={}, drain_timeout_s=10, port=1, pid=pid,
                         cmdline=cmdline, log_path="/dev/null", started_at=0.0)


def _sleeper() -> subprocess.Popen:
    process = subprocess.Popen(["sleep", "60"], start_new_session=True)
    for _ in range(100):  # until exec has replaced the forked child's command line
        if read_cmdline(process.pid) == ["sleep", "60"]:
            break
        time.sleep(0.01)
    return process


def test_banner_shows_urls_first_run_password_token_and_a_curl():
    summary = {"users": [{"username": "operator", "role": "operator", "password": "pw-1", "token": "tok-1"}],
               "client_api_key": "ck-1"}
    timings = ReadyTimings(processes_s=52.4, setup_s=13.2, before_launcher_s=30.1)
    lines = ready_banner(LaunchConfig(host="0.0.0.0", port=8001, router_port=8081), summary, timings)
    assert lines[0] == ("Ferry is ready: 96 s since `make run` started (install and model preparation 30 s, database "
                        "and setup 13 s, processes to ready 52 s)")
    assert lines[1] == "  dashboard  http://127.0.0.1:8001/   login: operator / pw-1"
    assert lines[2] == "  API        http://127.0.0.1:8001/api/v1/   header: Authorization: Token tok-1"
    assert lines[4] == ("  router     http://127.0.0.1:8081/v1/completions   header: Authorization: Bearer ck-1   "
                        "metrics: http://127.0.0.1:8081/metrics")
    assert lines[5].startswith("  try        curl -s http://127.0.0.1:8081/v1/completions -H 'Authorization: Bearer ck-1' ")
    later = ready_banner(LaunchConfig(), {"users": [{"username": "operator", "password": None, "token": "t"}]},
                         ReadyTimings(processes_s=1, setup_s=2))
    assert "changepassword operator" in later[1]


def test_ready_line_counts_from_make_run_with_model_preparation_or_says_it_counts_from_the_launcher():
    """A new user read "ready (52 s)" after a longer wait: model preparation and setup ran before that clock."""
    measured = ReadyTimings.measure(make_started_at=1000.0, launcher_started_at=1031.0, processes_started_at=1045.5,
                                    ready_at=1097.0)
    assert measured == ReadyTimings(processes_s=51.5, setup_s=14.5, before_launcher_s=31.0)
    assert measured.headline() == ("Ferry is ready: 97 s since `make run` started (install and model preparation "
                                   "31 s, database and setup 14 s, processes to ready 52 s)")
    alone = ReadyTimings.measure(make_started_at=None, launcher_started_at=1031.0, processes_started_at=1045.0,
                                 ready_at=1097.0)
    assert alone.headline() == ("Ferry is ready: 66 s since the launcher started (database and setup 14 s, "
                                "processes to ready 52 s)")
    # a start time after the launcher's (a wrong argument) is dropped, not shown as negative
    assert ReadyTimings.measure(make_started_at=2000.0, launcher_started_at=1031.0, processes_started_at=1045.0,
                                ready_at=1097.0).before_launcher_s is None


def test_make_run_passes_its_start_time_to_the_launcher():
    dry = subprocess.run(["make", "-n", "run", "PYTHON=python3"], capture_output=True, text=True, check=False,
                         cwd=Path(__file__).resolve().parents[3])
    launch = [line for line in dry.stdout.replace("\\\n", " ").splitlines() if "-m apps.setup.run" in line]
    assert len(launch) == 1 and re.search(r" --started-at \d{10} ", launch[0] + " "), dry.stdout[-2000:]
    assert parse_args(["--started-at", "1764600000"]).started_at == 1764600000.0


def test_agent_table_of_a_cleanly_stopped_run_is_cleared_but_kept_while_a_worker_runs(tmp_path):
    store = StateStore(tmp_path)
    store.save(AgentState(processes={"decode-stable-0": _record("decode-stable-0", 2**22 + 7, ["gone"])},
                          templates={"decode-stable": {"replicas": 2}}))
    assert agent_state_reset(tmp_path) is True
    assert not (tmp_path / "agent.json").exists()
    assert agent_state_reset(tmp_path) is False  # nothing to clear

    sleeper = _sleeper()
    try:
        store.save(AgentState(processes={"w": _record("w", sleeper.pid, read_cmdline(sleeper.pid))}))
        assert agent_state_reset(tmp_path) is False
        assert (tmp_path / "agent.json").exists()
    finally:
        sleeper.kill()
        sleeper.wait()


def test_sweep_kills_live_process_groups_and_workers_the_agent_left(tmp_path):
    group, worker = _sleeper(), _sleeper()
    StateStore(tmp_path).save(AgentState(processes={"decode-stable-0": _record(
        "decode-stable-0", worker.pid, read_cmdline(worker.pid))}))
    killed = sweep([group.pid], tmp_path)
    assert killed == [f"process group {group.pid}", f"model worker decode-stable-0 (pid {worker.pid})"]
    assert (group.wait(10), worker.wait(10)) == (-9, -9)
    assert sweep([group.pid], tmp_path) == []  # both gone: nothing left to kill


def test_sweep_leaves_a_group_that_finishes_within_the_grace_alone(tmp_path):
    finishing = subprocess.Popen(["sleep", "0.3"], start_new_session=True)
    reaper = threading.Thread(target=finishing.wait)  # as honcho reaps its children
    reaper.start()
    assert sweep([finishing.pid], tmp_path, grace_s=5) == []
    reaper.join(5)
    assert finishing.returncode == 0  # exited by itself, not SIGKILLed


def test_port_in_use_sees_a_listener():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        assert port_in_use("127.0.0.1", sock.getsockname()[1]) is True
    free = socket.socket()
    free.bind(("127.0.0.1", 0))
    port = free.getsockname()[1]
    free.close()
    assert port_in_use("127.0.0.1", port) is False


def test_redis_is_embedded_unless_redis_url_is_set_like_the_database():
    answers = {"redis://127.0.0.1:6379/5": True, "redis://127.0.0.1:6379/0": True}
    asked = []

    def reachable(url):
        asked.append(url)
        return answers.get(url, False)

    # unset or empty: embedded, and a Redis answering on the default port is not even asked
    assert redis_choice({}, reachable) == (None, "") and redis_choice({"REDIS_URL": " "}, reachable) == (None, "")
    assert asked == []
    assert redis_choice({"REDIS_URL": "redis://127.0.0.1:6379/5"}, reachable) == ("redis://127.0.0.1:6379/5", "")
    url, problem = redis_choice({"REDIS_URL": "redis://down:6379/0"}, reachable)
    assert url is None and problem.startswith("REDIS_URL=redis://down:6379/0 does not answer PING")


def test_launcher_stops_before_starting_anything_on_bad_router_args_or_a_silent_redis_url(tmp_path, monkeypatch, capsys):
    from apps.setup.embedded_redis import free_tcp_port
    from apps.setup.run import main

    ports = ["--port", str(free_tcp_port()), "--router-port", str(free_tcp_port()), "--agent-port", str(free_tcp_port())]
    monkeypatch.setenv("FERRY_VAR_DIR", str(tmp_path / "var"))
    monkeypatch.setenv("FERRY_ROUTER_EXTRA_ARGS", "--breaker-windw 10")
    assert main(ports) == 2
    assert capsys.readouterr().out == ("ferry | error: FERRY_ROUTER_EXTRA_ARGS: inference_worker router: error: "
                                         "unrecognized arguments: --breaker-windw 10\n")
    assert not (tmp_path / "var").exists()
    monkeypatch.setenv("FERRY_ROUTER_EXTRA_ARGS", "--breaker-window 10")
    closed = f"redis://127.0.0.1:{free_tcp_port()}/0"
    monkeypatch.setenv("REDIS_URL", closed)
    assert main(ports) == 2
    out = capsys.readouterr().out
    assert out.endswith(f"ferry | error: REDIS_URL={closed} does not answer PING; start that Redis, fix REDIS_URL, "
                        "or unset it to use an embedded one\n")
    assert not (tmp_path / "var" / "redis").exists()  # no embedded Redis was started in its place
