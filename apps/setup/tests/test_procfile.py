"""The launcher's process list, environment and tokens, as data (apps.setup.procfile)."""

import json
import os
import stat
import subprocess

import pytest
from honcho.environ import parse_procfile

from apps.setup.procfile import (
    LaunchConfig,
    child_env,
    launcher_tokens,
    procfile,
    router_extra_args,
    worker_threads,
)


def test_procfile_lists_every_process_of_the_product_each_execed():
    config = LaunchConfig(port=8000, router_port=8080, agent_port=8100, var_dir="/srv/ferry/var")
    processes = parse_procfile(procfile(config, python="/venv/bin/python")).processes
    assert list(processes) == ["web", "worker", "ticks", "beat", "telemetry", "agent", "router"]
    assert all(command.startswith("exec /venv/bin/python ") for command in processes.values())
    assert processes["web"] == ("exec /venv/bin/python -m controlplane.web --host 127.0.0.1 --port 8000 --access-log "
                                "/srv/ferry/var/log/web-access.log")
    assert processes["router"] == ("exec /venv/bin/python -m inference_worker router --host 127.0.0.1 --port 8080 "
                                   "--routing-table http://127.0.0.1:8000/api/v1/routing-table/ --log-level warning")
    assert processes["agent"] == ("exec /venv/bin/python -m inference_worker agent --port 8100 "
                                  "--state-dir /srv/ferry/var/agent --log-level warning")
    assert "-Q operations,default" in processes["worker"] and "-Q reconcile" in processes["ticks"]


def test_load_adds_a_bounded_generator_loop_against_the_router_and_tokenizer_is_passed():
    config = LaunchConfig(host="0.0.0.0", router_port=9090, load=True, var_dir="/v")
    processes = parse_procfile(procfile(config, python="py", tokenizer_dir="/m/gemma-3-270m")).processes
    assert processes["router"].endswith("--tokenizer /m/gemma-3-270m")
    # the generator starts once the launcher reports ready (no 503s from a router without workers)
    assert processes["load"].startswith("until [ -e /v/ready ]; do sleep 2; done; "
                                        "n=0; while :; do n=$((n+1)); py bench/serve_load.py --base-url http://127.0.0.1:9090 ")
    # multi-turn sessions by default (bench/workloads.py): the router's prefix cache hits show on the pool page
    assert "--sessions 12 --turns 2" in processes["load"] and processes["load"].endswith("; sleep 1; done")


def test_load_rounds_bring_new_sessions_so_a_canary_of_any_weight_gets_some(tmp_path):
    """The sticky track split hashes the session id: rounds reusing ids send every round's sessions to the same
    tracks (a 25% canary could get none, forever). Run the load line's shell loop for real (serve_load replaced
    by a recorder) and route the session ids of its rounds through the router's split."""
    from bench.workloads import MultiTurnConfig, multi_turn_sessions
    from inference_worker.router.decisions import choose_track
    from inference_worker.router.table import Track

    (tmp_path / "ready").touch()
    recorder = tmp_path / "py"
    calls = tmp_path / "calls"
    # records its arguments; the third round ends the loop's shell
    recorder.write_text(f'#!/bin/sh\necho "$@" >> {calls}\n[ $(wc -l < {calls}) -ge 3 ] && kill $PPID\nexit 0\n')
    recorder.chmod(0o755)
    config = LaunchConfig(load=True, var_dir=str(tmp_path))
    line = parse_procfile(procfile(config, python=str(recorder))).processes["load"]
    subprocess.run(["sh", "-c", line], cwd=tmp_path, timeout=20)
    rounds = [c.split() for c in calls.read_text().splitlines()]
    assert len(rounds) == 3
    ids = []
    for argv in rounds:
        option = dict(zip(argv, argv[1:]))
        cfg = MultiTurnConfig(num_sessions=int(option["--sessions"]), num_turns=int(option["--turns"]),
                              seed=int(option["--seed"]), session_prefix=option["--session-prefix"])
        ids.append([s.session_id for s in multi_turn_sessions(cfg)])
    assert len({i for r in ids for i in r}) == 3 * len(ids[0])  # every round's sessions are new
    for weight in (5, 15, 25, 50):
        tracks = (Track("stable", "v1", 100 - weight), Track("canary", "v2", weight))
        # each weight sees a canary session within the first two rounds (exact: the split is a fixed hash)
        assert any(choose_track(tracks, i).name == "canary" for i in ids[0] + ids[1]), weight


