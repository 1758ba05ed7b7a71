"""Not collected by the suite (no ``test_`` prefix): ``test_hermetic.py`` runs it in a child pytest with no
``DATABASE_URL``/``REDIS_URL`` and reads what it saw from ``FERRY_PROBE_OUT``. ``FERRY_PROBE_WAIT=1`` makes
it wait to be interrupted; ``FERRY_PROBE_FAIL=1`` adds a failing test. Under pytest-xdist each worker writes its own
report (``probe-gw0.json`` next to ``FERRY_PROBE_OUT``)."""

import json
import os
import time
from pathlib import Path

import psycopg
import redis
from django.conf import settings


def test_report_the_servers_this_run_uses():
    # straight to the server (no test database to create: this run is about which server, not the schema)
    with psycopg.connect(os.environ["DATABASE_URL"]) as conn:
        version = conn.execute("SHOW server_version").fetchone()[0]
    db = settings.DATABASES["default"]
    report = {"DATABASE_URL": os.environ["DATABASE_URL"], "REDIS_URL": os.environ["REDIS_URL"],
              "settings_redis_url": settings.REDIS_URL, "settings_database": [db["HOST"], db["PORT"], db["NAME"]],
              "server_version": version, "redis_ping": redis.Redis.from_url(settings.REDIS_URL).ping()}
    out = Path(os.environ["FERRY_PROBE_OUT"])
    if os.environ.get("PYTEST_XDIST_WORKER"):  # under pytest-xdist: one report per worker, probe-gw0.json ...
        from apps.setup import hermetic

        report["session_line"] = hermetic.session_line()  # the worker's own servers (its output is not shown)
        out = out.with_name(f"{out.stem}-{os.environ['PYTEST_XDIST_WORKER']}{out.suffix}")
    out.write_text(json.dumps(report))
    if os.environ.get("FERRY_PROBE_WAIT"):
        time.sleep(300)


def test_fails_when_asked():
    assert not os.environ.get("FERRY_PROBE_FAIL"), "failing on purpose (FERRY_PROBE_FAIL)"
