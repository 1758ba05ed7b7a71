"""The torch-free capacity planner and simulator (inference_worker/planning): exact values."""

from __future__ import annotations

import math
import subprocess
import sys

import numpy as np
import pytest
import simpy

from inference_worker.config import ModelConfig
from inference_worker.kv_transfer.layout import KVLayout
from inference_worker.planning.geometry import KVGeometry
from inference_worker.planning.planner import Fleet, Planner, erlang_c, latency_threshold
from inference_worker.planning.policies import (
    BandwidthAware,
    FixedThreshold,
    HomogeneousPD,
    NaiveHeterogeneous,
)
from inference_worker.planning.scenario import ScenarioError, load_scenario, scenario_from_dict
from inference_worker.planning.simulator import Link, Simulation, simulate
from inference_worker.planning.workload import LengthDistribution
from inference_worker.router.pd_cost import PDProfile, pd_costs
from inference_worker.router.table import derived_threshold

GEMMA = {"layer_types": (["sliding_attention"] * 5 + ["full_attention"]) * 3, "sliding_window": 512,
         "num_kv_heads": 1, "head_dim": 256, "dtype": "bfloat16"}


H200_NODE_FLOPS = 8 * 989e12 * 0.4  # prefill: 8 accelerators at 40% of peak
H20_NODE_FLOPS = 8 * 148e12 * 0.4


def prfaas_prefill_flops(n: int, full: int = 8, sliding: int = 40, window: int = 1024) -> float:
    """By hand: 2 x 30e9 x N + 8 FLOP per KV byte attended (64 query heads / 8 bf16 KV heads), query i
    attending i tokens on full layers and min(i, W) on sliding ones, 4096 B per token per layer."""
    sum_full = n * (n + 1) // 2
    sum_sliding = sum_full if n <= window else window * (window + 1) // 2 + (n - window) * window
    return 60e9 * n + 8 * 4096 * (full * sum_full + sliding * sum_sliding)


@pytest.fixture(scope="module")
def prfaas():
    return load_scenario("prfaas")


def test_planning_imports_without_torch():
    code = ("import sys; sys.modules['torch'] = None\n"
            "import inference_worker.planning.planner, inference_worker.planning.simulator\n"
            "import inference_worker.planning.policies, inference_worker.planning.scenario\n"
            "print('ok')")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"


def test_prfaas_kv_bytes_come_from_the_one_formula(prfaas):
    geo = prfaas.geometry
    # b = 2 * 8 * 128 * 2 = 4096 B/token/layer; 8 full + 40 sliding (W = 1024) layers.
    assert geo.config.num_full_layers == 8 and geo.config.num_sliding_layers == 40
    assert geo.transfer_bytes(32768) == 4096 * (8 * 32768 + 40 * 1023) == 1_241_350_144
    assert geo.resident_bytes(32768) == 4096 * (8 * 32768 + 40 * 1024) == 1_241_513_984
    assert load_scenario("prfaas_dense").geometry.transfer_bytes(32768) == 4096 * 48 * 32768
    # The paper-rate variant: 4 KV heads (2048 B/token/layer), 4 full + 44 sliding layers.
    paper = load_scenario("prfaas_paper_kv")
    assert paper.geometry.transfer_bytes(32768) == 2048 * (4 * 32768 + 44 * 1023)
    assert paper.profiles["compute"].flops_per_token == prfaas.profiles["compute"].flops_per_token == 2 * 30e9
    n = np.array([0, 1, 500, 1022, 1023, 1024, 1025, 4096, 131072])
    assert geo.transfer_bytes_array(n, 131072).tolist() == [geo.transfer_bytes(int(x)) for x in n]
    assert geo.resident_bytes_array(n, 131072).tolist() == [geo.resident_bytes(int(x)) for x in n]


