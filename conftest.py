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


def pytest_unconfigure(config):
    _PLAIN_HTTP_AND_STATIC_FILES.disable()
    hermetic.teardown_session()  # also after failures and Ctrl-C
