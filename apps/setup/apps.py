"""App config for :mod:`apps.setup`: the top layer (demo fleet, setup commands, the ``make run`` launcher)."""

from django.apps import AppConfig


class SetupConfig(AppConfig):
    name = "apps.setup"
    label = "setup"
    verbose_name = "Ferry setup"