def test_roofline_profiles_from_public_specs(prfaas):
    h200, h20 = prfaas.profiles["compute"], prfaas.profiles["bandwidth"]
    # 8 x 989e12 FLOP/s x 0.4 / (2 x 30e9 FLOP/token): the speed without attention
    assert h200.prefill_tokens_per_s == pytest.approx(52746.6667, rel=1e-9)
    # 32K tokens: 1.966e15 FLOP of weights + 1.840e14 of attention (8.6%): 0.6794 s on an H200 node, 4.540 s on H20
    assert prfaas_prefill_flops(32768) == pytest.approx(2.1502e15, rel=1e-4)
    assert h200.prefill_flops(32768) == pytest.approx(prfaas_prefill_flops(32768), rel=1e-12)
    assert h200.prefill_time_s(32768) == pytest.approx(prfaas_prefill_flops(32768) / H200_NODE_FLOPS, rel=1e-12)
    assert h20.prefill_time_s(32768) == pytest.approx(4.5399, abs=1e-4)
    n = np.array([1, 1000, 1024, 1025, 7893, 131072])
    assert h20.prefill_time_s(n).tolist() == pytest.approx([prfaas_prefill_flops(int(x)) / H20_NODE_FLOPS for x in n],
                                                           rel=1e-12)
    # decode step, batch 1: weights 60e9 B / (8 x 4.0e12 x 0.6) = 3.125 ms; batch 256 is compute-bound:
    # 256 x 60e9 / (8 x 148e12 x 0.4) = 32.43 ms, plus 8 FLOP per resident KV byte of attention
    assert h20.decode_step_s(1, 0.0) == pytest.approx(3.125e-3, rel=1e-12)
    assert h20.decode_step_s(256, 0.0) == pytest.approx(256 * 60e9 / H20_NODE_FLOPS, rel=1e-12)
    assert h20.decode_step_s(256, 100e9) == pytest.approx((256 * 60e9 + 8 * 100e9) / H20_NODE_FLOPS, rel=1e-12)
    assert h200.decode_step_s(256, 100e9) == pytest.approx(160e9 / (8 * 4.8e12 * 0.6), rel=1e-12)  # memory-bound
    assert h20.kv_capacity_bytes == pytest.approx(8 * 96e9 * 0.9 - 60e9)
    assert (h200.cost, h20.cost) == (20.0, 8.0)


def test_attention_flops_per_kv_byte_and_its_errors():
    from inference_worker.planning.profiles import attention_flops_per_kv_byte

    # 4 x 64 x 128 FLOP per (query, key, layer) over 2 x 8 x 128 x 2 bytes
    assert attention_flops_per_kv_byte(64, 8, 2) == 8.0
    assert attention_flops_per_kv_byte(4, 1, 2) == 4.0
    with pytest.raises(ValueError, match="multiple"):
        attention_flops_per_kv_byte(12, 8, 2)
    with pytest.raises(ValueError, match="positive"):
        attention_flops_per_kv_byte(0, 8, 2)
    assert load_scenario("prfaas").profiles["compute"].attention_flops_per_kv_byte == 8.0
    raw = _prfaas_dict()
    raw["model"]["num_query_heads"] = 12
    with pytest.raises(ScenarioError, match="multiple"):
        scenario_from_dict(raw)


def _prfaas_dict():
    import tomllib

    from inference_worker.planning.scenario import SCENARIO_DIR

    return tomllib.loads((SCENARIO_DIR / "prfaas.toml").read_text())


def test_cumulative_resident_bytes_is_the_sum_of_the_one_formula(prfaas):
    for geo in (prfaas.geometry, load_scenario("prfaas_dense").geometry):
        n = np.array([0, 1, 2, 1023, 1024, 1025, 3001])
        expected = [float(sum(geo.resident_bytes(i) for i in range(1, int(x) + 1))) for x in n]
        assert geo.cumulative_resident_bytes_array(n, 131072).tolist() == expected


def test_homogeneous_scenario_puts_both_pools_on_one_type(prfaas):
    home = prfaas.homogeneous("compute")
    assert home.profiles["bandwidth"] is prfaas.profiles["compute"] is home.profiles["compute"]
    assert Fleet(0, 48, 2, None).cost(home) == 1000.0  # 50 H200 nodes of 8 at 2.5
    assert home.name == "prfaas[compute]" and prfaas.homogeneous("bandwidth").profiles["compute"].cost == 8.0
    with pytest.raises(ScenarioError, match="unknown datacenter"):
        prfaas.homogeneous("edge")


