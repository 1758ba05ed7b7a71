"""WebSocket URL patterns served by the ASGI app (the dashboard adds its consumers here)."""

from django.urls import URLPattern

websocket_urlpatterns: list[URLPattern] = []
