"""Gateway API traffic splitting of a canary, for Kubernetes clusters with ``Cluster.gateway_httproute`` set.

Ferry's router stays the request pipeline (PD and cache-aware routing), but with one router Deployment per
track (``ferry-router-stable``, ``ferry-router-canary``: pinned with ``--track``, each behind its own
ClusterIP Service; ``deploy/kubernetes/components/gateway``) and the cluster's HTTPRoute splitting between
them. The controller's canary weight (``progress.applied_weight``, the one also published in the routing
table) becomes the route's backendRefs weights:

* :func:`gateway_sync` writes them after the tick's transaction committed (no row lock held during the
  Kubernetes call); a failed write is logged and retried by the next tick;
* :func:`gateway_behind` is what a step waits for: each route carries the weights and its Gateway reports
  ``Accepted`` for that generation. Replicas whose traffic moved away are held until then
  (:func:`apps.rollouts.traffic.scale_down_hold`).

Blue-green plans are not split by the gateway (the pool Service selector moves, ``switch_active``).
"""

from __future__ import annotations

import logging

from apps.fleet.models import Cluster
from apps.operations.backends import backend_session
from apps.orchestrators.base import BackendError
from apps.orchestrators.kubernetes_manifests import ROUTER_NAME, ROUTER_PORT
from apps.rollouts.desired import SERVING_ROLES
from apps.rollouts.models import RolloutPlan

logger = logging.getLogger(__name__)


def gateway_clusters(plan: RolloutPlan) -> list[Cluster]:
    """Kubernetes clusters of the canary plan's serving pools that split traffic with an HTTPRoute (1 query)."""
    if plan.strategy != RolloutPlan.Strategy.CANARY:
        return []
    return list(Cluster.objects.filter(kind=Cluster.Kind.KUBERNETES, pools__in=plan.pools.all(),
                                       pools__role__in=SERVING_ROLES).exclude(gateway_httproute="")
                .distinct().order_by("name"))


def route_weights(plan: RolloutPlan) -> dict[str, int]:
    """``{"stable": 100 - w, "canary": w}`` for the plan's applied canary weight ``w`` (percent)."""
    weight = plan.typed_progress.applied_weight
    return {"stable": 100 - weight, "canary": weight}


def gateway_sync(plan_id: int) -> list[str]:
    """Write the plan's weights to every gateway cluster's HTTPRoute that does not carry them yet.

    Call after the plan's transaction committed. Returns one line per route written; a backend error is
    logged and left to the next tick (:func:`gateway_behind` keeps the step waiting meanwhile).
    """
    plan = RolloutPlan.objects.filter(pk=plan_id).first()
    if plan is None:
        return []
    lines = []
    wanted = route_weights(plan)
    for cluster in gateway_clusters(plan):
        try:
            with backend_session(cluster) as backend:
                current, _ = backend.route_weights(cluster.namespace, cluster.gateway_httproute, ROUTER_NAME)
                if current == wanted:
                    continue
                generation = backend.set_route_weights(cluster.namespace, cluster.gateway_httproute, ROUTER_NAME,
                                                       ROUTER_PORT, wanted)
        except BackendError as exc:
            logger.warning("rollout %s: HTTPRoute %s/%s not written (%s); the next tick retries", plan_id,
                           cluster.namespace, cluster.gateway_httproute, exc)
            continue
        lines.append(f"HTTPRoute {cluster.namespace}/{cluster.gateway_httproute} generation {generation}: "
                     f"stable {wanted['stable']}% canary {wanted['canary']}%")
    return lines


def gateway_behind(plan: RolloutPlan) -> str | None:
    """None when every gateway cluster's HTTPRoute carries :func:`route_weights` and is Accepted for that
    generation, else what is awaited (an unreachable API server is waited for too)."""
    wanted = route_weights(plan)
    for cluster in gateway_clusters(plan):
        route = f"the HTTPRoute {cluster.namespace}/{cluster.gateway_httproute}"
        try:
            with backend_session(cluster) as backend:
                current, generation = backend.route_weights(cluster.namespace, cluster.gateway_httproute,
                                                            ROUTER_NAME)
                if current != wanted:
                    return f"{route} to carry stable {wanted['stable']}% / canary {wanted['canary']}% (has {current})"
                if not backend.route_accepted(cluster.namespace, cluster.gateway_httproute, generation):
                    return f"{route} to be Accepted by its Gateway (generation {generation})"
        except BackendError as exc:
            return f"{route} ({type(exc).__name__}: {exc})"
    return None
