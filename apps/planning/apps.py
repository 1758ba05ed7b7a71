"""App config for :mod:`apps.planning`: registers the ``pool.profile`` Action handler at startup."""

from django.apps import AppConfig


class PlanningConfig(AppConfig):
    name = "apps.planning"
    label = "planning"
    verbose_name = "Planning"

    def ready(self) -> None:
        from apps.planning import handlers  # noqa: F401 - register the pool.profile handler
