"""Client API key use counts from the routers' ``ferry_router_requests_by_key_total{key}`` counters.

The router counts every request authenticated with a key, per key name. The poller scrapes the registered routers
once per poll; :class:`KeyUseCounter` turns each router's counter into its increase since the previous poll
(per router, so two routers add up; a router restart, seen as a counter going down, counts from 0), and the
poller writes the sums onto the key rows with one UPDATE per key that was used
(:func:`apps.accounts.services.client_key_uses_record`) — never a write per request.

A counter first seen at a router's first scrape (the poller or the router just started) is a baseline: its history
is unknown, so it adds nothing. One created between two good scrapes of a router starts from the 0 the sample store
puts before it (:meth:`~apps.telemetry.sources.scrape.SampleStore.ingest`), so a new key's first requests count.
Uses between a poller's last poll and its restart are not counted (at most one poll interval).
"""

from __future__ import annotations

from apps.telemetry import metric_names as m
from apps.telemetry.sources.scrape import SampleStore


class KeyUseCounter:
    """Per (router, key name): the counter value seen at the previous poll."""

    def __init__(self) -> None:
        self._last: dict[tuple[tuple[str, str, str], str], float] = {}

    def increase(self, store: SampleStore) -> dict[str, int]:
        """Key name -> requests since the previous call, summed over the routers in ``store`` (> 0 only)."""
        uses: dict[str, int] = {}
        seen = set()
        for router, labels, samples in store.router_series(m.ROUTER_REQUESTS_BY_KEY):
            name = labels.get(m.LABEL_KEY)
            if not name:
                continue
            ident = (router, name)
            seen.add(ident)
            value = samples[-1][1]
            last = self._last.get(ident)
            if last is None:
                last = samples[0][1] if len(samples) > 1 and samples[0][1] == 0.0 else value
            delta = value - last if value >= last else value  # reset: the router restarted and counts from 0
            self._last[ident] = value
            if delta > 0:
                uses[name] = uses.get(name, 0) + round(delta)
        for ident in set(self._last) - seen:  # series aged out of the store (router gone)
            del self._last[ident]
        return uses
