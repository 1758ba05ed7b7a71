"""Prometheus metrics of the router (DESIGN, "Metrics contract": ``ferry_`` prefix, labels pool, decision).

``decision`` values are :data:`inference_worker.router.pipeline.DECISIONS` (``reason`` and ``cache``:
``pipeline.REASONS`` and ``pipeline.CACHE_STATES``); ``track`` is the routing
table track the request was split to (``stable``, ``canary``, ``blue``, ``green``), so a rollout can
see traffic follow each weight step. Readers that want totals per pool and decision sum over ``track``.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

ERROR_BUCKETS = (-1024, -256, -64, -16, -1, 0, 16, 64, 256, 1024)


class RouterMetrics:
    """The router's series on its own registry.

    - ``ferry_router_decisions_total{pool, decision, track}``: requests routed, by decode pool, prefill
      placement and traffic track (first attempts only; retries are counted in ``retries``).
    - ``ferry_router_decision_reasons_total{pool, decision, reason, cache}``: every plan (retries too), by
      PD decision, what decided it and whether cache scoring was on.
    - ``ferry_router_effective_threshold_tokens{pool, model_version}``: the remote-prefill threshold (uncached prompt
      tokens) of the last plan for the decode pool and model version: the cost function's crossover under the
      measured link load and the prefill replica's queue, clamped to the pool's bounds, or the fixed threshold
      (``+Inf``: remote never wins; absent until a plan had a prefill replica and a profile).
    - ``ferry_router_link_utilisation_ratio{source, target}``: the link load applied (0..1), per link of the table.
    - ``ferry_router_predicted_cached_tokens_total{pool}`` and ``ferry_router_reported_cached_tokens_total{pool}``:
      the index's prediction for the chosen decode replica and the worker's ``X-Ferry-Cached-Tokens`` for the
      same answered requests (their ratio is the index accuracy); ``ferry_router_cached_tokens_error``
      (histogram, tokens): predicted minus reported per request.
    - ``ferry_router_kv_index_resyncs_total{replica}``: gaps or restarts that re-synced a replica's index.
    - ``ferry_router_requests_total{status}``: client requests answered, by HTTP status code.
    - ``ferry_router_upstream_errors_total{pool, replica, kind}``: failed upstream attempts
      (``kind`` connect | timeout | status | stream | auth: the replica refused its pool's worker token).
    - ``ferry_router_retries_total{pool}``: attempts on another replica after a failure.
    - ``ferry_router_rate_limited_total{key}``: requests refused with 429.
    - ``ferry_router_requests_by_key_total{key}``: requests authenticated with each API key (by key name; those its
      rate limit refused included). The control plane's telemetry poller adds their increase to the key's use
      count and last use.
    - ``ferry_router_ejections_total{pool, track, replica, reason}``: circuit-breaker ejections (``reason``:
      ``breaker.EJECTION_REASONS``); ``ferry_router_replica_ejected{pool, track, replica}``: 1 from an ejection
      until a probe succeeds, else 0 (absent for a replica never ejected). ``track`` is the replica's.
    - ``ferry_router_track_failovers_total{from_track, to_track}``: requests sent to another track because
      ejection left the track the split chose without a replica.
    - ``ferry_router_admission_refused_total{reason}``: requests refused for want of an in-flight seat
      (``per_key``: 429, ``overall``: 503; :mod:`.admission`).
    - ``ferry_router_requests_in_flight``: requests holding a seat.
    - ``ferry_router_client_disconnects_total``: requests whose client left before the answer was complete
      and whose upstream request the router then cancelled (the worker aborts it).
    - ``ferry_router_routing_table_version``: version of the routing table applied (-1 before the first).
    - ``ferry_router_routing_table_refresh_errors_total``: failed table pulls or parses.
    """

    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.decisions = Counter("ferry_router_decisions",
                                 "Requests routed, by decode pool, prefill placement and traffic track.",
                                 ["pool", "decision", "track"], registry=r)
        self.decision_reasons = Counter("ferry_router_decision_reasons",
                                        "Plans by decode pool, PD decision, deciding rule and cache scoring state.",
                                        ["pool", "decision", "reason", "cache"], registry=r)
        self.effective_threshold = Gauge("ferry_router_effective_threshold_tokens",
                                         "Effective remote-prefill threshold of the last plan, uncached prompt tokens.",
                                         ["pool", "model_version"], registry=r)
        self.link_utilisation = Gauge("ferry_router_link_utilisation_ratio",
                                      "Measured share of the link's bandwidth in use, as applied to the PD decision.",
                                      ["source", "target"], registry=r)
        self.predicted_cached = Counter("ferry_router_predicted_cached_tokens",
                                        "Cached prompt tokens the prefix index predicted on the chosen replica.",
                                        ["pool"], registry=r)
        self.reported_cached = Counter("ferry_router_reported_cached_tokens",
                                       "Cached prompt tokens the workers reported in their cached-tokens header.",
                                       ["pool"], registry=r)
        self.cached_error = Histogram("ferry_router_cached_tokens_error",
                                      "Predicted minus reported cached prompt tokens per answered request.",
                                      ["pool"], buckets=ERROR_BUCKETS, registry=r)
        self.index_resyncs = Counter("ferry_router_kv_index_resyncs", "KV index re-syncs after a gap or restart.",
                                     ["replica"], registry=r)
        self.requests = Counter("ferry_router_requests", "Client requests answered, by HTTP status.", ["status"],
                                registry=r)
        self.upstream_errors = Counter("ferry_router_upstream_errors", "Failed upstream attempts.",
                                       ["pool", "replica", "kind"], registry=r)
        self.retries = Counter("ferry_router_retries", "Attempts on another replica after a failure.", ["pool"],
                               registry=r)
        self.rate_limited = Counter("ferry_router_rate_limited", "Requests refused with 429, by API key name.",
                                    ["key"], registry=r)
        self.requests_by_key = Counter("ferry_router_requests_by_key",
                                       "Requests authenticated with each API key (rate-limited ones included).",
                                       ["key"], registry=r)
        self.ejections = Counter("ferry_router_ejections", "Replicas ejected by the circuit breaker, by reason.",
                                 ["pool", "track", "replica", "reason"], registry=r)
        self.replica_ejected = Gauge("ferry_router_replica_ejected",
                                     "1 while the circuit breaker keeps the replica ejected, else 0.",
                                     ["pool", "track", "replica"], registry=r)
        self.track_failovers = Counter("ferry_router_track_failovers",
                                       "Requests sent to another track because ejection emptied theirs.",
                                       ["from_track", "to_track"], registry=r)
        self.admission_refused = Counter("ferry_router_admission_refused",
                                         "Requests refused for want of an in-flight seat.", ["reason"], registry=r)
        self.in_flight = Gauge("ferry_router_requests_in_flight", "Client requests holding an in-flight seat.",
                               registry=r)
        self.client_disconnects = Counter("ferry_router_client_disconnects",
                                          "Requests whose client left before the answer was complete.", registry=r)
        self.table_version = Gauge("ferry_router_routing_table_version", "Version of the routing table applied.",
                                   registry=r)
        self.table_errors = Counter("ferry_router_routing_table_refresh_errors",
                                    "Failed routing table pulls or parses.", registry=r)
        self.table_version.set(-1)
