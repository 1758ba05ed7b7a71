"""Capacity planner vs discrete-event simulator on issue 24's ``prfaas`` scenario and two variants.

For each scenario (``prfaas``, ``prfaas_10g``: a 10 Gbit/s link, ``prfaas_dense``: the dense model of
the same size), the four router policies on fleets of the same total cost (1,000 "bandwidth"
accelerator equivalents, compute:bandwidth cost 2.5:1), each fleet sized by the planner:

- homogeneous PD: the bandwidth datacenter alone, prefill and decode pools, all prefill local;
- naive heterogeneous: every prefill remote (link share not limited: it is what the policy does);
- fixed threshold: the planner's best fixed threshold and its fleet (link share <= the scenario's
  ``max_link_share`` at the planned rate);
- bandwidth-aware: ``Planner.plan_bandwidth_aware`` (central threshold: the best fixed threshold with the
  whole link, searched in 4K steps; remote pool sized so that it cannot fill more than ``max_link_share``
  of the link); the router moves within ``[low, high] x`` that threshold, gated by the link's load.

Goodput (DistServe): the highest Poisson rate with >= 90% of requests meeting TTFT <= 5 s and
TPOT <= 80 ms, by bisection in the simulator. Then, on ``prfaas``: the fixed-threshold sweep in
1K-token steps (each threshold on the planner's fleet for it) against the planner's threshold, the
P:D ratio against the seed's 1:5-1:8, and the simulator's wall time for 100,000 requests on 1,000
accelerators. Prints tables; JSON to ``bench/results/planner_prfaas.json``.

    .venv/bin/python bench/planner_prfaas.py [--requests 20000] [--sweep-requests 4000] [--big 100000]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from inference_worker.planning.planner import Planner  # noqa: E402
from inference_worker.planning.policies import (  # noqa: E402
    BandwidthAware,
    FixedThreshold,
    HomogeneousPD,
    NaiveHeterogeneous,
)
from inference_worker.planning.scenario import load_scenario  # noqa: E402
from inference_worker.planning.simulator import simulate, simulated_goodput  # noqa: E402

RESULTS = ROOT / "bench" / "results"
STEP = 1024


def policy_fleets(planner: Planner):
    """(policy, fleet, planner goodput) for the four policies, plus the planner's threshold choice."""
    sc = planner.scenario
    cap = sc.prompt.cap
    t, _, fleet, _, curve = planner.best_threshold(range(0, cap + 1, STEP))
    homo = planner.goodput(None)
    naive = planner.goodput(0, enforce_link_share=False)
    fixed = planner.goodput(t)
    lo, hi = sc.threshold_bounds
    t_ba, rate_ba, fleet_ba = planner.plan_bandwidth_aware(range(0, cap + 1, 4 * STEP))
    return t, curve, [
        (HomogeneousPD(), homo[1], homo[0]),
        (NaiveHeterogeneous(), naive[1], naive[0]),
        (FixedThreshold(t), fixed[1], fixed[0]),
        (BandwidthAware(int(lo * t_ba), int(hi * t_ba), sc.max_link_share), fleet_ba, rate_ba),
    ]


def compare(name: str, requests: int) -> dict:
    sc = load_scenario(name)
    planner = Planner(sc)
    t, curve, rows = policy_fleets(planner)
    hi_rate = 1.5 * max(r[2] for r in rows) + 1
    out = {"scenario": name, "planner_threshold_tokens": t, "policies": []}
    print(f"\n== {name}: planner threshold {t} tokens; goodput by bisection, {requests} requests per run")
    print(f"{'policy':22} {'fleet (P_remote/P_local/D)':28} {'planned':>8} {'goodput':>8} {'P90 TTFT':>9} "
          f"{'P90 TPOT':>9} {'link':>6} {'remote':>7}")
    for policy, fleet, planned in rows:
        rate, res = simulated_goodput(sc, fleet, policy, num_requests=requests, hi_rate=hi_rate)
        s = res.summary(sc) if res else {}
        out["policies"].append({"policy": policy.name, "fleet": fleet.to_dict(), "cost": fleet.cost(sc),
                                "planned_goodput": planned, "goodput": rate, **s})
        f = f"{fleet.remote_prefill}/{fleet.local_prefill}/{fleet.decode} (cost {fleet.cost(sc):.0f})"
        print(f"{policy.name:22} {f:28} {planned:8.2f} {rate:8.2f} {s.get('ttft_p90_s', float('nan')):8.2f}s "
              f"{1000 * s.get('tpot_p90_s', float('nan')):7.1f}ms {s.get('link_share', 0):6.1%} "
              f"{s.get('remote_share', 0):7.1%}")
    base = {p["policy"]: p["goodput"] for p in out["policies"]}
    ba = base["bandwidth_aware"]
    for other in ("homogeneous_pd", "naive_heterogeneous", "fixed_threshold"):
        gain = ba / base[other] - 1 if base[other] else float("inf")
        print(f"bandwidth_aware vs {other}: {gain:+.1%}")
    out["planner_curve"] = curve
    return out


