"""App config for :mod:`apps.accounts`: creates the role groups after every migrate."""

from django.apps import AppConfig
from django.db.models.signals import post_migrate


def _ensure_roles(sender, using="default", **kwargs) -> None:  # noqa: ANN001 - signal signature
    from apps.accounts.roles import roles_ensure

    roles_ensure(using=using)


class AccountsConfig(AppConfig):
    name = "apps.accounts"
    label = "accounts"
    verbose_name = "Accounts and roles"

    def ready(self) -> None:
        from apps.accounts import schema  # noqa: F401 - registers the OpenAPI scheme of the token authentication

        post_migrate.connect(_ensure_roles, dispatch_uid="ferry_roles_ensure")
