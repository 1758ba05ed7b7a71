"""Project wiring: production settings pass ``check --deploy``, migrations are complete, PostgreSQL is the
only database engine, ASGI and Celery."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from django.conf import settings
from django.core.management import call_command

ROOT = Path(settings.BASE_DIR)


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("DEBUG", "SECRET_KEY")}
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


def test_a_database_url_that_is_not_postgresql_is_refused_with_the_fix(tmp_path):
    env = _env(tmp_path, DATABASE_URL=f"sqlite:///{tmp_path}/ferry.sqlite3")
    r = _run([sys.executable, "manage.py", "check"], env)
    assert r.returncode == 1
    assert ("ImproperlyConfigured: DATABASE_URL must be a PostgreSQL URL (postgres://...), not "
            "django.db.backends.sqlite3; unset it and `make run`/`make test` start an embedded PostgreSQL") in r.stderr


def test_settings_read_postgresql_from_database_url(tmp_path):
    code = ("from django.conf import settings; d = settings.DATABASES['default']; "
            "print(d['ENGINE'], d['HOST'], d['PORT'], d['NAME'], d['USER'])")
    env = _env(tmp_path, DJANGO_SETTINGS_MODULE="controlplane.settings",
               DATABASE_URL="postgres://ferry@db.example:6543/fleet")
    assert _run([sys.executable, "-c", code], env).stdout.split() == [
        "django.db.backends.postgresql", "db.example", "6543", "fleet", "ferry"]


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


def test_database_pool_max_size_gives_a_process_a_reused_psycopg_pool(tmp_path):
    """The web process (controlplane.web) sets DATABASE_POOL_MAX_SIZE: connections are returned to a pool and
    reused, not opened per request; without it nothing changes for Celery and the tests."""
    code = ("from django.db import connection\n"
            "for _ in range(6):\n"
            "    with connection.cursor() as c:\n"
            "        c.execute('select pg_backend_pid()'); print(c.fetchone()[0])\n"
            "    connection.close()\n"
            "print(connection.settings_dict['OPTIONS'].get('pool'))")
    # DATABASE_URL: the one given, or the hermetic run's (exported to every child process)
    env = _env(tmp_path, DJANGO_SETTINGS_MODULE="controlplane.settings", DATABASE_POOL_MAX_SIZE="2")
    lines = _run([sys.executable, "-c", code], env).stdout.split("\n")
    # 6 uses on at most the pool's 2 backends (without a pool: 6 backends, one per connection)
    assert len(lines[:6]) == 6 and len(set(lines[:6])) <= 2
    assert lines[6] == "{'min_size': 1, 'max_size': 2, 'timeout': 10}"


def test_per_poll_loggers_are_quiet_at_info_and_back_at_debug(tmp_path):
    """Loggers that write a line per poll or tick (httpx requests, Celery beat's "Sending due task" every second)
    are at WARNING unless LOG_LEVEL=DEBUG; Ferry's own loggers follow LOG_LEVEL."""
    code = ("import django, logging; django.setup(); print(*[logging.getLevelName(logging.getLogger(n)"
            ".getEffectiveLevel()) for n in ('httpx', 'celery.beat', 'apps.telemetry.sources.scrape')])")
    levels = {level: _run([sys.executable, "-c", code], _env(tmp_path, DJANGO_SETTINGS_MODULE="controlplane.settings",
                                                             LOG_LEVEL=level)).stdout.split()
              for level in ("INFO", "DEBUG")}
    assert levels == {"INFO": ["WARNING", "WARNING", "INFO"], "DEBUG": ["DEBUG", "DEBUG", "DEBUG"]}
