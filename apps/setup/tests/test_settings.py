"""Project wiring: production settings pass ``check --deploy``, migrations are complete, the SQLite
default (WAL, busy timeout, IMMEDIATE transactions) works and runs the core suite, ASGI and Celery."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from django.conf import settings
from django.core.management import call_command

ROOT = Path(settings.BASE_DIR)
# A small core of the suite, run again on SQLite: models, services, API, roles, idempotency, Actions.
SQLITE_CORE = ["apps/operations/tests/test_pool_scale.py", "apps/operations/tests/test_actions.py",
               "apps/catalog/tests/test_model_versions.py::test_register_from_config_json_and_filter",
               "apps/catalog/tests/test_model_versions.py::test_version_in_use_cannot_be_deleted_409"]


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "DEBUG", "SECRET_KEY")}
    env.update(FERRY_VAR_DIR=str(tmp_path), **extra)
    return env


def _run(args: list[str], env: dict[str, str], timeout: int = 120) -> subprocess.CompletedProcess:
    return subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def test_production_settings_pass_check_deploy_without_warnings(tmp_path):
    env = _env(tmp_path, SECRET_KEY="k" * 20 + "Zq8#vP2@xL5!mN7$rT4%wY9^bH3&cF6*", ALLOWED_HOSTS="ferry.example.com")
    r = _run([sys.executable, "manage.py", "check", "--deploy", "--fail-level", "WARNING"], env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "System check identified no issues (0 silenced)." in r.stdout


def test_secret_key_is_generated_once_into_var_when_unset(tmp_path):
    code = "from django.conf import settings; print(settings.SECRET_KEY)"
    env = _env(tmp_path, DJANGO_SETTINGS_MODULE="controlplane.settings")
    first = _run([sys.executable, "-c", code], env).stdout.strip()
    second = _run([sys.executable, "-c", code], env).stdout.strip()
    assert first == second and len(first) >= 50
    assert oct((tmp_path / "secret_key").stat().st_mode & 0o777) == "0o600"


@pytest.mark.django_db
def test_makemigrations_check_is_clean():
    call_command("makemigrations", "--check", "--dry-run", verbosity=0)


def test_sqlite_default_uses_wal_busy_timeout_and_immediate_transactions(tmp_path):
    code = (
        "import django; django.setup()\n"
        "from django.db import connection\n"
        "c = connection.cursor()\n"
        "print(c.execute('PRAGMA journal_mode').fetchone()[0], c.execute('PRAGMA busy_timeout').fetchone()[0],"
        " connection.settings_dict['OPTIONS']['transaction_mode'], connection.settings_dict['NAME'])\n"
    )
    r = _run([sys.executable, "-c", code], _env(tmp_path, DJANGO_SETTINGS_MODULE="controlplane.settings"))
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["wal", "20000", "IMMEDIATE", str(tmp_path / "ferry.sqlite3")]


CONCURRENT_WRITER = """
import sys, time, django
django.setup()
from django.db import connection, transaction
with connection.cursor() as c:
    c.execute("CREATE TABLE IF NOT EXISTS t (writer TEXT, n INTEGER)")
for n in range(25):
    with transaction.atomic():  # read, then write: deferred transactions would fail with SQLITE_BUSY here
        with connection.cursor() as c:
            c.execute("SELECT count(*) FROM t")
            time.sleep(0.005)
            c.execute("INSERT INTO t VALUES (%s, %s)", [sys.argv[1], n])
print("ok")
"""


def test_sqlite_default_lets_concurrent_writers_wait_instead_of_failing(tmp_path):
    env = _env(tmp_path, DJANGO_SETTINGS_MODULE="controlplane.settings")
    writers = [subprocess.Popen([sys.executable, "-c", CONCURRENT_WRITER, name], cwd=ROOT, env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for name in "ab"]
    results = [w.communicate(timeout=120) for w in writers]
    assert [w.returncode for w in writers] == [0, 0], [err[-2000:] for _, err in results]
    import sqlite3

    with sqlite3.connect(tmp_path / "ferry.sqlite3") as db:
        assert db.execute("SELECT writer, count(*) FROM t GROUP BY writer ORDER BY writer").fetchall() == [
            ("a", 25), ("b", 25)]


@pytest.mark.slow
def test_core_suite_passes_on_sqlite_with_database_url_unset(tmp_path):
    r = _run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *SQLITE_CORE], _env(tmp_path),
             timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert " passed" in r.stdout.splitlines()[-1] and "failed" not in r.stdout.splitlines()[-1]


def test_asgi_routes_http_and_websocket():
    from channels.routing import ProtocolTypeRouter

    from controlplane.asgi import application

    assert isinstance(application, ProtocolTypeRouter)
    assert sorted(application.application_mapping) == ["http", "websocket"]


def test_celery_app_uses_redis_broker_and_routes_operations_tasks():
    from controlplane.celery import app

    assert app.conf.broker_url == settings.REDIS_URL
    app.loader.import_default_modules()  # what a worker does at start: autodiscover apps' tasks.py
    assert "operations.execute_action" in app.tasks
    assert app.amqp.router.route({}, "operations.execute_action")["queue"].name == "operations"
