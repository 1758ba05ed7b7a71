"""Router decisions without the network: hash split, length threshold, version pairing, load, keys, tokens."""

import hashlib
import json

import pytest

from inference_worker.kv_transfer.bucket import TokenBucket
from inference_worker.kv_transfer.layout import KVLayout
from inference_worker.router.auth import ApiKey, ApiKeys
from inference_worker.router.decisions import LoadTracker, NoReplicaAvailable, choose_track
from inference_worker.router.pipeline import (
    LOCAL_PREFILL,
    LOCAL_PREFILL_FALLBACK,
    REMOTE_PREFILL,
    PromptInfo,
    eligibility,
)
from inference_worker.router.pipeline import plan_route as pipeline_plan
from inference_worker.router.prompt import PromptCounter
from inference_worker.router.table import RoutingTable, RoutingTableError, derived_threshold

GEMMA = {"layer_types": ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(18)],
         "sliding_window": 512, "num_kv_heads": 1, "head_dim": 256, "dtype": "bfloat16"}


def table_dict(threshold=1000, canary_prefill=False, **extra):
    pools = [
        {"name": "decode-dc1", "role": "decode", "datacenter": "dc1", "replicas": [
            {"name": "d0", "url": "http://d0", "track": "stable"},
            {"name": "d1", "url": "http://d1", "track": "stable"},
            {"name": "d2", "url": "http://d2", "track": "canary"}]},
        {"name": "prefill-dc2", "role": "prefill", "datacenter": "dc2", "replicas": [
            {"name": "p0", "url": "http://p0", "track": "stable"}]
            + ([{"name": "p1", "url": "http://p1", "track": "canary"}] if canary_prefill else [])},
    ]
    data = {"version": 3, "tracks": [{"name": "stable", "model_version": "v1", "weight": 90},
                                     {"name": "canary", "model_version": "v2", "weight": 10}],
            "pools": pools, "length_routing": {"threshold_tokens": threshold}}
    data.update(extra)
    return data


def plan_route(table, *, key, num_prompt_tokens, loads):
    eligible = eligibility(table, model=None, sticky_key=key)
    return pipeline_plan(table, eligible=eligible, prompt=PromptInfo(num_prompt_tokens, (), "no_tokenizer"),
                         loads=loads)


def candidates(table, key):
    return [r.name for r in eligibility(table, model=None, sticky_key=key).decode]


def independent_bucket(request_id):
    """The documented hash, computed another way: first 16 hex digits of sha256 -> int -> mod 10000."""
    return int(hashlib.sha256(request_id.encode()).hexdigest()[:16], 16) % 10000


def test_ninety_ten_split_over_1000_ids_matches_the_hash_exactly():
    table = RoutingTable.from_dict(table_dict())
    ids = [f"req-{i:04d}" for i in range(1000)]
    tracks = [choose_track(table.tracks, rid).name for rid in ids]
    expected_stable = sum(1 for rid in ids if independent_bucket(rid) < 9000)
    assert tracks.count("stable") == expected_stable == 898
    assert tracks.count("canary") == 1000 - expected_stable
    assert all(choose_track(table.tracks, rid).name == t for rid, t in zip(ids, tracks, strict=True))
    # A 50/50 split moves only ids from canary's range: every id on canary at 10% stays canary at 50%.
    wider = RoutingTable.from_dict({**table_dict(), "tracks": [
        {"name": "stable", "model_version": "v1", "weight": 50}, {"name": "canary", "model_version": "v2",
                                                                  "weight": 50}]})
    assert all(choose_track(wider.tracks, rid).name == "canary" for rid, t in zip(ids, tracks, strict=True)
               if t == "canary")


def stable_key():
    return next(f"k{i}" for i in range(100) if independent_bucket(f"k{i}") < 9000)


def canary_key():
    return next(f"k{i}" for i in range(1000) if independent_bucket(f"k{i}") >= 9000)


