"""Agent process management on real ``python -m inference_worker router`` processes (no model to load).

The router is a real inference_worker role that becomes ready as soon as its routing table file is
loaded, so start/ready/stop/kill/restart/re-adoption are exercised on real processes in seconds.
Serve workers on Gemma 3 270M (drain of an in-flight request) are covered by
``apps/orchestrators/tests/test_local_backend.py``.
"""

import json
import os
import signal

import pytest

from inference_worker.agent.processes import read_cmdline
from inference_worker.tests.support.agent import AgentProcess, wait_for

TABLE = {"version": 1, "tracks": [{"name": "stable", "model_version": "v1", "weight": 100}], "pools": []}


@pytest.fixture(scope="module")
def table_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("routing") / "table.json"
    path.write_text(json.dumps(TABLE))
    return str(path)


@pytest.fixture(scope="module")
def agent(tmp_path_factory):
    holder = {"agent": AgentProcess(tmp_path_factory.mktemp("agent-procs") / "state").start()}
    yield holder
    holder["agent"].terminate()


def router_body(name, table_file, **labels):
    return {"name": name, "args": ["router", "--routing-table", table_file, "--scrape-interval", "0", "--no-auth"],
            "env": {"OMP_NUM_THREADS": "1"}, "labels": {"role": "router", **labels}, "drain_timeout_s": 10}


def get(agent, name):
    with agent["agent"].client() as client:
        return client.get(f"/v1/processes/{name}").json()


def test_start_two_and_both_become_ready_on_distinct_ports(agent, table_file):
    with agent["agent"].client() as client:
        a = client.post("/v1/processes", json=router_body("r-0", table_file, pool="p"))
        b = client.post("/v1/processes", json=router_body("r-1", table_file, pool="q"))
        assert (a.status_code, b.status_code) == (201, 201)
        assert a.json()["port"] != b.json()["port"]
        assert a.json()["cmdline"][1:6] == ["-m", "inference_worker", "router", "--routing-table", table_file]
        assert a.json()["cmdline"][-4:] == ["--host", "127.0.0.1", "--port", str(a.json()["port"])]
        assert client.post("/v1/processes", json=router_body("r-0", table_file)).status_code == 409
        assert wait_for(lambda: all(p["ready"] for p in client.get("/v1/processes").json()), 60)
        listed = client.get("/v1/processes", params={"selector": "pool=q"}).json()
        assert [(p["name"], p["alive"], p["ready"], p["exit_code"]) for p in listed] == [("r-1", True, True, None)]


def test_workers_do_not_inherit_the_agents_control_plane_secrets(agent):
    """Issue 19: a worker's environment has what its request gave it, not the agent or service token."""
    pid = get(agent, "r-0")["pid"]
    with open(f"/proc/{pid}/environ", "rb") as fh:
        environ = dict(item.split(b"=", 1) for item in fh.read().split(b"\0") if b"=" in item)
    assert environ[b"OMP_NUM_THREADS"] == b"1"
    assert not {b"FERRY_AGENT_TOKEN", b"FERRY_SERVICE_TOKEN", b"DATABASE_URL", b"SECRET_KEY"} & set(environ)


def test_logs_tail_returns_the_last_lines(agent):
    with agent["agent"].client() as client:
        text = client.get("/v1/processes/r-0/logs", params={"tail": 200}).text
        assert text.startswith("--- ferry agent: starting r-0: ")
        assert len(client.get("/v1/processes/r-0/logs", params={"tail": 1}).text.splitlines()) == 1
        assert client.get("/v1/processes/r-0/logs", params={"tail": 0}).status_code == 400


def test_a_sigkilled_process_shows_not_alive_with_its_exit_code_and_is_not_restarted(agent):
    pid = get(agent, "r-1")["pid"]
    os.kill(pid, signal.SIGKILL)
    assert wait_for(lambda: not get(agent, "r-1")["alive"], 10)
    record = get(agent, "r-1")
    assert (record["alive"], record["ready"], record["exit_code"], record["pid"]) == (False, False, -9, pid)


def test_restart_starts_it_again_with_the_same_args_and_counts(agent):
    with agent["agent"].client() as client:
        before = get(agent, "r-1")
        after = client.post("/v1/processes/r-1/restart").json()
        assert (after["restart_count"], after["args"], after["labels"]) == (1, before["args"], before["labels"])
        assert after["pid"] != before["pid"] and after["exit_code"] is None
        assert wait_for(lambda: get(agent, "r-1")["ready"], 60)


def test_stop_sends_sigterm_and_removes_the_process(agent):
    with agent["agent"].client() as client:
        pid = get(agent, "r-1")["pid"]
        final = client.delete("/v1/processes/r-1").json()
        assert (final["alive"], final["ready"]) == (False, False)
        assert final["exit_code"] in (0, -signal.SIGTERM)  # exited on SIGTERM, not SIGKILL
        assert read_cmdline(pid) is None
        assert [p["name"] for p in client.get("/v1/processes").json()] == ["r-0"]


def test_a_restarted_agent_re_adopts_a_running_worker_by_pid_and_cmdline(agent):
    old = agent["agent"]
    before = get(agent, "r-0")
    old.kill()  # SIGKILL: no shutdown hook, the router keeps running in its own session
    assert read_cmdline(before["pid"]) == before["cmdline"]
    agent["agent"] = AgentProcess(old.state_dir, port=old.port).start()
    after = get(agent, "r-0")
    assert (after["pid"], after["alive"], after["adopted"]) == (before["pid"], True, True)
    assert wait_for(lambda: get(agent, "r-0")["ready"], 30)
    with agent["agent"].client() as client:
        final = client.delete("/v1/processes/r-0").json()
    assert final["alive"] is False and final["exit_code"] is None  # not our child: exit code unknowable
    assert wait_for(lambda: read_cmdline(before["pid"]) is None, 10)


def test_a_dead_pid_is_not_adopted(agent, table_file):
    with agent["agent"].client() as client:
        started = client.post("/v1/processes", json=router_body("r-2", table_file)).json()
    old = agent["agent"]
    old.kill()
    os.killpg(started["pid"], signal.SIGKILL)
    assert wait_for(lambda: read_cmdline(started["pid"]) is None, 10)
    agent["agent"] = AgentProcess(old.state_dir, port=old.port).start()
    record = get(agent, "r-2")
    assert (record["alive"], record["adopted"], record["exit_code"]) == (False, False, None)


def test_agent_sigterm_stops_every_worker(tmp_path, table_file):
    agent = AgentProcess(tmp_path / "state").start()
    with agent.client() as client:
        pid = client.post("/v1/processes", json=router_body("r-9", table_file)).json()["pid"]
    assert read_cmdline(pid) is not None
    assert agent.terminate() == -signal.SIGTERM
    assert read_cmdline(pid) is None
    saved = json.loads((tmp_path / "state" / "agent.json").read_text())
    assert saved["processes"] == []
