"""Per-request cost of the top API endpoints: pyinstrument profiles and query counts, in-process.

Each endpoint is requested ``--repeat`` times through Django's full stack (middleware, authentication, DRF,
serializers; ``django.test.Client``, so no server and no network) against the database at ``DATABASE_URL``
with an existing user's API token. Per endpoint it reports the mean wall time per request, the SQL queries of
one request (``CaptureQueriesContext``) and writes pyinstrument's text report (``--out-dir``); the JSON
summary goes to ``--out``.

    DATABASE_URL=postgres://... python bench/api_profile.py --user operator --out var/bench/api_profile.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")

import django  # noqa: E402

django.setup()

from django.db import connection  # noqa: E402
from django.test import Client  # noqa: E402
from django.test.utils import CaptureQueriesContext  # noqa: E402
from pyinstrument import Profiler  # noqa: E402

ENDPOINTS = ("/api/v1/pools/", "/api/v1/replicas/", "/api/v1/actions/", "/api/v1/clusters/",
             "/api/v1/model-versions/", "/api/v1/rollouts/", "/api/v1/alerts/", "/api/v1/routing-table/")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--user", default="operator", help="whose API token to send")
    parser.add_argument("--repeat", type=int, default=50)
    parser.add_argument("--endpoint", action="append", help=f"path (repeatable; default {', '.join(ENDPOINTS)})")
    parser.add_argument("--out", type=Path, default=Path("var/bench/api_profile.json"))
    parser.add_argument("--out-dir", type=Path, default=Path("var/bench/api_profile"))
    args = parser.parse_args(argv)
    from django.contrib.auth import get_user_model

    from apps.accounts.services import api_token_create

    # API tokens are stored hashed (knox): a new one for this run, the clear value only exists here.
    token = api_token_create(user=get_user_model().objects.get(username=args.user))
    client = Client(HTTP_AUTHORIZATION=f"Token {token}", HTTP_HOST="127.0.0.1")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    results = {}
    for path in args.endpoint or ENDPOINTS:
        status = client.get(path).status_code  # warm-up (imports, caches)
        with CaptureQueriesContext(connection) as queries:
            client.get(path)
        sql = [q["sql"][:200] for q in queries.captured_queries]  # now: a reconnect clears the query log
        profiler = Profiler(interval=0.0005)
        start = time.perf_counter()
        with profiler:
            for _ in range(args.repeat):
                client.get(path)
        mean_ms = (time.perf_counter() - start) / args.repeat * 1000
        name = path.strip("/").replace("/", "_")
        (args.out_dir / f"{name}.txt").write_text(profiler.output_text(unicode=False, color=False))
        results[path] = {"status": status, "mean_ms": round(mean_ms, 2), "num_queries": len(sql), "queries": sql}
        print(f"{path:28s} {status} {mean_ms:7.2f} ms/request {len(sql):3d} queries", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"repeat": args.repeat, "loadavg": os.getloadavg(), "endpoints": results},
                                   indent=2) + "\n")


if __name__ == "__main__":
    main()
