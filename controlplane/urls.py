"""Top-level URLs: admin, health probe, the versioned REST API and the dashboard (no catch-all patterns).

``/api/v1/``: each app's routes plus the OpenAPI schema and offline Swagger UI. An app that adds
endpoints exposes ``urlpatterns`` in ``apps/<app>/api/urls.py`` and is listed in ``API_V1`` (the
project wires the apps together; no app includes another's routes).
"""

from django.contrib import admin
from django.urls import include, path
from drf_spectacular.views import SpectacularAPIView, SpectacularSwaggerView

from apps.core.views import ApiRootView, healthz

admin.site.site_header = "Ferry control plane"
admin.site.site_title = "Ferry admin"

API_V1 = [
    path("", ApiRootView.as_view(), name="api-root"),
    path("", include("apps.fleet.api.urls")),
    path("", include("apps.catalog.api.urls")),
    path("", include("apps.rollouts.api.urls")),
    path("", include("apps.operations.api.urls")),
    path("", include("apps.telemetry.api.urls")),
    path("", include("apps.planning.api.urls")),
    path("schema/", SpectacularAPIView.as_view(), name="schema"),
    path("docs/", SpectacularSwaggerView.as_view(url_name="schema"), name="docs"),
]

urlpatterns = [
    path("admin/", admin.site.urls),
    path("healthz", healthz, name="healthz"),
    path("api/v1/", include(API_V1)),
    path("", include("apps.dashboard.urls")),
]