@pytest.mark.parametrize("gbps", [0.5, 1.0, 10.0, 100.0])
@pytest.mark.parametrize("speed", [500.0, 2000.0, 8000.0])
def test_link_only_threshold_is_the_routers_derived_threshold(gbps, speed, prfaas):
    for layout_dict, geo in ((GEMMA, KVGeometry(ModelConfig.from_hf_config(_gemma_hf()))), (None, prfaas.geometry)):
        layout = KVLayout.from_dict(layout_dict) if layout_dict else prfaas.geometry.layout
        expected = derived_threshold(layout, bandwidth_gbps=gbps, rtt_s=0.01, decode_prefill_tokens_per_s=speed,
                                     max_tokens=8192)
        got = latency_threshold(geo, local_prefill_tokens_per_s=speed, bandwidth_gbps=gbps, rtt_s=0.01,
                                max_tokens=8192)
        assert got == expected


def _gemma_hf():
    return {"model_type": "gemma3_text", "num_hidden_layers": 18, "hidden_size": 640, "intermediate_size": 2048,
            "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 256, "vocab_size": 262144,
            "max_position_embeddings": 32768, "sliding_window": 512, "rope_theta": 1e6,
            "rope_local_base_freq": 1e4, "rms_norm_eps": 1e-6, "torch_dtype": "bfloat16",
            "layer_types": GEMMA["layer_types"]}


def test_latency_threshold_hand_computed(prfaas):
    # Gemma 3 270M at 10 Gbit/s, 2000 tok/s, RTT 20 ms: N (1/2000 - 18*1024/1.25e9) > 0.02 <=> N > 41.2.
    geo = KVGeometry(ModelConfig.from_hf_config(_gemma_hf()))
    assert latency_threshold(geo, local_prefill_tokens_per_s=2000, bandwidth_gbps=10, rtt_s=0.02) == 41
    # A remote prefill at 4000 tok/s halves the saving: N (1/2000 - 1/4000 - 18*1024/1.25e9) > 0.02 <=> N > 85.6.
    assert latency_threshold(geo, local_prefill_tokens_per_s=2000, remote_prefill_tokens_per_s=4000,
                             bandwidth_gbps=10, rtt_s=0.02) == 85
    with pytest.raises(ValueError):
        latency_threshold(geo, local_prefill_tokens_per_s=0, bandwidth_gbps=10, rtt_s=0.02)


def test_erlang_c_known_values():
    assert erlang_c(1, 0.5) == pytest.approx(0.5)
    assert erlang_c(2, 1.0) == pytest.approx(1 / 3)
    with pytest.raises(ValueError):
        erlang_c(2, 2.0)


def _tiny(prfaas, **changes):
    return prfaas.with_changes(prompt=LengthDistribution(7893, None, 131072), output=LengthDistribution(3),
                               **changes)


def test_planner_ttft_percentiles_hand_computed(prfaas):
    # One local replica, constant prompts of 7893 tokens (S = 4.9165e14 FLOP / 4.736e14 FLOP/s = 1.0381 s), rate
    # 0.4/s: Erlang C = rho, cs^2 = 0, theta = (1/S - 0.4) * 2, P(TTFT <= t) = 1 - rho exp(-theta (t - S)).
    planner = Planner(_tiny(prfaas), grid_size=50)
    s = prfaas_prefill_flops(7893) / H20_NODE_FLOPS
    assert s == pytest.approx(1.0381, abs=1e-4)
    rho, theta = 0.4 * s, (1 / s - 0.4) * 2
    pred = planner.predict(Fleet(0, 1, 1, None), 0.4)
    assert pred.ttft_p50_s == pytest.approx(s, abs=1e-9)  # P(no wait) = 1 - rho >= 0.5: the median is S
    assert pred.ttft_p90_s == pytest.approx(s + math.log(rho / 0.1) / theta, abs=1e-9)
    # Fluid decode: x = 0.4 * 3 tokens/s, TPOT = (beta + gamma) / (1 - gamma x), beta = 60e9 / 19.2e12,
    # gamma = KV / 19.2e12 (a sequence's step reads its own KV too).
    kv = prfaas.geometry.resident_bytes_array(np.array([7893 + 1.5]), 131075)[0]
    assert pred.tpot_s == pytest.approx((60e9 + kv) / 19.2e12 / (1 - kv / 19.2e12 * 1.2), rel=1e-12)
    assert pred.link_share == 0.0 and pred.remote_share == 0.0


def _run(scenario, fleet, policy, arrivals, n, out):
    sim = Simulation(scenario, fleet, policy, np.array(arrivals, float), np.array(n), np.array(out))
    return sim, sim.run()


