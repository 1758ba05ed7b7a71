"""Ferry control-plane settings, read from the environment.

Environment variables (all optional; safe development defaults, production-safe when DEBUG is off):

- ``DATABASE_URL`` (default ``postgres://postgres@127.0.0.1:5432/ferry``): PostgreSQL, the only engine.
  ``make run`` and ``make test`` set it to an embedded PostgreSQL when it is unset
  (:mod:`apps.setup.embedded_postgresql`); the default here serves ``manage.py`` run by hand.
- ``REDIS_URL`` (default ``redis://127.0.0.1:6379/0``): Celery broker and Channels layer. ``make run`` and
  ``make test`` set it to an embedded Redis when it is unset (never a Redis they find on the machine).
- ``SECRET_KEY``: unset, a random key is created once in ``var/secret_key`` (mode 0600).
- ``DEBUG`` (default off), ``ALLOWED_HOSTS`` and ``CSRF_TRUSTED_ORIGINS`` (comma separated).
- ``SECURE_SSL_REDIRECT`` (default on when DEBUG is off), ``SECURE_HSTS_SECONDS`` (default one
  year when DEBUG is off), ``TRUST_X_FORWARDED_PROTO`` (behind a TLS-terminating proxy).
- ``DATABASE_CONN_MAX_AGE`` (default 0): seconds to keep database connections open.
- ``DATABASE_POOL_MAX_SIZE`` (default 0: no pool): a psycopg connection pool of this many connections per
  process (the web process sets 4).
- ``FERRY_MODEL_ROOTS``: colon-separated directories from which GGUF files may be registered.
"""

from __future__ import annotations

import os
import secrets
from datetime import timedelta
from pathlib import Path

import dj_database_url
from django.core.exceptions import ImproperlyConfigured

from apps.core.private_files import private_dir

BASE_DIR = Path(__file__).resolve().parent.parent
VAR_DIR = Path(os.environ.get("FERRY_VAR_DIR", BASE_DIR / "var"))
# Created 0700 when missing (secrets, data and logs: apps/core/private_files.py), never re-closed here: every Django
# process imports these settings, and the launcher's private var/ may have been opened to the embedded PostgreSQL's
# server user (group search, 0710, when started by root); closing it again makes that server PANIC at its next
# checkpoint. The launcher closes what an earlier run left open (apps.setup.run.var_dir_make_private).
if not VAR_DIR.exists():
    private_dir(VAR_DIR)


def env_bool(name: str, default: bool) -> bool:
    """Parse a boolean environment variable (1/true/yes/on vs 0/false/no/off/empty)."""
    raw = os.environ.get(name)
    if raw is None:
        return default
    value = raw.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off", ""):
        return False
    raise ImproperlyConfigured(f"{name}={raw!r} is not a boolean; use 1/0, true/false, yes/no or on/off")


def env_list(name: str, default: str) -> list[str]:
    """Parse a comma-separated environment variable into a list of non-empty stripped items."""
    return [item.strip() for item in os.environ.get(name, default).split(",") if item.strip()]


def _secret_key() -> str:
    key = os.environ.get("SECRET_KEY")
    if key:
        return key
    path = VAR_DIR / "secret_key"
    if not path.exists():
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(secrets.token_urlsafe(64))
    return path.read_text().strip()


DEBUG = env_bool("DEBUG", False)
SECRET_KEY = _secret_key()
ALLOWED_HOSTS = env_list("ALLOWED_HOSTS", "localhost,127.0.0.1,[::1]")
CSRF_TRUSTED_ORIGINS = env_list("CSRF_TRUSTED_ORIGINS", "")

INSTALLED_APPS = [
    "daphne",
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "whitenoise.runserver_nostatic",
    "django.contrib.staticfiles",
    "rest_framework",
    "knox",
    "axes",
    "django_filters",
    "drf_spectacular",
    "drf_spectacular_sidecar",
    "channels",
    "django_celery_beat",
    "apps.core",
    "apps.accounts",
    "apps.catalog",
    "apps.fleet",
    "apps.rollouts",
    "apps.planning",
    "apps.operations",
    "apps.telemetry",
    "apps.dashboard",
    "apps.setup",
]

