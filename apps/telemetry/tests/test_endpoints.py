"""Where telemetry finds routers: ``FERRY_ROUTER_METRICS_URLS``, their metrics URLs, and the Prometheus job."""

import pytest

from apps.telemetry.endpoints import RouterEndpoint, prometheus_router_scrape_config, router_endpoints


@pytest.mark.parametrize(
    ("url", "metrics_url"),
    [
        ("http://127.0.0.1:8080", "http://127.0.0.1:8080/metrics"),
        ("http://127.0.0.1:8080/", "http://127.0.0.1:8080/metrics"),
        ("https://router.ferry.internal/metrics", "https://router.ferry.internal/metrics"),
        ("http://10.0.0.7:9000/router/metrics", "http://10.0.0.7:9000/router/metrics"),
    ],
)
def test_router_metrics_url_defaults_to_the_metrics_path(url, metrics_url):
    assert RouterEndpoint(url).metrics_url == metrics_url


@pytest.mark.parametrize("url", ["127.0.0.1:8080", "ftp://h/metrics", "http:///metrics", "http://h:1/metrics?x=1",
                                 "http://h:1/metrics#top"])
def test_malformed_router_urls_are_refused(url):
    with pytest.raises(ValueError, match="is not http\\(s\\)://host:port\\[/metrics\\]"):
        RouterEndpoint(url)


def test_router_endpoints_come_from_the_setting_as_a_list_or_a_comma_separated_string(settings):
    settings.FERRY_ROUTER_METRICS_URLS = ["http://a:8080", "http://b:8080/metrics"]
    assert [r.metrics_url for r in router_endpoints()] == ["http://a:8080/metrics", "http://b:8080/metrics"]
    settings.FERRY_ROUTER_METRICS_URLS = " http://a:8080 , ,http://b:9/m "
    assert [r.metrics_url for r in router_endpoints()] == ["http://a:8080/metrics", "http://b:9/m"]
    settings.FERRY_ROUTER_METRICS_URLS = []
    assert router_endpoints() == []
    settings.FERRY_ROUTER_METRICS_URLS = ["a:8080"]
    with pytest.raises(ValueError, match="^FERRY_ROUTER_METRICS_URLS: router metrics URL 'a:8080'"):
        router_endpoints()


def test_a_router_key_never_equals_a_replica_key():
    assert RouterEndpoint("http://a:1").key == ("", "router", "http://a:1/metrics")


def test_prometheus_router_job_keeps_the_routers_labels_and_each_path():
    job = prometheus_router_scrape_config([RouterEndpoint("http://a:8080"), RouterEndpoint("https://b/r/metrics")],
                                          interval_s=1.5)
    assert job == {
        "job_name": "ferry-router", "scrape_interval": "1500ms", "scrape_timeout": "1500ms", "honor_labels": True,
        "static_configs": [
            {"targets": ["a:8080"], "labels": {"__metrics_path__": "/metrics", "__scheme__": "http"}},
            {"targets": ["b"], "labels": {"__metrics_path__": "/r/metrics", "__scheme__": "https"}},
        ],
    }
