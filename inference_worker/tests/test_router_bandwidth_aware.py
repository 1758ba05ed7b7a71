"""Bandwidth-aware routing (issue 24): the PD decision follows the link's measured load and the prefill queue, within
the decode pool's bounds; exact decisions and effective thresholds through the pipeline.

Fleet (as ``test_router_pipeline``): decode replica d0 in dc1, prefill replica p0 in dc2, a 1 Gbit/s link
(``B = 1.25e8`` B/s) with 20 ms RTT, Gemma 3 270M's KV in bf16 (``b = 1024`` B per token per layer, 3 full and 15
sliding layers, W = 512), the decode replica prefills 2000 tokens/s, the prefill replica 8000 tokens/s. For
``N <= 511`` a prompt ships ``18 * 1024 * N`` bytes, so on a cold fleet with link share ``u`` and ``q`` requests
queued on p0::

    local(N)  = N / 2000
    remote(N) = (1 + q) * N / 8000 + 18432 * N / (1.25e8 * (1 - u)) + 0.02

Crossovers ``T = floor(0.02 / slope difference)``:

* idle (u = 0, q = 0): ``0.02 / (5e-4 - 1.25e-4 - 1.47456e-4) = 87.89`` -> 87;
* half used (u = 0.5): ``0.02 / (5e-4 - 1.25e-4 - 2.94912e-4) = 249.73`` -> 249;
* one request queued (u = 0, q = 1): ``0.02 / (5e-4 - 2.5e-4 - 1.47456e-4) = 195.04`` -> 195;
* saturated (u = 1): the transfer never ends -> remote never wins (threshold ``inf``).
"""

import asyncio
import math

import httpx
import pytest
from prometheus_client import CollectorRegistry

from inference_worker import http_headers
from inference_worker.router.app import Router, RouterConfig
from inference_worker.router.decisions import LoadTracker
from inference_worker.router.metrics import RouterMetrics
from inference_worker.router.pd_cost import PDProfile, pd_costs
from inference_worker.router.pipeline import (
    LOCAL_PREFILL,
    REMOTE_PREFILL,
    PromptInfo,
    eligibility,
    plan_route,
)
from inference_worker.router.source import LinkLoadSource, TableSource, link_load_url, parse_link_load
from inference_worker.router.table import RoutingTable, RoutingTableError, ThresholdBounds

GEMMA = {"layer_types": ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(18)],
         "sliding_window": 512, "num_kv_heads": 1, "head_dim": 256, "dtype": "bfloat16"}


def table_dict(*, utilisation=None, bounds=None):
    link = {"source": "dc2", "target": "dc1", "bandwidth_gbps": 1.0, "rtt_ms": 20}
    if utilisation is not None:
        link["utilisation"] = utilisation
    return {
        "version": 1, "tracks": [{"name": "stable", "model_version": "v1", "weight": 100}],
        "pools": [{"name": "decode", "role": "decode", "datacenter": "dc1", **(bounds or {}),
                   "replicas": [{"name": "d0", "url": "http://d0", "track": "stable"}]},
                  {"name": "prefill", "role": "prefill", "datacenter": "dc2",
                   "replicas": [{"name": "p0", "url": "http://p0", "track": "stable"}]}],
        "links": [link],
        "length_routing": {"decode_prefill_tokens_per_s": 2000, "prefill_tokens_per_s": 8000},
        "models": {"v1": GEMMA}}


def table(**kwargs):
    return RoutingTable.from_dict(table_dict(**kwargs))


def decide(t, n, *, queued=0.0):
    """(decision, reason, effective threshold) of a cold-fleet plan for an ``n``-token prompt."""
    loads = LoadTracker()
    if queued:
        loads.queue_depth["p0"] = queued
    eligible = eligibility(t, model=None, sticky_key="s")
    plan = plan_route(t, eligible=eligible, prompt=PromptInfo(n), loads=loads)
    return plan.decision, plan.reason, plan.threshold_tokens


@pytest.mark.parametrize(("t", "queued", "threshold"), [
    (table(), 0, 87),
    (table(utilisation=0.5), 0, 249),
    (table(), 1, 195),
])
def test_the_threshold_follows_the_link_load_and_the_prefill_queue(t, queued, threshold):
    assert decide(t, threshold, queued=queued) == (LOCAL_PREFILL, "cost", threshold)
    assert decide(t, threshold + 1, queued=queued) == (REMOTE_PREFILL, "cost", threshold)


def test_a_saturated_link_keeps_every_prompt_local_and_a_reading_above_one_is_saturated():
    for reading in (1.0, 1.3):
        t = table(utilisation=reading)
        assert t.links[0].utilisation == 1.0
        assert decide(t, 131072) == (LOCAL_PREFILL, "cost", math.inf)