MIDDLEWARE = [
    # First: sees every response, so a client error under /api/ that DRF did not render becomes JSON, not HTML.
    "apps.core.middleware.ApiJsonErrorsMiddleware",
    "django.middleware.security.SecurityMiddleware",
    "whitenoise.middleware.WhiteNoiseMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    # Last, as django-axes requires: answers a locked-out sign-in with 429.
    "axes.middleware.AxesMiddleware",
]

ROOT_URLCONF = "controlplane.urls"
WSGI_APPLICATION = "controlplane.wsgi.application"
ASGI_APPLICATION = "controlplane.asgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]

# --------------------------------------------------------------------------- database
DATABASE_URL = os.environ.get("DATABASE_URL") or "postgres://postgres@127.0.0.1:5432/ferry"
# Persistent connections stay off by default: under ASGI each request may run in another thread
# (Django's deployment docs); set DATABASE_CONN_MAX_AGE for WSGI/Celery processes if wanted.
DATABASES = {"default": dj_database_url.parse(
    DATABASE_URL, conn_max_age=int(os.environ.get("DATABASE_CONN_MAX_AGE", "0")), conn_health_checks=True,
)}
# A psycopg connection pool per process (Django's "pool" option) of at most DATABASE_POOL_MAX_SIZE connections:
# requests reuse connections instead of opening one each (a PostgreSQL backend fork + authentication per
# request). Set by the web process (controlplane.web); off elsewhere (Celery forks its pool workers).
DATABASE_POOL_MAX_SIZE = int(os.environ.get("DATABASE_POOL_MAX_SIZE", "0"))
if DATABASE_POOL_MAX_SIZE > 0:
    DATABASES["default"]["CONN_MAX_AGE"] = 0  # pooled connections are returned, not kept
    DATABASES["default"]["CONN_HEALTH_CHECKS"] = False
    DATABASES["default"].setdefault("OPTIONS", {})["pool"] = {
        "min_size": 1, "max_size": DATABASE_POOL_MAX_SIZE, "timeout": 10}
if DATABASES["default"]["ENGINE"] != "django.db.backends.postgresql":
    raise ImproperlyConfigured(
        f"DATABASE_URL must be a PostgreSQL URL (postgres://...), not {DATABASES['default']['ENGINE']}; "
        "unset it and `make run`/`make test` start an embedded PostgreSQL")
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

# --------------------------------------------------------------------------- redis, celery, channels
REDIS_URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
CELERY_BROKER_URL = REDIS_URL
CELERY_TASK_IGNORE_RESULT = True
CELERY_TASK_ALWAYS_EAGER = env_bool("CELERY_TASK_ALWAYS_EAGER", False)
CELERY_TASK_DEFAULT_QUEUE = "default"
# Explicit queues: Actions (long backend calls) never delay the periodic reconcile/autoscale ticks.
# Workers: ``celery -A controlplane worker -Q default,operations,reconcile``.
CELERY_TASK_ROUTES = {
    "operations.execute_action": {"queue": "operations"},
    "operations.reconcile": {"queue": "reconcile"},
    "operations.autoscale": {"queue": "reconcile"},
    "operations.*": {"queue": "operations"},
}
CELERY_TASK_SOFT_TIME_LIMIT = 300
CELERY_TASK_TIME_LIMIT = 360
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
# Redis redelivers unacknowledged messages after this; tasks are idempotent (conditional claims), and
# reconcile re-enqueues pending Actions and takes over expired leases long before it matters.
CELERY_BROKER_TRANSPORT_OPTIONS = {"visibility_timeout": 3600}
CELERY_TIMEZONE = "UTC"
# Periodic tasks live in the database (django-celery-beat, editable in the admin); ``manage.py
# ferry_beat_setup`` creates them. Run beat with ``celery -A controlplane beat`` (this scheduler: the
# DatabaseScheduler, emptying the DEBUG query log at each tick, controlplane.beat).
CELERY_BEAT_SCHEDULER = "controlplane.beat:Scheduler"
CELERY_BEAT_SCHEDULE: dict[str, dict] = {}

