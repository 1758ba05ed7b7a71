"""App config for :mod:`apps.catalog`."""

from django.apps import AppConfig


class CatalogConfig(AppConfig):
    name = "apps.catalog"
    label = "catalog"
    verbose_name = "Model catalog"