def test_simulator_one_replica_deterministic_arrivals_exact_ttft(prfaas):
    s = prfaas_prefill_flops(7893) / H20_NODE_FLOPS
    # arrivals every 2 s > S: no queue, TTFT = S; every 0.5 s < S: the k-th waits k (S - 0.5).
    _, free = _run(prfaas, Fleet(0, 1, 1, None), HomogeneousPD(), [0, 2, 4], [7893] * 3, [3] * 3)
    assert free.ttft_s.tolist() == pytest.approx([s] * 3, abs=1e-9)
    _, busy = _run(prfaas, Fleet(0, 1, 1, None), HomogeneousPD(), [0, 0.5, 1.0, 1.5], [7893] * 4, [3] * 4)
    assert busy.ttft_s.tolist() == pytest.approx([s + k * (s - 0.5) for k in range(4)], abs=1e-9)
    # Alone on its decode replica: two iterations, each (weights + resident KV) / achieved bandwidth.
    step = (60e9 + prfaas.geometry.resident_bytes(7893)) / (8 * 4e12 * 0.6)
    assert free.tpot_s.tolist() == pytest.approx([step] * 3, rel=1e-9)


def test_simulator_remote_prefill_adds_transfer_and_rtt(prfaas):
    sim, res = _run(prfaas, Fleet(1, 0, 1, 0), NaiveHeterogeneous(), [0.0], [32768], [2])
    expected = prfaas_prefill_flops(32768) / H200_NODE_FLOPS + 1_241_350_144 / 12.5e9 + 0.01
    assert res.ttft_s[0] == pytest.approx(expected, abs=1e-9)
    assert res.remote.tolist() == [True] and res.link_bytes == 1_241_350_144


def test_link_processor_sharing_of_two_transfers():
    env = simpy.Environment()
    link = Link(env, 100.0)  # bytes/s
    done = {}

    def flow(name, start, nbytes):
        yield env.timeout(start)
        yield link.send(nbytes)
        done[name] = env.now

    env.process(flow("a", 0, 100))
    env.process(flow("b", 0, 200))
    env.process(flow("c", 5, 50))
    env.run()
    # 0-2 s: a and b share 100 B/s (a done at 2 s, b has 100 B); b alone until 3 s; c alone 5-5.5 s.
    assert done == pytest.approx({"a": 2.0, "b": 3.0, "c": 5.5})
    env = simpy.Environment()
    link = Link(env, 100.0)
    done.clear()
    env.process(flow("a", 0, 100))
    env.process(flow("b", 0.5, 100))
    env.run()
    # a alone 0-0.5 (50 B), then both at 50 B/s: a's last 50 B by 1.5; b has 50 B left, alone: 2.0.
    assert done == pytest.approx({"a": 1.5, "b": 2.0})


def test_policies_decide_by_threshold_bounds_and_link(prfaas):
    class View:
        budget = True

        def local_wait_s(self):
            return 2.0

        def remote_wait_s(self):
            return 0.0

        def local_prefill_s(self, n):
            return n / 1000

        def remote_prefill_s(self, n):
            return n / 5000

        def transfer_eta_s(self, n):
            return 0.1

        def link_budget_allows(self, n):
            return self.budget

        def link_budget_spend(self, n):
            self.spent.append(n)

    view = View()
    view.spent = []
    assert FixedThreshold(100).remote(101, view) and not FixedThreshold(100).remote(100, view)
    policy = BandwidthAware(low_tokens=50, high_tokens=5000, max_link_share=0.3)
    assert not policy.remote(50, view) and policy.remote(51, view) and policy.remote(6000, view)
    view.budget = False
    assert not policy.remote(51, view) and policy.remote(5001, view)
    assert view.spent == [6000, 5001]  # forced remote transfers count against the link budget


def test_scenario_errors_name_the_field():
    with pytest.raises(ScenarioError, match="'model'"):
        scenario_from_dict({"link": {}})
    with pytest.raises(ScenarioError, match="cannot read"):
        load_scenario("/nonexistent/x.toml")