def test_the_measured_load_laid_over_the_table_moves_the_threshold_either_direction_key():
    base = table()
    assert base.with_link_utilisation(None) is base and base.with_link_utilisation({}) is base
    half = base.with_link_utilisation({("dc1", "dc2"): 0.5})  # the document may name the link either way round
    assert (half.links[0].utilisation, half.version, base.links[0].utilisation) == (0.5, 1, 0.0)
    assert decide(half, 250) == (REMOTE_PREFILL, "cost", 249)
    assert table(utilisation=0.5).with_link_utilisation({("dc9", "dc1"): 0.9}).links[0].utilisation == 0.5


def test_the_minimum_bound_keeps_short_prompts_local_against_the_cost_function():
    t = table(bounds={"remote_threshold_min_tokens": 200})
    assert decide(t, 150) == (LOCAL_PREFILL, "bound_min", 200)  # the cost function alone: remote (150 > 87)
    assert decide(t, 200) == (LOCAL_PREFILL, "bound_min", 200)
    assert decide(t, 201) == (REMOTE_PREFILL, "cost", 200)
    assert decide(t, 80) == (LOCAL_PREFILL, "cost", 200)  # local anyway: the cost function decided


def test_the_maximum_bound_sends_long_prompts_remote_even_over_a_saturated_link():
    t = table(utilisation=1.0, bounds={"remote_threshold_max_tokens": 1000})
    assert decide(t, 1000) == (LOCAL_PREFILL, "cost", 1000)
    assert decide(t, 1001) == (REMOTE_PREFILL, "bound_max", 1000)
    # a bound the crossover is within does not change anything
    inside = table(bounds={"remote_threshold_min_tokens": 10, "remote_threshold_max_tokens": 1000})
    assert [decide(inside, n) for n in (87, 88)] == [(LOCAL_PREFILL, "cost", 87), (REMOTE_PREFILL, "cost", 87)]


@pytest.mark.parametrize(("utilisation", "queued", "bounds"), [
    (0.0, 0, {}), (0.5, 0, {}), (0.25, 1, {}), (0.0, 0, {"remote_threshold_min_tokens": 300}),
    (0.9, 0, {"remote_threshold_max_tokens": 400}), (1.0, 3, {"remote_threshold_max_tokens": 64}),
    (0.0, 0, {"remote_threshold_min_tokens": 50, "remote_threshold_max_tokens": 60}),
])
def test_on_a_cold_fleet_the_decision_is_exactly_n_above_the_effective_threshold(utilisation, queued, bounds):
    t = table(utilisation=utilisation, bounds=bounds)
    for n in range(0, 1200, 7):
        decision, _, threshold = decide(t, n, queued=queued)
        assert (decision == REMOTE_PREFILL) == (n > threshold), (n, threshold)


def test_the_bounds_apply_to_the_uncached_tokens():
    t = table(bounds={"remote_threshold_min_tokens": 200})
    profile = t.profile_for(t.replicas[1], t.replicas[0])
    assert profile == PDProfile(t.models["v1"], 2000.0, 1.0, 0.02, 8000.0)
    # 400 tokens of which 250 cached on the decode replica: 150 uncached <= 200 stays local whatever the cost
    loads = LoadTracker()
    eligible = eligibility(t, model=None, sticky_key="s")

    class Index:  # the prefix index's one call the pipeline makes: (hit tokens, expected tokens) per replica
        def hit_tokens(self, name, digests, num_tokens, groups, block_size):
            return (250, 250.0) if name == "d0" else (0, 0.0)

    plan = plan_route(t, eligible=eligible, prompt=PromptInfo(400, (b"x" * 32,) * 25), loads=loads, index=Index())
    assert (plan.predicted_cached_tokens, plan.decision, plan.reason) == (250, LOCAL_PREFILL, "cost")
    assert plan.costs == pd_costs(profile, 400, decode_hit_tokens=250)


def test_the_prefill_queue_charges_each_waiting_request_this_prompts_prefill_time():
    t = table()
    profile = t.profile_for(t.replicas[1], t.replicas[0], prefill_queue_requests=2)
    costs = pd_costs(profile, 400, prefill_hit_tokens=100)
    # 2 queued * 400 / 8000 + (400 - 100) / 8000 + 18432 * 400 / 1.25e8 + 0.02
    assert costs.remote_s == pytest.approx(0.1 + 0.0375 + 0.0589824 + 0.02, rel=1e-12)
    assert costs.local_s == pytest.approx(0.2, rel=1e-12)


