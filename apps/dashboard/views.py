"""Dashboard pages: server-rendered shells whose JS reads the REST API and the websockets.

Every page needs a signed-in user with a role: a signed-in user without one (a new account an admin has
not given a role yet) gets only the "no role yet" page (403), as the API and the websockets refuse them;
``can_operate`` (operator role or higher) decides whether
controls are rendered at all — viewers see the same data and no buttons. Controls call the
public REST API (``/api/v1/``) with the session cookie and the CSRF token, as automation does.
"""

from __future__ import annotations

import json
from functools import wraps

from django.contrib.auth.decorators import login_required
from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import render

from apps.accounts.roles import ADMIN, OPERATOR, role_at_least, user_role
from apps.dashboard import selectors
from apps.fleet.models import ClusterLink, Pool
from apps.planning import selectors as planning_selectors
from apps.rollouts.models import RolloutPlan
from apps.rollouts.selectors import rollout_list
from apps.rollouts.transitions import state_label
from apps.telemetry.slow_requests import slow_requests_latest

DEFAULT_ROLLOUT_STEPS = [{"set_weight": 25}, {"pause": {"seconds": 20}}, {"set_weight": 50},
                         {"pause": {"seconds": 20}}]
"""The create form's pre-filled steps: every pause ends by itself, so a canary started from the page
reaches 100% and ``promoted`` without a resume (the plan's end is the last step)."""


def role_required(view):
    """``login_required``, then the "no role yet" page (403) for a user without the viewer role or higher."""

    @login_required
    @wraps(view)
    def wrapped(request: HttpRequest, *args, **kwargs) -> HttpResponse:
        if user_role(request.user) is None:
            return render(request, "dashboard/no_role.html", status=403)
        return view(request, *args, **kwargs)

    return wrapped


def _context(request: HttpRequest, **extra) -> dict:
    return {"can_operate": role_at_least(request.user, OPERATOR), "role": user_role(request.user) or "none",
            **extra}


@role_required
def fleet_page(request: HttpRequest) -> HttpResponse:
    return render(request, "dashboard/fleet.html", _context(request, overview=selectors.fleet_overview()))


@role_required
def pool_page(request: HttpRequest, pool_id: int) -> HttpResponse:
    try:
        pool = selectors.pool_detail(pool_id)
    except Pool.DoesNotExist as exc:
        raise Http404(f"No pool with id {pool_id}.") from exc
    slow = slow_requests_latest(pool_id)
    return render(request, "dashboard/pool.html", _context(request, pool=pool, slow_requests=slow))


@role_required
def rollout_list_page(request: HttpRequest) -> HttpResponse:
    rollouts = list(rollout_list()[:100])
    for plan in rollouts:  # a rollback rollout reads as one ("rolled back", not "promoted")
        plan.state_label = state_label(plan.state, is_rollback=plan.rollback_of_id is not None)
    return render(request, "dashboard/rollouts.html", _context(
        request, rollouts=rollouts, form=selectors.rollout_form(),
        default_steps=json.dumps(DEFAULT_ROLLOUT_STEPS)))


@role_required
def rollout_page(request: HttpRequest, rollout_id: int) -> HttpResponse:
    try:
        rollout = selectors.rollout_detail(rollout_id)
    except RolloutPlan.DoesNotExist as exc:
        raise Http404(f"No rollout with id {rollout_id}.") from exc
    return render(request, "dashboard/rollout.html", _context(request, rollout=rollout))


@role_required
def model_versions_page(request: HttpRequest) -> HttpResponse:
    is_admin = role_at_least(request.user, ADMIN)  # registering a version is an admin's (the API's write role)
    return render(request, "dashboard/model_versions.html", _context(
        request, rows=selectors.model_version_rows(), is_admin=is_admin,
        register=selectors.model_version_register_choices() if is_admin else None))


@role_required
def link_page(request: HttpRequest, link_id: int) -> HttpResponse:
    try:
        link = selectors.link_detail(link_id)
    except ClusterLink.DoesNotExist as exc:
        raise Http404(f"No link with id {link_id}.") from exc
    return render(request, "dashboard/link.html", _context(request, link=link))


@role_required
def planning_page(request: HttpRequest) -> HttpResponse:
    """Capacity planning: profiles (import, measure), a plan for two pools and a link, apply, predicted vs measured."""
    return render(request, "dashboard/planning.html", _context(request, choices=selectors.planning_choices(),
                                                               workload=planning_selectors.PAGE_WORKLOAD))


@role_required
def alerts_page(request: HttpRequest) -> HttpResponse:
    return render(request, "dashboard/alerts.html", _context(request, data=selectors.alert_page_rows()))
