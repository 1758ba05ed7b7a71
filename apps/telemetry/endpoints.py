"""Where each replica's ``/metrics`` lives: ``ReplicaEndpoint`` and the provider that lists them.

Direct scraping needs one URL per replica. :func:`replica_endpoints` lists

1. the observed replicas that are alive and have an endpoint (the fleet's ``Replica`` rows, which
   reconcile keeps from the backends; :func:`apps.fleet.selectors.replica_endpoint_rows`), plus
2. ``settings.FERRY_TELEMETRY_STATIC_TARGETS``: a list of dicts
   ``{"pool": <pool id>, "track": "stable", "replica": "r0", "url": "http://host:port"}``
   (a static target with the same (pool, track, replica) key as a live row is dropped),

unless a test installed its own callable with ``set_endpoint_provider``.

Routers (``python -m inference_worker router``) belong to no pool: their series name the pool
in a label (``ferry_router_decisions_total{pool, decision}``). Direct scraping reads them from the
router registry (:class:`apps.fleet.models.Router`, admin-only, validated base URLs: the poller
fetches no URL an operator typed); Prometheus users add the job ``prometheus_router_scrape_config`` builds.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from urllib.parse import urlsplit

from django.conf import settings

from apps.fleet.selectors import replica_endpoint_rows, router_list
from inference_worker.engine_kinds import FERRY, check_engine, prometheus_metric_relabel_configs


@dataclass(frozen=True)
class ReplicaEndpoint:
    """One worker replica: its pool's primary key, track, replica name and base URL (``http://host:port``).

    ``metrics_url`` is ``<url>/metrics``. ``engine`` is the pool's engine kind
    (:mod:`inference_worker.engine_kinds`): its series are translated to Ferry's names where they are read.
    ``pool_name`` is the pool's name (the ``pool`` label a Prometheus job sets on an engine's series, which do not
    carry Ferry's labels themselves). Raises ``ValueError`` for a URL without scheme/host or an unknown engine.
    """

    pool_id: str
    track: str
    replica: str
    url: str
    engine: str = FERRY
    pool_name: str = ""

    def __post_init__(self):
        parts = urlsplit(self.url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise ValueError(f"replica {self.replica!r} has URL {self.url!r}; expected http(s)://host:port")
        if not self.pool_id or not self.track or not self.replica:
            raise ValueError("a replica endpoint needs a pool, a track and a replica name")
        check_engine(self.engine)

    @property
    def metrics_url(self) -> str:
        return self.url.rstrip("/") + "/metrics"

    @property
    def key(self) -> tuple[str, str, str]:
        return (self.pool_id, self.track, self.replica)


@dataclass(frozen=True)
class RouterEndpoint:
    """One router's metrics URL: ``http(s)://host:port[/path]``; no path means ``/metrics``.

    Raises ``ValueError`` for a URL without scheme/host, or with a query or fragment.
    """

    url: str

    def __post_init__(self):
        parts = urlsplit(self.url)
        if parts.scheme not in ("http", "https") or not parts.netloc or parts.query or parts.fragment:
            raise ValueError(f"router metrics URL {self.url!r} is not http(s)://host:port[/metrics]")

    @property
    def metrics_url(self) -> str:
        parts = urlsplit(self.url)
        return self.url if parts.path not in ("", "/") else f"{parts.scheme}://{parts.netloc}/metrics"

    @property
    def key(self) -> tuple[str, str, str]:
        """Never equal to a replica's key (those have a non-empty pool)."""
        return ("", "router", self.metrics_url)


def router_endpoints() -> list[RouterEndpoint]:
    """The registered routers' metrics endpoints (``<url>/metrics``), read at every poll."""
    return [RouterEndpoint(router.metrics_url) for router in router_list()]


EndpointProvider = Callable[[], Iterable[ReplicaEndpoint]]

_provider: list[EndpointProvider] = []


def set_endpoint_provider(provider: EndpointProvider | None) -> None:
    """Install a callable that lists replica endpoints instead of the observed replicas (tests); ``None``
    restores the default (observed replicas plus static targets)."""
    _provider.clear()
    if provider is not None:
        _provider.append(provider)


def static_endpoints() -> list[ReplicaEndpoint]:
    """Endpoints from ``settings.FERRY_TELEMETRY_STATIC_TARGETS``; ``ValueError`` on a bad entry."""
    targets = getattr(settings, "FERRY_TELEMETRY_STATIC_TARGETS", []) or []
    endpoints = []
    for target in targets:
        try:
            endpoints.append(
                ReplicaEndpoint(
                    pool_id=str(target["pool"]),
                    track=str(target.get("track", "stable")),
                    replica=str(target["replica"]),
                    url=str(target["url"]),
                )
            )
        except KeyError as exc:
            raise ValueError(f"FERRY_TELEMETRY_STATIC_TARGETS entry {target!r} lacks {exc}") from exc
    return endpoints


