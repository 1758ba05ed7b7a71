"""WebSocket URL patterns served by the ASGI app (the dashboard adds its consumers here)."""

from django.urls import URLPattern

from apps.dashboard.websocket_urls import websocket_urlpatterns as dashboard_websocket_urlpatterns

websocket_urlpatterns: list[URLPattern] = [*dashboard_websocket_urlpatterns]