CHANNEL_LAYERS = {
    "default": {"BACKEND": "channels_redis.core.RedisChannelLayer", "CONFIG": {"hosts": [REDIS_URL]}},
}

# --------------------------------------------------------------------------- auth, i18n, static
AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.UserAttributeSimilarityValidator"},
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
    {"NAME": "django.contrib.auth.password_validation.CommonPasswordValidator"},
    {"NAME": "django.contrib.auth.password_validation.NumericPasswordValidator"},
]
# Login throttling (django-axes): after AXES_FAILURE_LIMIT failed sign-ins for one username from one IP
# address, that pair is locked out for AXES_COOLOFF_TIME (429), on the dashboard's and the admin's login alike.
# Locking the pair (not the username alone) keeps an attacker from locking a user out from elsewhere.
# API tokens do not go through a login and are not throttled here. Unlock: manage.py axes_reset.
AUTHENTICATION_BACKENDS = ["axes.backends.AxesStandaloneBackend", "django.contrib.auth.backends.ModelBackend"]
AXES_FAILURE_LIMIT = int(os.environ.get("FERRY_LOGIN_FAILURE_LIMIT", "5"))
AXES_COOLOFF_TIME = timedelta(minutes=float(os.environ.get("FERRY_LOGIN_COOLOFF_MINUTES", "15")))
AXES_LOCKOUT_PARAMETERS = [["username", "ip_address"]]
AXES_RESET_ON_SUCCESS = True
AXES_VERBOSE = False  # no startup banner or per-request lines; lockouts are still logged
AXES_LOCKOUT_TEMPLATE = "registration/locked_out.html"
LOGIN_URL = "dashboard:login"
LOGIN_REDIRECT_URL = "dashboard:fleet"
LOGOUT_REDIRECT_URL = "dashboard:login"
LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True

STATIC_URL = "/static/"
STATIC_ROOT = BASE_DIR / "staticfiles"
STATICFILES_DIRS = [BASE_DIR / "static"]
# plotly.js comes from the installed plotly package (apps.dashboard.finders), never a CDN.
STATICFILES_FINDERS = [
    "django.contrib.staticfiles.finders.FileSystemFinder",
    "django.contrib.staticfiles.finders.AppDirectoriesFinder",
    "apps.dashboard.finders.PlotlyFinder",
]
STORAGES = {
    "default": {"BACKEND": "django.core.files.storage.FileSystemStorage"},
    "staticfiles": {
        "BACKEND": "django.contrib.staticfiles.storage.StaticFilesStorage"
        if DEBUG
        else "whitenoise.storage.CompressedManifestStaticFilesStorage"
    },
}

# --------------------------------------------------------------------------- security (production)
SECURE_SSL_REDIRECT = env_bool("SECURE_SSL_REDIRECT", not DEBUG)
SECURE_REDIRECT_EXEMPT = [r"^healthz$"]  # probes speak plain HTTP inside the cluster
SECURE_HSTS_SECONDS = int(os.environ.get("SECURE_HSTS_SECONDS", "0" if DEBUG else str(365 * 24 * 3600)))
SECURE_HSTS_INCLUDE_SUBDOMAINS = not DEBUG
SECURE_HSTS_PRELOAD = not DEBUG
SESSION_COOKIE_SECURE = not DEBUG
CSRF_COOKIE_SECURE = not DEBUG
SECURE_CONTENT_TYPE_NOSNIFF = True
X_FRAME_OPTIONS = "DENY"
if env_bool("TRUST_X_FORWARDED_PROTO", False):
    SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")

