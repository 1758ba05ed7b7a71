"""Engine kinds a pool can run — Ferry's own worker, vLLM or SGLang — and how Ferry reads their metrics (torch-free).

A pool's ``engine`` says which server its replicas run. Everything Ferry computes from worker metrics (the
telemetry signals behind gates, autoscaling and charts; the router's load scrape) is written against Ferry's
metric names (:mod:`apps.telemetry.metric_names`). An engine's own Prometheus series are *translated* into those
names where they are scraped, by one table per engine (:data:`METRIC_MAPS`), so every consumer works unchanged:

* the telemetry direct-scrape source and the router's queue-depth scrape call :func:`translate_samples`;
* the Prometheus source gets the same table as ``metric_relabel_configs`` (:func:`prometheus_metric_relabel_configs`)
  on the engine's scrape job, so PromQL sees the same names and label values.

Names and types come from the engines' documentation and metric definitions:

* vLLM (V1 engine, "Production Metrics", https://docs.vllm.ai/en/stable/usage/metrics/, and
  ``vllm/v1/metrics/loggers.py``): gauges ``vllm:num_requests_waiting``, ``vllm:num_requests_running``,
  ``vllm:kv_cache_usage_perc`` (a fraction, "1 means 100 percent"; named ``vllm:gpu_cache_usage_perc`` before
  V1); counters ``vllm:prompt_tokens``, ``vllm:generation_tokens``, ``vllm:prefix_cache_queries`` and
  ``vllm:prefix_cache_hits`` (tokens), ``vllm:request_success`` with label ``finished_reason`` (exposed with
  ``_total``); histograms ``vllm:time_to_first_token_seconds``, ``vllm:request_time_per_output_token_seconds``
  (per request, like Ferry's TPOT; ``vllm:inter_token_latency_seconds`` is per token) and
  ``vllm:e2e_request_latency_seconds``. Every series carries ``model_name`` and ``engine``.
* SGLang (``--enable-metrics``; "Production Metrics", https://docs.sglang.io/references/production_metrics.html,
  and ``python/sglang/srt/metrics/collector.py``): gauges ``sglang:num_queue_reqs``, ``sglang:num_running_reqs``,
  ``sglang:token_usage`` (fraction of the KV token pool in use); counters ``sglang:prompt_tokens_total``,
  ``sglang:generation_tokens_total``, ``sglang:cached_tokens_total``, ``sglang:num_requests_total``; histograms
  ``sglang:time_to_first_token_seconds``, ``sglang:inter_token_latency_seconds`` and
  ``sglang:e2e_request_latency_seconds``.

What does not translate, and so reads as "no data" (``None``) rather than a made-up value
(:data:`UNSUPPORTED_SIGNALS` where the series alone would not show it):

* ``error_rate`` on SGLang: it counts finished requests in one counter and has no server-error counter. Its
  requests are counted under ``outcome="finished"`` (not a Ferry outcome), so ``request_rate_per_s`` is right and
  the error series is absent. vLLM's ``finished_reason`` maps to Ferry outcomes (``stop``/``length`` success,
  ``abort`` aborted, ``error`` server_error where the version has it; other reasons keep no outcome label).
* ``prefix_cache_hit_rate`` on SGLang (it exports cached tokens, but lookups only as prompt tokens: one source
  series maps to at most one Ferry series so the relabel rules stay equivalent).
* SGLang's TPOT signal is its inter-token latency (per token gap), not a per-request mean: the quantiles of
  ``tpot_*`` on an SGLang pool are per-token quantiles.
* Request lengths: vLLM's ``vllm:request_prompt_tokens`` and ``vllm:request_generation_tokens`` histograms give
  ``request_sequences_per_s``, ``request_prompt_tokens_mean`` and ``request_generation_tokens_mean``; neither engine exports a request's computed
  (not cached) prompt tokens, so the ``request_computed_prompt_tokens_*`` signals are no data there, and on SGLang
  all request-length signals are.
* The KV transfer, router and prefix-block series are Ferry's own (PD disaggregation across Ferry workers).

Container commands (:func:`engine_container`) follow each engine's documented CLI (``vllm serve``;
``python -m sglang.launch_server``). Their weights are a model *directory* (``config.json``, tokenizer and
safetensors files), not one file; its integrity is checked with a ``SHA256SUMS`` file in that directory whose own
sha256 is the model version's ``sha256``: the init step checks the sums file against it, then every file against
the sums file (``sha256sum -c``), so one pinned digest covers the whole directory.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field

FERRY = "ferry"
VLLM = "vllm"
SGLANG = "sglang"
ENGINE_KINDS = (FERRY, VLLM, SGLANG)

HISTOGRAM_SUFFIXES = ("_bucket", "_count", "_sum")


@dataclass(frozen=True)
class MetricMap:
    """One engine series family mapped to one Ferry family.

    ``kind``: ``gauge`` or ``counter`` (``source``/``target`` are sample names, counters with ``_total``) or
    ``histogram`` (base names; ``_bucket``/``_count``/``_sum`` samples follow). ``label``: an engine label whose
    values map to a Ferry label (``(engine_label, ferry_label, {engine_value: ferry_value})``; the engine label is
    dropped, an unlisted value sets no Ferry label). ``fixed``: Ferry labels set on every sample.
    """

    kind: str
    source: str
    target: str
    label: tuple[str, str, Mapping[str, str]] | None = None
    fixed: Mapping[str, str] = field(default_factory=dict)

    def sample_names(self) -> Iterator[tuple[str, str]]:
        """(engine sample name, Ferry sample name) pairs this map covers."""
        if self.kind == "histogram":
            for suffix in HISTOGRAM_SUFFIXES:
                yield self.source + suffix, self.target + suffix
        else:
            yield self.source, self.target


VLLM_FINISHED_REASONS = {"stop": "success", "length": "success", "abort": "aborted", "error": "server_error"}

METRIC_MAPS: dict[str, tuple[MetricMap, ...]] = {
    FERRY: (),
    VLLM: (
        MetricMap("gauge", "vllm:num_requests_waiting", "ferry_num_requests_waiting"),
        MetricMap("gauge", "vllm:num_requests_running", "ferry_num_requests_running"),
        MetricMap("gauge", "vllm:kv_cache_usage_perc", "ferry_kv_cache_usage_ratio"),
        MetricMap("gauge", "vllm:gpu_cache_usage_perc", "ferry_kv_cache_usage_ratio"),
        MetricMap("counter", "vllm:prompt_tokens_total", "ferry_prompt_tokens_total"),
        MetricMap("counter", "vllm:generation_tokens_total", "ferry_generation_tokens_total"),
        MetricMap("counter", "vllm:prefix_cache_queries_total", "ferry_prefix_cache_queries_total"),
        MetricMap("counter", "vllm:prefix_cache_hits_total", "ferry_prefix_cache_hits_total"),
        MetricMap("counter", "vllm:request_success_total", "ferry_requests_total",
                  label=("finished_reason", "outcome", VLLM_FINISHED_REASONS)),
        MetricMap("histogram", "vllm:time_to_first_token_seconds", "ferry_time_to_first_token_seconds"),
        MetricMap("histogram", "vllm:request_time_per_output_token_seconds", "ferry_time_per_output_token_seconds"),
        MetricMap("histogram", "vllm:e2e_request_latency_seconds", "ferry_e2e_request_latency_seconds"),
        MetricMap("histogram", "vllm:request_prompt_tokens", "ferry_request_prompt_tokens"),
        MetricMap("histogram", "vllm:request_generation_tokens", "ferry_request_generation_tokens"),
    ),
    SGLANG: (
        MetricMap("gauge", "sglang:num_queue_reqs", "ferry_num_requests_waiting"),
        MetricMap("gauge", "sglang:num_running_reqs", "ferry_num_requests_running"),
        MetricMap("gauge", "sglang:token_usage", "ferry_kv_cache_usage_ratio"),
        MetricMap("counter", "sglang:prompt_tokens_total", "ferry_prompt_tokens_total"),
        MetricMap("counter", "sglang:generation_tokens_total", "ferry_generation_tokens_total"),
        MetricMap("counter", "sglang:cached_tokens_total", "ferry_prefix_cache_hits_total"),
        MetricMap("counter", "sglang:num_requests_total", "ferry_requests_total", fixed={"outcome": "finished"}),
        MetricMap("histogram", "sglang:time_to_first_token_seconds", "ferry_time_to_first_token_seconds"),
        MetricMap("histogram", "sglang:inter_token_latency_seconds", "ferry_time_per_output_token_seconds"),
        MetricMap("histogram", "sglang:e2e_request_latency_seconds", "ferry_e2e_request_latency_seconds"),
    ),
}
"""Engine -> its metric maps (Ferry's own worker needs none)."""

_COMPUTED_PROMPT_SIGNALS = ("request_computed_prompt_tokens_mean", "request_computed_prompt_tokens_p50",
                            "request_computed_prompt_tokens_p90", "request_computed_prompt_tokens_p99")
UNSUPPORTED_SIGNALS: dict[str, tuple[str, ...]] = {
    FERRY: (),
    VLLM: ("error_rate", *_COMPUTED_PROMPT_SIGNALS),
    SGLANG: ("error_rate", "prefix_cache_hit_rate", "request_sequences_per_s", "request_prompt_tokens_mean",
             "request_generation_tokens_mean",
             *_COMPUTED_PROMPT_SIGNALS),
}
"""Telemetry signals an engine's metrics cannot give: always "no data" on its pools (a gate on them fails closed).

``error_rate``: Ferry's ratio reads a missing failure series as 0 failures (its workers create every outcome series
at start); vLLM counts a failed request only as the ``error`` finish reason, which not every version has, and
SGLang not at all — so on their pools a 0 would claim a health nobody measured."""

# Labels an engine puts on every series that Ferry's consumers do not read (dropped on translation).
ENGINE_LABELS: dict[str, tuple[str, ...]] = {FERRY: (), VLLM: ("model_name", "engine"),
                                              SGLANG: ("model_name", "engine_type", "tp_rank", "pp_rank",
                                                       "moe_ep_rank")}


def check_engine(engine: str) -> str:
    """``engine`` if it is a known kind. Raises ValueError naming the known kinds."""
    if engine not in ENGINE_KINDS:
        raise ValueError(f"unknown engine {engine!r}; known: {', '.join(ENGINE_KINDS)}")
    return engine


def _by_sample_name(engine: str) -> dict[str, tuple[MetricMap, str]]:
    return {source: (mapping, target) for mapping in METRIC_MAPS[check_engine(engine)]
            for source, target in mapping.sample_names()}


_SAMPLE_INDEX = {engine: _by_sample_name(engine) for engine in ENGINE_KINDS}


def translate_sample(engine: str, name: str, labels: Mapping[str, str]) -> tuple[str, dict[str, str]] | None:
    """One engine sample's Ferry name and labels, or None when Ferry does not read it.

    For ``ferry`` the sample is returned as it is. Raises ValueError for an unknown engine.
    """
    if check_engine(engine) == FERRY:
        return name, dict(labels)
    found = _SAMPLE_INDEX[engine].get(name)
    if found is None:
        return None
    mapping, target = found
    dropped = set(ENGINE_LABELS[engine])
    out = {key: value for key, value in labels.items() if key not in dropped}
    if mapping.label is not None:
        source_label, target_label, values = mapping.label
        value = out.pop(source_label, None)
        if value in values:
            out[target_label] = values[value]
    out.update(mapping.fixed)
    return target, out


def translate_name(engine: str, name: str) -> str | None:
    """The Ferry sample name of one engine sample name, or None when Ferry does not read it."""
    if check_engine(engine) == FERRY:
        return name
    found = _SAMPLE_INDEX[engine].get(name)
    return None if found is None else found[1]


def translate_samples(engine: str, samples: Iterable[tuple[str, Mapping[str, str], float]]
                      ) -> list[tuple[str, dict[str, str], float]]:
    """Translate ``(sample name, labels, value)`` triples of an ``engine``'s ``/metrics`` page to Ferry's names.

    Samples Ferry does not read are left out; two engine series that become one Ferry series (same name and
    labels, e.g. vLLM's ``stop`` and ``length`` both ``outcome="success"``) are summed, as PromQL's ``sum`` over
    the dropped label would. Raises ValueError for an unknown engine.
    """
    merged: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for name, labels, value in samples:
        translated = translate_sample(engine, name, labels)
        if translated is None:
            continue
        target, out = translated
        key = (target, tuple(sorted(out.items())))
        merged[key] = merged.get(key, 0.0) + float(value)
    return [(name, dict(labels), value) for (name, labels), value in merged.items()]


def prometheus_metric_relabel_configs(engine: str) -> list[dict]:
    """Prometheus ``metric_relabel_configs`` that rename ``engine``'s series as :func:`translate_sample` does.

    Value maps become one rule per Ferry value (``source_labels: [__name__, <label>]``), then the name is
    rewritten, then the engine's own labels are dropped (``labeldrop``). Series Ferry does not read are kept
    under their own names. Unlike :func:`translate_samples`, Prometheus keeps two engine series that map to the
    same Ferry name and labels apart only by their dropped labels — PromQL sums them, as the signals do.
    """
    rules: list[dict] = []
    for mapping in METRIC_MAPS[check_engine(engine)]:
        names = "|".join(re.escape(source) for source, _ in mapping.sample_names())
        if mapping.label is not None:
            source_label, target_label, values = mapping.label
            by_target: dict[str, list[str]] = {}
            for value, target_value in values.items():
                by_target.setdefault(target_value, []).append(value)
            for target_value, engine_values in by_target.items():
                rules.append({"source_labels": ["__name__", source_label], "separator": ";",
                              "regex": f"({names});({'|'.join(re.escape(v) for v in engine_values)})",
                              "target_label": target_label, "replacement": target_value})
        for label, value in mapping.fixed.items():
            rules.append({"source_labels": ["__name__"], "regex": f"({names})", "target_label": label,
                          "replacement": value})
        if mapping.kind == "histogram":
            rules.append({"source_labels": ["__name__"], "regex": f"{re.escape(mapping.source)}(_bucket|_count|_sum)",
                          "target_label": "__name__", "replacement": f"{mapping.target}${{1}}"})
        else:
            rules.append({"source_labels": ["__name__"], "regex": re.escape(mapping.source),
                          "target_label": "__name__", "replacement": mapping.target})
    dropped = [*ENGINE_LABELS[engine], *{m.label[0] for m in METRIC_MAPS[engine] if m.label is not None}]
    if dropped:
        rules.append({"action": "labeldrop", "regex": "|".join(re.escape(label) for label in dropped)})
    return rules


@dataclass(frozen=True)
class EngineContainer:
    """What a Kubernetes container of an engine kind runs and how it is probed.

    ``args`` follow the engine's CLI; ``health_path`` is the liveness probe's path and ``ready_path`` the
    readiness probe's (HTTP 200 when serving); ``metrics_path`` is scraped on the same port.
    """

    command: list[str]
    args: list[str]
    health_path: str
    ready_path: str
    metrics_path: str = "/metrics"
    api_key_env_names: tuple[str, ...] = ()
    """Environment variables the engine reads its API key from (set to the pool's worker token)."""


def engine_container(engine: str, *, model_dir: str, served_model_name: str, port: int,
                     extra_args: Iterable[str] = (), api_key_env: str | None = None) -> EngineContainer:
    """The container of a ``vllm`` or ``sglang`` replica serving the model directory ``model_dir`` on ``port``.

    ``served_model_name`` is the OpenAI ``model`` clients send (the router routes by it). vLLM: ``vllm serve DIR
    --served-model-name NAME --host 0.0.0.0 --port P``, ``/health`` answers 200 once the engine is up (vLLM has
    no separate readiness path). SGLang: ``python -m sglang.launch_server --model-path DIR --served-model-name
    NAME --host 0.0.0.0 --port P --enable-metrics`` (metrics are off without the flag); ``/health`` for liveness,
    ``/health_generate`` (runs one generation step) for readiness. ``api_key_env``: the environment variable that
    holds the API key clients must send as ``Authorization: Bearer`` (vLLM reads ``VLLM_API_KEY``; SGLang takes
    ``--api-key``, given as ``$(VAR)`` for the kubelet to expand). Raises ValueError for ``ferry`` (its command is
    ``PoolTrackSpec.worker_args``) or an unknown kind.
    """
    extra = list(extra_args)
    if check_engine(engine) == VLLM:
        return EngineContainer(["vllm"], ["serve", model_dir, "--served-model-name", served_model_name,
                                          "--host", "0.0.0.0", "--port", str(port), *extra],
                               health_path="/health", ready_path="/health",
                               api_key_env_names=("VLLM_API_KEY",) if api_key_env else ())
    if engine == SGLANG:
        return EngineContainer(["python3", "-m", "sglang.launch_server"],
                               ["--model-path", model_dir, "--served-model-name", served_model_name,
                                "--host", "0.0.0.0", "--port", str(port), "--enable-metrics",
                                *(["--api-key", f"$({api_key_env})"] if api_key_env else []), *extra],
                               health_path="/health", ready_path="/health_generate")
    raise ValueError("the ferry engine's container runs `python -m inference_worker serve` (PoolTrackSpec.worker_args)")