@pytest.mark.parametrize("tokens, decision", [(999, LOCAL_PREFILL), (1000, LOCAL_PREFILL), (1001, REMOTE_PREFILL)])
def test_prompts_around_the_threshold(tokens, decision):
    table = RoutingTable.from_dict(table_dict(threshold=1000))
    plan = plan_route(table, key=stable_key(), num_prompt_tokens=tokens, loads=LoadTracker())
    assert plan.decision == decision and plan.track.name == "stable" and plan.reason == "threshold"
    assert candidates(table, stable_key()) == ["d0", "d1"] and plan.decode.name == "d0"
    assert (plan.prefill.name if plan.prefill else None) == ("p0" if decision == REMOTE_PREFILL else None)


def test_new_version_prefill_pairs_only_with_same_version_decode():
    table = RoutingTable.from_dict(table_dict())
    plan = plan_route(table, key=canary_key(), num_prompt_tokens=5000, loads=LoadTracker())
    assert plan.track.name == "canary" and candidates(table, canary_key()) == ["d2"] and plan.decode.name == "d2"
    assert plan.decision == LOCAL_PREFILL_FALLBACK and plan.prefill is None  # p0 serves v1: never paired
    table = RoutingTable.from_dict(table_dict(canary_prefill=True))
    plan = plan_route(table, key=canary_key(), num_prompt_tokens=5000, loads=LoadTracker())
    assert plan.decision == REMOTE_PREFILL and plan.prefill.name == "p1" and plan.prefill.model_version == "v2"


def test_a_weighted_track_with_no_ready_replica_fails_over_and_no_replica_at_all_is_an_error():
    """Chaos matrix, blue-green x agent at the switch: the new track had weight 100 while its replicas were
    briefly out of the table, and every request got 503 'no decode replica left'. It fails over instead."""
    data = table_dict()
    data["pools"][0]["replicas"] = [r for r in data["pools"][0]["replicas"] if r["track"] == "stable"]
    eligible = eligibility(RoutingTable.from_dict(data), model=None, sticky_key=canary_key())
    assert (eligible.track.name, eligible.failover_from, [r.name for r in eligible.decode]) == (
        "stable", "canary", ["d0", "d1"])
    data["pools"][0]["replicas"] = []
    with pytest.raises(NoReplicaAvailable, match="v2"):
        plan_route(RoutingTable.from_dict(data), key=canary_key(), num_prompt_tokens=1, loads=LoadTracker())


def test_least_loaded_replica_and_ties_to_the_least_assigned():
    table = RoutingTable.from_dict(table_dict())
    d0, d1 = table.replicas[0], table.replicas[1]
    loads = LoadTracker()
    assert [loads.pick([d0, d1]).name for _ in range(2)] == ["d0", "d0"]  # picking alone changes nothing
    loads.begin(d0)
    loads.end(d0)
    assert loads.pick([d0, d1]).name == "d1"  # equal load: d1 has had fewer requests
    loads.begin(d0)
    assert [loads.pick([d0, d1]).name for _ in range(3)] == ["d1"] * 3
    loads.queue_depth["d1"] = 4.0
    assert loads.pick([d0, d1]).name == "d0"
    assert loads.pick([d0, d1], exclude={"d0"}).name == "d1"
    assert loads.pick([d0], exclude={"d0"}) is None


def brute_force_threshold(layout, gbps, rtt_s, speed, max_tokens):
    paying = [n for n in range(1, max_tokens + 1) if n / speed > layout.transfer_bytes(n) / (gbps * 1e9 / 8) + rtt_s]
    return paying[0] - 1 if paying else None


@pytest.mark.parametrize("gbps, expected", [(10.0, 41), (1.0, 56), (0.01, None)])
def test_derived_threshold_follows_the_documented_formula(gbps, expected):
    # Gemma 3 270M, bf16 (b = 1024 B/token/layer), decode pool prefills 2000 tokens/s, RTT 20 ms.
    # 10 Gbit/s, N <= 511 (all 18 layers grow): N * (1/2000 - 18*1024/1.25e9) > 0.02  <=>  N > 41.2.
    layout = KVLayout.from_dict(GEMMA)
    got = derived_threshold(layout, bandwidth_gbps=gbps, rtt_s=0.02, decode_prefill_tokens_per_s=2000,
                            max_tokens=4096)
    assert got == expected == brute_force_threshold(layout, gbps, 0.02, 2000, 4096)


