"""Root pytest configuration: Django tests talk plain HTTP to the test client and need no collectstatic.

Settings are production-safe by default (DEBUG off: HTTPS redirect, manifest static storage); the
test client speaks plain HTTP and the suite does not run ``collectstatic``, so these two settings
are overridden for the whole session, plus a fast password hasher. Everything else is exercised as configured.
"""

import pytest
from django.test import override_settings


@pytest.fixture(autouse=True, scope="session")
def _plain_http_and_static_files():
    with override_settings(
        SECURE_SSL_REDIRECT=False,
        WHITENOISE_AUTOREFRESH=True,
        PASSWORD_HASHERS=["django.contrib.auth.hashers.MD5PasswordHasher"],  # fast users in tests only  # serve from the finders; there is no collected STATIC_ROOT
        STORAGES={
            "default": {"BACKEND": "django.core.files.storage.FileSystemStorage"},
            "staticfiles": {"BACKEND": "django.contrib.staticfiles.storage.StaticFilesStorage"},
        },
    ):
        yield
