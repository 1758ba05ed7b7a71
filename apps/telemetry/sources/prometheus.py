"""Prometheus source: one instant PromQL query per signal through ``prometheus-api-client``.

This is the only module that imports ``prometheus_api_client``. Queries come from the signal
specs (``rate()``, ``histogram_quantile()``, gauge aggregations) with the scope's ``pool``/
``track`` label matchers. On Kubernetes, GPU utilization comes from NVIDIA's DCGM exporter
(``DCGM_FI_DEV_GPU_UTIL``, percent, one series per GPU labelled with the pod) when a
``dcgm_matchers`` callable maps a scope to the pods' label matchers; otherwise from the
workers' own NVML gauge.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import requests
from prometheus_api_client import PrometheusApiClientException, PrometheusConnect

from apps.telemetry import metric_names as m
from apps.telemetry.series_math import finite_or_none
from apps.telemetry.signals import (
    SIGNAL_SPECS,
    Matcher,
    Scope,
    SignalSet,
    kv_transfer_breakdown_from_rows,
    kv_transfer_breakdown_promql,
    promql_selector,
)
from apps.telemetry.sources.base import MetricSource, MetricSourceError

logger = logging.getLogger(__name__)


def dcgm_gpu_utilization_promql(matchers: Sequence[Matcher]) -> str:
    """Mean GPU utilization (0..1) of the GPUs matched, from DCGM's percent gauge."""
    return f"avg({promql_selector(m.DCGM_GPU_UTIL, matchers)}) / 100"


class PrometheusSource(MetricSource):
    """Evaluates signals with PromQL against the Prometheus server at ``url``.

    ``dcgm_matchers(scope)`` returns label matchers selecting the scope's pods in DCGM's
    series (e.g. ``[("namespace", "=", ns), ("pod", "=~", "pool-7-.*")]``) or ``None``.
    ``timeout_s`` bounds each query. Raises ``MetricSourceError`` when Prometheus fails.
    """

    name = "prometheus"

    def __init__(
        self,
        url: str,
        *,
        timeout_s: float = 2.0,
        dcgm_matchers: Callable[[Scope], Sequence[Matcher] | None] | None = None,
    ):
        if not url:
            raise ValueError("PrometheusSource needs the server URL, e.g. http://127.0.0.1:9090")
        self.url = url
        self._client = PrometheusConnect(url=url, disable_ssl=True, timeout=timeout_s)
        self._dcgm_matchers = dcgm_matchers

    def queries(self, scope: Scope, window_s: float) -> dict[str, str]:
        """Signal name -> PromQL for ``scope`` over ``window_s`` (also used by the rules export)."""
        out = {name: spec.promql(scope.matchers(), window_s) for name, spec in SIGNAL_SPECS.items()}
        dcgm = self._dcgm_matchers(scope) if self._dcgm_matchers else None
        if dcgm:
            out["gpu_utilization"] = dcgm_gpu_utilization_promql(dcgm)
        return out

    def query_scalar(self, promql: str, at_s: float) -> float | None:
        """Run an instant query; the single result's value, ``None`` if empty or NaN.

        Raises ``MetricSourceError`` if Prometheus is unreachable, rejects the query, or the
        query returns more than one series (a signal query must aggregate to one value).
        """
        try:
            result = self._client.custom_query(promql, params={"time": f"{at_s:.3f}"})
        except (PrometheusApiClientException, requests.RequestException, ValueError) as exc:
            raise MetricSourceError(f"Prometheus at {self.url} failed on {promql!r}: {exc}") from exc
        if not result:
            return None
        if len(result) > 1:
            raise MetricSourceError(f"query {promql!r} returned {len(result)} series; expected one")
        return finite_or_none(float(result[0]["value"][1]))

    def signals(self, scope: Scope, *, window_s: float, at_s: float) -> SignalSet:
        values = {name: self.query_scalar(q, at_s) for name, q in self.queries(scope, window_s).items()}
        return SignalSet(scope=scope, at_s=at_s, window_s=window_s, source=self.name, values=values)

    def query_vector(self, promql: str, at_s: float) -> list[tuple[dict[str, str], float | None]]:
        """Run an instant query returning any number of series: ``[(labels, value or None if NaN)]``.

        Raises ``MetricSourceError`` if Prometheus is unreachable or rejects the query.
        """
        try:
            result = self._client.custom_query(promql, params={"time": f"{at_s:.3f}"})
        except (PrometheusApiClientException, requests.RequestException, ValueError) as exc:
            raise MetricSourceError(f"Prometheus at {self.url} failed on {promql!r}: {exc}") from exc
        return [(row["metric"], finite_or_none(float(row["value"][1]))) for row in result]

    def kv_transfers(self, scope: Scope, *, window_s: float, at_s: float) -> dict:
        transfers, wire = kv_transfer_breakdown_promql(scope.matchers(), window_s)
        return kv_transfer_breakdown_from_rows(self.query_vector(transfers, at_s), self.query_vector(wire, at_s))

    def close(self) -> None:
        self._client._session.close()
