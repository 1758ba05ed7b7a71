"""Dashboard page routes and the sign-in/sign-out views (Django's auth views)."""

from django.contrib.auth import views as auth_views
from django.urls import path

from apps.dashboard import views

app_name = "dashboard"
urlpatterns = [
    path("", views.fleet_page, name="fleet"),
    path("pools/<int:pool_id>/", views.pool_page, name="pool"),
    path("rollouts/", views.rollout_list_page, name="rollouts"),
    path("rollouts/<int:rollout_id>/", views.rollout_page, name="rollout"),
    path("model-versions/", views.model_versions_page, name="model_versions"),
    path("links/<int:link_id>/", views.link_page, name="link"),
    path("alerts/", views.alerts_page, name="alerts"),
    path("planning/", views.planning_page, name="planning"),
    path("login/", auth_views.LoginView.as_view(redirect_authenticated_user=True), name="login"),
    path("logout/", auth_views.LogoutView.as_view(), name="logout"),
]
