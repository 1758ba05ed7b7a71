"""The Prometheus source's queries (DCGM GPU utilization on Kubernetes) and its failure mode."""

import pytest

from apps.telemetry.poller import default_source_factory
from apps.telemetry.selectors import SourceChoice
from apps.telemetry.signals import Scope
from apps.telemetry.sources.base import MetricSourceError
from apps.telemetry.sources.prometheus import PrometheusSource
from inference_worker.tests.support.worker import free_port


@pytest.mark.parametrize(
    ("scope", "expected"),
    [
        (Scope("decode"), 'avg(DCGM_FI_DEV_GPU_UTIL{namespace="ferry",pod=~"decode-[a-z]+-.*"}) / 100'),
        (Scope("decode", "canary"), 'avg(DCGM_FI_DEV_GPU_UTIL{namespace="ferry",pod=~"decode-canary-.*"}) / 100'),
    ],
)
def test_kubernetes_gpu_utilization_comes_from_dcgm_by_pod(scope, expected):
    source = default_source_factory(SourceChoice("prometheus", "http://127.0.0.1:1", True, "ferry"), window_s=30)
    assert source.queries(scope, 30)["gpu_utilization"] == expected


def test_without_dcgm_gpu_utilization_is_the_workers_nvml_gauge():
    source = PrometheusSource("http://127.0.0.1:1")
    assert source.queries(Scope("decode"), 30)["gpu_utilization"] == 'avg(ferry_gpu_utilization_ratio{pool="decode"})'


def test_unreachable_prometheus_raises_metric_source_error():
    source = PrometheusSource(f"http://127.0.0.1:{free_port()}", timeout_s=1)
    with pytest.raises(MetricSourceError, match="failed on 'sum\\(rate\\(ferry_requests_total"):
        source.signals(Scope("decode"), window_s=30, at_s=1_780_000_000.0)
