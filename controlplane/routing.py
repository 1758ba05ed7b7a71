"""WebSocket URL patterns served by the ASGI app (the dashboard adds its consumers here)."""

from django.urls import URLPattern

from apps.dashboard.routing import websocket_urlpatterns as dashboard_websocket_urlpatterns

websocket_urlpatterns: list[URLPattern] = [*dashboard_websocket_urlpatterns]
