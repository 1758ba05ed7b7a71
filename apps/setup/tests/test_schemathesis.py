"""Property-based run over the OpenAPI schema (schemathesis): no request makes the API answer 5xx.

Every operation is exercised with valid (positive) and invalid (negative) generated requests,
through the WSGI app, authenticated with an operator token and with an admin token (operators
get 403 on admin-only writes; the admin run reaches the validation behind them). Detail routes
get the id of a real seeded object so updates and deletes reach the services. The example count
is bounded and generation is derandomized so the run is reproducible: per role, MAX_EXAMPLES (5)
positive and 5 negative examples per operation.

Boundary examples: BOUNDARY_VALUES (2**63, -4.2e19, 1e400) in every integer and number parameter of
every operation — 258 requests on today's schema (86 numeric query and path parameters). A query
parameter must answer 400 naming itself (not a 500, not a silently empty 200); a path id 400 or 404.
The same test checks that every filterset field is a query parameter of its list operation.
"""

import pytest
import schemathesis
from django.core import signals
from django.core.wsgi import get_wsgi_application
from django.db import close_old_connections, transaction
from django.urls import resolve
from django.utils import timezone
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode

from apps.accounts.services import user_create_with_role
from apps.fleet.models import Replica
from apps.fleet.services import cluster_link_create
from apps.operations.services import action_create
from apps.rollouts.services import rollout_plan_create
from apps.telemetry.models import Alert, AlertRule

pytestmark = pytest.mark.django_db

MAX_EXAMPLES = 5
# Past a signed 64-bit column, past any integer column below it, and a float that overflows to infinity.
BOUNDARY_VALUES = (str(2**63), "-4.2e19", "1e400")


@pytest.fixture
def seeded(pool, make_pool, make_model_version, make_cluster):
    """One object of each kind; returns {path prefix: id} for detail routes."""
    v2 = make_model_version("v2")
    prefill = make_pool("prefill", role="prefill")
    other = make_cluster("dc-b")
    link = cluster_link_create(source=pool.cluster, destination=other, bandwidth_gbps=10, rtt_ms=30)
    plan = rollout_plan_create(name="r", pools=[pool, prefill], target_model_version=v2, strategy="canary",
                               steps=[{"set_weight": 10}])
    action, _ = action_create(kind="pool.scale", target_type="pool", target_id=str(pool.pk), params={"replicas": 1})
    alert = Alert.objects.create(rule=AlertRule.objects.get(name="kv-cache-usage-critical", pool=None), pool=pool,
                                 severity="critical", started_at=timezone.now(), value=0.97)
    return {"/api/v1/alerts/": alert.pk, "/api/v1/signals/": pool.pk, "/api/v1/clusters/": pool.cluster_id, "/api/v1/cluster-links/": link.pk,
            "/api/v1/model-versions/": v2.pk, "/api/v1/pools/": pool.pk, "/api/v1/rollouts/": plan.pk,
            "/api/v1/actions/": action.pk}


def _ids_for(path: str, seeded: dict[str, int]) -> dict[str, int] | None:
    for prefix, pk in seeded.items():
        if path.startswith(prefix) and "{id}" in path:
            return {"id": pk}
    return None


@pytest.fixture
def keep_test_connection():
    """Like Django's test client: don't close the DB connection (and the test's transaction) per request."""
    signals.request_started.disconnect(close_old_connections)
    signals.request_finished.disconnect(close_old_connections)
    yield
    signals.request_started.connect(close_old_connections)
    signals.request_finished.connect(close_old_connections)


@pytest.mark.parametrize("role", ["operator", "admin"])
def test_api_never_answers_5xx(role, seeded, keep_test_connection):
    token = user_create_with_role(username=f"fuzz-{role}", role=role).token
    app = get_wsgi_application()
    schema = schemathesis.openapi.from_wsgi("/api/v1/schema/?format=json", app)
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 30
    failures, unsatisfiable, runs = [], [], 0
    for operation in operations:
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            ids = _ids_for(operation.path, seeded) if mode == GenerationMode.POSITIVE else None
            strategy = operation.as_strategy(generation_mode=mode, path_parameters=ids)

            @settings(max_examples=MAX_EXAMPLES, deadline=None, derandomize=True, database=None,
                      suppress_health_check=list(HealthCheck))
            @given(case=strategy)
            def run(case):
                with transaction.atomic():  # each request is isolated, as with autocommit in production
                    response = case.call(headers={"Authorization": f"Token {token}"})
                if response.status_code >= 500:
                    failures.append((case.method, case.formatted_path, case.query, case.body,
                                     response.status_code, response.text[:500]))

            try:
                run()
            except Unsatisfiable:  # schemathesis could not build a request of this kind (e.g. no negative path)
                unsatisfiable.append((operation.method, operation.path, mode.value))
            else:
                runs += 1
    assert runs >= 1.5 * len(operations), unsatisfiable
    assert failures == []


def _numeric_parameters(operation) -> list[tuple[str, str]]:
    return [(parameter.location, parameter.name) for parameter in operation.iter_parameters()
            if parameter.location in ("query", "path")
            and parameter.definition.get("schema", {}).get("type") in ("integer", "number")]


def test_boundary_numbers_in_every_numeric_parameter_are_a_4xx(seeded, keep_test_connection):
    """2**63, -4.2e19 and 1e400 in each integer/number parameter: a 400 naming the query parameter (a path id:
    400 or 404), never a 500 nor a silently empty 200; every filterset field is in the schema."""
    token = user_create_with_role(username="fuzz-bounds", role="admin").token
    replica = Replica.objects.create(pool_id=seeded["/api/v1/pools/"], track="stable", name="decode-stable-0",
                                     last_seen=timezone.now())
    seeded = {**seeded, "/api/v1/replicas/": replica.pk}
    schema = schemathesis.openapi.from_wsgi("/api/v1/schema/?format=json", get_wsgi_application())
    operations = [result.ok() for result in schema.get_all_operations()]
    wrong, examples = [], 0
    for operation in operations:
        parameters = _numeric_parameters(operation)
        if operation.method.upper() == "GET" and "{" not in operation.path:
            filterset = getattr(resolve(operation.path).func.cls, "filterset_class", None)
            names = {name for location, name in
                     ((p.location, p.name) for p in operation.iter_parameters()) if location == "query"}
            missing = set(filterset.base_filters) - names if filterset else set()
            assert not missing, f"{operation.path}: filters {sorted(missing)} are not in the OpenAPI schema"
        for location, name in parameters:
            for value in BOUNDARY_VALUES:
                ids = dict(_ids_for(operation.path, seeded) or {})
                query = {}
                if location == "path":
                    ids[name] = value
                else:
                    query[name] = value
                body = {"body": {}, "media_type": "application/json"} if operation.get_request_payload_content_types() else {}
                case = operation.Case(path_parameters=ids or None, query=query or None, **body)
                with transaction.atomic():
                    response = case.call(headers={"Authorization": f"Token {token}"})
                examples += 1
                expected = (400, 404) if location == "path" else (400,)
                if response.status_code not in expected or (location == "query" and name not in response.text):
                    wrong.append((operation.method, operation.path, name, value, response.status_code,
                                  response.text[:200]))
    assert examples >= 3 * 30, examples
    assert wrong == []
