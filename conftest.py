"""Root pytest configuration: the suite's own servers, plain HTTP for the test client, no collectstatic.

:mod:`apps.setup.hermetic` starts a throwaway PostgreSQL and Redis unless ``DATABASE_URL``/``REDIS_URL``
are given, then sets Django up (``controlplane.settings``) once the URLs are known: here, at import, because
pytest imports this file before any other conftest or test module.

Settings are production-safe by default (DEBUG off: HTTPS redirect, manifest static storage); the
test client speaks plain HTTP and the suite does not run ``collectstatic``, so these two settings
are overridden for the whole session, plus a fast password hasher. Everything else is exercised as configured.
"""


from apps.setup import hermetic

hermetic.setup_session()

import os  # noqa: E402
import sys  # noqa: E402

import pytest  # noqa: E402
from django.test import override_settings  # noqa: E402 - after Django is set up

# Enabled here, at import, not in a session fixture: a test module that builds the project's ASGI application at
# import (collection, before any fixture) would otherwise freeze the production values into its middleware
# (SecurityMiddleware reads SECURE_SSL_REDIRECT once, when built: every plain-HTTP request then answered 301).
_PLAIN_HTTP_AND_STATIC_FILES = override_settings(
    SECURE_SSL_REDIRECT=False,
    WHITENOISE_AUTOREFRESH=True,
    PASSWORD_HASHERS=["django.contrib.auth.hashers.MD5PasswordHasher"],  # fast users in tests only
    STORAGES={  # serve from the finders; there is no collected STATIC_ROOT
        "default": {"BACKEND": "django.core.files.storage.FileSystemStorage"},
        "staticfiles": {"BACKEND": "django.contrib.staticfiles.storage.StaticFilesStorage"},
    },
)
_PLAIN_HTTP_AND_STATIC_FILES.enable()


def pytest_sessionstart(session):
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None and hermetic.session_line():
        reporter.write_line(hermetic.session_line())  # shown with -q too: which servers, which ports


def pytest_configure(config):
    if getattr(config.option, "numprocesses", None) and not hasattr(config, "workerinput"):  # xdist controller
        hermetic.hand_over_to_xdist_workers()  # each worker starts its own servers (apps/setup/hermetic.py)


_SESSION_UMASK = os.umask(0o022)
os.umask(_SESSION_UMASK)


def pytest_runtest_setup(item):
    """The process umask as the session started, and the suite's one-thread torch rule, before every test.

    The launcher's ``make_private`` sets umask 0077 for the process (``apps.setup.run``); a test running it in-process
    left it set for the next tests of that process, and files they created became unreachable for the embedded
    PostgreSQL's server user (``test_embedded_postgresql`` failed when pytest-xdist ran it after such a test).

    The one-thread torch rule (``inference_worker.tests.support.models``), before every test: a test
    module sets it at import, but code run in-process (a worker's ``serve`` honouring ``TORCH_NUM_THREADS``) can
    change it for whatever runs next in that process, and bf16 parity is only exact at one thread (a different
    reduction order flips greedy tokens with top-2 gaps of 0.016-0.027; pytest-xdist's other file order showed it)."""
    os.umask(_SESSION_UMASK)
    torch = sys.modules.get("torch")  # never imports torch for a test that does not use it
    if torch is not None and torch.get_num_threads() != 1:
        torch.set_num_threads(1)


_FLUSHING_FIXTURES = {"transactional_db", "live_server", "django_db_reset_sequences", "django_db_serialized_rollback"}


def _flushes_the_database(item: pytest.Item) -> bool:
    """Whether ``item`` ran as a transactional test, whose teardown empties every table (Django's flush)."""
    if _FLUSHING_FIXTURES & set(getattr(item, "fixturenames", ())):
        return True
    marker = item.get_closest_marker("django_db")
    return marker is not None and bool(marker.kwargs.get("transaction") or (marker.args and marker.args[0]))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """After a transactional test's flush, put back the rows the migrations create (the default alert rules), so a
    later test finds the database as migrated whatever the order: pytest-django runs transactional tests last in a
    serial run, but under pytest-xdist's ``--dist loadfile`` a file's transactional tests run whenever its file
    does (a flushed default rule set failed later files' tests)."""
    yield
    if nextitem is not None and _flushes_the_database(item):  # none next: the test database is already gone
        from pytest_django.plugin import blocking_manager_key

        from apps.telemetry.alerts import create_default_rules
        from apps.telemetry.models import AlertRule

        with item.config.stash[blocking_manager_key].unblock():
            create_default_rules(AlertRule)


def pytest_unconfigure(config):
    _PLAIN_HTTP_AND_STATIC_FILES.disable()
    hermetic.teardown_session()  # also after failures and Ctrl-C