def test_policy_ordering_on_a_reduced_prfaas(prfaas):
    # prfaas with 400 H20 equivalents (the 100 Gbit/s link kept: 30% of it fills two H200 nodes' KV). Planned
    # goodput: homogeneous PD on H200 (19 prefill + 1 decode nodes) is far ahead: an H200 node prefills 2.67x the
    # tokens per cost unit of an H20 node and the workload is prefill-bound; bandwidth-aware (3 remote H200 nodes,
    # the link's 30% share) beats homogeneous PD on H20, and naive heterogeneous is bound by the whole link.
    sc = prfaas.with_changes(budget=400.0)
    planner = Planner(sc, grid_size=400)
    homo_rate, homo_fleet, _ = planner.goodput(None, iterations=12)
    h200 = sc.homogeneous("compute")
    h200_rate, h200_fleet, _ = Planner(h200, grid_size=400).goodput(None, iterations=12)
    naive_rate, naive_fleet, _ = planner.goodput(0, enforce_link_share=False, iterations=12)
    t, ba_rate, ba_fleet, _ = planner.plan_bandwidth_aware(range(0, sc.prompt.cap + 1, 16384))
    assert (h200_rate, ba_rate, homo_rate, naive_rate) == pytest.approx((67.34375, 29.848480224609375, 23.5859375,
                                                                         21.4140625), rel=1e-12)
    assert (h200_fleet, homo_fleet, naive_fleet, ba_fleet) == (
        Fleet(0, 19, 1, None), Fleet(0, 49, 1, None), Fleet(19, 0, 1, 0), Fleet(3, 40, 2, 49152))
    assert t == 49152
    # Simulated at 30 req/s (2000 requests): above homogeneous H20's capacity, H200 meets every objective,
    # bandwidth-aware still 92% within a link share of 27.4% (prompts above 2T = 98304 forced remote, their KV
    # drawn from the link budget), naive saturates the link.
    attained = {}
    for name, scenario, fleet, policy in (
            ("h20", sc, homo_fleet, HomogeneousPD()), ("h200", h200, h200_fleet, HomogeneousPD()),
            ("naive", sc, naive_fleet, NaiveHeterogeneous()),
            ("ba", sc, ba_fleet, BandwidthAware(t // 2, 2 * t, sc.max_link_share))):
        res = simulate(scenario, fleet, policy, 30.0, 2000)
        attained[name] = (res.attainment(scenario), round(res.summary(scenario)["link_share"], 4))
    assert attained == {"h20": (0.597, 0.0), "h200": (1.0, 0.0), "naive": (0.5265, 0.9704), "ba": (0.92, 0.2738)}


def test_bandwidth_aware_weights_and_link_limited_pool_hand_computed(prfaas):
    # Constant 65536-token prompts: KV 4096 * (8 * 65536 + 40 * 1023) = 2,315,059,200 B; H200-node prefill
    # 4.5822e15 FLOP / 3.1648e15 FLOP/s = 1.4479 s, so a busy replica ships 1.599 GB/s and 30% of 12.5 GB/s fills
    # 2.35 of them: 3 replicas are fed (the third below capacity).
    sc = prfaas.with_changes(prompt=LengthDistribution(65536, None, 131072))
    planner = Planner(sc, grid_size=10)
    assert planner.link_limited_remote_replicas(1000) == 3  # ceil(2.35)
    assert planner.link_limited_remote_replicas(65536) == 0
    t_remote = prfaas_prefill_flops(65536) / H200_NODE_FLOPS
    assert t_remote == pytest.approx(1.4479, abs=1e-4)
    f_link = 0.3 * 12.5e9 / (10 * 2_315_059_200)  # 0.16198
    f_pool = 0.9 * 2 / (10 * t_remote)  # 0.12431
    weights = planner.bandwidth_aware_weights(Fleet(2, 10, 1, 1000), 10.0, 1000)
    assert weights.tolist() == pytest.approx([min(f_link, f_pool)] * 10, rel=1e-12)
    assert planner.bandwidth_aware_weights(Fleet(2, 10, 1, 1000), 10.0, 65536).tolist() == [0.0] * 10
    # Above the upper bound every prompt is remote whatever the link; an upper bound above them changes nothing.
    assert planner.bandwidth_aware_weights(Fleet(2, 10, 1, 1000), 10.0, 1000, 60000).tolist() == [1.0] * 10
    assert planner.bandwidth_aware_weights(Fleet(2, 10, 1, 1000), 10.0, 1000, 65536).tolist() == pytest.approx(
        [min(f_link, f_pool)] * 10, rel=1e-12)
    assert planner.bandwidth_aware_weights(Fleet(0, 10, 1, 1000), 10.0, 1000, 60000).tolist() == [0.0] * 10


@pytest.mark.parametrize(("offered", "end", "middle", "stable"), [
    (1.056, 16.26, 14.63, True),  # bounded: bandwidth-aware keeps the remote pool full (prfaas, 64 req/s)
    (1.056, 16.26, 5.0, False),  # grew 11.26 s > 5% of the 156 s second half
    (1.04, 16.26, 0.0, True),  # offered under 105%
    (1.2, 4.9, 0.0, True),  # backlog under the 5 s objective
])
def test_stability_needs_overload_backlog_and_growth(offered, end, middle, stable):
    from inference_worker.planning.simulator import SimResult

    queues = ("link", "local_prefill", "remote_prefill")
    res = SimResult(64.0, np.zeros(1), np.zeros(1), np.zeros(1, bool), 0.0, 1.0, 100.0, 0.0,
                    {k: (offered if k == "remote_prefill" else 0.5) for k in queues},
                    {k: (end if k == "remote_prefill" else 0.0) for k in queues}, 5.0, 0,
                    {k: (middle if k == "remote_prefill" else 0.0) for k in queues}, 156.0)
    assert res.stable is stable


def test_offered_load_and_backlog_flag_an_overloaded_remote_pool(prfaas):
    # 20 remote prefills of 32768 tokens, 0.1 s apart, on one H200 node (0.67938 s each): when the last
    # arrives (1.9 s) three have started (0, 0.679, 1.359 s), 17 wait: backlog 17 x 0.67938 = 11.55 s > 5 s.
    service = prfaas_prefill_flops(32768) / H200_NODE_FLOPS
    assert service == pytest.approx(0.67938, abs=1e-5)
    _, res = _run(prfaas, Fleet(1, 0, 1, 0), NaiveHeterogeneous(), [0.1 * k for k in range(20)], [32768] * 20,
                  [2] * 20)
    assert res.backlog_s["remote_prefill"] == pytest.approx(17 * service)
    assert res.offered_load["remote_prefill"] == pytest.approx(20 * service / 1.9)
    assert res.offered_load["link"] == pytest.approx(20 * 1_241_350_144 / 12.5e9 / 1.9)
    assert not res.stable
    _, calm = _run(prfaas, Fleet(1, 0, 1, 0), NaiveHeterogeneous(), [0.0, 1.0], [32768] * 2, [2] * 2)
    assert calm.backlog_s == {"link": 0.0, "local_prefill": 0.0, "remote_prefill": 0.0} and calm.stable


def test_fitted_profile_recovers_exact_curves_and_rejects_bad_points():
    from inference_worker.planning.profiles import FittedProfile

    # t_prefill = 0.01 + 2e-4 N + 1e-9 N^2, t_step = 0.005 + 1e-4 B: exact points give the coefficients back.
    prefill = [(n, 0.01 + 2e-4 * n + 1e-9 * n * n) for n in (128, 512, 2048, 8192)]
    decode = [(b, 0.005 + 1e-4 * b) for b in (1, 8, 32)]
    fitted = FittedProfile.fit(prefill_points=prefill, decode_points=decode, kv_capacity_bytes=1e9, label="cpu")
    assert fitted.prefill_coefficients == pytest.approx((0.01, 2e-4, 1e-9), rel=1e-6)
    assert fitted.decode_coefficients == pytest.approx((0.005, 1e-4), rel=1e-9)
    assert fitted.prefill_time_s(4096) == pytest.approx(0.01 + 2e-4 * 4096 + 1e-9 * 4096**2, rel=1e-9)
    assert fitted.decode_step_s(16, 0.0) == pytest.approx(0.0066, rel=1e-9)
    with pytest.raises(ValueError, match="at least 3 prefill points"):
        FittedProfile.fit(prefill_points=prefill[:2], decode_points=decode, kv_capacity_bytes=1e9)
    with pytest.raises(ValueError, match="positive"):
        FittedProfile.fit(prefill_points=prefill + [(1, -1.0)], decode_points=decode, kv_capacity_bytes=1e9)


@pytest.mark.parametrize(("local_wait_s", "remote_wait_s", "share", "remote_speed"), [
    (0.0, 0.0, 0.0, math.inf), (0.0, 0.5, 0.5, 4000.0), (0.3, 0.0, 0.0, 4000.0), (2.0, 0.0, 0.9, 1000.0),
    (0.05, 0.0, 0.0, 1500.0), (0.021, 0.0, 0.0, 2040.8)])
def test_latency_threshold_is_the_pd_cost_functions_last_local_length(local_wait_s, remote_wait_s, share,
                                                                        remote_speed):
    # Brute force over every N with the router's one cost function: T is the last N where local is no worse.
    geo = KVGeometry(ModelConfig.from_hf_config(_gemma_hf()))
    profile = PDProfile(layout=geo.layout, decode_prefill_tokens_per_s=2000, bandwidth_gbps=10, rtt_s=0.02,
                        prefill_tokens_per_s=None if math.isinf(remote_speed) else remote_speed,
                        decode_wait_s=local_wait_s, prefill_wait_s=remote_wait_s, link_share_used=share)
    local = [n for n in range(4097) if not pd_costs(profile, n).remote]
    expected = None if local and local[-1] == 4096 else (local[-1] if local else -1)
    assert latency_threshold(geo, local_prefill_tokens_per_s=2000, remote_prefill_tokens_per_s=remote_speed,
                             bandwidth_gbps=10, rtt_s=0.02, local_wait_s=local_wait_s, remote_wait_s=remote_wait_s,
                             link_share_used=share, max_tokens=4096) == expected


def test_colocated_fleet_local_prompts_hand_checked(prfaas):
    # One decode replica prefills every prompt itself (no remote pool): constant prompts of 7893 tokens, 3 output
    # tokens, 0.3 req/s. The roofline's co-located prefill is t(N) + t_step(1) / 2 (weights only).
    sc = _tiny(prfaas)
    planner = Planner(sc, grid_size=50)
    p = sc.profiles["bandwidth"]
    t_alone = prfaas_prefill_flops(7893) / H20_NODE_FLOPS
    t_shared = t_alone + (60e9 / 19.2e12) / 2
    assert float(p.colocated_prefill_time_s(7893)) == pytest.approx(t_shared, rel=1e-12)
    rate = 0.3
    pred = planner.predict(Fleet(0, 0, 1, None, colocated=True), rate)
    # The fixed point the planner solved: B = x TPOT, p = 1 - exp(-B), service = p (t_shared + 1.5 gamma (B/p - 1))
    # + (1 - p) t_alone, rho_p = rate * service, TPOT = 1 / ((1 - rho_p) / (beta + gamma (1 + B)) + rate).
    kv = prfaas.geometry.resident_bytes_array(np.array([7893 + 1.5]), 131075)[0]
    beta, gamma, x = 60e9 / 19.2e12, kv / 19.2e12, rate * 3
    batch = pred.decode_batch
    assert batch == pytest.approx(x * pred.tpot_s, rel=1e-12)
    decoding = 1 - math.exp(-batch)
    service = decoding * (t_shared + 1.5 * gamma * (batch / decoding - 1)) + (1 - decoding) * t_alone
    assert pred.tpot_s == pytest.approx(1 / ((1 - rate * service) / (beta + gamma * (1 + batch)) + rate), rel=1e-9)
    # One server, constant service: P(no wait) = 1 - rho >= 0.5, so the median TTFT is the service time itself,
    # longer than the prefill alone (the step in progress, the sequences riding along).
    assert pred.ttft_p50_s == pytest.approx(service, rel=1e-9)
    assert t_alone < pred.ttft_p50_s < t_shared + 1.5 * gamma * batch
    separate = planner.predict(Fleet(0, 1, 1, None), rate)
    assert separate.ttft_p50_s == pytest.approx(t_alone, rel=1e-9) and separate.tpot_s < pred.tpot_s


def test_colocated_fleet_remote_first_token_waits_for_the_step_in_progress(prfaas):
    # Every prompt remote (threshold 0): no local prompt steps, so TPOT = beta + gamma (1 + B) with B = x TPOT,
    # i.e. (beta + gamma) / (1 - gamma x); an imported request waits p * t_step(B) / 2 for the step in progress.
    sc = _tiny(prfaas)
    planner = Planner(sc, grid_size=50)
    rate = 0.2
    pred = planner.predict(Fleet(1, 0, 1, 0, colocated=True), rate)
    kv = prfaas.geometry.resident_bytes_array(np.array([7893 + 1.5]), 131075)[0]
    beta, gamma, x = 60e9 / 19.2e12, kv / 19.2e12, rate * 3
    tpot = (beta + gamma) / (1 - gamma * x)
    assert pred.tpot_s == pytest.approx(tpot, rel=1e-9)
    batch = x * tpot
    wait = (1 - math.exp(-batch)) * (beta + gamma * (1 + batch)) / 2
    t_remote = prfaas_prefill_flops(7893) / H200_NODE_FLOPS
    link = sc.link_bytes_per_s * (1 - pred.link_share)
    transfer = sc.geometry.transfer_bytes_array(np.array([7893.0]), 131072 + 3)[0] / link
    # rho of the remote pool 0.2 * 0.15 s < 0.5: the median waits for no prefill.
    assert pred.ttft_p50_s == pytest.approx(t_remote + transfer + sc.rtt_s + wait, rel=1e-9)
    plain = planner.predict(Fleet(1, 0, 1, 0), rate)
    assert pred.ttft_p50_s - plain.ttft_p50_s == pytest.approx(wait, rel=1e-6)
    with pytest.raises(ValueError, match="local_prefill must be 0"):
        Fleet(1, 1, 1, 0, colocated=True)


def test_fitted_profile_colocated_overhead_measured_or_estimated():
    from inference_worker.planning.profiles import FittedProfile

    prefill = [(n, 0.08 + 2.5e-3 * n) for n in (32, 128, 256, 512)]
    decode = [(1, 0.075), (2, 0.13), (3, 0.185)]
    # Excess over the idle prefill: 100, 120, 90 and 130 ms (noise around a constant): mean 110 ms.
    colocated = [(32, 0.26), (128, 0.52), (256, 0.81), (512, 1.49)]
    fitted = FittedProfile.fit(prefill_points=prefill, decode_points=decode, kv_capacity_bytes=1e9,
                               colocated_prefill_points=colocated)
    assert fitted.colocated_overhead_s == pytest.approx(0.11, abs=1e-12)
    assert fitted.colocated_prefill_time_s(200) == pytest.approx(0.08 + 0.5 + 0.11, rel=1e-9)
    # One point is enough for a constant; a point decreasing with the prompt (a loaded machine) does no harm.
    loaded = FittedProfile.fit(prefill_points=prefill, decode_points=decode, kv_capacity_bytes=1e9,
                               colocated_prefill_points=[(16, 0.792), (32, 0.622), (64, 0.366)])
    assert loaded.colocated_overhead_s == pytest.approx((0.672 + 0.462 + 0.126) / 3, abs=1e-12)
    # Not measured: the prefill alone plus half a one-sequence step (0.02 + 0.055 = 0.075 s).
    plain = FittedProfile.fit(prefill_points=prefill, decode_points=decode, kv_capacity_bytes=1e9)
    assert plain.colocated_overhead_s is None
    assert plain.colocated_prefill_time_s(200) == pytest.approx(0.08 + 0.5 + 0.075 / 2, rel=1e-9)
    # Points below the idle curve (noise, or a bogus file) are read as no overhead: never faster than idle.
    noisy = FittedProfile.fit(prefill_points=prefill, decode_points=decode, kv_capacity_bytes=1e9,
                              colocated_prefill_points=[(n, 0.5 * t) for n, t in prefill])
    assert noisy.colocated_overhead_s == 0.0 and noisy.colocated_prefill_time_s(200) == pytest.approx(0.58)
    for bad, match in (([(1e300, 0.1)] + prefill[1:], "x must be in 1..1e"), ([(64, math.nan)] + prefill[1:], "finite"),
                       ([(64, 0.1), (64, 0.2), (64, 0.3)], "distinct"), (["ab"] + prefill[1:], "two numbers")):
        with pytest.raises(ValueError, match=match):
            FittedProfile.fit(prefill_points=bad, decode_points=decode, kv_capacity_bytes=1e9)


def test_planner_refuses_bad_rates_fleets_and_budgets(prfaas):
    planner = Planner(_tiny(prfaas), grid_size=50)
    for rate in (-1.0, math.nan, math.inf):
        with pytest.raises(ValueError, match="rate must be a finite number"):
            planner.predict(Fleet(0, 1, 1, None), rate)
    with pytest.raises(ValueError, match="decode must be a whole number of replicas >= 0"):
        Fleet(0, 0, -1, None, colocated=True)
    for budget in (math.inf, math.nan):
        with pytest.raises(ValueError, match="budget must be a finite cost"):
            planner.size_fleet(None, 0.1, budget=budget, colocated=True)
