"""Engine kinds: the metric translation table, its Prometheus relabel rules, the router's load scrape of a vLLM or
SGLang replica, and the engines' containers (torch-free)."""

import asyncio

import httpx
import pytest

from inference_worker.engine_kinds import (
    ENGINE_KINDS,
    METRIC_MAPS,
    engine_container,
    prometheus_metric_relabel_configs,
    translate_samples,
)
from inference_worker.router.decisions import LoadTracker
from inference_worker.router.source import QueueDepthScraper
from inference_worker.router.table import RoutingTable, RoutingTableError

VLLM_PAGE = """\
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="gemma"} 3.0
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="gemma"} 2.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="gemma"} 0.25
# HELP vllm:request_success_total Count of successfully processed requests.
# TYPE vllm:request_success_total counter
vllm:request_success_total{engine="0",finished_reason="stop",model_name="gemma"} 6.0
vllm:request_success_total{engine="0",finished_reason="length",model_name="gemma"} 2.0
vllm:request_success_total{engine="0",finished_reason="abort",model_name="gemma"} 1.0
"""
SGLANG_PAGE = """\
# HELP sglang:num_queue_reqs The number of requests in the waiting queue.
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{model_name="gemma"} 4.0
# HELP sglang:num_running_reqs The number of running requests.
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="gemma"} 1.0
# HELP sglang:token_usage The token usage.
# TYPE sglang:token_usage gauge
sglang:token_usage{model_name="gemma"} 0.5
"""
FERRY_PAGE = """\
# TYPE ferry_num_requests_waiting gauge
ferry_num_requests_waiting{pool="p"} 7.0
# TYPE ferry_num_requests_running gauge
ferry_num_requests_running{pool="p"} 1.0
# TYPE ferry_kv_cache_usage_ratio gauge
ferry_kv_cache_usage_ratio{pool="p"} 0.125
"""


def test_vllm_finish_reasons_become_ferry_outcomes_summed_like_promql():
    samples = [("vllm:request_success_total", {"model_name": "g", "engine": "0", "finished_reason": r}, v)
               for r, v in (("stop", 6.0), ("length", 2.0), ("abort", 1.0), ("repetition", 4.0))]
    samples.append(("vllm:iteration_tokens_total_bucket", {"le": "8.0"}, 3.0))  # not read by Ferry
    assert sorted(translate_samples("vllm", samples), key=lambda s: sorted(s[1].items())) == [
        ("ferry_requests_total", {}, 4.0),  # a reason Ferry does not know keeps no outcome label
        ("ferry_requests_total", {"outcome": "aborted"}, 1.0),
        ("ferry_requests_total", {"outcome": "success"}, 8.0),
    ]
    with pytest.raises(ValueError, match="unknown engine 'tgi'"):
        translate_samples("tgi", samples)


def test_every_map_has_a_rename_rule_and_the_engine_labels_are_dropped():
    rules = prometheus_metric_relabel_configs("vllm")
    renames = {rule["regex"]: rule["replacement"] for rule in rules if rule.get("target_label") == "__name__"}
    assert renames["vllm:num_requests_waiting"] == "ferry_num_requests_waiting"
    assert renames[r"vllm:time_to_first_token_seconds(_bucket|_count|_sum)"] == "ferry_time_to_first_token_seconds${1}"
    assert len(renames) == len(METRIC_MAPS["vllm"])
    outcome = [rule for rule in rules if rule.get("target_label") == "outcome"]
    assert [(r["regex"], r["replacement"]) for r in outcome] == [
        ("(vllm:request_success_total);(stop|length)", "success"),
        ("(vllm:request_success_total);(abort)", "aborted"),
        ("(vllm:request_success_total);(error)", "server_error")]
    assert rules[-1] == {"action": "labeldrop", "regex": "model_name|engine|finished_reason"}
    assert prometheus_metric_relabel_configs("ferry") == []


def test_the_router_reads_queue_depth_in_each_engines_own_names():
    pages = {"10.0.0.1": VLLM_PAGE, "10.0.0.2": SGLANG_PAGE, "10.0.0.3": FERRY_PAGE}
    table = RoutingTable.from_dict({"version": 1, "tracks": [{"name": "stable", "model_version": "v1", "weight": 100}],
                                    "pools": [
        {"name": "chat-vllm", "role": "colocated", "engine": "vllm",
         "replicas": [{"name": "a", "url": "http://10.0.0.1:8000", "track": "stable"}]},
        {"name": "chat-sglang", "role": "colocated", "engine": "sglang",
         "replicas": [{"name": "b", "url": "http://10.0.0.2:8000", "track": "stable"}]},
        {"name": "chat", "role": "colocated",
         "replicas": [{"name": "c", "url": "http://10.0.0.3:8000", "track": "stable"}]}]})
    assert [r.engine for r in table.replicas] == ["vllm", "sglang", "ferry"]

    class Source:
        pass

    source = Source()
    source.table = table
    loads = LoadTracker()
    transport = httpx.MockTransport(lambda request: httpx.Response(200, text=pages[request.url.host]))

    async def scrape():
        async with httpx.AsyncClient(transport=transport) as client:
            await QueueDepthScraper(source, loads, client=client).scrape()

    asyncio.run(scrape())
    assert loads.queue_depth == {"a": 3.0, "b": 4.0, "c": 7.0}
    assert loads.running == {"a": 2.0, "b": 1.0, "c": 1.0}
    assert loads.kv_usage == {"a": 0.25, "b": 0.5, "c": 0.125}


def test_an_unknown_engine_in_the_table_is_refused():
    with pytest.raises(RoutingTableError, match="engine must be one of"):
        RoutingTable.from_dict({"version": 1, "tracks": [{"name": "stable", "model_version": "v1", "weight": 100}],
                                "pools": [{"name": "p", "role": "colocated", "engine": "tgi", "replicas": []}]})


def test_engine_containers_follow_each_engines_cli():
    vllm = engine_container("vllm", model_dir="/models/model", served_model_name="gemma-3-270m", port=8000)
    assert (vllm.command, vllm.args, vllm.health_path, vllm.ready_path) == (
        ["vllm"], ["serve", "/models/model", "--served-model-name", "gemma-3-270m", "--host", "0.0.0.0",
                   "--port", "8000"], "/health", "/health")
    sglang = engine_container("sglang", model_dir="/models/model", served_model_name="gemma-3-270m", port=8000)
    assert (sglang.command, sglang.args, sglang.ready_path) == (
        ["python3", "-m", "sglang.launch_server"],
        ["--model-path", "/models/model", "--served-model-name", "gemma-3-270m", "--host", "0.0.0.0", "--port",
         "8000", "--enable-metrics"], "/health_generate")
    with pytest.raises(ValueError, match="worker_args"):
        engine_container("ferry", model_dir="/m", served_model_name="g", port=8000)
    assert ENGINE_KINDS == ("ferry", "vllm", "sglang")