# --------------------------------------------------------------------------- REST API
REST_FRAMEWORK = {
    # Token first: its WWW-Authenticate header makes DRF answer anonymous requests with 401, not 403.
    "DEFAULT_AUTHENTICATION_CLASSES": [
        "apps.accounts.authentication.TokenAuthentication",  # token, user and role in one query
        "rest_framework.authentication.SessionAuthentication",
    ],
    "DEFAULT_PERMISSION_CLASSES": ["apps.accounts.permissions.RolePermission"],
    "DEFAULT_FILTER_BACKENDS": [
        "apps.core.filters.FilterBackend",  # django-filter's, skipped for a request without query parameters
        "rest_framework.filters.OrderingFilter",
    ],
    "DEFAULT_PAGINATION_CLASS": "apps.core.pagination.Pagination",
    "DEFAULT_SCHEMA_CLASS": "drf_spectacular.openapi.AutoSchema",
    "EXCEPTION_HANDLER": "apps.core.exceptions.exception_handler",
    # DRF's defaults, the JSON one answering a too deeply nested body with 400 instead of a RecursionError (500)
    "DEFAULT_PARSER_CLASSES": ["apps.core.parsers.SafeJSONParser", "rest_framework.parsers.FormParser",
                               "rest_framework.parsers.MultiPartParser"],
    "DEFAULT_RENDERER_CLASSES": ["rest_framework.renderers.JSONRenderer",
                                 "rest_framework.renderers.BrowsableAPIRenderer"],
}
# API tokens (``Authorization: Token <key>``) are stored as SHA-512 digests by django-rest-knox, never in clear:
# 64 random hex characters (256 bits) need no slow password hasher, and one hash per request keeps the API fast.
# No expiry (TOKEN_TTL None): a token works until it is rotated (manage.py ferry_user --rotate-token NAME).
REST_KNOX = {"TOKEN_TTL": None, "AUTH_HEADER_PREFIX": "Token"}
SPECTACULAR_SETTINGS = {
    "TITLE": "Ferry control plane API",
    "DESCRIPTION": "Desired state of clusters, model versions, pools and rollouts; Actions are the audit log.",
    "VERSION": "1.0.0",
    "SERVE_INCLUDE_SCHEMA": False,
    "SERVE_PERMISSIONS": ["rest_framework.permissions.AllowAny"],
    "SWAGGER_UI_DIST": "SIDECAR",
    "SWAGGER_UI_FAVICON_HREF": "SIDECAR",
    "REDOC_DIST": "SIDECAR",
    "COMPONENT_SPLIT_REQUEST": True,
    # one name for the pool roles wherever a field uses them (pools' role, planning profiles' pool_kind)
    "ENUM_NAME_OVERRIDES": {"RoleEnum": "apps.fleet.models.Pool.Role"},
}

