"""Scale latency: time from ``POST /api/v1/pools/{id}/scale/`` to the backend applying the new replica count.

Path measured: the API request (Django test client, in process) -> Action row committed -> Celery
message on Redis -> a real Celery worker claims it -> ``pool.scale`` handler -> backend verb -> the
backend holds the new count. "Applied" is read from the backend itself, polled every 10 ms: the
Deployment's ``spec.replicas`` on kmock's Kubernetes emulator (a fake controller marks pods ready),
or the local agent's template ``replicas``. Readiness is not part of the figure (model load time is
not control-plane latency): the worker runs with ``FERRY_ACTION_READY_TIMEOUT_S=0``, and the local
pool's model name is deliberately unknown so its processes exit at once instead of loading weights.

Reference in the same run: the same backend verb (``scale_track``) called directly from this process;
the table reports p50/p90 of both over ``--runs`` alternating 1 <-> 0 scales and their ratio. The
Kubernetes emulator runs in this process, so the direct client shares its GIL (a worker process does
not): on a loaded machine the direct Kubernetes reference can come out slower than the full path.

Needs Postgres (``DATABASE_URL``; a throwaway test database is created and dropped) and Redis
(``REDIS_URL``). Usage: ``python bench/scale_latency.py [--runs 20]``. Writes bench/results/scale_latency.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100) of ``values``."""
    ordered = sorted(values)
    return ordered[max(0, min(len(ordered) - 1, round(q / 100 * len(ordered) + 0.5) - 1))]


def wait_until(predicate, timeout_s: float, interval_s: float = 0.01) -> bool:
    deadline = time.perf_counter() + timeout_s
    while time.perf_counter() < deadline:
        if predicate():
            return True
        time.sleep(interval_s)
    return predicate()


STAGES = ("api_to_enqueue", "broker_to_claim", "handler_to_backend", "backend_call")
"""POST -> applied in stages (seconds, from the Actions' timestamps and this process's clock; one host):
``api_to_enqueue`` the POST until its task was sent (``queued_at``, set on commit just before the message goes
to Redis); ``broker_to_claim`` until a worker claimed the ``pool.scale`` Action (``started_at``: the broker hop,
the task's start, the claim); ``handler_to_backend`` until its ``pool.track_set`` Action was claimed (the split,
the track Action recorded); ``backend_call`` until the backend held the new count (backend client set-up, the
spec, the backend's own call, and this bench's 10 ms poll)."""


def stage_times(action_id: int, start: float, applied: float) -> dict[str, float]:
    """:data:`STAGES` of one run from its Actions' timestamps (Unix seconds in, seconds out)."""
    from apps.operations.models import Action

    scale = Action.objects.get(pk=action_id)
    track = Action.objects.filter(idempotency_key__startswith=f"pool.scale-{action_id}:").order_by("id").first()
    queued, claimed = scale.queued_at.timestamp(), scale.started_at.timestamp()
    track_claimed = track.started_at.timestamp() if track is not None and track.started_at else claimed
    return {"api_to_enqueue": queued - start, "broker_to_claim": claimed - queued,
            "handler_to_backend": track_claimed - claimed, "backend_call": applied - track_claimed}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20)
    args = parser.parse_args()
    if not os.environ.get("DATABASE_URL", "").startswith("postgres"):
        print("scale_latency needs DATABASE_URL=postgres://... (a Celery worker process shares the database)")
        return 2

    from bench.throwaway_db import in_throwaway_database

    return in_throwaway_database(lambda: run(args.runs))


