"""The router pipeline's plan with cache hits (issue 18, acceptance 2): exact decode/prefill choices and costs.

Fleet: decode replicas d0, d1 in dc1, prefill replica p0 in dc2, a 1 Gbit/s link with 20 ms RTT, Gemma 3
270M's KV layout in bf16 (b = 1024 B per token per layer; 3 full and 15 sliding layers, W = 512), decode
replicas prefill 2000 tokens/s and the prefill replica 8000 tokens/s. A 2000-token prompt ships
``(3 * 2000 + 15 * 511) * 1024 = 13_992_960`` bytes: 0.11194368 s at 1.25e8 B/s.
"""

import pytest

from inference_worker.engine.block_hash import block_digests, prefix_root
from inference_worker.kv_transfer.layout import KVLayout
from inference_worker.router.decisions import LoadTracker, NoReplicaAvailable
from inference_worker.router.pd_cost import PDProfile, derived_threshold, pd_costs
from inference_worker.router.pipeline import (
    LOCAL_PREFILL,
    REMOTE_PREFILL,
    PromptInfo,
    UnknownModel,
    admit,
    eligibility,
    plan_route,
)
from inference_worker.router.prefix_index import FULL, SLIDING, PrefixIndex
from inference_worker.router.scoring import ReplicaLoad
from inference_worker.router.table import RoutingTable

SHA = "ab" * 32
GEMMA = {"layer_types": ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(18)],
         "sliding_window": 512, "num_kv_heads": 1, "head_dim": 256, "dtype": "bfloat16",
         "model": "gemma", "tokenizer": "gemma-3-270m", "weights_sha256": SHA, "kv_dtype": "bfloat16", "block_size": 16}
N = 2000
TRANSFER_S = (3 * 2000 + 15 * 511) * 1024 / 1.25e8


def table(**length):
    return RoutingTable.from_dict({
        "version": 1, "tracks": [{"name": "stable", "model_version": "v1", "weight": 100}],
        "pools": [{"name": "decode", "role": "decode", "datacenter": "dc1", "replicas": [
                      {"name": "d0", "url": "http://d0", "track": "stable"},
                      {"name": "d1", "url": "http://d1", "track": "stable"}]},
                  {"name": "prefill", "role": "prefill", "datacenter": "dc2", "replicas": [
                      {"name": "p0", "url": "http://p0", "track": "stable"}]}],
        "links": [{"source": "dc2", "target": "dc1", "bandwidth_gbps": 1.0, "rtt_ms": 20}],
        "length_routing": {"decode_prefill_tokens_per_s": 2000, "prefill_tokens_per_s": 8000, **length},
        "models": {"v1": GEMMA}})


def prompt():
    digests = block_digests(prefix_root(SHA, "bfloat16", 16), list(range(1, N + 1)), 16)
    assert len(digests) == 125
    return PromptInfo(N, tuple(digests), "on")


def index_with(cached):
    """An index where each replica of ``cached`` (name -> blocks) holds the prompt's first blocks in both groups."""
    index = PrefixIndex()
    index.retain({"d0": "v1", "d1": "v1", "p0": "v1"})
    digests = prompt().digests
    for name in ("d0", "d1", "p0"):
        events = [{"type": "cleared"}] + [{"type": "stored", "digest": d.hex(), "parent": "", "group": g,
                                           "tier": "device"} for d in digests[:cached.get(name, 0)] for g in (FULL, SLIDING)]
        assert index.apply(name, {"worker_id": name, "seq": len(events), "snapshot": True, "events": events})
    return index


def plan(t, index, loads=None, exclude=frozenset(), session=None):
    eligible = eligibility(t, model="gemma", sticky_key="s", exclude=exclude)
    return plan_route(t, eligible=eligible, prompt=prompt(), loads=loads or LoadTracker(), index=index,
                      session=session)


