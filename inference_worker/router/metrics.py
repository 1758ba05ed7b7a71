"""Prometheus metrics of the router (DESIGN, "Metrics contract": ``ferry_`` prefix, labels pool, decision).

``decision`` values are :data:`inference_worker.router.decisions.DECISIONS`; ``track`` is the routing
table track the request was split to (``stable``, ``canary``, ``blue``, ``green``), so a rollout can
see traffic follow each weight step. Readers that want totals per pool and decision sum over ``track``.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge


class RouterMetrics:
    """The router's series on its own registry.

    - ``ferry_router_decisions_total{pool, decision, track}``: requests routed, by decode pool, prefill
      placement and traffic track (first attempts only; retries are counted in ``retries``).
    - ``ferry_router_requests_total{status}``: client requests answered, by HTTP status code.
    - ``ferry_router_upstream_errors_total{pool, replica, kind}``: failed upstream attempts
      (``kind`` connect | timeout | status | stream).
    - ``ferry_router_retries_total{pool}``: attempts on another replica after a failure.
    - ``ferry_router_rate_limited_total{key}``: requests refused with 429.
    - ``ferry_router_routing_table_version``: version of the routing table applied (-1 before the first).
    - ``ferry_router_routing_table_refresh_errors_total``: failed table pulls or parses.
    """

    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.decisions = Counter("ferry_router_decisions",
                                 "Requests routed, by decode pool, prefill placement and traffic track.",
                                 ["pool", "decision", "track"], registry=r)
        self.requests = Counter("ferry_router_requests", "Client requests answered, by HTTP status.", ["status"],
                                registry=r)
        self.upstream_errors = Counter("ferry_router_upstream_errors", "Failed upstream attempts.",
                                       ["pool", "replica", "kind"], registry=r)
        self.retries = Counter("ferry_router_retries", "Attempts on another replica after a failure.", ["pool"],
                               registry=r)
        self.rate_limited = Counter("ferry_router_rate_limited", "Requests refused with 429, by API key name.",
                                    ["key"], registry=r)
        self.table_version = Gauge("ferry_router_routing_table_version", "Version of the routing table applied.",
                                   registry=r)
        self.table_errors = Counter("ferry_router_routing_table_refresh_errors",
                                    "Failed routing table pulls or parses.", registry=r)
        self.table_version.set(-1)
