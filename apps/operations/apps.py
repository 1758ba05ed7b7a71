"""App config for :mod:`apps.operations`: registers the pool and pool-track Action handlers at startup."""

from django.apps import AppConfig


class OperationsConfig(AppConfig):
    name = "apps.operations"
    label = "operations"
    verbose_name = "Operations"

    def ready(self) -> None:
        from apps.operations import pool_actions, tracks  # noqa: F401 - register the pool.* handlers
