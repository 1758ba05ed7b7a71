"""Top-level URLs: admin, health probe and the versioned REST API (no catch-all patterns)."""

from django.contrib import admin
from django.urls import include, path

from apps.core.views import healthz

admin.site.site_header = "Ferry control plane"
admin.site.site_title = "Ferry admin"

urlpatterns = [
    path("admin/", admin.site.urls),
    path("healthz", healthz, name="healthz"),
    path("api/v1/", include("apps.core.api.urls")),
    path("", include("apps.dashboard.urls")),
]