def test_a_long_prompt_cached_on_the_chosen_decode_replica_stays_local():
    p = plan(table(), index_with({"d0": 125}))  # 124 blocks count: the last token is always computed
    assert (p.decode.name, p.decision, p.reason, p.prefill) == ("d0", LOCAL_PREFILL, "cost", None)
    assert p.predicted_cached_tokens == 1984 and p.prefill_cached_tokens == 0
    assert p.costs.local_s == pytest.approx(16 / 2000, rel=1e-12)
    assert p.costs.remote_s == pytest.approx(2000 / 8000 + TRANSFER_S + 0.02, rel=1e-12)


def test_the_same_prompt_on_a_cold_fleet_goes_remote():
    p = plan(table(), index_with({}))
    assert (p.decode.name, p.decision, p.reason, p.prefill.name) == ("d0", REMOTE_PREFILL, "cost", "p0")
    assert p.predicted_cached_tokens == 0
    assert p.costs.local_s == pytest.approx(1.0, rel=1e-12)
    assert p.costs.remote_s == pytest.approx(0.25 + TRANSFER_S + 0.02, rel=1e-12)


def test_a_retry_after_the_chosen_replica_fails_re_plans_on_the_next_one():
    t, index = table(), index_with({"d0": 125})
    first = plan(t, index)
    assert (first.decode.name, first.decision) == ("d0", LOCAL_PREFILL)
    retry = plan(t, index, exclude=frozenset({"d0"}))  # d1 is cold: the cost function now sends it remote
    assert (retry.decode.name, retry.decision, retry.prefill.name) == ("d1", REMOTE_PREFILL, "p0")
    with pytest.raises(NoReplicaAvailable, match="2 tried"):
        plan(t, index, exclude=frozenset({"d0", "d1"}))


def test_hits_on_the_prefill_replica_lower_the_remote_cost():
    p = plan(table(), index_with({"d0": 40, "p0": 125}))
    assert (p.decode.name, p.decision, p.prefill.name) == ("d0", REMOTE_PREFILL, "p0")
    assert (p.predicted_cached_tokens, p.prefill_cached_tokens) == (640, 1984)
    assert p.costs.local_s == pytest.approx((2000 - 640) / 2000, rel=1e-12)
    assert p.costs.remote_s == pytest.approx(16 / 8000 + TRANSFER_S + 0.02, rel=1e-12)


def test_cached_tokens_outweigh_a_short_queue_but_not_a_long_one():
    t, index = table(), index_with({"d0": 125})
    loads = LoadTracker()
    loads.queue_depth["d0"] = 7.0  # score 2 * 1984 - 7 * 512 = 384 > 0 (d1); hit weight 2 (router/scoring.py)
    assert plan(t, index, loads).decode.name == "d0"
    loads.queue_depth["d0"] = 8.0  # 3968 - 4096 < 0
    p = plan(t, index, loads)
    assert (p.decode.name, p.decision) == ("d1", REMOTE_PREFILL)
    loads.kv_usage["d1"] = 0.5  # d1: -512; d0: -128
    assert plan(t, index, loads).decode.name == "d0"


def test_the_session_breaks_ties_the_same_way_every_time_and_admission_books_the_replicas():
    t, index = table(), index_with({})
    loads = LoadTracker()
    chosen = plan(t, index, loads, session="user-0").decode.name
    for _ in range(3):
        p = plan(t, index, loads, session="user-0")
        admit(p, loads)
        loads.end(p.decode)
        assert p.decode.name == chosen  # assigned counts grow on it, the session still wins the tie
    assert loads.assigned[p.decode.name] == 3 and loads.assigned["p0"] == 3
    names = {plan(t, index, LoadTracker(), session=f"user-{i}").decode.name for i in range(20)}
    assert names == {"d0", "d1"}


def test_the_fixed_threshold_applies_to_the_uncached_tokens():
    t = table(threshold_tokens=1000)
    p = plan(t, index_with({"d0": 125}))
    assert (p.decode.name, p.decision, p.reason) == ("d0", LOCAL_PREFILL, "threshold")
    p = plan(t, index_with({}))
    assert (p.decision, p.reason, p.prefill.name) == (REMOTE_PREFILL, "threshold", "p0")


