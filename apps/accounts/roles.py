"""Roles are Django groups: ``viewer`` < ``operator`` < ``admin`` (each includes the ones below).

- viewer: read everything through the API.
- operator: also scale pools, create/change rollout plans, retry/cancel Actions.
- admin: also create/change/delete clusters, links, pools and model versions; Django staff
  (the admin site) with every model permission (Ferry's apps, users, tokens, beat schedules...).
Superusers count as admin.
"""

from __future__ import annotations

from django.apps import apps as django_apps
from django.contrib.auth.models import AbstractBaseUser, AnonymousUser, Group, Permission

VIEWER, OPERATOR, ADMIN = "viewer", "operator", "admin"
ROLES = (VIEWER, OPERATOR, ADMIN)
ROLE_LEVEL = {VIEWER: 1, OPERATOR: 2, ADMIN: 3}
def ferry_app_labels() -> tuple[str, ...]:
    """Labels of Ferry's own Django apps (modules under ``apps.``), including ones added later."""
    return tuple(cfg.label for cfg in django_apps.get_app_configs() if cfg.name.startswith("apps."))


def user_role(user: AbstractBaseUser | AnonymousUser | None) -> str | None:
    """The highest role of ``user`` (None: anonymous or no role). Cached on the user object."""
    if user is None or not user.is_authenticated:
        return None
    cached = getattr(user, "_ferry_role", False)
    if cached is not False:
        return cached
    names = () if user.is_superuser else user.groups.filter(name__in=ROLES).values_list("name", flat=True)
    role = role_of(names, is_superuser=user.is_superuser)
    user._ferry_role = role
    return role


def role_of(group_names, *, is_superuser: bool) -> str | None:  # noqa: ANN001 - any iterable of names
    """The highest role among ``group_names`` (admin for a superuser; None: no role group)."""
    if is_superuser:
        return ADMIN
    names = {name for name in group_names if name in ROLE_LEVEL}
    return max(names, key=ROLE_LEVEL.__getitem__) if names else None


def role_at_least(user: AbstractBaseUser | AnonymousUser | None, required: str) -> bool:
    """True when ``user``'s role is ``required`` or higher.

    Raises:
        ValueError: ``required`` is not one of :data:`ROLES`.
    """
    if required not in ROLE_LEVEL:
        raise ValueError(f"unknown role {required!r}; expected one of {ROLES}")
    role = user_role(user)
    return role is not None and ROLE_LEVEL[role] >= ROLE_LEVEL[required]


def roles_ensure(*, using: str = "default") -> dict[str, Group]:
    """Create the three role groups if missing and (re)assign their model permissions.

    viewer and operator get the ``view_*`` permissions of Ferry's apps (every app under ``apps.``);
    admin gets every permission of every installed app. Idempotent; runs after every ``migrate``.
    """
    groups = {name: Group.objects.using(using).get_or_create(name=name)[0] for name in ROLES}
    labels = ferry_app_labels()
    perms = Permission.objects.using(using).select_related("content_type")
    view_perms = [p for p in perms if p.content_type.app_label in labels and p.codename.startswith("view_")]
    admin_perms = list(perms)
    groups[VIEWER].permissions.set(view_perms)
    groups[OPERATOR].permissions.set(view_perms)
    groups[ADMIN].permissions.set(admin_perms)
    return groups
