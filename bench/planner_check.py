"""Issue 24, acceptance 3: the planner's predicted TTFT p50 for the demo fleet under the multi-turn load vs measured.

Run it against a running ``make run`` stack, with that stack's environment (``DATABASE_URL`` and the rest of its
settings, ``FERRY_CLIENT_API_KEY`` for the router)::

    nice -n 19 ionice -c3 .venv/bin/python bench/planner_check.py --router-url http://127.0.0.1:8080

1. **Profiles, co-located**: ``manage.py ferry_profile`` on the demo's prefill and decode pools while the whole
   fleet runs (the sweep shares the machine with it, as the load will), unless ``--reuse-profiles`` takes each
   pool's newest profile. The decode pool's sweep also measures its prefill while it decodes
   (:mod:`apps.planning.profiling`). Batch sizes ``--batch-sizes`` (1, 2, 3: the batches this load runs at).
2. **Load**: ``bench/workloads.py``'s multi-turn sessions (:class:`MultiTurnConfig`, its token ids drawn with
   ``--seed``: a new seed per run by default, since a rerun of the same prompts would hit the prefix caches the
   last run filled) through the router, sessions arriving as a Poisson process at ``--session-rate`` per second
   and each later turn after the user's think time (``--think-time-s``, exponential, ``bench/serve_load.
   run_sessions``), TTFT measured client-side (first streamed token).
3. **Prediction** for the fleet as it runs: the planner (:class:`inference_worker.planning.planner.Planner`, on the
   measured profiles through :mod:`apps.planning.recommend`) at the run's request rate (requests / wall time), its
   prompt lengths the tokens each request really computed (``prompt_tokens - cached_tokens``, median and p90 as a
   log-normal) after the run's mean cached prefix (``cached_tokens``: a later turn finds its conversation in the
   prefix cache, and its computed tokens attend to it: ``Workload.cached_prefix_mean``), its outputs the requested
   ``max_tokens``, the router's threshold (``--threshold``, the demo's 256
   by default), and ``Fleet(remote_prefill=P, local_prefill=0, decode=D, colocated=True)`` with ``P`` and ``D`` the
   pools' ready replicas: a demo decode replica prefills short prompts itself, in the batch of its decodes (the
   planner's "co-located local prefill": its prompts wait for the step in progress and share steps with the
   decoding sequences, and remotely prefilled requests wait for the step in progress before their first token).

4. **Telemetry's view** of the same load: the workload the planning page's "recent traffic" source reads over the
   load's span (:func:`apps.planning.selectors.telemetry_workload`: the decode workers' request-length histograms
   through the telemetry poller), printed beside the client's lengths and stored as ``telemetry_workload``.

Prints predicted vs measured TTFT p50 and p90 and their ratios, and the ratios of a prediction that prices the
computed tokens as fresh prompts (the model before session 10); writes ``bench/results/planner_check.json``.
``--repredict JSON`` predicts again for an earlier run's measurements with the newest profiles.
Acceptance: the prediction's p50 within 25% of the measured p50. Session arrivals are Poisson but a session's turns
follow one another, so request arrivals are burstier than the planner's Poisson assumption; without a think time
(``--think-time-s 0``) turns whose answers ended in the same decode step arrive together.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import math
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")

import django  # noqa: E402

django.setup()

from django.core.exceptions import ValidationError  # noqa: E402
from django.core.management import call_command  # noqa: E402

from apps.fleet.models import ClusterLink, Pool, Replica  # noqa: E402
from apps.planning import selectors  # noqa: E402
from apps.planning.recommend import Workload, build_scenario  # noqa: E402
from apps.setup.demo import DEMO_CLUSTERS  # noqa: E402
from apps.setup.procfile import DEMO_REMOTE_PREFILL_THRESHOLD_TOKENS  # noqa: E402
from bench.serve_load import percentile, run_sessions  # noqa: E402
from bench.workloads import MultiTurnConfig, MultiTurnWorkload  # noqa: E402
from inference_worker.planning.planner import Fleet, Planner  # noqa: E402

OUT = ROOT / "bench" / "results" / "planner_check.json"


def demo_pools() -> tuple[Pool, Pool, ClusterLink]:
    """The demo's prefill and decode pools and the link from the prefill cluster to the decode cluster.

    Raises:
        SystemExit: the demo fleet is not loaded.
    """
    (p_cluster, p_name, _), (d_cluster, d_name, _) = DEMO_CLUSTERS
    try:
        prefill = Pool.objects.select_related("model_version", "cluster").get(cluster__name=p_cluster, name=p_name)
        decode = Pool.objects.select_related("model_version", "cluster").get(cluster__name=d_cluster, name=d_name)
        link = ClusterLink.objects.get(source=prefill.cluster, destination=decode.cluster)
    except (Pool.DoesNotExist, ClusterLink.DoesNotExist) as exc:
        raise SystemExit(f"the demo fleet is not loaded here ({exc}); start `make run` first") from exc
    return prefill, decode, link


def ready_replicas(pool: Pool) -> int:
    return Replica.objects.filter(pool=pool, ready=True, alive=True).count()


def profile(pool: Pool, label: str, batch_sizes: str) -> None:
    """``ferry_profile`` on ``pool`` (prints the Action's log)."""
    out = io.StringIO()
    call_command("ferry_profile", f"{pool.cluster.name}/{pool.name}", "--hardware-label", label,
                 "--batch-sizes", batch_sizes, stdout=out)
    print(out.getvalue(), end="", flush=True)


def run_load(router_url: str, model: str, config: MultiTurnConfig, session_rate: float, concurrency: int,
             seed: int, think_time_s: float) -> tuple[list, float]:
    workload = MultiTurnWorkload.from_config(config)
    return asyncio.run(run_sessions(router_url, model, workload, concurrency=concurrency, session_rate=session_rate,
                                    seed=seed, encode=None, timeout_s=600.0, think_time_s=think_time_s))


def request_rows(turns: list) -> list[dict]:
    """Per request: session, turn, router decision, prompt and cached tokens, TTFT and end-to-end seconds."""
    return [{"session": t.session_id, "turn": t.turn, "ok": t.result.ok, "decision": t.result.decision,
             "prompt_tokens": t.result.num_prompt_tokens, "cached_tokens": t.result.num_cached_tokens,
             "ttft_s": t.result.ttft_s, "e2e_s": t.result.e2e_s} for t in turns]


def measured_workload(turns: list, wall_s: float) -> dict:
    """Rate, computed prompt tokens (median, p90, max), output tokens, TTFT percentiles and median TPOT of a run's
    successful turns."""
    ok = [t.result for t in turns if t.result.ok]
    computed = [max(1, r.num_prompt_tokens - r.num_cached_tokens) for r in ok]
    return {"requests": len(ok), "failed": len(turns) - len(ok), "wall_s": wall_s, "rate_per_s": len(ok) / wall_s,
            "computed_prompt_median": int(percentile(computed, 50)), "computed_prompt_p90": int(percentile(computed, 90)),
            "computed_prompt_max": max(computed), "cached_prefix_mean": sum(r.num_cached_tokens for r in ok) / len(ok),
            "output_median": int(percentile([r.max_tokens for r in ok], 50)),
            "ttft_p50_s": percentile([r.ttft_s for r in ok], 50), "ttft_p90_s": percentile([r.ttft_s for r in ok], 90),
            "tpot_s": percentile([r.tpot_s for r in ok if r.num_output_tokens > 1], 50)}


def telemetry_workload(prefill: Pool, decode: Pool, load_started: float) -> dict | None:
    """The workload the planner's "recent traffic" source reads for the load's span
    (:func:`apps.planning.selectors.telemetry_workload`, from the decode workers' request-length histograms), once
    the poller (a record a second, each over a trailing 30 s window) has recorded the load's last requests; None
    without telemetry."""
    time.sleep(5)
    try:
        return selectors.telemetry_workload(pool=decode, prefill_pool=prefill, since_s=load_started)
    except ValidationError as exc:
        print(f"telemetry workload: {exc.messages[0]}")
        return None


def predict(prefill: Pool, decode: Pool, link: ClusterLink, run: dict, threshold: int | None,
            prefill_replicas: int, decode_replicas: int, *, cached_prefix: bool = True) -> dict:
    """The planner's prediction for the running fleet at the run's rate and lengths; ``cached_prefix``: the computed
    tokens attend to the run's mean cached prefix (``Workload.cached_prefix_mean``), else they are priced as fresh
    prompts (the model before session 10)."""
    p_profile, d_profile = selectors.profile_for_pool(pool=prefill), selectors.profile_for_pool(pool=decode)
    if p_profile is None or d_profile is None:
        raise SystemExit("no profile for a demo pool: run without --reuse-profiles")
    median, p90 = run["computed_prompt_median"], max(run["computed_prompt_p90"], run["computed_prompt_median"])
    workload = Workload(prompt_median=median, prompt_p90=p90 if p90 > median else None,
                        prompt_cap=max(run["computed_prompt_max"], p90), output_median=run["output_median"],
                        rate_per_s=run["rate_per_s"], ttft_slo_s=math.inf, tpot_slo_s=math.inf,
                        cached_prefix_mean=run["cached_prefix_mean"] if cached_prefix else 0.0)
    fitted = selectors.fitted(p_profile), selectors.fitted(d_profile)
    scenario = build_scenario(config=decode.model_version.model_config(), prefill=fitted[0], decode=fitted[1],
                              bandwidth_gbps=link.bandwidth_gbps, rtt_s=link.rtt_ms / 1000, workload=workload,
                              budget=float(prefill_replicas + 2 * decode_replicas))
    fleet = Fleet(prefill_replicas, 0, decode_replicas, threshold, colocated=True)
    prediction = Planner(scenario).predict(fleet, run["rate_per_s"])
    return {"profiles": [p_profile.pk, d_profile.pk], "fleet": fleet.to_dict(), **prediction.to_dict()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--router-url", default="http://127.0.0.1:8080")
    parser.add_argument("--model", default="gemma-3-270m")
    parser.add_argument("--reuse-profiles", action="store_true", help="skip ferry_profile; use the newest profiles")
    parser.add_argument("--hardware-label", default="cpu-demo-colocated")
    parser.add_argument("--num-sessions", type=int, default=8)
    parser.add_argument("--num-turns", type=int, default=4)
    parser.add_argument("--output-tokens", type=int, default=16)
    parser.add_argument("--session-rate", type=float, default=0.2, help="Poisson session arrivals per second")
    parser.add_argument("--concurrency", type=int, default=4, help="sessions in flight at most")
    parser.add_argument("--think-time-s", type=float, default=2.0, help="mean user think time before a later turn")
    parser.add_argument("--batch-sizes", default="1,2,3", help="decode batch sizes of the profiles' sweep")
    parser.add_argument("--threshold", type=int, default=DEMO_REMOTE_PREFILL_THRESHOLD_TOKENS,
                        help="the router's remote-prefill threshold (tokens)")
    parser.add_argument("--seed", type=int, default=None,
                        help="token ids and arrivals (default: from the clock, so no run reuses another's prompts)")
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--repredict", type=Path, metavar="JSON",
                        help="predict again for an earlier run's measurements (its file is rewritten; no load)")
    args = parser.parse_args()
    if args.seed is None:
        args.seed = time.time_ns() % 2**31
    if args.repredict:
        repredict(args.repredict)
        return

    prefill, decode, link = demo_pools()
    replicas = ready_replicas(prefill), ready_replicas(decode)
    if min(replicas) < 1:
        raise SystemExit(f"the demo pools need a ready replica each, have prefill {replicas[0]}, decode {replicas[1]}")
    started = time.time()
    if not args.reuse_profiles:
        for pool in (prefill, decode):
            profile(pool, args.hardware_label, args.batch_sizes)
    config = MultiTurnConfig(num_sessions=args.num_sessions, num_turns=args.num_turns,
                             max_tokens=args.output_tokens, seed=args.seed)
    turns, wall_s = run_load(args.router_url, args.model, config, args.session_rate, args.concurrency, args.seed,
                             args.think_time_s)
    run = measured_workload(turns, wall_s)
    if run["requests"] == 0:
        raise SystemExit(f"every request failed; first error: {turns[0].result.error if turns else 'no turns'}")
    result = {"started_at": started, "args": {k: str(v) for k, v in vars(args).items()},
              "replicas": {"prefill": replicas[0], "decode": replicas[1]}, "measured": run,
              "requests": request_rows(turns), "load_average": os.getloadavg(),
              "telemetry_workload": telemetry_workload(prefill, decode, time.time() - wall_s)}
    report(result, prefill, decode, link, args.threshold, args.out)


def report(result: dict, prefill: Pool, decode: Pool, link: ClusterLink, threshold: int | None, out: Path) -> None:
    """Predict (with the cached prefix, and as fresh prompts for comparison), print, write ``out``."""
    run, replicas = result["measured"], (result["replicas"]["prefill"], result["replicas"]["decode"])
    predicted = predict(prefill, decode, link, run, threshold, *replicas)
    fresh = predict(prefill, decode, link, run, threshold, *replicas, cached_prefix=False)
    ratio = predicted["ttft_p50_s"] / run["ttft_p50_s"]
    print(f"{'':24}{'measured':>12}{'predicted':>12}{'ratio':>8}{'as fresh prompts':>18}")
    for name in ("ttft_p50_s", "ttft_p90_s", "tpot_s"):
        print(f"{name:24}{run[name]:12.3f}{predicted[name]:12.3f}{predicted[name] / run[name]:8.2f}"
              f"{fresh[name] / run[name]:18.2f}")
    print(f"rate {run['rate_per_s']:.2f} req/s, computed prompt tokens median {run['computed_prompt_median']} p90 "
          f"{run['computed_prompt_p90']}, cached prefix mean {run['cached_prefix_mean']:.0f}, fleet "
          f"{predicted['fleet']}, load average {os.getloadavg()[0]:.1f}")
    seen = result.get("telemetry_workload")
    if seen:
        print("the load's lengths (tokens) as the planner's telemetry source reads them, beside the client's:")
        for name, theirs in (("prompt_median", "computed_prompt_median"), ("prompt_p90", "computed_prompt_p90"),
                             ("prompt_cap", "computed_prompt_max"), ("cached_prefix_mean", "cached_prefix_mean"),
                             ("output_median", "output_median"), ("rate_per_s", "rate_per_s")):
            print(f"  {name:20} telemetry {_fmt(seen[name]):>10}   client {_fmt(run[theirs]):>10}")
    print(f"acceptance 3 (|predicted p50 / measured p50 - 1| <= 25%): {'met' if abs(ratio - 1) <= 0.25 else 'NOT met'}")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({**result, "predicted": predicted, "predicted_as_fresh_prompts": fresh,
                               "p50_ratio": ratio}, indent=2))
    print(f"wrote {out}")


def _fmt(value) -> str:
    return "-" if value is None else f"{value:.2f}" if isinstance(value, float) else str(value)


def repredict(path: Path) -> None:
    """Predict again for the run in ``path`` with the newest profiles (a run's own, when no sweep came after it)."""
    result = json.loads(path.read_text())
    run, rows = result["measured"], [r for r in result["requests"] if r["ok"]]
    run.setdefault("cached_prefix_mean", sum(r["cached_tokens"] for r in rows) / len(rows))
    prefill, decode, link = demo_pools()
    report(result, prefill, decode, link, int(result["args"]["threshold"]), path)


if __name__ == "__main__":
    main()
