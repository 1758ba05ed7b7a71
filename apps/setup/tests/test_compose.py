"""docker-compose.yml, the Dockerfile it builds and deploy/prometheus.yml, validated without a Docker engine.

Debian's ``docker-compose config`` validates the file against the compose schema and ``promtool`` the
Prometheus config (each skipped with a reason when its binary is missing; ``.ci/run`` installs both).
The structure (one image for every Ferry process, who shares the agent's network namespace, which
management commands exist) is checked as data.
"""

import shutil
import subprocess

import pytest
import yaml
from django.core.management import get_commands

from apps.setup.procfile import BASE_DIR

COMPOSE = BASE_DIR / "docker-compose.yml"
COMPOSE_SECRETS = ("FERRY_SECRET_KEY", "FERRY_AGENT_TOKEN", "FERRY_SERVICE_TOKEN", "FERRY_KV_LINK_SECRET",
                   "FERRY_POSTGRES_PASSWORD", "FERRY_ROUTER_API_KEY")
FERRY_SERVICES = {"setup", "web", "worker", "beat", "agent", "telemetry", "router", "prometheus-targets"}


@pytest.fixture(scope="module")
def compose():
    return yaml.safe_load(COMPOSE.read_text())


def test_compose_has_the_whole_stack_and_every_ferry_process_comes_from_the_one_dockerfile(compose):
    services = compose["services"]
    assert set(services) == FERRY_SERVICES | {"postgres", "redis", "prometheus", "otel-collector"}
    collector = services["otel-collector"]  # optional: only with `--profile tracing`
    assert collector["profiles"] == ["tracing"]
    assert "./deploy/otel-collector.yaml:/etc/otelcol/config.yaml:ro" in collector["volumes"]
    assert {name for name, s in services.items() if s.get("build") == "."} == FERRY_SERVICES
    assert {s["image"] for name, s in services.items() if name in FERRY_SERVICES} == {"ferry:latest"}
    assert (BASE_DIR / "Dockerfile").is_file()
    # the workers listen on the agent container's loopback: whoever talks to them shares its network namespace
    assert {name for name, s in services.items() if s.get("network_mode") == "service:agent"} == {
        "telemetry", "router", "prometheus"}
    assert "./deploy/prometheus.yml:/etc/prometheus/prometheus.yml:ro" in services["prometheus"]["volumes"]
    assert services["web"]["depends_on"]["setup"] == {"condition": "service_completed_successfully"}
    # the poller scrapes the router (router decisions per pool) where it listens, on the shared loopback
    assert services["router"]["command"][services["router"]["command"].index("--port") + 1] == "8080"
    setup = services["setup"]["command"]
    assert setup[setup.index("--router-url") + 1] == "http://agent.ferry.internal:8080"  # registered, not env
    assert services["telemetry"]["environment"]["REDIS_URL"] == services["web"]["environment"]["REDIS_URL"]


def test_every_manage_py_command_in_compose_exists(compose):
    used = {s["command"][s["command"].index("manage.py") + 1] for s in compose["services"].values()
            if isinstance(s.get("command"), list) and "manage.py" in s["command"]}
    assert used == {"ferry_setup", "telemetry", "ferry_prometheus_targets"}
    assert used <= set(get_commands())


def test_docker_compose_config_validates_the_file():
    binary = shutil.which("docker-compose")
    if binary is None:
        pytest.skip("docker-compose is not installed (apt-get install docker-compose; .ci/run does)")
    secrets = {name: "x" * 32 for name in COMPOSE_SECRETS}
    env = {"PATH": "/usr/bin:/bin", **secrets}
    result = subprocess.run([binary, "-f", str(COMPOSE), "config", "-q"], cwd=BASE_DIR, capture_output=True,
                            text=True, timeout=60, env=env)
    assert (result.returncode, result.stderr) == (0, "")
    # no default secrets: without any one of them compose refuses to start, naming it
    for missing in COMPOSE_SECRETS:
        env = {"PATH": "/usr/bin:/bin", **{k: v for k, v in secrets.items() if k != missing}}
        result = subprocess.run([binary, "-f", str(COMPOSE), "config", "-q"], cwd=BASE_DIR, capture_output=True,
                                text=True, timeout=60, env=env)
        assert result.returncode != 0 and f"set {missing}" in result.stderr, (missing, result.stderr)


def test_compose_publishes_web_and_router_on_loopback_and_not_prometheus(compose):
    published = {name: s.get("ports", []) for name, s in compose["services"].items() if s.get("ports")}
    assert published == {"web": ["${FERRY_PUBLISH_ADDRESS:-127.0.0.1}:8000:8000"],
                         "agent": ["${FERRY_PUBLISH_ADDRESS:-127.0.0.1}:8080:8080"]}


def test_promtool_accepts_the_prometheus_config():
    binary = shutil.which("promtool")
    if binary is None:
        pytest.skip("promtool is not installed (apt-get install prometheus; .ci/run does)")
    result = subprocess.run([binary, "check", "config", str(BASE_DIR / "deploy" / "prometheus.yml")],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout + result.stderr
