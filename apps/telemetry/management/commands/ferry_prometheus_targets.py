"""``manage.py ferry_prometheus_targets --out FILE``: the model workers as a Prometheus ``file_sd`` target file.

Workers listen on ports the local agent picks, so Prometheus cannot list them statically. This command
writes the observed replicas that have an endpoint (the ``Replica`` rows reconcile keeps) as
``[{"targets": ["host:port"], "labels": {"ferry_pool": ..., "ferry_track": ..., "ferry_replica": ...}}]``,
atomically (temporary file + rename, as Prometheus' file_sd expects), once or every ``--interval``
seconds until SIGTERM/SIGINT. docker-compose.yml runs it next to Prometheus (deploy/prometheus.yml).
"""

from __future__ import annotations

import json
import os
import signal
import tempfile
import threading
from pathlib import Path
from urllib.parse import urlsplit

from django.core.management.base import BaseCommand, CommandError

from apps.core.process_loop import loop_iteration_started
from apps.fleet.models import Replica


def prometheus_targets() -> list[dict]:
    """file_sd groups, one per replica with an ``http://host:port`` endpoint, ordered by pool, track, name."""
    groups = []
    for replica in Replica.objects.select_related("pool").exclude(endpoint="").order_by("pool__name", "track", "name"):
        parts = urlsplit(replica.endpoint)
        if not parts.hostname or not parts.port:
            continue
        groups.append({"targets": [f"{parts.hostname}:{parts.port}"],
                       "labels": {"ferry_pool": replica.pool.name, "ferry_track": replica.track,
                                  "ferry_replica": replica.name}})
    return groups


def write_atomically(path: Path, content: str) -> None:
    """Write ``content`` to ``path`` through a temporary file in the same directory and ``os.replace``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w") as fh:
        fh.write(content)
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)


class Command(BaseCommand):
    help = "Write the observed model workers as a Prometheus file_sd JSON file, once or every --interval seconds."

    def add_arguments(self, parser) -> None:  # noqa: ANN001 - Django signature
        parser.add_argument("--out", required=True, type=Path, help="target file, e.g. /etc/prometheus/targets/workers.json")
        parser.add_argument("--interval", type=float, default=0.0, help="seconds between writes (0: write once)")

    def handle(self, *args, out: Path, interval: float, **options) -> None:
        if interval < 0:
            raise CommandError(f"--interval must be >= 0, got {interval}")
        stop = threading.Event()
        if interval:
            for sig in (signal.SIGTERM, signal.SIGINT):
                signal.signal(sig, lambda *_: stop.set())
        last = None
        while True:
            content = json.dumps(prometheus_targets(), indent=2) + "\n"
            if content != last:
                write_atomically(out, content)
                self.stdout.write(f"{out}: {len(json.loads(content))} worker target(s)")
                last = content
            if not interval or stop.wait(interval):
                return
            loop_iteration_started()  # a long-running loop: empty the DEBUG query log, drop an old connection