@pytest.mark.parametrize(("pool", "message"), [
    ({"remote_threshold_min_tokens": 500, "remote_threshold_max_tokens": 100}, "must be <= remote_threshold_max"),
    ({"remote_threshold_min_tokens": -1}, "remote_threshold_min_tokens must be an integer >= 0"),
    ({"remote_threshold_max_tokens": True}, "remote_threshold_max_tokens must be an integer >= 0"),
    ({"remote_threshold_max_tokens": 1.5}, "remote_threshold_max_tokens must be an integer >= 0"),
])
def test_bad_bounds_are_refused_at_parse_time(pool, message):
    with pytest.raises(RoutingTableError, match=message):
        table(bounds=pool)


@pytest.mark.parametrize("reading", [-0.1, float("nan"), float("inf"), "lots"])
def test_a_bad_utilisation_is_refused_at_parse_time(reading):
    with pytest.raises(RoutingTableError):
        table(utilisation=reading)


def test_the_table_carries_each_pools_bounds():
    t = table(bounds={"remote_threshold_max_tokens": 4096})
    assert t.bounds_for("decode") == ThresholdBounds(None, 4096)
    assert t.bounds_for("prefill") == ThresholdBounds()
    assert ThresholdBounds(10, 20).clamp(-1) == 10 and ThresholdBounds(10, 20).clamp(math.inf) == 20


def test_the_link_load_document_url_and_shape():
    assert link_load_url("http://web:8000/api/v1/routing-table/") == "http://web:8000/api/v1/link-load/"
    assert parse_link_load({"links": [{"source": "dc2", "target": "dc1", "utilisation": 0.25}]}) == {
        ("dc2", "dc1"): 0.25}
    for bad in ([], {"links": {}}, {"links": [{"source": "a", "target": "b", "utilisation": -1}]}):
        with pytest.raises(ValueError):
            parse_link_load(bad)


@pytest.mark.parametrize(("links", "message"), [
    ([1], "link 0: expected an object with source, target and utilisation, got 1"),
    ([{}], "link 0: expected an object with source, target and utilisation, got {}"),
    ([{"source": "a", "target": "b"}], "link 0: expected an object with source, target and utilisation"),
    ([{"source": "a", "target": "b", "utilisation": 10 ** 400}], "link 0: utilisation must be a finite number >= 0"),
    ([{"source": "a", "target": "b", "utilisation": None}], "link 0: utilisation must be a finite number >= 0, got None"),
    ([{"source": "a", "target": "b", "utilisation": [1]}], "link 0: utilisation must be a finite number >= 0, got [1]"),
    ([{"source": "a", "target": "b", "utilisation": True}], "link 0: utilisation must be a finite number >= 0, got True"),
    ([{"source": "a", "target": "b", "utilisation": "0.5"}], "link 0: utilisation must be a finite number >= 0, got '0.5'"),
    ([{"source": "a", "target": "b", "utilisation": math.nan}], "link 0: utilisation must be a finite number >= 0, got nan"),
    ([{"source": {"x": 1}, "target": "b", "utilisation": 0.5}], "link 0: source and target must be cluster names"),
])
def test_a_garbage_link_load_document_is_a_value_error_naming_the_link(links, message):
    """Whatever the document holds, the parser raises ValueError (the poller catches it and keeps polling); an
    OverflowError or TypeError escaped the poller's handler and ended its task."""
    with pytest.raises(ValueError) as refused:
        parse_link_load({"links": [{"source": "dc2", "target": "dc1", "utilisation": 0.1}, *links]})
    assert str(refused.value).startswith(message.replace("link 0", "link 1"))


TABLE_URL = "http://web/api/v1/routing-table/"
LOAD_URL = "http://web/api/v1/link-load/"


