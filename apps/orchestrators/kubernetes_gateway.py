"""Gateway API traffic splitting on Kubernetes: the HTTPRoute part of :class:`KubernetesBackend`.

The operator creates the HTTPRoute (parentRefs to its Gateway, matches, filters); Ferry writes only the
``backendRefs`` of its rules: one ClusterIP Service per track router (``<router>-<track>``, see
:func:`apps.orchestrators.kubernetes_manifests.track_router`) with the track's weight in percent. HTTPRoute
is a custom resource (``gateway.networking.k8s.io/v1``), written with JSON merge patches through
``CustomObjectsApi``. Source of the fields: Gateway API v1 ``HTTPRoute`` (``spec.rules[].backendRefs[]``:
group, kind, name, port, weight) and ``RouteStatus`` (``status.parents[].conditions``, type ``Accepted``,
``observedGeneration``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from kubernetes import client

from apps.orchestrators import kubernetes_manifests as manifests
from apps.orchestrators.base import InvalidSpec, validate_weights


class HTTPRouteWeights:
    """Mixin of :class:`~apps.orchestrators.kubernetes_backend.KubernetesBackend` (its call policy: ``_call``
    with backoff and typed errors, ``_retry_conflicts`` for 409s)."""

    custom: client.CustomObjectsApi
    _call: Callable[..., Any]
    _retry_conflicts: Callable[[Callable[[], Any]], Any]

    def _read_route(self, namespace: str, route: str) -> dict:
        return self._call(self.custom.get_namespaced_custom_object, manifests.GATEWAY_API_GROUP,
                          manifests.GATEWAY_API_VERSION, namespace, manifests.HTTPROUTES, route)

    def set_route_weights(self, namespace: str, route: str, router_name: str, port: int,
                          weights: Mapping[str, int]) -> int:
        """Write ``weights`` (track -> percent) as the backendRefs of every rule of HTTPRoute ``route``.

        Each backendRef is the ClusterIP Service ``<router_name>-<track>`` of a router pinned to that track
        (:func:`manifests.track_router`); the rules' matches and filters are kept. The patch carries the
        route's resourceVersion (a concurrent writer -> 409 -> re-read, bounded). Returns the route's
        ``metadata.generation`` after the write, which :meth:`route_accepted` waits for.

        Raises:
            InvalidSpec: weights that are not percentages summing to 100, or a route without rules.
            NotFound: no such HTTPRoute (the operator creates it with its parentRefs to the Gateway).
        """
        validate_weights(weights)
        refs = manifests.http_route_backend_refs(router_name, port, weights)

        def write_once() -> int:
            current = self._read_route(namespace, route)
            rules = (current.get("spec") or {}).get("rules") or []
            if not rules:
                raise InvalidSpec(f"HTTPRoute {namespace}/{route} has no rules to carry the backendRefs")
            body = {"metadata": {"resourceVersion": current["metadata"].get("resourceVersion")},
                    "spec": {"rules": [{**rule, "backendRefs": refs} for rule in rules]}}
            written = self._call(self.custom.patch_namespaced_custom_object, manifests.GATEWAY_API_GROUP,
                                 manifests.GATEWAY_API_VERSION, namespace, manifests.HTTPROUTES, route, body)
            return int((written.get("metadata") or {}).get("generation") or 0)

        return self._retry_conflicts(write_once)

    def route_weights(self, namespace: str, route: str, router_name: str) -> tuple[dict[str, int], int]:
        """The HTTPRoute's per-track weights (from backendRefs ``<router_name>-<track>`` of its rules; every
        rule must agree, else ``{}``) and its ``metadata.generation``.

        Raises:
            NotFound: no such HTTPRoute.
        """
        current = self._read_route(namespace, route)
        prefix = f"{router_name}-"
        splits = [{ref["name"][len(prefix):]: int(ref.get("weight", 1))
                   for ref in rule.get("backendRefs") or [] if str(ref.get("name", "")).startswith(prefix)}
                  for rule in (current.get("spec") or {}).get("rules") or []]
        weights = splits[0] if splits and all(split == splits[0] for split in splits) else {}
        return weights, int((current.get("metadata") or {}).get("generation") or 0)

    def route_accepted(self, namespace: str, route: str, generation: int) -> bool:
        """True when every parent (Gateway) in the route's status reports ``Accepted=True`` for
        ``generation`` or later (``observedGeneration``), and there is at least one parent.

        Source: Gateway API v1 RouteStatus (``status.parents[].conditions``, type ``Accepted``).
        """
        status = self._read_route(namespace, route).get("status") or {}
        parents = status.get("parents") or []
        def accepted(parent: dict) -> bool:
            return any(c.get("type") == "Accepted" and c.get("status") == "True"
                       and int(c.get("observedGeneration") or 0) >= generation
                       for c in parent.get("conditions") or [])
        return bool(parents) and all(accepted(p) for p in parents)
