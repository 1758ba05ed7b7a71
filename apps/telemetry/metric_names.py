"""The worker and router metric names and labels the telemetry layer reads (DESIGN, "Metrics contract").

The names are an interface between the inference worker (``inference_worker/metrics.py`` and
``inference_worker/router/metrics.py`` define them) and the control plane. This module is the single place on the control-plane
side that spells them, so aligning with the worker is a one-file change.
"""

from __future__ import annotations

PREFIX = "ferry_"

# Labels every worker series carries.
LABEL_MODEL = "model"
LABEL_MODEL_VERSION = "model_version"
LABEL_ROLE = "role"
LABEL_POOL = "pool"
LABEL_TRACK = "track"
LABEL_REPLICA = "replica"

# Gauges.
NUM_REQUESTS_WAITING = "ferry_num_requests_waiting"
NUM_REQUESTS_RUNNING = "ferry_num_requests_running"
KV_CACHE_USAGE = "ferry_kv_cache_usage_ratio"
ENGINE_BUSY = "ferry_engine_busy_ratio"
GPU_UTILIZATION = "ferry_gpu_utilization_ratio"
READY = "ferry_worker_ready"

# Counters (sample names as exposed, with ``_total``).
REQUESTS = "ferry_requests_total"
REQUEST_OUTCOME_LABEL = "outcome"
# Outcomes that count as failures of the service (inference_worker.metrics.REQUEST_OUTCOMES):
# client errors, client aborts and drain rejections are not the server failing.
REQUEST_ERROR_OUTCOMES = ("server_error",)
PROMPT_TOKENS = "ferry_prompt_tokens_total"
GENERATION_TOKENS = "ferry_generation_tokens_total"
# KV transfers finished, labels direction (send|receive), outcome (success|failure), reason.
KV_TRANSFERS = "ferry_kv_transfer_total"
KV_TRANSFER_OUTCOME_LABEL = "outcome"
KV_TRANSFER_FAILURE_OUTCOME = "failure"
KV_TRANSFER_WIRE_BYTES = "ferry_kv_transfer_wire_bytes_total"
KV_TRANSFER_DIRECTION_LABEL = "direction"  # send | receive (on both KV series)
KV_TRANSFER_REASON_LABEL = "reason"  # none for successes, else the failure's reason

# Prefix cache (tokens): looked up at admission and found cached; blocks cached now, label ``group`` (KV-cache
# group: full_attention | sliding_attention). The worker's prefix cache has one tier today, the device's.
PREFIX_CACHE_QUERIES = "ferry_prefix_cache_queries_total"
PREFIX_CACHE_HITS = "ferry_prefix_cache_hits_total"
PREFIX_CACHE_BLOCKS = "ferry_prefix_cache_blocks"
PREFIX_CACHE_GROUP_LABEL = "group"
PREFIX_CACHE_FULL_GROUP = "full_attention"

# Histograms (base names; series are ``<base>_bucket`` with ``le``, ``<base>_count``, ``<base>_sum``).
TTFT = "ferry_time_to_first_token_seconds"
TPOT = "ferry_time_per_output_token_seconds"
E2E = "ferry_e2e_request_latency_seconds"
# Request lengths in tokens, observed where a request is answered (its decode or co-located pool): the whole prompt,
# the prompt tokens no prefix cache held (computed), the output.
REQUEST_PROMPT_TOKENS = "ferry_request_prompt_tokens"
REQUEST_COMPUTED_PROMPT_TOKENS = "ferry_request_computed_prompt_tokens"
REQUEST_GENERATION_TOKENS = "ferry_request_generation_tokens"

# Router counter: requests routed, labels ``pool`` (the decode pool's name), ``decision`` (values:
# inference_worker.router.decisions.DECISIONS) and ``track``; pool signals sum over the other labels.
ROUTER_DECISIONS = "ferry_router_decisions_total"
ROUTER_DECISION_LABEL = "decision"
# Where the prompt was prefilled. Local: on the decode pool itself, for a short prompt or, as a
# fallback, for a long prompt when no prefill replica of the same model version was available.
ROUTER_LOCAL_PREFILL_FALLBACK_DECISIONS = ("local_prefill_fallback",)
ROUTER_LOCAL_PREFILL_DECISIONS = ("local_prefill", *ROUTER_LOCAL_PREFILL_FALLBACK_DECISIONS)
ROUTER_REMOTE_PREFILL_DECISIONS = ("remote_prefill",)
# Router circuit breaker (inference_worker.router.breaker), labels pool, track, replica (and reason).
ROUTER_EJECTIONS = "ferry_router_ejections_total"
ROUTER_REPLICA_EJECTED = "ferry_router_replica_ejected"

# Router prefix index accuracy, label ``pool``: cached tokens the index predicted on the chosen decode replica
# and the tokens the worker reported (``X-Ferry-Cached-Tokens``), over the same answered requests.
ROUTER_PREDICTED_CACHED_TOKENS = "ferry_router_predicted_cached_tokens_total"
ROUTER_REPORTED_CACHED_TOKENS = "ferry_router_reported_cached_tokens_total"

# Router counter: requests authenticated with each client API key, label ``key`` (the key's name); the poller adds
# its increase to the key's use count (apps.telemetry.key_uses).
ROUTER_REQUESTS_BY_KEY = "ferry_router_requests_by_key_total"
LABEL_KEY = "key"

# NVIDIA DCGM exporter on Kubernetes: GPU utilization in percent (0..100), labelled by pod.
DCGM_GPU_UTIL = "DCGM_FI_DEV_GPU_UTIL"
