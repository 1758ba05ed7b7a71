"""App config for :mod:`apps.rollouts`."""

from django.apps import AppConfig


class RolloutsConfig(AppConfig):
    name = "apps.rollouts"
    label = "rollouts"
    verbose_name = "Rollouts"