# --------------------------------------------------------------------------- Ferry
FERRY_MODEL_ROOTS = [
    Path(p) for p in os.environ.get(
        "FERRY_MODEL_ROOTS", f"{VAR_DIR / 'models'}:{Path.home() / '.cache'}:{BASE_DIR / '.venv'}"
    ).split(":") if p
]
FERRY_ACTION_LEASE_S = int(os.environ.get("FERRY_ACTION_LEASE_S", "60"))
# Pending Actions older than this are re-enqueued by reconcile (a lost message or a broker outage).
FERRY_ACTION_REQUEUE_S = int(os.environ.get("FERRY_ACTION_REQUEUE_S", "30"))
# How long a scale/apply Action waits for the backend's ready replicas to match before failing (retryable).
FERRY_ACTION_READY_TIMEOUT_S = int(os.environ.get("FERRY_ACTION_READY_TIMEOUT_S", "240"))
FERRY_RECONCILE_INTERVAL_S = float(os.environ.get("FERRY_RECONCILE_INTERVAL_S", "5"))
# Restart backoff of a replica that keeps dying (apps.operations.reconcile.restart_backoff_s): none after
# the first death, then 10 s doubling per restart up to 5 minutes (Kubernetes' CrashLoopBackOff).
FERRY_RESTART_BACKOFF_S = float(os.environ.get("FERRY_RESTART_BACKOFF_S", "10"))
FERRY_RESTART_BACKOFF_MAX_S = float(os.environ.get("FERRY_RESTART_BACKOFF_MAX_S", "300"))
# Reconcile restarts a replica the routers' circuit breaker ejected this many times within the window (seconds)
# since its last restart.
FERRY_EJECTIONS_BEFORE_RESTART = int(os.environ.get("FERRY_EJECTIONS_BEFORE_RESTART", "3"))
FERRY_EJECTION_RESTART_WINDOW_S = int(os.environ.get("FERRY_EJECTION_RESTART_WINDOW_S", "600"))
FERRY_AUTOSCALE_INTERVAL_S = float(os.environ.get("FERRY_AUTOSCALE_INTERVAL_S", "15"))
# Bearer token of the local agent (kind=local clusters) and the router's service token for
# GET /api/v1/routing-table/ (users in the "service" group may also use their API token).
FERRY_AGENT_TOKEN = os.environ.get("FERRY_AGENT_TOKEN", "")
FERRY_SERVICE_TOKEN = os.environ.get("FERRY_SERVICE_TOKEN", "")
# Signs the workers' KV cache reset (pool.flush_kv_cache); the secret the workers share (FERRY_KV_LINK_SECRET).
FERRY_KV_LINK_SECRET = os.environ.get("FERRY_KV_LINK_SECRET", "")
# Telemetry: the Prometheus that scrapes Kubernetes clusters' pods (unset: every cluster is scraped
# directly), and the routers' metrics URLs (comma separated, http://host:port means /metrics) the poller
# scrapes for directly scraped pools: router decisions (local vs remote prefill) per pool.
FERRY_PROMETHEUS_URL = os.environ.get("FERRY_PROMETHEUS_URL", "")
# Router: fixed remote-prefill threshold in prompt tokens (unset: derived by the router or never remote).
FERRY_REMOTE_PREFILL_THRESHOLD_TOKENS = (
    int(os.environ["FERRY_REMOTE_PREFILL_THRESHOLD_TOKENS"])
    if os.environ.get("FERRY_REMOTE_PREFILL_THRESHOLD_TOKENS") else None
)

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "handlers": {"console": {"class": "logging.StreamHandler"}},
    "root": {"handlers": ["console"], "level": os.environ.get("LOG_LEVEL", "INFO")},
    # httpx logs every request at INFO and Celery beat every task it sends (the rollouts tick each second): the
    # telemetry poller, reconcile and beat would print several lines a second and bury what matters (the ready
    # banner, Actions). LOG_LEVEL=DEBUG shows them again.
    "loggers": {
        # Django's default config gives "django" a console handler of its own (with DEBUG) and lets it propagate to
        # the root's: each "Bad Request: /api/..." was printed twice. One handler, the root's format.
        "django": {"handlers": ["console"], "level": os.environ.get("LOG_LEVEL", "INFO"), "propagate": False},
        **{name: {"level": "DEBUG" if os.environ.get("LOG_LEVEL") == "DEBUG" else "WARNING"}
           for name in ("httpx", "celery.beat")},
        # A worker's "Task ... received" / "succeeded" lines of the periodic ticks (each 1-2 s); other tasks' lines,
        # and any failure, still show (apps.core.log_filters).
        **{name: {"filters": [] if os.environ.get("LOG_LEVEL") == "DEBUG" else ["periodic_ticks"]}
           for name in ("celery.worker.strategy", "celery.app.trace")},
    },
    "filters": {"periodic_ticks": {"()": "apps.core.log_filters.PeriodicTaskInfoFilter"}},
}
