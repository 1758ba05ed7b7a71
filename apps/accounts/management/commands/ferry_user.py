"""``manage.py ferry_user --role operator USERNAME``: create a user with a role; print password and token."""

from __future__ import annotations

from django.core.exceptions import ValidationError
from django.core.management.base import BaseCommand, CommandError

from apps.accounts.roles import ROLES
from apps.accounts.selectors import user_token_get
from apps.accounts.services import user_create_with_role


class Command(BaseCommand):
    help = "Create a user with a role (viewer, operator, admin) and print its password and API token."

    def add_arguments(self, parser) -> None:  # noqa: ANN001 - Django signature
        parser.add_argument("username")
        parser.add_argument("--role", required=True, choices=ROLES)
        parser.add_argument(
            "--if-missing", action="store_true",
            help="If the user exists, print its token and exit 0 instead of failing.",
        )

    def handle(self, *args, username: str, role: str, if_missing: bool, **options) -> None:
        existing_token = user_token_get(username=username)
        if if_missing and existing_token is not None:
            self.stdout.write(f"user {username} exists (password unchanged)\ntoken: {existing_token}")
            return
        try:
            created = user_create_with_role(username=username, role=role)
        except ValidationError as exc:
            raise CommandError("; ".join(exc.messages)) from exc
        self.stdout.write(f"user: {username}\nrole: {role}\npassword: {created.password}\ntoken: {created.token}")
