"""Capacity planner vs discrete-event simulator on issue 24's ``prfaas`` scenario and two variants.

For each scenario (``prfaas``, ``prfaas_10g``: a 10 Gbit/s link, ``prfaas_dense``: the dense model of
the same size), the four router policies on fleets of the same total cost (1,000 "bandwidth"
accelerator equivalents, compute:bandwidth cost 2.5:1), each fleet sized by the planner:

- homogeneous PD: the bandwidth datacenter alone, prefill and decode pools, all prefill local;
- naive heterogeneous: every prefill remote (link share not limited: it is what the policy does);
- fixed threshold: the planner's best fixed threshold and its fleet (link share <= the scenario's
  ``max_link_share`` at the planned rate);
- fixed threshold with the whole link: the best fixed threshold when the link share is not limited;
- bandwidth-aware: ``Planner.plan_bandwidth_aware`` (central threshold in 1K steps and a remote pool of
  at most the replicas whose KV fills ``max_link_share`` of the link, by predicted goodput); the router
  moves within ``[low, high] x`` that threshold, its link budget refilled at ``max_link_share``.

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

from inference_worker.planning.planner import Fleet, Planner  # noqa: E402
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
    whole = max(((x, planner.goodput(x, enforce_link_share=False, iterations=16)) for x in range(0, cap + 1, STEP)),
                key=lambda x: x[1][0])
    lo, hi = sc.threshold_bounds
    t_ba, rate_ba, fleet_ba, _ = planner.plan_bandwidth_aware(range(0, cap + 1, STEP))
    return t, curve, [
        (HomogeneousPD(), homo[1], homo[0]),
        (NaiveHeterogeneous(), naive[1], naive[0]),
        (FixedThreshold(t), fixed[1], fixed[0]),
        (FixedThreshold(whole[0], name="fixed_whole_link"), whole[1][1], whole[1][0]),
        (BandwidthAware(int(lo * t_ba), int(hi * t_ba), sc.max_link_share), fleet_ba, rate_ba),
    ]


def compare(name: str, requests: int) -> dict:
    sc = load_scenario(name)
    planner = Planner(sc)
    t, curve, rows = policy_fleets(planner)
    hi_rate = 1.5 * max(r[2] for r in rows) + 1
    out = {"scenario": name, "planner_threshold_tokens": t, "policies": []}
    print(f"\n== {name}: planner thresholds: fixed {t}, fixed with the whole link {rows[3][0].threshold_tokens}, "
          f"bandwidth-aware bounds {rows[4][0].low_tokens}..{rows[4][0].high_tokens}; goodput by bisection, "
          f"{requests} requests per run")
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
    for other in ("homogeneous_pd", "naive_heterogeneous", "fixed_threshold", "fixed_whole_link"):
        gain = ba / base[other] - 1 if base[other] else float("inf")
        print(f"bandwidth_aware vs {other}: {gain:+.1%}")
    out["planner_curve"] = curve
    return out


def sweep(requests: int) -> dict:
    """Fixed thresholds in 1K steps, each on the planner's fleet for it (whole link: a fixed threshold
    does not watch the link); planner's best vs simulator's best, overall and among link share <= max."""
    sc = load_scenario("prfaas")
    planner = Planner(sc)
    t_capped = planner.best_threshold(range(0, sc.prompt.cap + 1, STEP))[0]
    rows = []
    for t in range(STEP, sc.prompt.cap + 1, STEP):
        rate, fleet, _ = planner.goodput(t, iterations=16, enforce_link_share=False)
        rows.append({"threshold": t, "planned": rate, "fleet": fleet.to_dict() if fleet else None})
    hi_rate = 1.5 * max(r["planned"] for r in rows) + 1
    print(f"\n== prfaas fixed-threshold sweep, {STEP}-token steps, {requests} requests per run")
    for r in rows:
        if r["fleet"] is None:
            r.update(goodput=0.0, link_share=0.0)
            continue
        got, res = simulated_goodput(sc, Fleet(**r["fleet"]), FixedThreshold(r["threshold"]),
                                     num_requests=requests, hi_rate=hi_rate, iterations=7)
        r.update(goodput=got, link_share=res.summary(sc)["link_share"] if res else 0.0)
    best = max(rows, key=lambda r: r["goodput"])
    planned_best = max(rows, key=lambda r: r["planned"])
    ok = [r for r in rows if r["link_share"] <= sc.max_link_share]
    best_ok = max(ok, key=lambda r: r["goodput"])
    print(f"{'threshold':>9} {'planned':>8} {'simulated':>9} {'link':>6}")
    for r in rows[::8] + [best]:
        print(f"{r['threshold']:9d} {r['planned']:8.2f} {r['goodput']:9.2f} {r['link_share']:6.1%}")
    err = abs(planned_best["threshold"] - best["threshold"]) / best["threshold"]
    print(f"whole link: planner threshold {planned_best['threshold']} (planned {planned_best['planned']:.2f}/s), "
          f"simulator best {best['threshold']} ({best['goodput']:.2f}/s, link {best['link_share']:.1%}): {err:.1%} apart")
    print(f"link share <= {sc.max_link_share:.0%}: planner threshold {t_capped}, simulator best {best_ok['threshold']} "
          f"({best_ok['goodput']:.2f}/s)")
    return {"rows": rows, "planner_threshold": planned_best["threshold"], "simulator_best": best["threshold"],
            "relative_error": err, "planner_threshold_capped": t_capped, "simulator_best_capped": best_ok["threshold"]}


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