def sweep(requests: int) -> dict:
    sc = load_scenario("prfaas")
    planner = Planner(sc)
    t_plan, _, _, _, curve = planner.best_threshold(range(0, sc.prompt.cap + 1, STEP))
    planned = dict(curve)
    hi_rate = 1.5 * max(planned.values()) + 1
    rows = []
    print(f"\n== prfaas fixed-threshold sweep, {STEP}-token steps, {requests} requests per run")
    for t in range(STEP, sc.prompt.cap + 1, STEP):
        rate, fleet, _ = planner.goodput(t, iterations=16)
        if fleet is None:
            rows.append({"threshold": t, "planned": 0.0, "goodput": 0.0})
            continue
        got, res = simulated_goodput(sc, fleet, FixedThreshold(t), num_requests=requests, hi_rate=hi_rate,
                                     iterations=7)
        share = res.summary(sc)["link_share"] if res else 0.0
        rows.append({"threshold": t, "planned": rate, "goodput": got, "link_share": share, "fleet": fleet.to_dict()})
    ok = [r for r in rows if r.get("link_share", 0) <= sc.max_link_share]
    best = max(ok, key=lambda r: r["goodput"])
    best_any = max(rows, key=lambda r: r["goodput"])
    print(f"{'threshold':>9} {'planned':>8} {'simulated':>9} {'link':>6}")
    for r in rows[::8] + ([best] if best not in rows[::8] else []):
        print(f"{r['threshold']:9d} {r['planned']:8.2f} {r['goodput']:9.2f} {r.get('link_share', 0):6.1%}")
    err = abs(t_plan - best["threshold"]) / best["threshold"]
    print(f"planner threshold {t_plan}, simulator best {best['threshold']} (goodput {best['goodput']:.2f}): "
          f"{err:.1%} apart")
    print(f"without the link-share limit: simulator best {best_any['threshold']} (goodput {best_any['goodput']:.2f}, "
          f"link {best_any.get('link_share', 0):.1%})")
    return {"rows": rows, "planner_threshold": t_plan, "simulator_best": best["threshold"], "relative_error": err,
            "simulator_best_any_link": best_any["threshold"]}


def pd_ratio() -> dict:
    sc = load_scenario("prfaas")
    planner = Planner(sc)
    out = {}
    print("\n== P:D ratio (replicas = 8-accelerator nodes) vs the seed's 1:5-1:8")
    for label, threshold, enforce in (("homogeneous", None, True), ("planner", "best", True),
                                      ("no link cap", "best_nocap", False)):
        if threshold == "best":
            threshold = planner.best_threshold(range(0, sc.prompt.cap + 1, STEP))[0]
        if threshold == "best_nocap":
            curve = [(t, planner.goodput(t, enforce_link_share=False, iterations=16)[0])
                     for t in range(0, sc.prompt.cap + 1, 4 * STEP)]
            threshold = max(curve, key=lambda x: x[1])[0]
        rate, fleet, pred = planner.goodput(threshold, enforce_link_share=enforce)
        p = fleet.remote_prefill + fleet.local_prefill
        out[label] = {"threshold": threshold, "goodput": rate, "fleet": fleet.to_dict(),
                      "p_to_d": p / fleet.decode, "link_share": pred.link_share}
        print(f"{label:12} T={threshold}  P {p} : D {fleet.decode}  (P:D = {p / fleet.decode:.1f}:1)  "
              f"goodput {rate:.1f}/s  link {pred.link_share:.1%}")
    return out


def scale(requests: int) -> dict:
    sc = load_scenario("prfaas")
    planner = Planner(sc)
    rate, fleet, _ = planner.goodput(None)
    accelerators = (fleet.local_prefill + fleet.decode) * sc.profiles["bandwidth"].accelerators_per_replica
    started = time.perf_counter()
    res = simulate(sc, fleet, HomogeneousPD(), rate, requests)
    wall = time.perf_counter() - started
    print(f"\n== simulator cost: {accelerators} accelerators ({fleet.local_prefill + fleet.decode} replicas), "
          f"{requests} requests at {rate:.1f}/s: {wall:.1f} s wall, {res.events} events, "
          f"{res.duration_s:.0f} s simulated")
    return {"accelerators": accelerators, "requests": requests, "wall_s": wall, "events": res.events,
            "simulated_s": res.duration_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=20000, help="requests per policy run")
    parser.add_argument("--sweep-requests", type=int, default=4000, help="requests per sweep run")
    parser.add_argument("--big", type=int, default=100000, help="requests of the wall-time run")
    parser.add_argument("--skip-sweep", action="store_true")
    args = parser.parse_args()
    started = time.perf_counter()
    results = {"scale": scale(args.big), "pd_ratio": pd_ratio(),
               "scenarios": [compare(n, args.requests) for n in ("prfaas", "prfaas_10g", "prfaas_dense")]}
    if not args.skip_sweep:
        results["sweep"] = sweep(args.sweep_requests)
    results["wall_s"] = time.perf_counter() - started
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "planner_prfaas.json").write_text(json.dumps(results, indent=1, default=float))
    print(f"\nwall {results['wall_s']:.0f} s; JSON: bench/results/planner_prfaas.json")


if __name__ == "__main__":
    main()
