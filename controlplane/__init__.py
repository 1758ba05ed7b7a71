"""Ferry's Django project: settings, URLs, ASGI app and Celery app."""
