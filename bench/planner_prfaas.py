"""Capacity planner vs discrete-event simulator on issue 24's ``prfaas`` scenario and two variants.

For each scenario (``prfaas``, ``prfaas_10g``: a 10 Gbit/s link, ``prfaas_dense``: the dense model of
the same size), the four router policies on fleets of the same total cost (1,000 "bandwidth"
accelerator equivalents, compute:bandwidth cost 2.5:1), each fleet sized by the planner:

- homogeneous PD on either accelerator type (``Scenario.homogeneous``: one datacenter, one type, all prefill
  local), each with its planned prefill/decode split; the better of the two is the baseline;
- naive heterogeneous: every prefill remote (link share not limited: it is what the policy does);
- fixed threshold: the planner's best fixed threshold and its fleet (link share <= the scenario's
  ``max_link_share`` at the planned rate);
- fixed threshold with the whole link: the best fixed threshold when the link share is not limited;
- bandwidth-aware: ``Planner.plan_bandwidth_aware`` (central threshold in 1K steps and a remote pool of
  at most the replicas whose KV fills ``max_link_share`` of the link, by predicted goodput); the router
  moves within ``[low, high] x`` that threshold, its link budget refilled at ``max_link_share``.

Beside each table, the fluid bound (:func:`link_bound`): the most requests/s any split of the prefill between the
datacenters could serve at the link share, without queueing or SLOs, so no policy's goodput exceeds it.

Goodput (DistServe): the highest Poisson rate with >= 90% of requests meeting TTFT <= 5 s and
TPOT <= 80 ms, by bisection in the simulator. Then, on ``prfaas``: the fixed-threshold sweep in
1K-token steps (each threshold on the planner's fleet for it, whole link: the optimum is interior)
against the planner's threshold, the P:D ratio against the seed's 1:5-1:8, and the simulator's wall
time for 100,000 requests on 1,000 accelerators. Prints tables beside the PrfaaS paper's figures;
JSON to ``bench/results/planner_prfaas.json``.

    .venv/bin/python bench/planner_prfaas.py [--requests 20000] [--sweep-requests 4000] [--big 100000]
    .venv/bin/python bench/planner_prfaas.py --only prfaas_paper_kv   # one scenario's policy table
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

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


PAPER = ("PrfaaS paper (issue 24's summary): +54% over homogeneous PD, +32% over naive heterogeneous, threshold "
         "~19.4K tokens with ~half the requests remote, link ~13% of 100 Gbit/s, KV rate at 32K 59.9 Gbit/s dense "
         "vs 4.66 hybrid")


def kv_rate_gbps(sc, num_tokens: int = 32768) -> float:
    """KV a busy ``compute`` replica ships while prefilling ``num_tokens``-token prompts, Gbit/s."""
    return sc.geometry.transfer_bytes(num_tokens) * 8e-9 / sc.profiles["compute"].prefill_time_s(num_tokens)


def link_bound(sc, decode_cost: float, share: float, grid: int = 4000) -> dict:
    """The most requests/s any split of prefill between the two datacenters can serve at a link share, serving
    every request: a fluid bound (no queueing, no SLO), so every policy's goodput is at or below it.

    Per request of ``N`` prompt tokens (the prompt distribution's quantile grid): prefill cost-seconds
    ``w_b(N) = c_b t_b(N)`` on a "bandwidth" replica, ``w_c(N) = c_c t_c(N)`` on a "compute" one (replica cost
    ``c``, roofline prefill time ``t``), and KV to ship ``k(N)`` Gbit (the catalog's transfer formula). Sending the
    set ``S`` remote serves ``lambda(S) = min(B_p / W(S), share x L / K(S))`` requests/s, with
    ``W(S) = E[w_c 1_S + w_b 1_not S]``, ``K(S) = E[k 1_S]``, ``L`` the link's Gbit/s and ``B_p`` the budget less
    ``decode_cost``. For a given rate, the least ``W`` under the link's ``K`` is a fractional knapsack: requests
    in order of saved cost per KV bit ``(w_b - w_c) / k``, so the maximum over the prefixes of that order is the
    bound (to one grid point). ``share`` 0: homogeneous on the "bandwidth" type.

    Returns:
        ``{"share", "rate_per_s", "homogeneous_rate_per_s", "gain", "remote_share", "shortest_remote_tokens"}``.
    """
    lengths = sc.prompt.quantile_grid(grid)
    local, remote = sc.profiles["bandwidth"], sc.profiles["compute"]
    w_b = np.array([local.cost * local.prefill_time_s(int(n)) for n in lengths])
    w_c = np.array([remote.cost * remote.prefill_time_s(int(n)) for n in lengths])
    kv = np.array([sc.geometry.transfer_bytes(int(n)) * 8e-9 for n in lengths])
    order = [i for i in np.argsort(-(w_b - w_c) / kv, kind="stable") if w_b[i] > w_c[i]]
    budget = sc.budget - decode_cost
    work = np.concatenate([[w_b.sum()], w_b.sum() - np.cumsum((w_b - w_c)[order])]) / grid
    link = np.concatenate([[0.0], np.cumsum(kv[order])]) / grid
    with np.errstate(divide="ignore"):
        rates = np.minimum(budget / work, np.where(link > 0, share * sc.bandwidth_gbps / link, np.inf))
    k = int(np.argmax(rates))
    return {"share": share, "rate_per_s": float(rates[k]), "homogeneous_rate_per_s": float(rates[0]),
            "gain": float(rates[k] / rates[0] - 1), "remote_share": k / grid,
            "shortest_remote_tokens": int(min(lengths[order[:k]])) if k else None}


def policy_rows(sc):
    """Rows (label, policy, scenario simulated, fleet, planner goodput) for the policies, plus the planner's
    fixed threshold and its 1K-step curve. Every fleet is sized by the planner within the same budget."""
    planner = Planner(sc)
    cap = sc.prompt.cap
    t, _, _, _, curve = planner.best_threshold(range(0, cap + 1, STEP))
    rows = []
    for dc in ("bandwidth", "compute"):  # homogeneous PD on either type; the better one is the baseline
        home = sc.homogeneous(dc)
        rate, fleet, _ = Planner(home).goodput(None)
        name = f"homogeneous_pd_{sc.profiles[dc].accelerator.name.lower()}"
        rows.append((name, HomogeneousPD(name=name), home, fleet, rate))
    naive = planner.goodput(0, enforce_link_share=False)
    rows.append(("naive_heterogeneous", NaiveHeterogeneous(), sc, naive[1], naive[0]))
    fixed = planner.goodput(t)
    rows.append(("fixed_threshold", FixedThreshold(t), sc, fixed[1], fixed[0]))
    whole = max(((x, planner.goodput(x, enforce_link_share=False, iterations=16)) for x in range(0, cap + 1, STEP)),
                key=lambda x: x[1][0])
    rows.append(("fixed_whole_link", FixedThreshold(whole[0], name="fixed_whole_link"), sc, whole[1][1], whole[1][0]))
    lo, hi = sc.threshold_bounds
    try:
        t_ba, rate_ba, fleet_ba, _ = planner.plan_bandwidth_aware(range(0, cap + 1, STEP))
    except ValueError:  # no bandwidth-aware fleet meets the SLOs at any rate
        t_ba, rate_ba, fleet_ba = 0, 0.0, None
    rows.append(("bandwidth_aware", BandwidthAware(int(lo * t_ba), int(hi * t_ba), sc.max_link_share), sc, fleet_ba,
                 rate_ba))
    return t, curve, rows


def compare(name: str, requests: int) -> dict:
    sc = load_scenario(name)
    t, curve, rows = policy_rows(sc)
    ba = rows[-1][1]
    out = {"scenario": name, "planner_threshold_tokens": t, "kv_rate_32k_gbps": kv_rate_gbps(sc), "policies": []}
    print(f"\n== {name}: KV rate of a busy compute replica at 32K tokens {kv_rate_gbps(sc):.2f} Gbit/s; planner "
          f"thresholds: fixed {t}, fixed with the whole link {rows[4][1].threshold_tokens}, bandwidth-aware bounds "
          f"{ba.low_tokens}..{ba.high_tokens}; goodput by bisection, {requests} requests per run")
    print(f"{'policy':22} {'fleet (P_remote/P_local/D)':28} {'planned':>8} {'goodput':>8} {'P90 TTFT':>9} "
          f"{'P90 TPOT':>9} {'link':>6} {'remote':>7}")
    for label, policy, scenario, fleet, planned in rows:
        if fleet is None:  # the planner finds no fleet meeting the SLOs at any rate
            out["policies"].append({"policy": label, "fleet": None, "planned_goodput": 0.0, "goodput": 0.0})
            print(f"{label:22} {'none meets the SLOs':28} {0.0:8.2f} {0.0:8.2f}")
            continue
        # bisection on [0, 1.6 x planned + 2]: resolution 1/256 of it (8 iterations)
        rate, res = simulated_goodput(scenario, fleet, policy, num_requests=requests, hi_rate=1.6 * planned + 2)
        s = res.summary(scenario) if res else {}
        out["policies"].append({"policy": label, "fleet": fleet.to_dict(), "cost": fleet.cost(scenario),
                                "accelerator_types": sorted({scenario.profiles[dc].accelerator.name
                                                             for dc, n in (("compute", fleet.remote_prefill),
                                                                           ("bandwidth", fleet.local_prefill
                                                                            + fleet.decode)) if n}),
                                "planned_goodput": planned, "goodput": rate, **s})
        f = f"{fleet.remote_prefill}/{fleet.local_prefill}/{fleet.decode} (cost {fleet.cost(scenario):.0f})"
        print(f"{label:22} {f:28} {planned:8.2f} {rate:8.2f} {s.get('ttft_p90_s', float('nan')):8.2f}s "
              f"{1000 * s.get('tpot_p90_s', float('nan')):7.1f}ms {s.get('link_share', 0):6.1%} "
              f"{s.get('remote_share', 0):7.1%}")
    base = {p["policy"]: p["goodput"] for p in out["policies"]}
    homo = max((k for k in base if k.startswith("homogeneous_pd")), key=base.get)
    out["best_homogeneous"] = homo
    gains = {}
    for other in [k for k in base if k != "bandwidth_aware"]:
        gains[other] = base["bandwidth_aware"] / base[other] - 1 if base[other] else float("inf")
        print(f"bandwidth_aware vs {other}: {gains[other]:+.1%}" + ("  (best homogeneous)" if other == homo else ""))
    out["gains"] = gains
    # The fluid bound: no split serves more than this, whatever the router does (decode as in the H20 fleet).
    h20 = next(p for p in out["policies"] if p["policy"] == "homogeneous_pd_h20")
    decode_cost = h20["fleet"]["decode"] * sc.profiles["bandwidth"].cost if h20["fleet"] else 0.0
    out["link_bound"] = [link_bound(sc, decode_cost, s) for s in (sc.max_link_share, 1.0)]
    for b in out["link_bound"]:
        simulated = (f"{b['rate_per_s'] / base['homogeneous_pd_h20'] - 1:+.1%} over its simulated goodput"
                     if base["homogeneous_pd_h20"] else "its simulated goodput is 0")
        print(f"fluid bound, link share <= {b['share']:.0%}: {b['rate_per_s']:.1f} req/s, {b['gain']:+.1%} over the "
              f"H20 fleet's {b['homogeneous_rate_per_s']:.1f} (same bound, share 0) and {simulated}; remote "
              f"{b['remote_share']:.1%} of requests (from {b['shortest_remote_tokens']} tokens)")
    print(PAPER)
    out["planner_curve"] = curve
    return out


def sweep(requests: int, t_capped: int) -> dict:
    """Fixed thresholds in 1K steps, each on the planner's fleet for it (whole link: a fixed threshold
    does not watch the link); planner's best vs simulator's best, overall and among link share <= max."""
    sc = load_scenario("prfaas")
    planner = Planner(sc)
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
    for r in rows[::8] + [r for r in rows if abs(r["threshold"] - best["threshold"]) <= 4 * STEP]:
        print(f"{r['threshold']:9d} {r['planned']:8.2f} {r['goodput']:9.2f} {r['link_share']:6.1%}")
    err = abs(planned_best["threshold"] - best["threshold"]) / best["threshold"]
    print(f"whole link: planner threshold {planned_best['threshold']} (planned {planned_best['planned']:.2f}/s), "
          f"simulator best {best['threshold']} ({best['goodput']:.2f}/s, link {best['link_share']:.1%}): {err:.1%} apart")
    print(f"link share <= {sc.max_link_share:.0%}: planner threshold {t_capped}, simulator best {best_ok['threshold']} "
          f"({best_ok['goodput']:.2f}/s)")
    return {"rows": rows, "planner_threshold": planned_best["threshold"], "simulator_best": best["threshold"],
            "relative_error": err, "planner_threshold_capped": t_capped, "simulator_best_capped": best_ok["threshold"]}


def pd_ratio(compared: dict) -> dict:
    """P:D of the planned fleets on ``prfaas`` against the seed's 1:5-1:8, in two readings: all prefill replicas
    to decode replicas, and (the seed's PrfaaS split: prefill nodes in the compute cluster, decode nodes that
    also prefill short prompts locally) remote-prefill replicas to the bandwidth datacenter's replicas."""
    sc = load_scenario("prfaas")
    planner = Planner(sc)
    out = {}
    print("\n== P:D ratio (replicas = 8-accelerator nodes) vs the seed's 1:5-1:8 (8xA100 prefill nodes, "
          "2xXeon 8480+ decode nodes)")
    fleets = {p["policy"]: (Fleet(**p["fleet"]), p["planned_goodput"]) for p in compared["policies"] if p["fleet"]}
    curve = [(t, planner.goodput(t, enforce_link_share=False, iterations=16)) for t in range(0, sc.prompt.cap + 1,
                                                                                             4 * STEP)]
    for label in ("homogeneous_pd_h20", "homogeneous_pd_h200", "fixed_whole_link", "bandwidth_aware"):
        fleet, rate = fleets[label]
        p = fleet.remote_prefill + fleet.local_prefill
        out[label] = {"goodput": rate, "fleet": fleet.to_dict(), "p_to_d": p / fleet.decode,
                      "remote_p_to_bandwidth_dc": fleet.remote_prefill / (fleet.local_prefill + fleet.decode)}
        local = fleet.local_prefill + fleet.decode
        ratio = f"1:{local / fleet.remote_prefill:.1f}" if fleet.remote_prefill else "no remote prefill"
        print(f"{label:20} P {p} : D {fleet.decode} (P:D = {p / fleet.decode:.1f}:1); remote P {fleet.remote_prefill}"
              f" : bandwidth-DC nodes {local} ({ratio})  planned {rate:.1f}/s")
    out["whole_link_curve_4k"] = [(t, g[0], g[1].to_dict() if g[1] else None) for t, g in curve]
    return out


def scale(requests: int) -> dict:
    """Simulator wall time for ``requests`` requests on 1,000 accelerators (homogeneous PD on H20: 125 nodes of 8)
    and on the bandwidth-aware fleet, each at its planned goodput."""
    sc = load_scenario("prfaas")
    out = {}
    home = sc.homogeneous("bandwidth")
    rate, fleet, _ = Planner(home).goodput(None)
    t_ba, rate_ba, fleet_ba, _ = Planner(sc).plan_bandwidth_aware(range(0, sc.prompt.cap + 1, 4 * STEP))
    lo, hi = sc.threshold_bounds
    for label, scenario, fl, policy, r in (
            ("homogeneous_pd_h20", home, fleet, HomogeneousPD(), rate),
            ("bandwidth_aware", sc, fleet_ba, BandwidthAware(int(lo * t_ba), int(hi * t_ba), sc.max_link_share),
             rate_ba)):
        accelerators = (fl.remote_prefill + fl.local_prefill + fl.decode) * sc.profiles["bandwidth"].accelerators_per_replica
        started = time.perf_counter()
        res = simulate(scenario, fl, policy, r, requests)
        wall = time.perf_counter() - started
        print(f"\n== simulator cost, {label}: {accelerators} accelerators ({fl.remote_prefill + fl.local_prefill + fl.decode}"
              f" replicas), {requests} requests at {r:.1f}/s: {wall:.1f} s wall, {res.events} events, "
              f"{res.duration_s:.0f} s simulated")
        out[label] = {"accelerators": accelerators, "requests": requests, "wall_s": wall, "events": res.events,
                      "simulated_s": res.duration_s}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=20000, help="requests per policy run")
    parser.add_argument("--sweep-requests", type=int, default=4000, help="requests per sweep run")
    parser.add_argument("--big", type=int, default=100000, help="requests of the wall-time run")
    parser.add_argument("--skip-sweep", action="store_true")
    parser.add_argument("--only", nargs="+", metavar="SCENARIO",
                        help="compare the policies on these scenarios only (no scale run, sweep or P:D report); "
                             "JSON to bench/results/planner_prfaas-<names>.json")
    args = parser.parse_args()
    started = time.perf_counter()
    if args.only:
        only = {"scenarios": [compare(n, args.requests) for n in args.only], "wall_s": time.perf_counter() - started}
        out = RESULTS / f"planner_prfaas-{'-'.join(args.only)}.json"
        RESULTS.mkdir(exist_ok=True)
        out.write_text(json.dumps(only, indent=1, default=float))
        print(f"\nwall {only['wall_s']:.0f} s; JSON: {out.relative_to(ROOT)}")
        return
    results = {"scale": scale(args.big),
               "scenarios": [compare(n, args.requests) for n in ("prfaas", "prfaas_10g", "prfaas_dense")]}
    results["pd_ratio"] = pd_ratio(results["scenarios"][0])
    if not args.skip_sweep:
        results["sweep"] = sweep(args.sweep_requests, results["scenarios"][0]["planner_threshold_tokens"])
    results["wall_s"] = time.perf_counter() - started
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "planner_prfaas.json").write_text(json.dumps(results, indent=1, default=float))
    print(f"\nwall {results['wall_s']:.0f} s; JSON: bench/results/planner_prfaas.json")


if __name__ == "__main__":
    main()
