"""The ``web`` process's settings (controlplane.web): worker count and access log, as data; the compose file's
web command agrees with the process list."""

import logging.config

import pytest
import yaml

import controlplane.web
from apps.setup.kube_manifests import process_commands
from apps.setup.procfile import BASE_DIR
from controlplane.web import default_web_workers, log_config, web_workers


def test_default_workers_are_cores_plus_one_between_2_and_8():
    assert [default_web_workers(cores) for cores in (1, 2, 3, 7, 8, 64)] == [2, 3, 4, 8, 8, 8]


def test_the_argument_wins_over_the_environment_which_wins_over_the_cores():
    assert web_workers(5, {"FERRY_WEB_WORKERS": "3"}) == 5
    assert web_workers(None, {"FERRY_WEB_WORKERS": "3"}) == 3
    assert 2 <= web_workers(None, {"FERRY_WEB_WORKERS": ""}) <= 8


@pytest.mark.parametrize(("arg", "env", "message"), [
    (None, "two", "FERRY_WEB_WORKERS must be an integer >= 1, got 'two'"),
    (None, "0", "the web worker count must be >= 1, got 0"),
    (-1, "", "the web worker count must be >= 1, got -1"),
])
def test_a_bad_worker_count_is_refused_with_its_value(arg, env, message):
    with pytest.raises(ValueError) as raised:
        web_workers(arg, {"FERRY_WEB_WORKERS": env})
    assert str(raised.value) == message


def test_access_log_goes_to_the_given_file_and_nowhere_without_one(tmp_path):
    path = tmp_path / "web-access.log"
    config = log_config(str(path))
    assert config["handlers"]["access"] == {"class": "logging.FileHandler", "formatter": "access",
                                            "filename": str(path), "mode": "a"}
    logging.config.dictConfig(config)
    try:
        logging.getLogger("uvicorn.access").info('%s - "%s %s HTTP/%s" %d', "127.0.0.1:1", "GET", "/healthz", "1.1", 200)
        logging.getLogger("uvicorn.access").handlers[0].flush()
        assert path.read_text() == 'INFO:     127.0.0.1:1 - "GET /healthz HTTP/1.1" 200 OK\n'
    finally:
        for handler in logging.getLogger("uvicorn.access").handlers:
            handler.close()
        logging.getLogger("uvicorn.access").handlers.clear()
    assert log_config(None)["handlers"]["access"]["class"] == "logging.StreamHandler"


def test_compose_runs_the_process_lists_web_command_without_its_access_log_file():
    web = process_commands()["web"]
    at = web.index("--access-log")
    compose = yaml.safe_load((BASE_DIR / "docker-compose.yml").read_text())
    assert compose["services"]["web"]["command"] == web[:at] + web[at + 2:]
    assert compose["services"]["web"]["command"][:3] == ["python", "-m", "controlplane.web"]


def test_uvicorn_gets_the_worker_count_and_a_health_check_a_busy_worker_can_answer(monkeypatch):
    """A worker's health answer waits for the GIL behind every request in flight: 30 s, not uvicorn's 5 s, before the
    supervisor kills it (controlplane.web.WORKER_HEALTHCHECK_TIMEOUT_S)."""
    calls = []
    monkeypatch.setattr(controlplane.web.uvicorn, "run", lambda app, **options: calls.append((app, options)))
    monkeypatch.delenv("FERRY_WEB_WORKERS", raising=False)
    controlplane.web.main(["--port", "21001", "--workers", "3"])
    [(app, options)] = calls
    assert (app, options["port"], options["workers"], options["timeout_worker_healthcheck"]) == (
        "controlplane.asgi:application", 21001, 3, 30)