def replica_endpoints() -> list[ReplicaEndpoint]:
    """Every known replica endpoint: an installed provider's, else the observed replicas plus the static targets.

    Live ``Replica`` rows come first (pool id as a string); a static target with the same
    (pool, track, replica) key is dropped.
    """
    if _provider:
        return list(_provider[0]())
    found = {}
    for pool_id, track, name, endpoint, engine, pool_name in replica_endpoint_rows():
        ep = ReplicaEndpoint(pool_id=str(pool_id), track=track, replica=name, url=endpoint, engine=engine,
                             pool_name=pool_name)
        found[ep.key] = ep
    for ep in static_endpoints():
        found.setdefault(ep.key, ep)
    return list(found.values())


def prometheus_scrape_config(endpoints: Iterable[ReplicaEndpoint], *, interval_s: float = 1.0) -> dict:
    """A Prometheus ``scrape_configs`` job scraping ``endpoints``, as a dict to dump as YAML.

    Targets carry ``pool_id``/``track``/``replica`` target labels (so ``up`` is attributable);
    ``honor_labels`` keeps the worker's own labels (``pool`` = the pool's name) authoritative. Only Ferry workers:
    replicas of other engine kinds are scraped by :func:`prometheus_engine_scrape_configs`' jobs.
    """
    static_configs = []
    for ep in endpoints:
        if ep.engine != FERRY:
            continue
        static_configs.append(
            {
                "targets": [urlsplit(ep.url).netloc],
                "labels": {"pool_id": ep.pool_id, "track": ep.track, "replica": ep.replica},
            }
        )
    interval = f"{round(interval_s * 1000)}ms"
    return {
        "job_name": "ferry-workers",
        "scrape_interval": interval,
        "scrape_timeout": interval,
        "honor_labels": True,
        "metrics_path": "/metrics",
        "static_configs": static_configs,
    }


def prometheus_engine_scrape_configs(endpoints: Iterable[ReplicaEndpoint], *, interval_s: float = 1.0) -> list[dict]:
    """One Prometheus ``scrape_configs`` job per engine kind other than Ferry's (``ferry-<engine>``), as dicts.

    An engine's series carry none of Ferry's labels, so each target sets ``pool`` (the pool's name), ``pool_id``,
    ``track`` and ``replica``, and the job's ``metric_relabel_configs`` rename the engine's series to Ferry's
    names (:func:`inference_worker.engine_kinds.prometheus_metric_relabel_configs`): the PromQL signals then read
    a vLLM or SGLang pool exactly as a Ferry one. Raises ``ValueError`` for an engine endpoint without a pool name.
    """
    by_engine: dict[str, list[dict]] = {}
    for ep in endpoints:
        if ep.engine == FERRY:
            continue
        if not ep.pool_name:
            raise ValueError(f"replica {ep.replica!r} runs {ep.engine} but has no pool name for its pool label")
        by_engine.setdefault(ep.engine, []).append({
            "targets": [urlsplit(ep.url).netloc],
            "labels": {"pool": ep.pool_name, "pool_id": ep.pool_id, "track": ep.track, "replica": ep.replica},
        })
    interval = f"{round(interval_s * 1000)}ms"
    return [{"job_name": f"ferry-{engine}", "scrape_interval": interval, "scrape_timeout": interval,
             "metrics_path": "/metrics", "static_configs": targets,
             "metric_relabel_configs": prometheus_metric_relabel_configs(engine)}
            for engine, targets in sorted(by_engine.items())]


def prometheus_router_scrape_config(routers: Iterable[RouterEndpoint], *, interval_s: float = 1.0) -> dict:
    """A Prometheus ``scrape_configs`` job scraping the routers' metrics URLs, as a dict to dump as YAML.

    ``honor_labels`` keeps the router's ``pool`` label (the decode pool's name), which is how
    router series are attributed to pools; each target carries its own path and scheme
    (``__metrics_path__``, ``__scheme__``).
    """
    static_configs = []
    for router in routers:
        parts = urlsplit(router.metrics_url)
        static_configs.append({"targets": [parts.netloc],
                               "labels": {"__metrics_path__": parts.path, "__scheme__": parts.scheme}})
    interval = f"{round(interval_s * 1000)}ms"
    return {
        "job_name": "ferry-router",
        "scrape_interval": interval,
        "scrape_timeout": interval,
        "honor_labels": True,
        "static_configs": static_configs,
    }