def test_the_link_load_source_applies_keeps_on_304_and_drops_a_stale_measurement():
    """Script: 200 (u = 0.5), 304, then failures; after ``stale_s`` without a confirmation the table's value rules."""
    now = [0.0]
    answers = [httpx.Response(200, json={"at": 1.0, "window_s": 30, "links": [
                   {"source": "dc2", "target": "dc1", "bandwidth_gbps": 1.0, "kv_gbps": 0.5, "utilisation": 0.5}]},
                   headers={"ETag": '"abc"'}),
               httpx.Response(304, headers={"ETag": '"abc"'}),
               httpx.Response(404, json={"detail": "none"}), httpx.Response(404, json={"detail": "none"})]
    seen = []

    def web(request):
        if request.url == TABLE_URL:
            return httpx.Response(200, json=table_dict(), headers={"ETag": '"t1"'})
        seen.append((request.headers.get("If-None-Match"), request.headers.get("Authorization")))
        return answers.pop(0)

    async def go():
        metrics = RouterMetrics(CollectorRegistry())
        async with httpx.AsyncClient(transport=httpx.MockTransport(web)) as client:
            source = TableSource(TABLE_URL, client=client, metrics=metrics)
            await source.refresh()
            load = LinkLoadSource(source, client=client, url=LOAD_URL, service_token="svc", stale_s=5.0,
                                  clock=lambda: now[0])
            shares = []
            for step in (0.0, 1.0, 3.0, 3.0):  # t = 0, 1, 4, 7
                now[0] += step
                await load.refresh()
                shares.append((source.table.links[0].utilisation, decide(source.table, 250)[2]))
            gauge = metrics.registry.get_sample_value("ferry_router_link_utilisation_ratio",
                                                      {"source": "dc2", "target": "dc1"})
            return shares, gauge

    shares, gauge = asyncio.run(go())
    # kept at t = 4 (confirmed at t = 1, 3 s ago), dropped at t = 7 (6 s > 5 s)
    assert shares == [(0.5, 249), (0.5, 249), (0.5, 249), (0.0, 87)]
    assert seen == [(None, "Bearer svc"), ('"abc"', "Bearer svc"), ('"abc"', "Bearer svc"), ('"abc"', "Bearer svc")]
    assert gauge == 0.0


def test_a_garbage_link_load_answer_keeps_the_current_measurement_and_the_poller_alive():
    """A 200 whose utilisation overflows a float, one whose link is not an object, one nested past the JSON
    decoder's recursion limit: each refresh returns (the
    measurement of the first answer stays until stale) instead of raising out of the poller's loop."""
    answers = [httpx.Response(200, json={"links": [{"source": "dc2", "target": "dc1", "utilisation": 0.5}]}),
               httpx.Response(200, json={"links": [{"source": "dc2", "target": "dc1", "utilisation": 10 ** 400}]}),
               httpx.Response(200, json={"links": ["dc2"]}),
               httpx.Response(200, content=b"[" * 100_000 + b"]" * 100_000)]

    def web(request):
        if request.url == TABLE_URL:
            return httpx.Response(200, json=table_dict(), headers={"ETag": '"t1"'})
        return answers.pop(0)

    async def go():
        async with httpx.AsyncClient(transport=httpx.MockTransport(web)) as client:
            source = TableSource(TABLE_URL, client=client, metrics=RouterMetrics(CollectorRegistry()))
            await source.refresh()
            load = LinkLoadSource(source, client=client, url=LOAD_URL, clock=lambda: 0.0)
            shares = []
            for _ in range(4):
                await load.refresh()
                shares.append(source.table.links[0].utilisation)
            return shares

    assert asyncio.run(go()) == [0.5, 0.5, 0.5, 0.5]


def test_the_router_exports_the_effective_threshold_and_the_bound_reason(tmp_path):
    t = table(utilisation=0.5, bounds={"remote_threshold_max_tokens": 200})
    router = Router(RouterConfig(routing_table=str(tmp_path / "unused.json"), kv_index=False),
                    RouterMetrics(CollectorRegistry()))
    routed = []

    def upstream(request):
        routed.append((request.url.host, request.headers.get(http_headers.PREFILL_ENDPOINT)))
        return httpx.Response(200, stream=httpx.ByteStream(b'{"choices": [{"text": "ok"}]}'))

    router.client = httpx.AsyncClient(transport=httpx.MockTransport(upstream))

    async def go():
        try:
            for n in (150, 230):  # crossover 249 at u = 0.5, clamped to 200: 230 goes remote by the bound
                eligible = eligibility(t, model=None, sticky_key="k")
                response = await router._forward("/v1/completions", b"{}", {}, t, eligible, PromptInfo(n),
                                                 session=None, model=None, key="k", stream=False)
                assert response.status_code == 200
        finally:
            await router.client.aclose()

    asyncio.run(go())
    assert routed == [("d0", None), ("d0", "http://p0")]
    sample = router.metrics.registry.get_sample_value
    assert sample("ferry_router_effective_threshold_tokens", {"pool": "decode", "model_version": "v1"}) == 200.0
    assert sample("ferry_router_decision_reasons_total", {"pool": "decode", "decision": "remote_prefill",
                                                          "reason": "bound_max", "cache": "on"}) == 1.0
    assert sample("ferry_router_decision_reasons_total", {"pool": "decode", "decision": "local_prefill",
                                                          "reason": "cost", "cache": "on"}) == 1.0
