"""Telemetry's settings are read from the environment variables the README documents."""

import json
import os
import subprocess
import sys

from django.conf import settings

PRINT_SETTINGS = (
    "import django, json; django.setup(); from django.conf import settings; "
    "print(json.dumps([settings.FERRY_PROMETHEUS_URL, getattr(settings, 'FERRY_ROUTER_METRICS_URLS', None)]))"
)


def read_settings(**environ: str) -> list:
    env = {k: v for k, v in os.environ.items() if k not in ("FERRY_PROMETHEUS_URL", "FERRY_ROUTER_METRICS_URLS")}
    env.update(DJANGO_SETTINGS_MODULE="controlplane.settings", **environ)
    result = subprocess.run([sys.executable, "-c", PRINT_SETTINGS], cwd=settings.BASE_DIR, env=env, capture_output=True,
                            text=True, timeout=60, check=True)
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_prometheus_url_comes_from_the_environment_and_router_urls_no_longer_do():
    assert read_settings() == ["", None]
    assert read_settings(FERRY_PROMETHEUS_URL="http://prometheus:9090",
                         FERRY_ROUTER_METRICS_URLS="http://127.0.0.1:8080/metrics") == ["http://prometheus:9090", None]