def test_child_env_keeps_user_values_but_not_their_redis_and_database_urls():
    config = LaunchConfig(var_dir="relative/var")
    env = child_env(config, {"DEBUG": "0", "REDIS_URL": "redis://down:6379/0", "DATABASE_URL": "", "PATH": "/bin"},
                    redis_url="redis://127.0.0.1:4242/0", database_url="postgres://postgres@127.0.0.1:4343/ferry",
                    tokens={"FERRY_AGENT_TOKEN": "a" * 20,
                                                                  "FERRY_SERVICE_TOKEN": "s" * 20,
                                                                  "FERRY_KV_LINK_SECRET": "k" * 20}, cpu_count=16)
    assert env["REDIS_URL"] == "redis://127.0.0.1:4242/0"
    assert env["DATABASE_URL"] == "postgres://postgres@127.0.0.1:4343/ferry"
    assert env["DEBUG"] == "0" and env["PATH"] == "/bin"
    assert env["FERRY_VAR_DIR"] == os.path.abspath("relative/var")
    assert json.loads(env["FERRY_WORKER_ENV"]) == {"TORCH_NUM_THREADS": "4", "OMP_NUM_THREADS": "4",
                                                   "FERRY_KV_LINK_SECRET": "k" * 20}
    assert env["FERRY_WORKER_EXTRA_ARGS"] == "--max-num-seqs 8 --kv-cache-memory 256MiB --kv-bandwidth-gbps 10"
    assert env["FERRY_REMOTE_PREFILL_THRESHOLD_TOKENS"] == "256"
    assert (env["FERRY_AGENT_TOKEN"], env["FERRY_SERVICE_TOKEN"]) == ("a" * 20, "s" * 20)


def test_routers_reach_telemetry_through_the_registry_not_the_environment():
    tokens = {"FERRY_AGENT_TOKEN": "a", "FERRY_SERVICE_TOKEN": "s", "FERRY_KV_LINK_SECRET": "k"}
    env = child_env(LaunchConfig(host="0.0.0.0", router_port=9091), {}, redis_url="redis://r:1/0",
                    database_url="postgres://p@d:1/f", tokens=tokens)
    assert "FERRY_ROUTER_METRICS_URLS" not in env  # routers are registered (ferry_setup --router-url)


def test_a_users_worker_env_keeps_its_values_and_gains_the_kv_link_secret():
    env = child_env(LaunchConfig(), {"FERRY_WORKER_ENV": '{"OMP_NUM_THREADS": "3"}'}, redis_url="redis://r:1/0",
                    database_url="postgres://p@d:1/f",
                    tokens={"FERRY_AGENT_TOKEN": "a", "FERRY_SERVICE_TOKEN": "s", "FERRY_KV_LINK_SECRET": "k" * 16})
    assert json.loads(env["FERRY_WORKER_ENV"]) == {"OMP_NUM_THREADS": "3", "FERRY_KV_LINK_SECRET": "k" * 16}


def test_worker_threads_is_a_quarter_of_the_cores_at_least_one():
    assert [worker_threads(n) for n in (None, 1, 2, 7, 8, 64)] == [1, 1, 1, 1, 2, 16]


def test_tokens_are_created_once_with_mode_0600_and_the_environment_wins(tmp_path):
    first = launcher_tokens(tmp_path, {})
    path = tmp_path / "launcher_tokens.json"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert sorted(first) == ["FERRY_AGENT_TOKEN", "FERRY_CLIENT_API_KEY", "FERRY_KV_LINK_SECRET", "FERRY_SERVICE_TOKEN"]
    assert all(len(v) >= 40 for v in first.values())
    assert launcher_tokens(tmp_path, {}) == first
    assert launcher_tokens(tmp_path, {"FERRY_AGENT_TOKEN": "x" * 16})["FERRY_AGENT_TOKEN"] == "x" * 16


def test_make_runs_client_key_reaches_setup_as_a_hash_and_the_router_reads_keys_from_the_table(tmp_path):
    """Issue 19: ``make run`` generates a client API key (kept with the other launcher tokens); setup gets only its
    SHA-256 (``ferry_setup --client-key-sha256``: the control plane's ``make-run`` key) and the router, with no
    keys file, takes its keys from the control plane's routing table; the load generator gets the key in its
    environment."""
    import hashlib

    from apps.setup.run import client_key_setup_args

    tokens = launcher_tokens(tmp_path, {})
    key = tokens["FERRY_CLIENT_API_KEY"]
    assert len(key) >= 40
    config = LaunchConfig(var_dir=tmp_path, load=True)
    env = child_env(config, {}, redis_url="redis://r:1/0", database_url="postgres://p@d:1/f", tokens=tokens)
    assert client_key_setup_args(env) == ["--client-key-sha256", hashlib.sha256(key.encode()).hexdigest()]
    assert client_key_setup_args({}) == []
    lines = dict(line.split(": ", 1) for line in procfile(config, python="py").splitlines())
    assert "--api-keys" not in lines["router"] and "--no-auth" not in lines["router"]
    assert "--routing-table http://127.0.0.1:8000/api/v1/routing-table/" in lines["router"]
    assert env["FERRY_CLIENT_API_KEY"] == key  # bench/serve_load.py sends it as a Bearer key


def test_router_extra_args_are_appended_quoted_and_checked_by_the_routers_parser():
    config = LaunchConfig(var_dir="/v")
    line = parse_procfile(procfile(config, python="py", router_args="--breaker-window 10 --breaker-min-requests 4")
                          ).processes["router"]
    assert line.endswith("--log-level warning --breaker-window 10 --breaker-min-requests 4")
    assert router_extra_args("--no-breaker") == ["--no-breaker"]
    for bad, message in (("--breaker-windw 10", "unrecognized arguments: --breaker-windw 10"),
                         ("--breaker-window ten", "argument --breaker-window: invalid float value: 'ten'"),
                         ("--port 9", "may not set --port: make run sets them"),
                         ("--no-auth", "may not set --no-auth"),
                         ("--breaker-window '10", "No closing quotation")):
        with pytest.raises(ValueError, match=message):
            router_extra_args(bad)
