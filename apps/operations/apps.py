"""App config for :mod:`apps.operations`."""

from django.apps import AppConfig


class OperationsConfig(AppConfig):
    name = "apps.operations"
    label = "operations"
    verbose_name = "Operations"