def test_unknown_model_and_two_models_in_one_table():
    data = {"version": 1, "tracks": [{"name": "g", "model_version": "g1", "weight": 100},
                                     {"name": "s", "model_version": "s1", "weight": 100}],
            "pools": [{"name": "pg", "role": "decode", "replicas": [{"name": "g-0", "url": "http://g", "track": "g"}]},
                      {"name": "ps", "role": "decode", "replicas": [{"name": "s-0", "url": "http://s", "track": "s"}]}],
            "models": {"g1": {**GEMMA, "model": "gemma"}, "s1": {**GEMMA, "model": "smol"}}}
    t = RoutingTable.from_dict(data)
    assert [r.name for r in eligibility(t, model="gemma", sticky_key="k").decode] == ["g-0"]
    assert [r.name for r in eligibility(t, model="smol", sticky_key="k").decode] == ["s-0"]
    with pytest.raises(UnknownModel, match="'llama' is not served here; available: \\['gemma', 'smol'\\]"):
        eligibility(t, model="llama", sticky_key="k")


def test_derived_threshold_is_the_cost_functions_cold_crossover():
    layout = KVLayout.from_dict(GEMMA)
    profile = PDProfile(layout, 2000, 1.0, 0.02, 8000)
    threshold = derived_threshold(profile, 4096)
    assert not pd_costs(profile, threshold).remote and pd_costs(profile, threshold + 1).remote
    # local N/2000 > N/8000 + bytes(N)/1.25e8 + 0.02 with bytes = 18 * 1024 * N below W:
    # N * (5e-4 - 1.25e-4 - 1.47456e-4) > 0.02  <=>  N > 87.9
    assert threshold == 87


def test_bad_routing_weights_are_refused_at_parse_time_and_bad_token_ids_turn_cache_scoring_off():
    from inference_worker.router.prompt import PromptHasher
    from inference_worker.router.table import ModelInfo, RoutingTableError

    data = {"version": 1, "tracks": [{"name": "stable", "model_version": "v1", "weight": 100}],
            "pools": [{"name": "d", "role": "decode", "routing_weights": {"hits": 2},
                       "replicas": [{"name": "d0", "url": "http://d0", "track": "stable"}]}]}
    with pytest.raises(RoutingTableError, match="pool 'd': routing_weights: unknown routing weights \\['hits'\\]"):
        RoutingTable.from_dict(data)
    data["pools"][0]["routing_weights"] = {"waiting": 256}
    assert RoutingTable.from_dict(data).pool_weights == {"d": {"waiting": 256.0}}
    hasher = PromptHasher()
    info = ModelInfo("smol", "smollm2-135m-instruct", SHA, "float32", 4)  # its tokenizer.json is small
    got = hasher.info("v1", info, "/v1/completions", {"prompt": [2, 5, 7, 9, 11]})
    assert (got.num_tokens, got.cache, len(got.digests)) == (5, "on", 1)
    got = hasher.info("v1", info, "/v1/completions", {"prompt": [2, -5, 7, 9, 11]})
    assert (got.num_tokens, got.cache, got.digests) == (5, "unhashable", ())
    got = hasher.info("v1", ModelInfo("gemma"), "/v1/completions", {"prompt": "x" * 41})
    assert (got.num_tokens, got.cache) == (11, "no_tokenizer")


def test_least_loaded_ignores_the_session_and_the_index():
    t, index = table(), index_with({"d1": 125})
    loads = LoadTracker()
    names = []
    for _ in range(4):
        eligible = eligibility(t, model="gemma", sticky_key="s")
        p = plan_route(t, eligible=eligible, prompt=prompt(), loads=loads, index=index, session="user-0",
                       policy="least_loaded")
        admit(p, loads)
        loads.end(p.decode)
        names.append(p.decode.name)
    assert names == ["d0", "d1", "d0", "d1"] and p.cache == "policy"


def test_a_tokenizer_that_does_not_load_turns_cache_scoring_off(tmp_path):
    from inference_worker.router.prompt import PromptHasher
    from inference_worker.router.table import ModelInfo

    (tmp_path / "tokenizer.json").write_text("{not json")
    got = PromptHasher().info("v1", ModelInfo("m", str(tmp_path), SHA, "float32", 4), "/v1/completions",
                              {"prompt": "x" * 8})
    assert (got.num_tokens, got.cache) == (2, "no_tokenizer")


