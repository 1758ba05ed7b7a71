"""``/metrics`` pages of vLLM and SGLang written from their documented metric names, types, labels and buckets.

vLLM: ``vllm/v1/metrics/loggers.py`` (``PrometheusStatLogger``) and https://docs.vllm.ai/en/stable/usage/metrics/ —
labels ``model_name`` and ``engine``; ``vllm:request_success`` has ``finished_reason`` children created for every
reason up front (this version's reasons: stop, length, abort). SGLang: ``python/sglang/srt/metrics/collector.py``
(``SchedulerMetricsCollector``, ``TokenizerMetricsCollector``) and
https://docs.sglang.io/references/production_metrics.html — label ``model_name``. Buckets are the engines' defaults.
"""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

VLLM_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                     20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
VLLM_TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                     40.0, 80.0)
VLLM_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                    480.0, 960.0, 1920.0, 7680.0)
# vLLM's request-length buckets: build_1_2_5_buckets(max_model_len), here for a 32K context.
VLLM_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000)
SGLANG_TTFT_BUCKETS = (0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400)
SGLANG_ITL_BUCKETS = (0.002, 0.004, 0.006, 0.008, 0.010, 0.015, 0.020, 0.025, 0.030, 0.035, 0.040, 0.060, 0.080,
                      0.100, 0.200, 0.400, 0.600, 0.800, 1.000, 2.000, 4.000, 6.000, 8.000)
SGLANG_E2E_BUCKETS = (0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400, 600, 1200, 1800,
                      2400)


class VllmExporter:
    """A vLLM server's metrics (one engine, ``engine="0"``) in a registry of its own."""

    def __init__(self, model_name: str = "google/gemma-3-270m"):
        self.registry = r = CollectorRegistry()
        labels = ("model_name", "engine")
        values = (model_name, "0")
        self.waiting = Gauge("vllm:num_requests_waiting", "Waiting.", labels, registry=r).labels(*values)
        self.running = Gauge("vllm:num_requests_running", "Running.", labels, registry=r).labels(*values)
        self.kv_usage = Gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", labels,
                              registry=r).labels(*values)
        self.prefix_queries = Counter("vllm:prefix_cache_queries", "Queried tokens.", labels,
                                      registry=r).labels(*values)
        self.prefix_hits = Counter("vllm:prefix_cache_hits", "Cached tokens.", labels, registry=r).labels(*values)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prefill tokens.", labels, registry=r).labels(*values)
        self.generation_tokens = Counter("vllm:generation_tokens", "Generation tokens.", labels,
                                         registry=r).labels(*values)
        success = Counter("vllm:request_success", "Successful requests.", (*labels, "finished_reason"), registry=r)
        self.success = {reason: success.labels(*values, reason) for reason in ("stop", "length", "abort")}
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "TTFT.", labels, buckets=VLLM_TTFT_BUCKETS,
                              registry=r).labels(*values)
        self.tpot = Histogram("vllm:request_time_per_output_token_seconds", "TPOT per request.", labels,
                              buckets=VLLM_TPOT_BUCKETS, registry=r).labels(*values)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "ITL.", labels, buckets=VLLM_TPOT_BUCKETS,
                             registry=r).labels(*values)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "E2E.", labels, buckets=VLLM_E2E_BUCKETS,
                             registry=r).labels(*values)
        self.prompt_lengths = Histogram("vllm:request_prompt_tokens", "Prefill tokens per request.", labels,
                                        buckets=VLLM_TOKEN_BUCKETS, registry=r).labels(*values)
        self.generation_lengths = Histogram("vllm:request_generation_tokens", "Generation tokens per request.",
                                            labels, buckets=VLLM_TOKEN_BUCKETS, registry=r).labels(*values)


class SglangExporter:
    """An SGLang server's metrics (``--enable-metrics``) in a registry of its own."""

    def __init__(self, model_name: str = "google/gemma-3-270m"):
        self.registry = r = CollectorRegistry()
        labels = ("model_name",)
        self.queue = Gauge("sglang:num_queue_reqs", "Waiting queue.", labels, registry=r).labels(model_name)
        self.running = Gauge("sglang:num_running_reqs", "Running.", labels, registry=r).labels(model_name)
        self.token_usage = Gauge("sglang:token_usage", "The token usage.", labels, registry=r).labels(model_name)
        self.gen_throughput = Gauge("sglang:gen_throughput", "Token/s.", labels, registry=r).labels(model_name)
        self.prompt_tokens = Counter("sglang:prompt_tokens", "Prefill tokens.", labels, registry=r).labels(model_name)
        self.generation_tokens = Counter("sglang:generation_tokens", "Generation tokens.", labels,
                                         registry=r).labels(model_name)
        self.cached_tokens = Counter("sglang:cached_tokens", "Cached prompt tokens.", labels,
                                     registry=r).labels(model_name)
        self.requests = Counter("sglang:num_requests", "Requests processed.", labels, registry=r).labels(model_name)
        self.aborted = Counter("sglang:num_aborted_requests", "Requests aborted.", labels,
                               registry=r).labels(model_name)
        self.ttft = Histogram("sglang:time_to_first_token_seconds", "TTFT.", labels, buckets=SGLANG_TTFT_BUCKETS,
                              registry=r).labels(model_name)
        self.itl = Histogram("sglang:inter_token_latency_seconds", "ITL.", labels, buckets=SGLANG_ITL_BUCKETS,
                             registry=r).labels(model_name)
        self.e2e = Histogram("sglang:e2e_request_latency_seconds", "E2E.", labels, buckets=SGLANG_E2E_BUCKETS,
                             registry=r).labels(model_name)


def serve_text_format(registry: CollectorRegistry) -> ThreadingHTTPServer:
    """Serve ``registry`` at ``/metrics`` on a free loopback port in Prometheus' text format 0.0.4 only.

    The engines answer Prometheus' scrapes in the text format, where ``vllm:num_requests_waiting`` keeps its colon.
    prometheus-client's own server would answer Prometheus' OpenMetrics ``Accept`` with names escaped to
    ``vllm_num_requests_waiting`` (its 0.2x default), which is not what an engine's scrape stores. Stop it with
    ``shutdown()`` and ``server_close()``.
    """

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (http.server's name)
            body = generate_latest(registry)
            self.send_response(200)
            self.send_header("Content-Type", CONTENT_TYPE_LATEST)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server
