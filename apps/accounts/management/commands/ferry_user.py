"""``manage.py ferry_user --role operator USERNAME``: create a user with a role; print password and token.

``--rotate-token USERNAME`` revokes the user's API tokens and prints a new one (tokens are stored hashed, so
an existing token can never be printed again).
"""

from __future__ import annotations

from django.contrib.auth import get_user_model
from django.core.exceptions import ValidationError
from django.core.management.base import BaseCommand, CommandError

from apps.accounts.roles import ROLES
from apps.accounts.selectors import user_exists
from apps.accounts.services import api_token_rotate, user_create_with_role


class Command(BaseCommand):
    help = "Create a user with a role (viewer, operator, admin) and print its password and API token."

    def add_arguments(self, parser) -> None:  # noqa: ANN001 - Django signature
        parser.add_argument("username")
        parser.add_argument("--role", choices=ROLES, help="role of a new user (required unless --rotate-token)")
        parser.add_argument(
            "--if-missing", action="store_true",
            help="If the user exists, say so and exit 0 instead of failing.",
        )
        parser.add_argument("--rotate-token", action="store_true",
                            help="Revoke the existing user's API tokens and print a new one.")

    def handle(self, *args, username: str, role: str | None, if_missing: bool, rotate_token: bool,
               **options) -> None:
        if rotate_token:
            user = get_user_model().objects.filter(username=username).first()
            if user is None:
                raise CommandError(f"no user {username!r}")
            self.stdout.write(f"user: {username}\ntoken: {api_token_rotate(user=user)}")
            return
        if role is None:
            raise CommandError("--role is required to create a user")
        if if_missing and user_exists(username=username):
            self.stdout.write(f"user {username} exists (password and token unchanged; tokens are stored hashed: "
                              f"a new one with --rotate-token)")
            return
        try:
            created = user_create_with_role(username=username, role=role)
        except ValidationError as exc:
            raise CommandError("; ".join(exc.messages)) from exc
        self.stdout.write(f"user: {username}\nrole: {role}\npassword: {created.password}\ntoken: {created.token}")
