"""WebSocket routes of the dashboard (included by ``controlplane.websocket_urls``)."""

from django.urls import path

from apps.dashboard.consumers import FleetConsumer, PoolConsumer, RolloutConsumer

websocket_urlpatterns = [
    path("ws/fleet/", FleetConsumer.as_asgi()),
    path("ws/pools/<int:pool_id>/", PoolConsumer.as_asgi()),
    path("ws/rollouts/<int:rollout_id>/", RolloutConsumer.as_asgi()),
]
