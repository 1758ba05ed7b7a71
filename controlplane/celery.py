"""The Celery application: Redis broker from ``REDIS_URL``; settings under the ``CELERY_`` prefix.

Run a worker with ``celery -A controlplane worker -Q default,operations`` (tasks route by name:
``operations.*`` goes to the ``operations`` queue, see ``CELERY_TASK_ROUTES``).
"""

import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")

app = Celery("ferry")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()
