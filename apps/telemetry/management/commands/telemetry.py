"""``manage.py telemetry``: run the telemetry poller (its own process) until SIGTERM/SIGINT."""

from __future__ import annotations

import signal
import threading

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError

from apps.telemetry.endpoints import router_endpoints
from apps.telemetry.poller import TelemetryPoller


class Command(BaseCommand):
    help = "Poll worker metrics every interval: signals, 15-minute Redis history, channel-layer stream, alerts."

    def add_arguments(self, parser):
        parser.add_argument("--interval", type=float, default=getattr(settings, "FERRY_TELEMETRY_INTERVAL_S", 1.0),
                            help="Seconds between polls (1-2 s recommended).")
        parser.add_argument("--window", type=float, default=getattr(settings, "FERRY_TELEMETRY_WINDOW_S", 30.0),
                            help="Trailing window in seconds for rates and quantiles.")
        parser.add_argument("--polls", type=int, default=None, help="Stop after this many polls (default: run forever).")

    def handle(self, *args, interval: float, window: float, polls: int | None, **options):
        if not (0 < interval <= 60) or window <= 0:
            raise CommandError("--interval must be in (0, 60] s and --window positive")
        routers = router_endpoints()  # re-read at every poll: the registry may change while the poller runs
        stop = threading.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop.set())
        poller = TelemetryPoller(window_s=window, interval_s=interval)
        scraped = ", ".join(r.metrics_url for r in routers) or "none registered (admin: /api/v1/routers/)"
        self.stdout.write(f"telemetry poller: every {interval:g} s, window {window:g} s; routers: {scraped}")
        try:
            done = poller.run(stop, max_polls=polls)
        finally:
            poller.close()
        self.stdout.write(f"telemetry poller stopped after {done} polls")
