"""``RolePermission``: the default DRF permission of the API, driven by :mod:`apps.accounts.roles`.

Reads (GET/HEAD/OPTIONS) need viewer. Writes need the view's ``write_role`` (default admin);
``action_roles`` maps a viewset action name (``scale``, ``retry``, ``create``...) to the role it
needs. Anonymous requests get 401 (TokenAuthentication supplies ``WWW-Authenticate``), users
without the role get 403 with a message naming the required role. A method the view does not take passes here, so
the view answers its 405 naming the method (a 403 "needs the admin role" for ``DELETE /api/v1/actions/1/``, which
no role may do, sent an operator looking for an admin).
"""

from __future__ import annotations

from rest_framework.permissions import SAFE_METHODS, BasePermission

from apps.accounts.roles import ADMIN, VIEWER, role_at_least, user_role


def required_role(request, view) -> str:  # noqa: ANN001 - DRF signature
    """The role ``request`` needs on ``view``."""
    action = getattr(view, "action", None)
    action_roles = getattr(view, "action_roles", {})
    if action in action_roles:
        return action_roles[action]
    if request.method in SAFE_METHODS:
        return VIEWER
    return getattr(view, "write_role", ADMIN)


class RolePermission(BasePermission):
    message = "Your role does not allow this request."

    def has_permission(self, request, view) -> bool:  # noqa: ANN001 - DRF signature
        if not (request.user and request.user.is_authenticated):
            return False
        allowed = getattr(view, "allowed_methods", None)
        if allowed is not None and request.method.upper() not in allowed:
            return True  # the view's dispatch answers 405: no role could make this request
        needed = required_role(request, view)
        if role_at_least(request.user, needed):
            return True
        self.message = f"This request needs the {needed} role; you have {user_role(request.user) or 'no role'}."
        return False
