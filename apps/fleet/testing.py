"""Test helpers of the fleet app (imported by tests only)."""

from __future__ import annotations

from apps.fleet.models import Cluster, Router
from apps.fleet.services import router_create


def router_for(url: str, cluster: Cluster | None = None) -> Router:
    """The registered router with base ``url`` (registered in ``cluster``, default the first cluster, if new)."""
    url = url.rstrip("/")
    found = Router.objects.filter(url=url).first()
    if found is not None:
        return found
    cluster = cluster or Cluster.objects.order_by("pk").first()
    return router_create(name=f"router-{Router.objects.count() + 1}", cluster=cluster, url=url)