def test_derived_threshold_from_the_table_uses_the_link_between_the_datacenters():
    data = table_dict(threshold=None, models={"v1": GEMMA},
                      links=[{"source": "dc1", "target": "dc2", "bandwidth_gbps": 1.0, "rtt_ms": 20}])
    data["length_routing"] = {"decode_prefill_tokens_per_s": 2000, "max_tokens": 4096}
    table = RoutingTable.from_dict(data)
    key = stable_key()
    assert plan_route(table, key=key, num_prompt_tokens=56, loads=LoadTracker()).decision == LOCAL_PREFILL
    plan = plan_route(table, key=key, num_prompt_tokens=57, loads=LoadTracker())
    assert plan.decision == REMOTE_PREFILL and plan.reason == "cost"
    assert table.threshold_for(plan.prefill, plan.decode) == 56


@pytest.mark.parametrize("change, message", [
    ({"tracks": [{"name": "stable", "model_version": "v1", "weight": 80}]}, "sum to 100"),
    ({"version": "7"}, "version"),
    ({"pools": [{"name": "x", "role": "gateway", "replicas": []}]}, "role"),
])
def test_malformed_tables_are_refused_with_the_field_named(change, message):
    with pytest.raises(RoutingTableError, match=message):
        RoutingTable.from_dict({**table_dict(), **change})


def test_api_keys_and_rate_limits(tmp_path):
    path = tmp_path / "keys.json"
    path.write_text(json.dumps({"keys": [
        {"name": "hashed", "key_sha256": hashlib.sha256(b"secret-a").hexdigest()},
        {"name": "plain", "key": "secret-b", "rate_per_s": 0.5, "burst": 2}]}))
    keys = ApiKeys.from_file(path)
    assert keys.authenticate("Bearer secret-a").name == "hashed"
    assert keys.authenticate("Bearer secret-c") is None and keys.authenticate(None) is None
    assert keys.authenticate("secret-a") is None  # not a bearer header
    clock = [0.0]
    limited = ApiKey("t", b"", TokenBucket(0.5, 2, clock=lambda: clock[0]))
    assert [ApiKeys.retry_after_s(limited) for _ in range(3)] == [0, 0, 2]
    clock[0] = 2.0
    assert ApiKeys.retry_after_s(limited) == 0
    with pytest.raises(ValueError, match="invalid API keys file"):
        ApiKeys.from_file(tmp_path / "missing.json")


def test_prompt_tokens_counted_like_the_worker(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2, "hello": 3, "world": 4, "[UNK]": 5}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(tmp_path / "tokenizer.json"))
    assert PromptCounter(tmp_path).count("/v1/chat/completions", {"messages": [  # no template: contents only
        {"role": "system", "content": "hello"}, {"role": "user", "content": "world world"}]}) == 3
    (tmp_path / "chat_template.jinja").write_text(
        "{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}")
    counter = PromptCounter(tmp_path)
    assert counter.count("/v1/completions", {"prompt": "hello world hello"}) == 3
    assert counter.count("/v1/completions", {"prompt": [7, 8, 9, 10]}) == 4
    assert counter.count("/v1/completions", {"prompt": ["hello", [1, 2, 3, 4, 5]]}) == 5
    rendered = counter.template.render([{"role": "user", "content": "hello world"}])
    assert rendered.split() == ["user", "hello", "world"]
    assert counter.count("/v1/chat/completions", {"messages": [{"role": "user", "content": "hello world"}]}) == 3
    assert PromptCounter().count("/v1/completions", {"prompt": "x" * 41}) == 11  # estimate: ceil(41 / 4)


def test_a_router_pinned_to_a_track_serves_only_that_track_whatever_the_weights():
    table = RoutingTable.from_dict(table_dict())  # stable 90 / canary 10
    keys = [f"req-{i}" for i in range(200)]
    pinned = {key: eligibility(table, model=None, sticky_key=key, track="canary") for key in keys}
    assert {e.track.name for e in pinned.values()} == {"canary"}
    assert {tuple(r.name for r in e.decode) for e in pinned.values()} == {("d2",)}
    assert {e.track.name for e in (eligibility(table, model=None, sticky_key=k, track="stable") for k in keys)} == {
        "stable"}
    with pytest.raises(NoReplicaAvailable, match="serves track 'blue' only"):
        eligibility(table, model=None, sticky_key="k", track="blue")
