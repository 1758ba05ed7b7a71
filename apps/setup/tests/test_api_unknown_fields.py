"""Every write endpoint of the API refuses a field it does not take: 400 naming the field, and nothing written.

Before, several serializers dropped such a field without a word (``PATCH /api/v1/model-versions/{id}/
{"sha256": ...}`` answered 200 with the old digest; ``POST /api/v1/pools/{id}/scale/ {"replicas": 3,
"track": "canary"}`` scaled the whole pool) and the verbs without a body ignored any (``POST
/api/v1/rollouts/{id}/promote/ {"force": true}``). The routes are read from the URL configuration, not listed by
hand: a new write route is walked as soon as it is routed; one on an object needs that object seeded below
(:data:`SEEDED_BASENAMES`), else :func:`test_every_detail_write_route_has_a_seeded_object` fails naming it.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from django.apps import apps as django_apps
from django.urls import URLPattern, URLResolver, get_resolver, reverse
from django.utils import timezone

from apps.fleet.models import Router
from apps.fleet.services import cluster_link_create
from apps.operations.services import action_create
from apps.planning.services import plan_create, profile_import
from apps.rollouts.services import rollout_plan_create
from apps.telemetry.models import Alert, AlertRule

pytestmark = pytest.mark.django_db

WRITE_METHODS = ("post", "put", "patch")
UNKNOWN_FIELD = "zz_not_a_field"
PLANNING_FIXTURES = Path(__file__).resolve().parents[2] / "planning" / "tests" / "fixtures"


@dataclass(frozen=True)
class WriteRoute:
    """One (route, method) of the API that takes a request body."""

    name: str  # the URL name (``pool-scale``), for reverse()
    method: str  # post | put | patch
    basename: str | None  # the viewset's router basename; None for a plain APIView
    kwargs: tuple[str, ...]  # the route's path arguments (``pk``)

    def __str__(self) -> str:
        return f"{self.method.upper()} {self.name}"


def _patterns(patterns: list, prefix: str = "") -> Iterator[tuple[str, URLPattern]]:
    for entry in patterns:
        route = prefix + str(entry.pattern)
        if isinstance(entry, URLResolver):
            yield from _patterns(entry.url_patterns, route)
        else:
            yield route, entry


def api_write_routes() -> list[WriteRoute]:
    """Every (route, write method) under ``api/`` in the project's URL configuration, as DRF dispatches them: a
    viewset route's methods from its action map, an APIView's from its handlers, less methods the view refuses
    (``http_method_names``)."""
    routes = []
    for route, pattern in _patterns(get_resolver().url_patterns):
        view = getattr(pattern.callback, "cls", None)
        if not route.startswith("api/") or view is None:
            continue
        actions = getattr(pattern.callback, "actions", None)
        methods = list(actions) if actions is not None else [m for m in WRITE_METHODS if hasattr(view, m)]
        initkwargs = getattr(pattern.callback, "initkwargs", {})
        for method in methods:
            if method in WRITE_METHODS and method in view.http_method_names:
                routes.append(WriteRoute(name=pattern.name, method=method, basename=initkwargs.get("basename"),
                                         kwargs=tuple(pattern.pattern.regex.groupindex)))
    return routes


WRITE_ROUTES = api_write_routes()

SEEDED_BASENAMES = ("alert", "alert-rule", "action", "client-key", "cluster", "cluster-link", "model-version", "plan",
                    "pool", "rollout", "router")
"""Router basenames :func:`seeded` makes one object of (a detail write route needs an object to reach its body
check)."""


def test_the_walk_finds_the_write_routes_it_should():
    """Guards the walk itself: it must see viewset actions, detail updates and plain create routes."""
    found = {(route.name, route.method) for route in WRITE_ROUTES}
    assert {("pool-scale", "post"), ("pool-detail", "patch"), ("pool-detail", "put"), ("pool-list", "post"),
            ("rollout-promote", "post"), ("model-version-detail", "patch"), ("plan-apply", "post"),
            ("client-key-detail", "patch")} <= found
    assert ("client-key-detail", "put") not in found  # its viewset refuses PUT (http_method_names)
    assert len(found) >= 40


def test_every_detail_write_route_has_a_seeded_object():
    missing = sorted({route.basename for route in WRITE_ROUTES if route.kwargs} - set(SEEDED_BASENAMES))
    assert not missing, f"seed an object for the write routes of {missing} in seeded() and SEEDED_BASENAMES"


@pytest.fixture
def seeded(pool, make_pool, make_model_version, make_cluster, admin_api) -> dict[str, int]:
    """One object per basename of :data:`SEEDED_BASENAMES`: {basename: pk}."""
    v2 = make_model_version("v2")
    prefill = make_pool("prefill", role="prefill")
    link = cluster_link_create(source=prefill.cluster, destination=make_cluster("dc-b"), bandwidth_gbps=10,
                               rtt_ms=5)
    decode_dc = make_pool("decode-b", role="decode", cluster=link.destination)
    for p, name in ((prefill, "prefill_profile.json"), (decode_dc, "decode_profile.json")):
        profile_import(pool=p, text=(PLANNING_FIXTURES / name).read_text())
    plan = plan_create(prefill_pool=prefill, decode_pool=decode_dc, link=link, workload={
        "prompt_median": 256, "prompt_p90": 1024, "prompt_cap": 2048, "output_median": 16, "rate_per_s": 1.0,
        "ttft_slo_s": 2.0, "tpot_slo_s": 0.1, "attainment": 0.9, "max_link_share": 1.0})
    rollout = rollout_plan_create(name="r", pools=[pool, prefill], target_model_version=v2, strategy="canary",
                                  steps=[{"set_weight": 10}])
    action, _ = action_create(kind="pool.scale", target_type="pool", target_id=str(pool.pk), params={"replicas": 1})
    rule = AlertRule.objects.get(name="kv-cache-usage-critical", pool=None)
    alert = Alert.objects.create(rule=rule, pool=pool, severity="critical", started_at=timezone.now(), value=0.97)
    key = admin_api.post("/api/v1/client-keys/", {"name": "team-a"}, format="json").json()["id"]
    router = Router.objects.create(name="r1", cluster=pool.cluster, url="http://r1.example:8080")
    return {"alert": alert.pk, "alert-rule": rule.pk, "action": action.pk, "client-key": key,
            "cluster": pool.cluster_id, "cluster-link": link.pk, "model-version": v2.pk, "plan": plan.pk,
            "pool": pool.pk, "rollout": rollout.pk, "router": router.pk}


def _rows() -> dict[str, list[dict]]:
    """Every row of every Ferry model, for "nothing was written"."""
    return {model._meta.label: list(model.objects.order_by("pk").values())
            for model in django_apps.get_models() if model.__module__.startswith("apps.")}


@pytest.mark.parametrize("route", WRITE_ROUTES, ids=str)
def test_a_write_with_an_unknown_field_is_a_400_naming_it_and_writes_nothing(route, admin_api, seeded):
    url = reverse(route.name, kwargs={name: seeded[route.basename] for name in route.kwargs})
    before = _rows()
    r = getattr(admin_api, route.method)(url, {UNKNOWN_FIELD: 1}, format="json")
    assert r.status_code == 400, (url, r.status_code, r.content[:300])
    assert r["Content-Type"] == "application/json"
    errors = r.json()
    assert errors[UNKNOWN_FIELD][0].startswith("Unknown field:"), errors
    assert _rows() == before, f"{route}: a refused request wrote rows"


@pytest.mark.parametrize("route", WRITE_ROUTES, ids=str)
def test_a_write_with_a_lone_surrogate_field_name_is_a_400_not_a_500(route, admin_api, seeded):
    """Regression: the 400 naming the field could not be encoded (a lone surrogate is not Unicode): 500 text/plain."""
    url = reverse(route.name, kwargs={name: seeded[route.basename] for name in route.kwargs})
    r = admin_api.generic(route.method.upper(), url, '{"\\ud800": 1}', content_type="application/json")
    assert r.status_code == 400 and r["Content-Type"] == "application/json", (url, r.status_code, r.content[:200])
    assert "lone UTF-16 surrogate" in r.json()["detail"]


ALL_METHODS = ("get", "post", "put", "patch", "delete")


def api_routes_and_methods() -> list[tuple[str, str, frozenset[str]]]:
    """Every named route under ``api/``: (URL name, a URL of it, the methods its view takes), as DRF dispatches them
    (a viewset route's action map, an APIView's handlers, within ``http_method_names``). Path arguments are "1":
    a method the view does not take is refused before any object is looked up."""
    found = []
    for route, pattern in _patterns(get_resolver().url_patterns):
        view = getattr(pattern.callback, "cls", None)
        kwargs = tuple(pattern.pattern.regex.groupindex)
        if not route.startswith("api/") or view is None or pattern.name is None or "format" in kwargs:
            continue
        actions = getattr(pattern.callback, "actions", None)
        taken = set(actions) if actions is not None else {m for m in ALL_METHODS if hasattr(view, m)}
        found.append((pattern.name, reverse(pattern.name, kwargs=dict.fromkeys(kwargs, "1")),
                      frozenset(taken & set(view.http_method_names))))
    return found


def test_a_method_the_view_does_not_take_is_a_405_whatever_the_role(viewer_api, operator_api):
    """Regression: ``DELETE /api/v1/actions/1/`` as an operator answered 403 "needs the admin role", which no role
    can do (actions are never deleted); the role check now leaves a method the view does not take to its 405."""
    routes = api_routes_and_methods()
    assert len(routes) >= 40 and ("action-detail", "/api/v1/actions/1/", frozenset({"get"})) in routes
    wrong = []
    for name, url, taken in routes:
        for method in sorted(set(ALL_METHODS) - taken):
            for client in (viewer_api, operator_api):
                answer = getattr(client, method)(url, {}, format="json")
                if answer.status_code != 405:  # the schema views render it in their own format
                    wrong.append((method.upper(), url, answer.status_code))
    assert not wrong
    # A method the view takes still needs its role.
    refused = viewer_api.post("/api/v1/clusters/", {"name": "x"}, format="json")
    assert refused.status_code == 403 and "needs the admin role" in refused.json()["detail"]
