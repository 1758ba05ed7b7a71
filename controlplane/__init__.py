"""Ferry's Django project: settings, URLs, ASGI app and Celery app."""

from .celery import app as celery_app

__all__ = ["celery_app"]