def run(runs: int) -> int:
    import logging
    import tempfile

    from rest_framework.test import APIClient

    from apps.accounts.services import user_create_with_role
    from apps.catalog.services import model_version_register
    from apps.fleet.services import cluster_create, pool_create
    from apps.operations.backends import pool_ref
    from apps.operations.models import Action
    from apps.operations.tests.celery_worker import CeleryWorker, purge_queues
    from apps.orchestrators.kubernetes_backend import KubernetesBackend
    from apps.orchestrators.local_backend import LocalAgentBackend
    from apps.orchestrators.tests.kube_mock import DEPLOYMENTS, FakeController, KubeMock, api_client
    from inference_worker.tests.support.agent import AgentProcess

    config = {"model_type": "gemma3_text", "num_hidden_layers": 18, "hidden_size": 640, "intermediate_size": 2048,
              "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 256, "vocab_size": 262144,
              "max_position_embeddings": 32768, "sliding_window": 512}
    for noisy in ("aiohttp.access", "httpx"):  # per-request logs of the emulator and the agent client
        logging.getLogger(noisy).setLevel(logging.WARNING)
    tmp = Path(tempfile.mkdtemp(prefix="ferry-scale-bench-"))
    operator = user_create_with_role(username="bench-operator", role="operator")
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Token {operator.token}")
    version = model_version_register(name="bench-no-such-model", version="v1", weights_uri="s3://bench/none",
                                     sha256="a" * 64, config=config)
    results: dict[str, dict] = {}
    with KubeMock() as kube:
        controller = FakeController(kube.url, "ferry", ready_delay_s=0.05)
        controller.start()
        agent = AgentProcess(tmp / "agent").start()
        purge_queues()
        worker = CeleryWorker(tmp, {"FERRY_AGENT_TOKEN": agent.token, "FERRY_ACTION_READY_TIMEOUT_S": "0"}).start()
        try:
            k8s = cluster_create(name="bench-k8s", kind="kubernetes", kubeconfig_path=kube.kubeconfig(
                str(tmp / "kubeconfig.json")), context="mock", namespace="ferry")
            local = cluster_create(name="bench-local", kind="local", agent_url=agent.base_url)
            k8s_backend = KubernetesBackend(KubernetesBackend.configure(api_client(kube.url).configuration))
            local_backend = LocalAgentBackend(agent.base_url, agent.token)
            for label, cluster, backend, applied in [
                ("mock kubernetes", k8s, k8s_backend,
                 lambda ref, n: (kube.obj(DEPLOYMENTS, "ferry", f"{ref.pool_name}-stable") or {})
                 .get("spec", {}).get("replicas") == n),
                ("local agent", local, local_backend,
                 lambda ref, n: local_backend._request("GET", f"/v1/templates/{ref.pool_name}-stable")
                 .json()["replicas"] == n),
            ]:
                pool = pool_create(name=f"bench-{cluster.kind[:5]}", cluster=cluster, role="decode",
                                   model_version=version, replicas=0, drain_timeout_s=5)
                ref = pool_ref(pool)

                def post(n: int, pool=pool) -> int:
                    r = client.post(f"/api/v1/pools/{pool.pk}/scale/", {"replicas": n}, format="json", secure=True)
                    if r.status_code != 201:
                        raise RuntimeError(f"scale answered {r.status_code}: {r.content[:300]!r}")
                    return r.json()["id"]

                def done(action_id: int) -> bool:
                    return Action.objects.get(pk=action_id).status in ("succeeded", "failed")

                warm = post(0)  # first scale applies the track (create); not measured
                if not wait_until(lambda warm=warm: done(warm), 60, 0.05):
                    raise RuntimeError(f"warm-up action did not finish:\n{worker.log()[-2000:]}")
                api_s, direct_s, stages = [], [], []
                for i in range(runs):
                    n = 1 if i % 2 == 0 else 0
                    start, start_wall = time.perf_counter(), time.time()
                    action_id = post(n)
                    if not wait_until(lambda n=n, f=applied, r=ref: f(r, n), 30):
                        raise RuntimeError(f"{label}: not applied within 30 s:\n{worker.log()[-2000:]}")
                    api_s.append(time.perf_counter() - start)
                    applied_wall = time.time()
                    wait_until(lambda a=action_id: done(a), 60, 0.01)
                    stages.append(stage_times(action_id, start_wall, applied_wall))
                for i in range(runs):
                    n = 1 if i % 2 == 0 else 0
                    start = time.perf_counter()
                    backend.scale_track(ref, "stable", n)
                    wait_until(lambda n=n, f=applied, r=ref: f(r, n), 30)
                    direct_s.append(time.perf_counter() - start)
                results[label] = {
                    "runs": runs, "api_p50_ms": 1000 * statistics.median(api_s),
                    "api_p90_ms": 1000 * percentile(api_s, 90), "direct_p50_ms": 1000 * statistics.median(direct_s),
                    "direct_p90_ms": 1000 * percentile(direct_s, 90),
                    "ratio_p50": statistics.median(api_s) / statistics.median(direct_s),
                    "api_s": api_s, "direct_s": direct_s,
                    "stages_p50_ms": {k: 1000 * statistics.median(st[k] for st in stages) for k in STAGES},
                    "stages_s": stages,
                }
            local_backend.close()
        finally:
            worker.stop()
            agent.terminate()
            controller.stop()

    print(f"{'backend':<16} {'runs':>4} {'POST->applied p50':>18} {'p90':>9} {'direct verb p50':>16} {'p90':>9}"
          f" {'ratio p50':>9}")
    for label, r in results.items():
        print(f"{label:<16} {r['runs']:>4} {r['api_p50_ms']:>15.1f} ms {r['api_p90_ms']:>6.1f} ms"
              f" {r['direct_p50_ms']:>13.1f} ms {r['direct_p90_ms']:>6.1f} ms {r['ratio_p50']:>8.1f}x")
    print("where the time goes (p50 per stage, ms; the stages add up to POST->applied):")
    print(f"{'backend':<16} " + " ".join(f"{k:>{max(len(k), 8)}}" for k in STAGES))
    for label, r in results.items():
        print(f"{label:<16} " + " ".join(f"{r['stages_p50_ms'][k]:>{max(len(k), 8)}.1f}" for k in STAGES))
    out = ROOT / "bench" / "results" / "scale_latency.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    load = os.getloadavg()
    print(f"load average during the run: {load[0]:.1f} (1 min) on {os.cpu_count()} CPUs")
    out.write_text(json.dumps({"benchmark": "scale_latency", "load_average_1m": load[0], "cpus": os.cpu_count(),
                               "results": results}, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