def test_a_session_stays_on_its_cache_while_the_replica_only_decodes_and_moves_for_prefill_work_ahead():
    # d0 holds the whole prompt (1984 tokens hit, scored at hit weight 2: 3968). Another request in flight on d0
    # that already has its first byte is decoding: it costs only as running once scraped, so the session stays
    # (least_loaded, which counts every in-flight request as waiting, leaves). Prefill work still ahead on d0 is
    # charged token for token: 3967 uncached tokens pending keep d0 (3968 - 3967 > 0), 3969 move it to d1.
    t, index = table(), index_with({"d0": 125})
    loads = LoadTracker()
    d0 = next(r for r in t.replicas if r.name == "d0")
    loads.begin(d0, 4000)  # another request prefilling 4000 uncached tokens on d0
    assert plan(t, index, loads).decode.name == "d1"  # 3968 - 4000 < 0
    loads.prefill_done(d0, 4000)  # its first byte came back: now decoding
    assert (loads.in_flight["d0"], loads.pending_prefill_tokens["d0"]) == (1, 0)
    assert plan(t, index, loads).decode.name == "d0"
    eligible = eligibility(t, model="gemma", sticky_key="s")
    least = plan_route(t, eligible=eligible, prompt=prompt(), loads=loads, index=index, policy="least_loaded")
    assert least.decode.name == "d1"  # one request in flight on d0 counts as waiting
    for pending, chosen in ((3967, "d0"), (3969, "d1")):
        loads.pending_prefill_tokens["d0"] = pending
        assert plan(t, index, loads).decode.name == chosen, pending


def test_admission_books_the_uncached_tokens_of_a_local_prefill_and_none_for_a_remote_one():
    loads = LoadTracker()
    local = plan(table(), index_with({"d0": 120}))  # 1920 cached of 2000: 80 computed on d0
    remote = plan(table(), index_with({"p0": 125}))
    assert (local.decision, local.decode_prefill_tokens, remote.decision, remote.decode_prefill_tokens) == (
        LOCAL_PREFILL, 80, REMOTE_PREFILL, 0)
    admit(local, loads)
    admit(remote, loads)
    assert (loads.in_flight["d0"], loads.pending_prefill_tokens["d0"]) == (2, 80)


def test_an_own_request_queued_in_the_engine_is_charged_once_by_its_tokens():
    # d0 holds 320 tokens of the prompt (20 blocks). A request this router sent d0 waits in d0's engine queue with
    # 100 uncached tokens, so the scrape shows queue depth 1: it delays us by its 100 tokens, once. d0 scores
    # 2 * 320 - 100 > 0 and keeps the session (charged again as a waiting request, 512 more, it went to cold d1
    # at hit weight 1). Two more queued requests that are not this router's (depth 3) are charged as waiting:
    # 640 - 100 - 2 * 512 < 0.
    t, index = table(), index_with({"d0": 20})
    loads = LoadTracker()
    d0 = next(r for r in t.replicas if r.name == "d0")
    loads.begin(d0, 100)
    loads.queue_depth["d0"] = 1.0
    assert loads.cache_signals(d0) == ReplicaLoad(waiting=0.0, running=0.0, kv_usage_ratio=0.0,
                                                  pending_prefill_tokens=100.0)
    chosen = plan(t, index, loads)
    assert (chosen.decode.name, chosen.predicted_cached_tokens) == ("d0", 320)
    loads.queue_depth["d0"] = 2.0
    assert loads.cache_signals(d0).waiting == 1.0
    assert plan(t, index, loads).decode.name == "d0"  # 640 - 100 - 512 > 0
    loads.queue_depth["d0"] = 3.0
    assert loads.cache_signals(d0).waiting == 2.0
    assert plan(t, index, loads).decode.name == "d1"
    loads.prefill_done(d0, 100)  # its first byte: no longer this router's pending work, the scrape is stale
    assert (loads.pending_requests["d0"], loads.pending_prefill_tokens["d0"], loads.cache_signals(d0).waiting) == (
        0, 0, 3.0)
