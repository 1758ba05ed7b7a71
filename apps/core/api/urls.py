"""``/api/v1/``: each app's routes plus the OpenAPI schema and offline Swagger UI.

An app that adds endpoints exposes ``urlpatterns`` in ``apps/<app>/api/urls.py`` and is listed here.
"""

from django.urls import include, path
from drf_spectacular.views import SpectacularAPIView, SpectacularSwaggerView

urlpatterns = [
    path("", include("apps.fleet.api.urls")),
    path("", include("apps.catalog.api.urls")),
    path("", include("apps.rollouts.api.urls")),
    path("", include("apps.operations.api.urls")),
    path("", include("apps.telemetry.api.urls")),
    path("schema/", SpectacularAPIView.as_view(), name="schema"),
    path("docs/", SpectacularSwaggerView.as_view(url_name="schema"), name="docs"),
]
